// dspark/dist_verify_stats.h: the host interface of dist_verify_stats: its parameters, workspace and
// launch (plain C++ over the CUDA runtime's types; no torch, no device code). dspark/dist_verify_stats.cuh holds
// the kernel and defines the functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "dist_rows.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyStatsParams {
  dist::TargetRows target;
  const void* draft_logits = nullptr;  // [N, K, Vl] or null
  DType draft_dtype = DType::kFloat32;
  const void* draft_tokens = nullptr;  // [N, K] int32 / int64
  bool drafts_i64 = false;
  const float* temperature = nullptr;  // [N], or null: greedy only (the argmax fields)
  int64_t N = 0, K = 0, Vl = 0, vocab_start = 0, vocab_size = 0;
  int64_t width = 2;                   // StatsLayout.width
  float* out = nullptr;                // [N, K+1, width]
};

// Workspace bytes of launch_dist_verify_stats (the partials) and its tickets (N (K+1) words, zero before the first
// launch, left zero by every launch).
size_t dist_verify_stats_workspace_bytes(int64_t rows, int64_t Vl);

// Launch on `s`; the caller checked the arguments (N, K, Vl >= 1, N (K+1) < 2^31, the shard inside [0, vocab_size),
// vocab_size <= 2^24) and sized `out` [N, K+1, width].
cudaError_t launch_dist_verify_stats(const DistVerifyStatsParams& p, void* workspace, uint32_t* tickets,
                                     cudaStream_t s);

}  // namespace dspark
