// dspark/dist_verify_decide.h: the host interface of dist_verify_decide: its parameters and launch (plain C++ over
// the CUDA runtime's types; no torch, no device code). dspark/dist_verify_decide.cuh holds the kernel and defines the
// functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "dist_rows.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyDecideParams {
  const float* stats = nullptr;        // [P, N, K+1, F]
  const int64_t* shards = nullptr;     // [P, 2]: (vocab_start, size)
  const float* residual = nullptr;     // [P, N, R, 3] or null
  const void* cu_seqlens = nullptr;    // [N+1] or null (dense)
  bool cu_i64 = false;
  int64_t num_rows = 0;
  const void* draft_tokens = nullptr;  // [N, K]
  bool drafts_i64 = false;
  const float* draft_logprobs = nullptr;  // [N, K] or null
  const void* verify_lens = nullptr;      // [N] or null
  bool lens_i64 = false;
  const void* survival = nullptr;         // [N, K] and thresholds [K], or null
  const void* thresholds = nullptr;
  DType survival_dtype = DType::kFloat32, thresholds_dtype = DType::kFloat32;
  const float* temperature = nullptr;     // [N] or null (greedy)
  rng::Key rng_key;
  const void* stop_ids = nullptr;         // [num_stops] or null
  bool stops_i64 = false;
  int64_t num_stops = 0;
  bool block_method = false, has_draft = false;
  int64_t N = 0, K = 0, P = 0, F = 0, R = 0, vocab_size = 0;
  int64_t* out_tokens = nullptr;          // [N, K+1]
  int32_t* out_num_accepted = nullptr;    // [N]
  uint8_t* out_accept_mask = nullptr;     // [N, K]
  float* out_plan = nullptr;              // [N, R, 9] (R = 0 greedy, 1 token, K+1 block)
};

// Launch on `s` (a CTA of one warp per request); the caller checked the arguments (N < 2^31) and sized the outputs.
cudaError_t launch_dist_verify_decide(const DistVerifyDecideParams& p, cudaStream_t s);

}  // namespace dspark
