// dspark/utils.cuh: what most kernels include (no torch): the platform layer, reductions, vector access, the
// generator, and a vector store.
#pragma once

#include <stdint.h>

#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

// A 16-byte store of four floats (p must be 16-byte aligned).
DSPARK_DEVICE void store_f32x4(float* p, const rng::F32x4& v) {
  stg(reinterpret_cast<float4*>(p), make_float4(v.x, v.y, v.z, v.w));
}

}  // namespace dspark
