// dspark/draft_block.h: the host interface of draft_block: its parameters, limits, workspace and launch (plain C++
// over the CUDA runtime's types; no torch, no device code). dspark/draft_block.cuh holds the kernels and defines the
// functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {
namespace draft {

enum Head : int { kVanilla = 0, kGated = 1, kRnn = 2 };

struct DraftBlockParams {
  const void* base;  // U [N, K, V]
  DType base_dtype;
  const void* anchors;  // [N] int32 or int64
  bool anchors_int64;
  int head;  // Head
  const void* w1;  // [VT, R]
  DType w1_dtype;
  const void* w2;  // [V, R]
  DType w2_dtype;  // a float dtype, or kFloat8E4M3 with w2_scale
  const float* w2_scale;  // [V]: per-row scales of an fp8 W2 (bias_j = w2_scale[j] * (W2_j . v)), else null
  const void* d2t;  // [V] int32 or int64 target ids of the draft ids, or null (the identity; VT = V)
  bool d2t_int64;
  const void* wg;  // [R, D + R] (gated)
  DType wg_dtype;
  const void* bg;  // [R]
  DType bg_dtype;
  const void* wj;  // [3R, 2R + D] (rnn)
  DType wj_dtype;
  const void* bj;  // [3R]
  DType bj_dtype;
  const void* hidden;  // [N, K, D] or null (vanilla without confidence; D = 0)
  DType hidden_dtype;
  const void* conf_w;  // [D + R] or null (no confidence head)
  DType conf_w_dtype;
  const void* conf_b;  // [1]
  DType conf_b_dtype;
  const void* sts;  // [K] or null (all 1)
  DType sts_dtype;
  const float* temperature;  // [N] or null (every request greedy); T <= 0 or NaN: greedy
  rng::Key rng_key;
  int64_t N, K, V, R, D;
  int64_t VT;         // W1's rows (the target vocabulary)
  int64_t* tokens;    // [N, K]
  float* logprobs;    // [N, K]
  float* logits;      // [N, K, V] or null
  float* conf;        // [N, K] or null
  float* survival;    // [N, K] or null
  int64_t top_k;          // 0: the full proposal; else top-k proposals (draft_block_topk.cuh)
  int64_t* candidates;    // [N, K, top_k] the target ids of the sparse logits' columns, or null
};


}  // namespace draft

using draft::DraftBlockParams;

namespace draft_topk {
constexpr int64_t kMaxTopK = 1024;  // the op's limit on top_k (top_select::kMaxTop)
}  // namespace draft_topk

// Workspace the launches need for `p` on the current device (bytes; 16-byte aligned start required); 0 when no
// launch configuration fits. With top_k > 0 the top-k kernels (dspark/draft_block_topk.cuh) run instead.
size_t draft_block_workspace_bytes(const DraftBlockParams& p);

// Enqueue on `stream` (no allocation, no synchronisation); the caller has checked the arguments (shapes, dtypes,
// K < 2^24, V <= 2^31 - 1) and gives draft_block_workspace_bytes(p) bytes of workspace.
cudaError_t launch_draft_block(const DraftBlockParams& p, void* workspace, cudaStream_t stream);

}  // namespace dspark
