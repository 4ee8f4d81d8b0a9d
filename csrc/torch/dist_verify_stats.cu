// Torch launcher of dspark_C::verify_stats, the CUDA backend of dspark_dist::verify_stats (the first exchange's
// buffer of one vocabulary shard; the kernel lives in csrc/include/dspark/dist_verify_stats.cuh).
#include "dist_common.h"
#include "dspark/dist_verify_stats.cuh"

#include <ATen/ops/empty.h>

namespace dspark_torch::dist_verify_stats {

using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "verify_stats";

Tensor launch(const Tensor& target_shard, const OptT& cu_seqlens, const Tensor& draft_tokens,
              const OptT& draft_logits_shard, const OptT& temperature, const Tensor& rng_key, int64_t vocab_start,
              int64_t vocab_size, int64_t top_m) {
  dspark::DistVerifyStatsParams p;
  p.drafts_i64 = check_int(kOp, "draft_tokens", draft_tokens, draft_tokens, {kAnySize, kAnySize});
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1, kOp, ": draft_tokens must have K >= 1 columns");
  TORCH_CHECK(N * (K + 1) < (int64_t(1) << 31), kOp, ": N * (K + 1) must be < 2^31, got ", N * (K + 1));
  p.target = check_target_shard(kOp, target_shard, cu_seqlens, draft_tokens, N, K);
  const int64_t Vl = target_shard.size(-1);
  check_shard_span(kOp, vocab_start, Vl, vocab_size);
  TORCH_CHECK(top_m >= 1 && top_m <= dspark::dist_stats::kMaxTopM, kOp, ": top_m must be in [1, ",
              dspark::dist_stats::kMaxTopM, "], got ", top_m);
  if (draft_logits_shard) {
    p.draft_dtype = check_float(kOp, "draft_logits_shard", *draft_logits_shard, draft_tokens, {N, K, Vl});
    p.draft_logits = draft_logits_shard->data_ptr();
  }
  if (temperature) {
    check_tensor(kOp, "temperature", *temperature, draft_tokens, at::kFloat, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  p.rng_key = check_rng_key(kOp, rng_key, draft_tokens);
  p.draft_tokens = draft_tokens.data_ptr();
  p.N = N;
  p.K = K;
  p.Vl = Vl;
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  p.top_m = top_m;
  p.width = dspark::dist::stats_width(temperature.has_value(), draft_logits_shard.has_value(), top_m);
  Tensor out = at::empty({N, K + 1, p.width}, draft_tokens.options().dtype(at::kFloat));
  if (N == 0) return out;
  p.out = out.data_ptr<float>();
  const DeviceGuard guard(draft_tokens);
  check_launch(dspark::launch_dist_verify_stats(p, current_stream(draft_tokens)), kOp);
  return out;
}

}  // namespace dspark_torch::dist_verify_stats

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_stats", &dspark_torch::dist_verify_stats::launch);
}
