// The CPU kernels of torch.ops.dspark_cpu. The library's schemas are defined from Python before this library loads
// (dspark_kernels/_ext.py, from each op's define_op schema), so they are spelled once; this file only registers
// the implementations for the CPU dispatch key.
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY_IMPL(dspark_cpu, CPU, m) {
  m.impl("rng_uniform_", &dspark_cpu::rng_uniform);
  m.impl("verify_chain", &dspark_cpu::verify_chain);
  m.impl("draft_block", &dspark_cpu::draft_block);
  m.impl("accept_prefix_scan", &dspark_cpu::accept_prefix_scan);
  m.impl("schedule_verify_lens", &dspark_cpu::schedule_verify_lens);
}
