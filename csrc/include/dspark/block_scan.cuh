// dspark/block_scan.cuh: block-wide integer scans and reductions (no torch), for blockDim.x a multiple of 32
// (<= 1024). Every call starts with the block converged and ends with a barrier, so its scratch (shared
// memory for 32 values) may be reused right after it. Used by accept_prefix_scan.cuh and schedule_verify_lens.cuh.
#pragma once

#include <stdint.h>

#include "platform.cuh"

namespace dspark {

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Inclusive scan of `v` over the lanes of a full warp.
template <typename T>
DSPARK_DEVICE T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Exclusive scan of `v` over the block in thread order; `*total` (optional) gets the block's sum.
// `scratch`: shared memory for 32 values of T.
template <typename T>
DSPARK_DEVICE T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const T incl = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  T before = 0, sum = 0;
  for (int w = 0; w < nwarps; ++w) {
    const T s = scratch[w];
    if (w < warp) before += s;
    sum += s;
  }
  __syncthreads();
  if (total) *total = sum;
  return before + incl - v;
}

// Sum of `v` over the block (every thread gets it).
template <typename T>
DSPARK_DEVICE T block_sum_int(T v, T* scratch) {
  T total;
  (void)block_exclusive_scan(v, scratch, &total);
  return total;
}

// Minimum of `v` over the block (every thread gets it).
template <typename T>
DSPARK_DEVICE T block_min_int(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T y = __shfl_xor_sync(0xffffffffu, v, o);
    v = y < v ? y : v;
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < nwarps; ++w) r = scratch[w] < r ? scratch[w] : r;
  __syncthreads();
  return r;
}
#endif

}  // namespace dspark
