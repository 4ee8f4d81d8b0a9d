// The kernels of dist_verify_stats for the torch extension, compiled without torch's headers:
// dspark/dist_verify_stats.cuh defines the launch functions that dspark/dist_verify_stats.h declares
// and csrc/torch/dist_verify_stats.cpp calls.
#include "dspark/dist_verify_stats.cuh"
