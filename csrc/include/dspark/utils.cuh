// dspark/utils.cuh: small device helpers shared by the kernels (no torch): launch arithmetic, 16-byte
// accesses, warp and block reductions (sum, max, argmax with ties to the lowest index).
#pragma once

#include <stdint.h>

#include <cuda_runtime.h>

#include "rng.cuh"

namespace dspark {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// 16-byte global accesses (the caller guarantees 16-byte alignment).
__device__ __forceinline__ void store_f32x4(float* p, const rng::F32x4& v) {
  *reinterpret_cast<float4*>(p) = make_float4(v.x, v.y, v.z, v.w);
}
__device__ __forceinline__ float4 load_f32x4(const float* __restrict__ p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ bool is_aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Every lane ends with the warp's argmax (ties to the lowest index, NaN already mapped to -inf by ArgMax).
__device__ __forceinline__ rng::ArgMax warp_argmax(rng::ArgMax a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    rng::ArgMax b;
    b.value = __shfl_xor_sync(kFullMask, a.value, o);
    b.index = __shfl_xor_sync(kFullMask, a.index, o);
    a.merge(b);
  }
  return a;
}

// Block-wide argmax for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
// `scratch` is __shared__ rng::ArgMax[32]; the call ends with a barrier, so scratch may be reused after it.
__device__ __forceinline__ rng::ArgMax block_argmax(rng::ArgMax a, rng::ArgMax* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_argmax(a);
  if (lane == 0) scratch[warp] = a;
  __syncthreads();
  a = lane < nwarps ? scratch[lane] : rng::ArgMax::empty();
  a = warp_argmax(a);
  __syncthreads();
  return a;
}

// Block-wide sum, same contract as block_argmax (`scratch` is __shared__ float[32]).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

}  // namespace dspark
