// The kernels of rng_uniform for the torch extension, compiled without torch's headers:
// dspark/rng_uniform.cuh defines the launch functions that dspark/rng_uniform.h declares
// and csrc/torch/rng_uniform.cpp calls.
#include "dspark/rng_uniform.cuh"
