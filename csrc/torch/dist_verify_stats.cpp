// Torch launcher of dspark_C::verify_stats, the CUDA backend of dspark_dist::verify_stats (the first exchange's
// buffer of one vocabulary shard; the kernel lives in dspark/dist_verify_stats.cuh).
#include "dist_common.h"
#include "dspark/dist_verify_stats.h"
#include "tickets.h"

#include <ATen/ops/empty.h>

namespace dspark_torch::dist_verify_stats {

using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "verify_stats";

Tensor launch(const Tensor& target_shard, const OptT& cu_seqlens, const Tensor& draft_tokens,
              const OptT& draft_logits_shard, const OptT& temperature, int64_t vocab_start, int64_t vocab_size) {
  dspark::DistVerifyStatsParams p;
  p.drafts_i64 = check_int(kOp, "draft_tokens", draft_tokens, draft_tokens, {kAnySize, kAnySize});
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1, kOp, ": draft_tokens must have K >= 1 columns");
  TORCH_CHECK(N * (K + 1) < (int64_t(1) << 31), kOp, ": N * (K + 1) must be < 2^31, got ", N * (K + 1));
  p.target = check_target_shard(kOp, target_shard, cu_seqlens, draft_tokens, N, K);
  const int64_t Vl = target_shard.size(-1);
  check_shard_span(kOp, vocab_start, Vl, vocab_size);
  if (draft_logits_shard) {
    p.draft_dtype = check_float(kOp, "draft_logits_shard", *draft_logits_shard, draft_tokens, {N, K, Vl});
    p.draft_logits = draft_logits_shard->data_ptr();
  }
  if (temperature) {
    check_tensor(kOp, "temperature", *temperature, draft_tokens, at::kFloat, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  p.draft_tokens = draft_tokens.data_ptr();
  p.N = N;
  p.K = K;
  p.Vl = Vl;
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  p.width = dspark::dist::stats_width(temperature.has_value(), draft_logits_shard.has_value());
  Tensor out = at::empty({N, K + 1, p.width}, draft_tokens.options().dtype(at::kFloat));
  if (N == 0) return out;
  p.out = out.data_ptr<float>();
  const DeviceGuard guard(draft_tokens);
  const int64_t rows = N * (K + 1);
  Tensor workspace = at::empty({static_cast<int64_t>(dspark::dist_verify_stats_workspace_bytes(rows, Vl))},
                               draft_tokens.options().dtype(at::kByte));
  check_launch(dspark::launch_dist_verify_stats(p, workspace.data_ptr(), zeroed_tickets(draft_tokens, rows),
                                                current_stream(draft_tokens)),
               kOp);
  return out;
}

}  // namespace dspark_torch::dist_verify_stats

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_stats", &dspark_torch::dist_verify_stats::launch);
}
