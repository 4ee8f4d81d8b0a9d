// dspark/block_scan.cuh: warp and block scans of the two bookkeeping kernels (accept_prefix_scan.cuh,
// schedule_verify_lens.cuh; no torch), for blockDim.x a multiple of 32 (<= 1024).
//
// A block scan costs ONE barrier: each warp scans its lanes with shuffles, lane 31 publishes the warp's total, and
// after the barrier every thread adds the totals of the warps before its own. The scratch (32 values) is read after
// that barrier, so the caller must not write it again before a later barrier: consecutive scans alternate two
// scratch arrays (any barrier in between, the scan's own included, retires the older one).
#pragma once

#include <stdint.h>

#include "platform.cuh"

// Fully unrolled loops over a thread's few items. The SIMT build unrolls them too, so each item's load or store is
// its own instruction there as on the GPU (the access model pairs the lanes' executions of one instruction; a
// rolled loop whose lanes skip different items would pair unrelated accesses).
#if defined(DSPARK_SIMT)
#define DSPARK_UNROLL _Pragma("GCC unroll 16")
#else
#define DSPARK_UNROLL _Pragma("unroll")
#endif

namespace dspark {

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Inclusive scan of `v` over the lanes of a full warp.
template <typename T>
DSPARK_DEVICE T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
DSPARK_UNROLL
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Sum of `v` over the lanes of a full warp (every lane gets it).
template <typename T>
DSPARK_DEVICE T warp_sum(T v) {
DSPARK_UNROLL
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive scan of `v` over the block in thread order, one barrier; `*total` (optional) gets the block's sum.
// `scratch`: shared memory for 32 values of T, not written again before a later barrier (see above).
template <typename T>
DSPARK_DEVICE T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const T incl = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  T before = 0, sum = 0;
  for (int w = 0; w < nwarps; ++w) {
    const T s = scratch[w];
    before += w < warp ? s : T(0);
    sum += s;
  }
  if (total) *total = sum;
  return before + incl - v;
}
#endif

}  // namespace dspark
