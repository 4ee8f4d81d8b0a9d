// Torch launcher of dspark_C::verify_chain (the kernels live in dspark/verify_chain.cuh).
#include "common.h"
#include "dspark/verify_chain.h"
#include "tickets.h"

#include <ATen/ops/empty.h>

namespace dspark_torch::verify_chain {

constexpr const char* kOp = "verify_chain";

// The draft rows' layout: dense [N, K, V], reduced [N, K, Vd] with target_to_draft int32 [V], top-k [N, K, k] with
// draft_candidates [N, K, k].
void check_draft_rows(dspark::VerifyChainParams& p, const at::Tensor& drafts, const std::optional<at::Tensor>& logits,
                      const std::optional<at::Tensor>& inv, const std::optional<at::Tensor>& cands) {
  const int64_t N = p.N, K = p.K, V = p.V;
  TORCH_CHECK(!(inv && cands), kOp, ": give target_to_draft or draft_candidates, not both");
  TORCH_CHECK(logits || !(inv || cands), kOp, ": ", inv ? "target_to_draft" : "draft_candidates",
              " needs draft_logits");
  p.draft_dtype = p.target_dtype;
  if (!logits) return;
  p.draft_dtype = check_float(kOp, "draft_logits", *logits, drafts);
  TORCH_CHECK(V < (int64_t(1) << 31), kOp, ": draft_logits need V < 2^31 (a draft's column is an int32), got ", V);
  if (inv) {
    check_tensor(kOp, "target_to_draft", *inv, drafts, at::kInt, {V});
    check_shape(kOp, "draft_logits", *logits, {N, K, kAnySize});
    p.layout = dspark::DraftLayout::kReduced;
    p.target_to_draft = inv->data_ptr<int32_t>();
  } else if (cands) {
    p.cands_i64 = check_int(kOp, "draft_candidates", *cands, drafts, {N, K, kAnySize});
    check_shape(kOp, "draft_logits", *logits, {N, K, cands->size(2)});
    TORCH_CHECK(cands->size(2) <= dspark::verify::kMaxTopK, kOp, ": draft_candidates must have at most ",
                dspark::verify::kMaxTopK, " columns, got ", cands->size(2));
    p.layout = dspark::DraftLayout::kTopK;
    p.draft_candidates = cands->data_ptr();
  } else {
    check_shape(kOp, "draft_logits", *logits, {N, K, V});
  }
  p.draft_width = logits->size(2);
  TORCH_CHECK(p.draft_width >= 1, kOp, ": draft_logits must have at least one column");
  p.draft_logits = logits->data_ptr();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> launch(
    const at::Tensor& target_logits, const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& target_to_draft,
    const std::optional<at::Tensor>& draft_candidates, const std::optional<at::Tensor>& draft_logprobs,
    const std::optional<at::Tensor>& verify_lens, const std::optional<at::Tensor>& survival,
    const std::optional<at::Tensor>& thresholds, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, const std::optional<at::Tensor>& stop_token_ids, c10::string_view method) {
  dspark::VerifyChainParams p;
  p.drafts_i64 = check_int(kOp, "draft_tokens", draft_tokens, draft_tokens, {kAnySize, kAnySize});
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1 && K <= dspark::verify::kMaxK, kOp, ": draft_tokens must have K in [1, ", dspark::verify::kMaxK,
              "] columns, got ", K);
  p.target_dtype = check_float(kOp, "target_logits", target_logits, draft_tokens);
  if (cu_seqlens) {
    TORCH_CHECK(target_logits.dim() == 2, kOp, ": target_logits must be packed [R, V] with cu_seqlens, got shape ",
                target_logits.sizes());
    p.cu_i64 = check_int(kOp, "cu_seqlens", *cu_seqlens, draft_tokens, {N + 1});
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.total_rows = target_logits.size(0);
  } else {
    check_shape(kOp, "target_logits", target_logits, {N, K + 1, kAnySize});
  }
  const int64_t V = target_logits.size(-1);
  TORCH_CHECK(V >= 1, kOp, ": target_logits must have V >= 1");
  TORCH_CHECK(V < (int64_t(1) << 34), kOp, ": V must be < 2^34, got ", V);
  p.N = N;
  p.K = K;
  p.V = V;
  check_draft_rows(p, draft_tokens, draft_logits, target_to_draft, draft_candidates);
  if (draft_logprobs) {
    TORCH_CHECK(draft_logits.has_value(), kOp, ": draft_logprobs needs draft_logits");
    check_tensor(kOp, "draft_logprobs", *draft_logprobs, draft_tokens, at::kFloat, {N, K});
    p.draft_logprobs = draft_logprobs->data_ptr<float>();
  }
  if (verify_lens) {
    p.lens_i64 = check_int(kOp, "verify_lens", *verify_lens, draft_tokens, {N});
    p.verify_lens = verify_lens->data_ptr();
  }
  const SurvivalInputs surv = check_survival(kOp, survival, thresholds, draft_tokens, N, K);
  p.survival = surv.survival;
  p.thresholds = surv.thresholds;
  p.survival_dtype = surv.survival_dtype;
  p.thresholds_dtype = surv.thresholds_dtype;
  if (temperature) {
    check_tensor(kOp, "temperature", *temperature, draft_tokens, at::kFloat, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  p.rng_key = check_rng_key(kOp, rng_key, draft_tokens);
  if (stop_token_ids) {
    p.stops_i64 = check_int(kOp, "stop_token_ids", *stop_token_ids, draft_tokens, {kAnySize});
    p.num_stops = stop_token_ids->numel();
    p.stop_ids = stop_token_ids->data_ptr();
  }
  TORCH_CHECK(method == "token" || method == "block", kOp, ": method must be 'token' or 'block', got '",
              std::string(method), "'");
  p.block_method = method == "block";
  p.target = target_logits.data_ptr();
  p.draft_tokens = draft_tokens.data_ptr();
  const auto opts = draft_tokens.options();
  at::Tensor tokens = at::empty({N, K + 1}, opts.dtype(at::kLong));
  at::Tensor num_accepted = at::empty({N}, opts.dtype(at::kInt));
  at::Tensor accept_mask = at::empty({N, K}, opts.dtype(at::kBool));
  if (N == 0) return {tokens, num_accepted, accept_mask};
  p.out_tokens = tokens.data_ptr<int64_t>();
  p.out_num_accepted = num_accepted.data_ptr<int32_t>();
  p.out_accept_mask = reinterpret_cast<uint8_t*>(accept_mask.data_ptr<bool>());
  const DeviceGuard guard(draft_tokens);
  const int64_t W = draft_logits ? p.draft_width : V;
  TORCH_CHECK(dspark::verify_chain_grid_fits(N, K, V, W), kOp, ": N = ", N,
              " requests need more CTAs than one launch's grid holds (K = ", K, ", V = ", V, ")");
  at::Tensor workspace = at::empty({static_cast<int64_t>(dspark::verify_chain_workspace_bytes(N, K, V, W))},
                                   opts.dtype(at::kByte));
  uint32_t* ticket = zeroed_tickets(draft_tokens, dspark::verify_chain_ticket_count(N));
  check_launch(dspark::launch_verify_chain(p, workspace.data_ptr(), ticket, current_stream(draft_tokens)), kOp);
  return {tokens, num_accepted, accept_mask};
}

}  // namespace dspark_torch::verify_chain

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_chain", &dspark_torch::verify_chain::launch);
}
