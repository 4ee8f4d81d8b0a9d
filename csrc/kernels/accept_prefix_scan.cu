// The kernels of accept_prefix_scan for the torch extension, compiled without torch's headers:
// dspark/accept_prefix_scan.cuh defines the launch functions that dspark/accept_prefix_scan.h declares
// and csrc/torch/accept_prefix_scan.cpp calls.
#include "dspark/accept_prefix_scan.cuh"
