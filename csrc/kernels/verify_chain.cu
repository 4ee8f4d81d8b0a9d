// The kernels of verify_chain for the torch extension, compiled without torch's headers:
// dspark/verify_chain.cuh defines the launch functions that dspark/verify_chain.h declares
// and csrc/torch/verify_chain.cpp calls.
#include "dspark/verify_chain.cuh"
