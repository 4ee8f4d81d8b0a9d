// Kernels that exist to test the SIMT harness itself (compiled only into the SIMT build): a toy kernel whose
// counters are computed by hand in python_tests/test_simt.py, and one deliberately broken kernel per fault the
// harness must catch, each next to its correct twin (variant 0 = correct, 1 = broken).
#pragma once

#include "dspark/utils.cuh"

namespace dspark {
namespace selftest {

// y[i] = alpha * x[i] (grid-stride), and block_sums[b] = sum of the x[i] block b visited.
__global__ void scale_sum_kernel(const float* x, float* y, float* block_sums, int64_t n, float alpha) {
  DSPARK_SHARED_ARRAY(float, scratch, 32);
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = ldg(x + i);
    stg(y + i, alpha * v);
    acc += v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) stg(block_sums + blockIdx.x, acc);
}

// Each thread writes its value to shared memory and then reads its neighbour's: the broken variant has no barrier
// between the two.
__global__ void neighbour_kernel(const float* x, float* y, int variant) {
  DSPARK_SHARED_ARRAY(float, buf, 1024);
  const int t = threadIdx.x, n = blockDim.x;
  buf[t] = ldg(x + blockIdx.x * n + t);
  if (variant == 0) __syncthreads();
  stg(y + blockIdx.x * n + t, buf[(t + 1) % n]);
}

// A barrier only some threads reach (broken), or one all reach (correct).
__global__ void divergent_barrier_kernel(float* y, int variant) {
  DSPARK_SHARED_ARRAY(float, buf, 1024);
  buf[threadIdx.x] = static_cast<float>(threadIdx.x);
  if (variant == 0 || threadIdx.x < blockDim.x / 2) __syncthreads();
  stg(y + threadIdx.x, buf[blockDim.x - 1 - threadIdx.x]);
}

// Reads a shared slot nobody wrote (broken: the last slot is left out).
__global__ void uninitialised_kernel(float* y, int variant) {
  DSPARK_SHARED_ARRAY(float, buf, 1024);
  const int t = threadIdx.x, n = blockDim.x;
  if (variant == 0 || t < n - 1) buf[t] = static_cast<float>(t);
  __syncthreads();
  stg(y + t, buf[n - 1 - t]);
}

// A full-mask shuffle that only half of the warp executes (broken).
__global__ void shuffle_mask_kernel(float* y, int variant) {
  float v = static_cast<float>(threadIdx.x);
  const unsigned lane = threadIdx.x & 31;
  if (variant == 0) {
    __syncwarp();
    v += __shfl_xor_sync(kFullMask, v, 1);
  } else if (lane < 16) {
    v += __shfl_xor_sync(kFullMask, v, 1);
  }
  stg(y + threadIdx.x, v);
}

// Reads x[n] (broken: one past the end; AddressSanitizer must report it).
__global__ void oob_read_kernel(const float* x, float* y, int64_t n, int variant) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t last = variant == 0 ? n - 1 : n;
  if (i <= last) stg(y + (i < n ? i : n - 1), ldg(x + i));
}

// A cooperative kernel: phase 1 writes per-block values, grid barrier, phase 2 reads another block's value.
__global__ void grid_barrier_kernel(float* buf, float* y) {
  if (threadIdx.x == 0) stg(buf + blockIdx.x, static_cast<float>(blockIdx.x + 1));
  grid_sync();
  if (threadIdx.x == 0) stg(y + blockIdx.x, ld_coherent(buf + (blockIdx.x + 1) % gridDim.x));
}

// Every block reads all of x[0, n) twice (its threads striding by the block), with a block barrier between the two
// passes, or a grid barrier when `variant` is 1 (a cooperative launch); y[block, thread] = the thread's sum. For
// the DRAM-read estimate's hand-computed cases (python_tests/test_simt.py).
__global__ void reread_kernel(const float* x, float* y, int64_t n, int variant) {
  float acc = 0.0f;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1 && variant == 1) grid_sync();
    if (pass == 1 && variant == 0) __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += ldg(x + i);
  }
  stg(y + blockIdx.x * int64_t(blockDim.x) + threadIdx.x, acc);
}

// Programmatic dependent launch: pdl_writer_kernel writes y, then pdl_reader_kernel (a pdl launch) reads it into aux
// after grid_dependency_wait (variant 0); the broken variants read y (1) or write aux (2) before the wait, or call
// launch_dependents before it (3).
__global__ void pdl_writer_kernel(const float* x, float* y) { stg(y + threadIdx.x, 2.0f * ldg(x + threadIdx.x)); }
__global__ void pdl_reader_kernel(const float* y, float* aux, int variant) {
  const int t = threadIdx.x;
  if (variant == 3) launch_dependents();
  if (variant == 2) stg(aux + t, 0.0f);
  const float early = variant == 1 ? ldg(y + t) : 0.0f;
  grid_dependency_wait();
  launch_dependents();
  stg(aux + t, ldg(y + t) + 1.0f + 0.0f * early);
}

}  // namespace selftest
}  // namespace dspark

namespace dspark {
namespace selftest {

// The partial of one (row, chunk) of a row of logits. Every field merges associatively, with the package's tie rule,
// so a row's merged partials do not depend on how the row was split.
struct RowPartial {
  SoftmaxStats stats;  // of the scaled logits
  ArgMax argmax;       // of the raw logits
  ArgMax race;         // of the sampling scores (Gumbel race)
  DSPARK_HOST_DEVICE_FN static RowPartial empty() {
    return RowPartial{SoftmaxStats::empty(), ArgMax::empty(), ArgMax::empty()};
  }
  DSPARK_HOST_DEVICE_FN void merge(const RowPartial& o) {
    stats.merge(o.stats);
    argmax.merge(o.argmax);
    race.merge(o.race);
  }
};

// The split-V convention end to end, on rows of any float dtype: phase 1 reduces each (row, chunk) to a RowPartial
// (softmax stats of row / T, argmax, Gumbel race winner with uniform(request=row, position=0, RESIDUAL, token))
// through 16-byte loads with a scalar head and tail; phase 2 merges a row's chunks.
template <typename T>
__global__ void row_partials_kernel(const T* logits, int64_t V, int64_t chunk, int64_t chunks, float temperature,
                                    const rng::Key rng_key, RowPartial* partials) {
  DSPARK_SHARED_ARRAY(RowPartial, scratch, 32);
  const int64_t row = blockIdx.y, c = blockIdx.x;
  const rng::Philox ph = rng::load_philox(rng_key);
  const int64_t begin = c * chunk, end = begin + chunk < V ? begin + chunk : V;
  RowPartial part = RowPartial::empty();
  for_each_element(logits + row * V, begin, end, threadIdx.x, blockDim.x, [&](int64_t i, float x) {
    const float l = x / temperature;
    part.stats.update(l);
    part.argmax.update(x, i);
    part.race.update(gumbel_score(l, ph.uniform(row, 0, rng::kStreamResidual, i)), i);
  });
  part = block_allreduce(part, scratch);
  if (threadIdx.x == 0) stg(partials + row * chunks + c, part);
}

__global__ void row_combine_kernel(const RowPartial* partials, int64_t chunks, float* lse, int64_t* argmax,
                                   int64_t* race) {
  const int64_t row = blockIdx.x;
  RowPartial acc = RowPartial::empty();
  for (int64_t c = threadIdx.x; c < chunks; c += 32) acc.merge(ldg(partials + row * chunks + c));
  acc = warp_allreduce(acc);
  if (threadIdx.x == 0) {
    stg(lse + row, acc.stats.log_sum_exp());
    stg(argmax + row, acc.argmax.index);
    stg(race + row, acc.race.index);
  }
}

// Two launches; `workspace` holds rows * split.chunks partials.
template <typename T>
inline void row_stats(const T* logits, int64_t rows, int64_t V, float temperature, const rng::Key rng_key,
                      int64_t min_chunk, RowPartial* workspace, float* lse, int64_t* argmax, int64_t* race) {
  const SplitV split = split_v(V, rows, 2 * device_sm_count(), min_chunk);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(split.chunks), static_cast<unsigned>(rows));
  cfg.block = dim3(128);
  launch("row_partials_kernel", row_partials_kernel<T>, cfg, logits, V, split.chunk, split.chunks, temperature, rng_key,
         workspace);
  cfg.grid = dim3(static_cast<unsigned>(rows));
  cfg.block = dim3(32);
  launch("row_combine_kernel", row_combine_kernel, cfg, workspace, split.chunks, lse, argmax, race);
}

}  // namespace selftest
}  // namespace dspark

namespace dspark {
namespace selftest {

// The access model's planted cases (one warp of 32 threads; counts computed by hand in python_tests/test_simt.py).
// variant 0: lane l stores and loads shared word l (conflict-free); 1: word 8 l (8-way conflict: banks 0, 8, 16,
// 24 hold 8 words each); 2: float4 l (16-byte, conflict-free per quarter-warp); 3: every lane loads word 0 (a
// broadcast). Each load reads a word another lane stored (a thread's reload of an address it accessed before is not
// seen by the access model: see DESIGN).
__global__ void bank_kernel(const float* x, float* y, int variant) {
  DSPARK_SHARED_ARRAY(float4, buf, 256);
  float* s = reinterpret_cast<float*>(buf);
  const int l = threadIdx.x;
  const float v = ldg(x + l);
  if (variant == 2) {
    buf[l] = make_float4(v, v, v, v);  // model: 16-byte store
    __syncwarp();
    const float4 w = buf[(l + 1) & 31];  // model: 16-byte load
    stg(y + l, w.x + w.w);
  } else {
    const int i = variant == 1 ? 8 * l : l;
    s[i] = v;  // model: shared store
    __syncwarp();
    stg(y + l, s[variant == 3 ? 0 : i]);  // model: shared load
  }
}

// y[t] = x[t * stride] (variant 0); variant 1 adds a loop whose trip count depends on the lane (odd lanes store
// once more), so the warps' access sequences do not line up.
__global__ void strided_kernel(const float* x, float* y, int stride, int variant) {
  const int t = threadIdx.x;
  const float v = ldg(x + t * stride);  // model: strided load
  stg(y + t, v);  // model: store
  if (variant == 1)
    for (int i = 0; i < (t & 1); ++i) stg(y + blockDim.x + t, v);  // model: divergent store
}

// cp.async: three copies in two groups (16-byte rows, 8-byte rows, 4-byte words zero-filled on odd threads), then
// each thread reads its neighbour's. variant 1 reads the second group's destination after waiting only for the
// first; variant 2 reads the first group's before any wait; variant 3 too, after writing that destination before
// its cp.async (a ring slot reused: without the hooks only its poisoning at issue changes what the early read sees).
__global__ void cp_async_kernel(const float* x, float* y, int variant) {
  DSPARK_SHARED_ARRAY(float4, a, 64);
  DSPARK_SHARED_ARRAY(float2, b, 64);
  DSPARK_SHARED_ARRAY(float, c, 64);
  const int t = threadIdx.x, n = blockDim.x;
  if (variant == 3) {  // the destination held a value before its cp.async (a ring slot reused)
    a[t] = float4{1.0f, 2.0f, 3.0f, 4.0f};
    __syncthreads();
  }
  cp_async<16>(a + t, x + 4 * t);  // model: cp.async 16
  cp_async_commit();
  cp_async<8>(b + t, x + 4 * n + 2 * t);  // model: cp.async 8
  cp_async_zfill<4>(c + t, x + 6 * n + t, (t & 1) ? 0 : 4);  // model: cp.async 4
  cp_async_commit();
  float r = 0.0f;
  if (variant == 2 || variant == 3) r += a[t].x;
  cp_async_wait<1>();
  r += a[t].w;
  if (variant == 1) r += b[t].y;
  cp_async_wait<0>();
  __syncthreads();
  const int u = (t + 1) % n;
  stg(y + t, a[u].x + a[u].y + a[u].z + a[u].w + b[u].x + b[u].y + c[u] + r);
}

}  // namespace selftest
}  // namespace dspark
