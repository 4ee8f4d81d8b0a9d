// dspark_capi: the C ABI (csrc/capi/dspark.h) over the header-only templates of csrc/include/dspark.
#include "dspark.h"

#include <stdio.h>

#include <string>

#include "dspark/rng.cuh"
#include "dspark/rng_uniform.cuh"

namespace {

thread_local std::string g_last_error;

int fail(int code, const std::string& msg) {
  g_last_error = msg;
  return code;
}

int ok() {
  g_last_error.clear();
  return DSPARK_OK;
}

}  // namespace

extern "C" {

DSPARK_API const char* dspark_last_error(void) { return g_last_error.c_str(); }

DSPARK_API int dspark_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const int64_t* rng_key_device,
                                  int stream, cudaStream_t s) {
  if (N < 0 || K < 0 || V < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: N, K, V must be >= 0, got N=" + std::to_string(N) +
                                          " K=" + std::to_string(K) + " V=" + std::to_string(V));
  if (K >= (int64_t(1) << 24))
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: K (positions) must be < 2^24, got " + std::to_string(K));
  if (V > (int64_t(1) << 34))
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: V (tokens) must be <= 2^34, got " + std::to_string(V));
  if (stream < 0 || stream >= 256)
    return fail(DSPARK_ERR_BAD_VALUE, "dspark_rng_uniform: stream must be in [0, 256), got " + std::to_string(stream));
  if (N == 0 || K == 0 || V == 0) return ok();
  if (out == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_rng_uniform: out is NULL");
  if (rng_key_device == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_rng_uniform: rng_key_device is NULL");
  const cudaError_t err = dspark::launch_rng_uniform(out, N, K, V, rng_key_device, stream, s);
  if (err != cudaSuccess)
    return fail(DSPARK_ERR_CUDA, std::string("dspark_rng_uniform: launch failed: ") + cudaGetErrorString(err));
  return ok();
}

DSPARK_API int dspark_philox_uniform_host(uint64_t seed, uint64_t offset, uint64_t request, uint64_t position,
                                          int stream, uint64_t token, uint32_t* bits, float* uniform) {
  if (stream < 0 || stream >= 256)
    return fail(DSPARK_ERR_BAD_VALUE,
                "dspark_philox_uniform_host: stream must be in [0, 256), got " + std::to_string(stream));
  const uint32_t x = dspark::rng::Philox::make(seed, offset).bits(request, position, uint32_t(stream), token);
  if (bits) *bits = x;
  if (uniform) *uniform = dspark::rng::bits_to_uniform(x);
  return ok();
}

DSPARK_API int dspark_philox4x32_10_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  if (!counter) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: counter is NULL");
  if (!key) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: key is NULL");
  if (!out) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: out is NULL");
  const dspark::rng::U32x4 r =
      dspark::rng::philox4x32_10(dspark::rng::U32x4{counter[0], counter[1], counter[2], counter[3]}, key[0], key[1]);
  out[0] = r.x;
  out[1] = r.y;
  out[2] = r.z;
  out[3] = r.w;
  return ok();
}

}  // extern "C"
