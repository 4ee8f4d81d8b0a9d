// dspark/dist_draft_step.h: the host interface of dist_draft_step: its parameters, limits, workspace and launch
// (plain C++ over the CUDA runtime's types; no torch, no device code). dspark/dist_draft_step.cuh holds the kernels
// and defines the functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistDraftStepParams {
  const void* base = nullptr;  // U at this position, rows of Vl elements `base_stride` apart
  DType base_dtype = DType::kFloat32;
  int64_t base_stride = 0;
  const float* v = nullptr;    // [N, R]
  const void* w2 = nullptr;    // [Vl, R] rows of the shard
  DType w2_dtype = DType::kFloat32;
  const float* temperature = nullptr;  // [N] or null (every request greedy)
  rng::Key rng_key;
  int64_t N = 0, Vl = 0, R = 0, position = 0, vocab_start = 0;
  float* logits = nullptr;     // [N, Vl] float32, or null
  int64_t* packed = nullptr;   // [N]
  float* stats = nullptr;      // [N, 5]: max, sum, bad, the winner's scaled logit, its id (as float32)
};


namespace dist_draft {
constexpr int kStatsWidth = 5;
constexpr int64_t kMaxRank = int64_t(1) << 20;
}  // namespace dist_draft

// The largest R the op takes.
inline int64_t dist_draft_step_max_rank(int64_t) { return dist_draft::kMaxRank; }

// Workspace bytes for these sizes (the per-(CTA, request) partials: 16 + 8 bytes, rows of padded_requests(N)); 0 when
// no launch configuration fits.
size_t dist_draft_step_workspace_bytes(const DistDraftStepParams& p);

// Launch on `s`; the caller checked the arguments (N, Vl, R >= 1, R <= dist_draft_step_max_rank(N), Vl < 2^24,
// vocab_start + Vl <= 2^24, position < 2^24) and gives dist_draft_step_workspace_bytes(p) bytes of workspace. The
// sweep is an ordinary launch (U and v may come from the launch before it), the merge a dependent one.
cudaError_t launch_dist_draft_step(const DistDraftStepParams& p, void* workspace, cudaStream_t s);

}  // namespace dspark
