// dspark/rng_uniform.cuh: out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v)
// for a contiguous float32 [N, K, V] tensor (no torch). Defines what dspark/rng_uniform.h declares: a library
// includes this header in one translation unit (csrc/kernels/rng_uniform.cu, csrc/capi/dspark_capi.cu).
//
// One thread handles one counter block (4 consecutive tokens of a row, one Philox evaluation) and writes it
// as one 16-byte store when V % 4 == 0 and `out` is 16-byte aligned; otherwise the warp trades values by
// shuffles so that each of its four scalar stores covers 32 consecutive elements. Grid-stride over the
// N*K*ceil(V/4) blocks; 32-bit index arithmetic when all offsets fit, 64-bit otherwise. The key (rng::Key) is read on the device where it is a buffer, so a captured
// CUDA graph replays with the key's current contents. Philox costs ~100 integer instructions per
// 16 bytes written, so on H100/H200 this kernel is bound by integer throughput, not by DRAM.
#pragma once

#include <stdint.h>

#include "reduce.cuh"
#include "rng.cuh"
#include "rng_uniform.h"
#include "utils.cuh"

namespace dspark {

template <typename Index, bool kVec>
__global__ void __launch_bounds__(256) rng_uniform_kernel(float* __restrict__ out, Index K, Index V,
                                                          Index quads_per_row, Index total_quads,
                                                          const rng::Key rng_key, uint32_t stream) {
  const rng::Philox ph = rng::load_philox(rng_key);
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  const int lane = threadIdx.x & 31;
  // The warp walks 32 consecutive quads at a time (all lanes stay in the loop: the scalar path shuffles).
  const Index first = static_cast<Index>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u);
  for (Index w = first; w < total_quads; w += step) {
    const Index q = w + lane;
    const bool live = q < total_quads;
    const Index row = live ? q / quads_per_row : 0;
    const Index quad = live ? q - row * quads_per_row : 0;
    const Index n = row / K;
    const Index k = row - n * K;
    const rng::F32x4 u = ph.uniform4(n, k, stream, quad);
    const Index at = row * V + quad * 4;  // this lane's first element
    if (kVec) {
      if (live) store_f32x4(out + at, u);
    } else {
      // A quad's 4 elements would be 4 strided stores; instead store j writes element lane & 3 of lane
      // 8 j + lane / 4's quad, so each store instruction covers 32 consecutive elements of the warp's 128.
      const Index left = live ? V - quad * 4 : 0;  // this lane's elements in its row, 0 when past the end
      const int c = lane & 3;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int src = 8 * j + (lane >> 2);
        const float x = __shfl_sync(kFullMask, u.x, src), y = __shfl_sync(kFullMask, u.y, src);
        const float z = __shfl_sync(kFullMask, u.z, src), t = __shfl_sync(kFullMask, u.w, src);
        const Index src_at = __shfl_sync(kFullMask, at, src);
        const Index src_left = __shfl_sync(kFullMask, left, src);
        if (c < src_left) stg(out + src_at + c, c == 0 ? x : c == 1 ? y : c == 2 ? z : t);
      }
    }
  }
}

cudaError_t launch_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const rng::Key rng_key, int stream,
                               cudaStream_t s) {
  if (N <= 0 || K <= 0 || V <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const uint64_t qpr = (static_cast<uint64_t>(V) + 3) / 4;
  const uint64_t total = static_cast<uint64_t>(N) * static_cast<uint64_t>(K) * qpr;
  const uint64_t max_blocks = static_cast<uint64_t>(device_sm_count()) * (2048 / kThreads) * 4;
  uint64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(blocks));
  cfg.block = dim3(kThreads);
  cfg.stream = s;
  const bool vec = (V % 4 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  // 32-bit indices when every quad index (plus one grid step) and element offset stays below 2^32.
  const bool small = total * 4 + blocks * kThreads < (uint64_t(1) << 32);
  const uint32_t st = static_cast<uint32_t>(stream);
  if (small) {
    const uint32_t k = uint32_t(K), v = uint32_t(V), q = uint32_t(qpr), t = uint32_t(total);
    if (vec) return launch("rng_uniform_kernel<u32, vec>", rng_uniform_kernel<uint32_t, true>, cfg, out, k, v, q, t,
                           rng_key, st);
    return launch("rng_uniform_kernel<u32>", rng_uniform_kernel<uint32_t, false>, cfg, out, k, v, q, t, rng_key, st);
  }
  const uint64_t k = uint64_t(K), v = uint64_t(V);
  if (vec) return launch("rng_uniform_kernel<u64, vec>", rng_uniform_kernel<uint64_t, true>, cfg, out, k, v, qpr, total,
                         rng_key, st);
  return launch("rng_uniform_kernel<u64>", rng_uniform_kernel<uint64_t, false>, cfg, out, k, v, qpr, total, rng_key,
                st);
}

}  // namespace dspark
