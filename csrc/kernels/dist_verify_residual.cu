// The kernels of dist_verify_residual for the torch extension, compiled without torch's headers:
// dspark/dist_verify_residual.cuh defines the launch functions that dspark/dist_verify_residual.h declares
// and csrc/torch/dist_verify_residual.cpp calls.
#include "dspark/dist_verify_residual.cuh"
