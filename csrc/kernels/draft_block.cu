// The kernels of draft_block and of dist_draft_step for the torch extension, compiled without torch's headers, in one
// unit since both launch the same sweep kernels (dspark/draft_sweep.cuh): dspark/draft_block.cuh and
// dspark/dist_draft_step.cuh define the launch functions their .h headers declare, which csrc/torch/draft_block.cpp
// calls.
#include "dspark/dist_draft_step.cuh"
#include "dspark/draft_block.cuh"
