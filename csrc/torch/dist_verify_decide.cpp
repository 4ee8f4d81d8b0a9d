// Torch launcher of dspark_C::verify_decide, the CUDA backend of dspark_dist::verify_decide (the replicated decide
// step over every shard's statistics; the kernel lives in dspark/dist_verify_decide.cuh).
#include "dist_common.h"
#include "dspark/dist_verify_decide.h"

#include <ATen/ops/empty.h>

#include <tuple>

namespace dspark_torch::dist_verify_decide {

using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "verify_decide";

std::tuple<Tensor, Tensor, Tensor, Tensor> launch(
    const Tensor& stats, const Tensor& shards, const OptT& residual, const OptT& cu_seqlens, int64_t num_rows,
    const Tensor& draft_tokens, const OptT& draft_logprobs, const OptT& verify_lens, const OptT& survival,
    const OptT& thresholds, const OptT& temperature, const Tensor& rng_key, const OptT& stop_token_ids,
    c10::string_view method, bool has_draft_logits, int64_t vocab_size) {
  dspark::DistVerifyDecideParams p;
  p.drafts_i64 = check_int(kOp, "draft_tokens", draft_tokens, draft_tokens, {kAnySize, kAnySize});
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1, kOp, ": draft_tokens must have K >= 1 columns");
  TORCH_CHECK(N < (int64_t(1) << 31), kOp, ": draft_tokens must have N < 2^31 rows, got ", N);
  TORCH_CHECK(method == "token" || method == "block", kOp, ": method must be 'token' or 'block', got '",
              std::string(method), "'");
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= kMaxShardedVocab, kOp, ": vocab_size must be in [1, 2^24], got ",
              vocab_size);
  const bool sampling = temperature.has_value();
  p.has_draft = sampling && has_draft_logits;
  p.block_method = method == "block";
  const int64_t F = dspark::dist::stats_width(sampling, p.has_draft);
  check_tensor(kOp, "stats", stats, draft_tokens, at::kFloat, {kAnySize, N, K + 1, F});
  const int64_t P = stats.size(0);
  TORCH_CHECK(P >= 1, kOp, ": stats must hold at least one shard");
  check_tensor(kOp, "shards", shards, draft_tokens, at::kLong, {P, 2});
  const int64_t R = dspark::dist::plan_slots(sampling, p.block_method, K);
  if (residual) {
    check_tensor(kOp, "residual", *residual, draft_tokens, at::kFloat, {P, N, R, dspark::dist::kResWidth});
  }
  if (cu_seqlens) {
    p.cu_i64 = check_int(kOp, "cu_seqlens", *cu_seqlens, draft_tokens, {N + 1});
    p.cu_seqlens = cu_seqlens->data_ptr();
  }
  if (draft_logprobs) check_tensor(kOp, "draft_logprobs", *draft_logprobs, draft_tokens, at::kFloat, {N, K});
  if (verify_lens) p.lens_i64 = check_int(kOp, "verify_lens", *verify_lens, draft_tokens, {N});
  const SurvivalInputs surv = check_survival(kOp, survival, thresholds, draft_tokens, N, K);
  p.survival = surv.survival;
  p.thresholds = surv.thresholds;
  p.survival_dtype = surv.survival_dtype;
  p.thresholds_dtype = surv.thresholds_dtype;
  if (temperature) check_tensor(kOp, "temperature", *temperature, draft_tokens, at::kFloat, {N});
  p.rng_key = check_rng_key(kOp, rng_key, draft_tokens);
  if (stop_token_ids) {
    p.stops_i64 = check_int(kOp, "stop_token_ids", *stop_token_ids, draft_tokens, {kAnySize});
    p.stop_ids = stop_token_ids->data_ptr();
    p.num_stops = stop_token_ids->numel();
  }
  p.stats = stats.data_ptr<float>();
  p.shards = shards.data_ptr<int64_t>();
  p.residual = residual ? residual->data_ptr<float>() : nullptr;
  p.num_rows = num_rows;
  p.draft_tokens = draft_tokens.data_ptr();
  p.draft_logprobs = draft_logprobs ? draft_logprobs->data_ptr<float>() : nullptr;
  p.verify_lens = verify_lens ? verify_lens->data_ptr() : nullptr;
  p.temperature = temperature ? temperature->data_ptr<float>() : nullptr;
  p.N = N;
  p.K = K;
  p.P = P;
  p.F = F;
  p.R = R;
  p.vocab_size = vocab_size;
  const auto opts = draft_tokens.options();
  Tensor tokens = at::empty({N, K + 1}, opts.dtype(at::kLong));
  Tensor num_accepted = at::empty({N}, opts.dtype(at::kInt));
  Tensor accept_mask = at::empty({N, K}, opts.dtype(at::kBool));
  Tensor plan = at::empty({N, R, dspark::dist::kPlanWidth}, opts.dtype(at::kFloat));
  if (N == 0) return {tokens, num_accepted, accept_mask, plan};
  p.out_tokens = tokens.data_ptr<int64_t>();
  p.out_num_accepted = num_accepted.data_ptr<int32_t>();
  p.out_accept_mask = reinterpret_cast<uint8_t*>(accept_mask.data_ptr<bool>());
  p.out_plan = sampling ? plan.data_ptr<float>() : nullptr;
  const DeviceGuard guard(draft_tokens);
  check_launch(dspark::launch_dist_verify_decide(p, current_stream(draft_tokens)), kOp);
  return {tokens, num_accepted, accept_mask, plan};
}

}  // namespace dspark_torch::dist_verify_decide

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_decide", &dspark_torch::dist_verify_decide::launch);
}
