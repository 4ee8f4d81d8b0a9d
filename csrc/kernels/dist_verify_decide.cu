// The kernels of dist_verify_decide for the torch extension, compiled without torch's headers:
// dspark/dist_verify_decide.cuh defines the launch functions that dspark/dist_verify_decide.h declares
// and csrc/torch/dist_verify_decide.cpp calls.
#include "dspark/dist_verify_decide.cuh"
