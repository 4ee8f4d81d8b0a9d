// The kernels of schedule_verify_lens for the torch extension, compiled without torch's headers:
// dspark/schedule_verify_lens.cuh defines the launch functions that dspark/schedule_verify_lens.h declares
// and csrc/torch/schedule_verify_lens.cpp calls.
#include "dspark/schedule_verify_lens.cuh"
