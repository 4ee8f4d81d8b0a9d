// dspark/utils.cuh: what most kernels include (no torch): the platform layer, reductions, vector access, and small
// launch arithmetic.
#pragma once

#include <stdint.h>

#include "mma.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// A 16-byte store of four floats (p must be 16-byte aligned).
DSPARK_DEVICE void store_f32x4(float* p, const rng::F32x4& v) {
  stg(reinterpret_cast<float4*>(p), make_float4(v.x, v.y, v.z, v.w));
}

}  // namespace dspark
