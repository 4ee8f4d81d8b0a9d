// dspark/verify_chain.h: the host interface of verify_chain: its parameters, limits, workspace and launch (plain
// C++ over the CUDA runtime's types; no torch, no device code). dspark/verify_chain.cuh holds the kernels and defines
// the functions declared here; the torch launcher (csrc/torch/verify_chain.cpp) includes only this header.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

enum class DraftLayout : int32_t { kDense = 0, kReduced = 1, kTopK = 2 };

struct VerifyChainParams {
  const void* target = nullptr;          // [N, K+1, V] or [R, V]
  DType target_dtype = DType::kFloat32;
  const void* cu_seqlens = nullptr;      // [N+1] int32/int64 (packed), or null (dense)
  bool cu_i64 = true;
  int64_t total_rows = 0;                // R (packed)
  const void* draft_tokens = nullptr;    // [N, K] int32/int64
  bool drafts_i64 = true;
  const void* draft_logits = nullptr;    // [N, K, W] or null (one-hot drafts)
  DType draft_dtype = DType::kFloat32;
  DraftLayout layout = DraftLayout::kDense;
  int64_t draft_width = 0;               // W: V (dense), Vd (reduced), k (top-k)
  const int32_t* target_to_draft = nullptr;  // [V] (reduced): the column of each target id, -1 none
  const void* draft_candidates = nullptr;    // [N, K, k] int32/int64 (top-k): the target id of each column
  bool cands_i64 = true;
  const float* draft_logprobs = nullptr; // [N, K] or null
  const void* verify_lens = nullptr;     // [N] int32/int64 or null
  bool lens_i64 = true;
  const void* survival = nullptr;        // [N, K] float or null
  DType survival_dtype = DType::kFloat32;
  const void* thresholds = nullptr;      // [K] float (with survival)
  DType thresholds_dtype = DType::kFloat32;
  const float* temperature = nullptr;    // [N] or null (every request greedy)
  rng::Key rng_key;                      // (seed, offset)
  const void* stop_ids = nullptr;        // [S] int32/int64 or null
  bool stops_i64 = true;
  int64_t num_stops = 0;
  bool block_method = false;
  int64_t N = 0, K = 0, V = 0;
  int64_t* out_tokens = nullptr;         // [N, K+1]
  int32_t* out_num_accepted = nullptr;   // [N]
  uint8_t* out_accept_mask = nullptr;    // [N, K] (bool)
};

namespace verify {
constexpr int kMaxK = 16;       // draft positions a request
constexpr int kMaxTopK = 1024;  // columns of a top-k draft row (draft_block's MAX_TOP_K)
}  // namespace verify

// Workspace of a launch_verify_chain call with these shapes (no initialisation needed), and its tickets: 32-bit
// words that must be zero before the first launch and that every launch leaves zero.
size_t verify_chain_workspace_bytes(int64_t N, int64_t K, int64_t V, int64_t W);

// Whether N requests fit one launch's grid: the widest pass has N x ((K + 1) x vocabulary chunks + K x draft
// chunks) CTAs, which gridDim.x holds below 2^31 (launch_verify_chain returns cudaErrorInvalidValue beyond).
bool verify_chain_grid_fits(int64_t N, int64_t K, int64_t V, int64_t W);
inline int64_t verify_chain_ticket_count(int64_t N) { return 3 * N; }

// Launch on `stream`; the caller has checked shapes and dtypes (K in [1, 16], V >= 1, N >= 0, the draft layout's
// width W >= 1 and, for top-k rows, W <= 1024). Returns the first failing launch's status. Launches: pass A (every
// call), + pass M (block verification with K > 1), + pass B (sampling: a temperature tensor).
cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, uint32_t* tickets, cudaStream_t stream);

}  // namespace dspark
