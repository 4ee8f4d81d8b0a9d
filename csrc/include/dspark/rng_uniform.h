// dspark/rng_uniform.h: the host interface of rng_uniform (plain C++ over the CUDA runtime's types; no torch, no
// device code). dspark/rng_uniform.cuh holds the kernel and defines the function declared here.
#pragma once

#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "rng.cuh"

namespace dspark {

// Launch on `s`; the caller has checked the arguments (N, K, V >= 0, K < 2^24, stream < 256, V < 2^34).
// Returns the launch status (cudaSuccess for an empty tensor, which launches nothing).
cudaError_t launch_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, rng::Key rng_key, int stream,
                               cudaStream_t s);

}  // namespace dspark
