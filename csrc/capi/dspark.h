/* dspark.h: C ABI of dspark_kernels for engines without PyTorch (library dspark_capi, built by CMakeLists.txt).
 *
 * Every function returns DSPARK_OK (0) or a negative DSPARK_ERR_* code; dspark_last_error() then describes the
 * failure (naming the argument) for the calling thread. Kernels run asynchronously on the given stream: a
 * DSPARK_ERR_CUDA return reports a launch error only, as with any CUDA launch.
 *
 * Random numbers come from the package's generator (dspark_kernels/rng.py, csrc/include/dspark/rng.cuh):
 * Philox4x32-10, key = (seed_lo, seed_hi ^ offset_hi), counter = (token >> 2, position | stream << 24,
 * request, offset_lo), word token & 3, u = ((x >> 8) | 1) * 2^-24.
 */
#ifndef DSPARK_CAPI_H_
#define DSPARK_CAPI_H_

#include <stdint.h>

#include <cuda_runtime_api.h>

#if defined(_WIN32)
#define DSPARK_API __declspec(dllexport)
#else
#define DSPARK_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum {
  DSPARK_OK = 0,
  DSPARK_ERR_NULL_POINTER = -1,  /* a required pointer is NULL */
  DSPARK_ERR_BAD_SHAPE = -2,     /* a size is negative or out of the generator's range */
  DSPARK_ERR_BAD_VALUE = -3,     /* another argument is out of range (e.g. stream) */
  DSPARK_ERR_CUDA = -4           /* the CUDA launch failed */
};

/* Streams of the generator (dspark_kernels.rng.STREAM_*). */
enum { DSPARK_STREAM_DRAFT = 0, DSPARK_STREAM_ACCEPT = 1, DSPARK_STREAM_RESIDUAL = 2, DSPARK_STREAM_USER = 16 };

/* The message of the calling thread's last failed call ("" if none). */
DSPARK_API const char* dspark_last_error(void);

/* out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v) for a contiguous float32
 * [N, K, V] device buffer. rng_key_device: device int64 [2] = (seed, offset), read by the kernel (graph-safe).
 * N, K, V >= 0, K < 2^24, V <= 2^34, 0 <= stream < 256. */
DSPARK_API int dspark_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const int64_t* rng_key_device,
                                  int stream, cudaStream_t s);

/* The generator on the host: the uint32 draw and its float32 uniform of one cell (either output may be NULL). */
DSPARK_API int dspark_philox_uniform_host(uint64_t seed, uint64_t offset, uint64_t request, uint64_t position,
                                          int stream, uint64_t token, uint32_t* bits, float* uniform);

/* Philox4x32-10 itself on the host: out = philox(counter, key). */
DSPARK_API int dspark_philox4x32_10_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

#ifdef __cplusplus
}
#endif

#endif /* DSPARK_CAPI_H_ */
