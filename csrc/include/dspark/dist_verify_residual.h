// dspark/dist_verify_residual.h: the host interface of dist_verify_residual: its parameters, workspace and
// launch (plain C++ over the CUDA runtime's types; no torch, no device code). dspark/dist_verify_residual.cuh holds
// the kernel and defines the functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "dist_rows.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyResidualParams {
  dist::TargetRows target;
  const void* draft_logits = nullptr;  // [N, K, Vl] or null (one-hot drafts)
  DType draft_dtype = DType::kFloat32;
  const void* draft_tokens = nullptr;  // [N, K] int32 / int64
  bool drafts_i64 = false;
  const float* plan = nullptr;         // [N, S, 9] (layout.PLAN_*)
  const float* temperature = nullptr;  // [N]
  rng::Key rng_key;
  int64_t N = 0, K = 0, S = 0, Vl = 0, vocab_start = 0, vocab_size = 0;
  float* out = nullptr;                // [N, S, 5]: mass, residual score and id, Gumbel key and id (float32)
};

// The workspace bytes of launch_dist_verify_residual (the partials) and its tickets (N S words, zero before the
// first launch, left zero by every launch).
size_t dist_verify_residual_workspace_bytes(int64_t slots, int64_t Vl);

// Launch on `s`; the caller checked the arguments (N, K, Vl >= 1, S >= 0, N S < 2^31, the shard inside [0, 2^24)).
cudaError_t launch_dist_verify_residual(const DistVerifyResidualParams& p, void* workspace, uint32_t* tickets,
                                        cudaStream_t s);

}  // namespace dspark
