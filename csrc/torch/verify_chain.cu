// Torch launcher of dspark_C::verify_chain (the kernels live in csrc/include/dspark/verify_chain.cuh).
#include "common.h"
#include "dspark/verify_chain.cuh"

#include <ATen/ops/empty.h>

namespace dspark_torch {
namespace {

constexpr const char* kOp = "verify_chain";

bool int_tensor(const char* name, const at::Tensor& t, const at::Tensor& like) {
  check_input(kOp, name, t, like);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, kOp, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong;
}

void check_shape(const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, kOp, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_chain(
    const at::Tensor& target_logits, const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& draft_logprobs,
    const std::optional<at::Tensor>& verify_lens, const std::optional<at::Tensor>& survival,
    const std::optional<at::Tensor>& thresholds, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, const std::optional<at::Tensor>& stop_token_ids, c10::string_view method) {
  dspark::VerifyChainParams p;
  p.drafts_i64 = int_tensor("draft_tokens", draft_tokens, draft_tokens);
  TORCH_CHECK(draft_tokens.dim() == 2, kOp, ": draft_tokens must be [N, K], got shape ", draft_tokens.sizes());
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1 && K <= dspark::vc::kMaxK, kOp, ": draft_tokens must have K in [1, ", dspark::vc::kMaxK,
              "] columns, got ", K);
  check_input(kOp, "target_logits", target_logits, draft_tokens);
  p.target_dtype = float_dtype(kOp, "target_logits", target_logits);
  if (cu_seqlens) {
    TORCH_CHECK(target_logits.dim() == 2, kOp, ": target_logits must be packed [R, V] with cu_seqlens, got shape ",
                target_logits.sizes());
    p.cu_i64 = int_tensor("cu_seqlens", *cu_seqlens, draft_tokens);
    check_shape("cu_seqlens", *cu_seqlens, {N + 1});
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.total_rows = target_logits.size(0);
  } else {
    TORCH_CHECK(target_logits.dim() == 3 && target_logits.size(0) == N && target_logits.size(1) == K + 1, kOp,
                ": target_logits must be [N, K+1, V] = [", N, ", ", K + 1, ", V], got shape ", target_logits.sizes());
  }
  const int64_t V = target_logits.size(-1);
  TORCH_CHECK(V >= 1, kOp, ": target_logits must have V >= 1");
  TORCH_CHECK(V < (int64_t(1) << 34), kOp, ": V must be < 2^34, got ", V);
  p.draft_dtype = p.target_dtype;
  if (draft_logits) {
    check_input(kOp, "draft_logits", *draft_logits, draft_tokens);
    p.draft_dtype = float_dtype(kOp, "draft_logits", *draft_logits);
    check_shape("draft_logits", *draft_logits, {N, K, V});
    p.draft_logits = draft_logits->data_ptr();
  }
  if (draft_logprobs) {
    TORCH_CHECK(draft_logits.has_value(), kOp, ": draft_logprobs needs draft_logits");
    check_input(kOp, "draft_logprobs", *draft_logprobs, draft_tokens);
    check_dtype(kOp, "draft_logprobs", *draft_logprobs, at::kFloat);
    check_shape("draft_logprobs", *draft_logprobs, {N, K});
    p.draft_logprobs = draft_logprobs->data_ptr<float>();
  }
  if (verify_lens) {
    p.lens_i64 = int_tensor("verify_lens", *verify_lens, draft_tokens);
    check_shape("verify_lens", *verify_lens, {N});
    p.verify_lens = verify_lens->data_ptr();
  }
  TORCH_CHECK(survival.has_value() == thresholds.has_value(), kOp, ": survival and thresholds must be given together");
  if (survival) {
    check_input(kOp, "survival", *survival, draft_tokens);
    p.survival_dtype = float_dtype(kOp, "survival", *survival);
    check_shape("survival", *survival, {N, K});
    check_input(kOp, "thresholds", *thresholds, draft_tokens);
    p.thresholds_dtype = float_dtype(kOp, "thresholds", *thresholds);
    check_shape("thresholds", *thresholds, {K});
    p.survival = survival->data_ptr();
    p.thresholds = thresholds->data_ptr();
  }
  if (temperature) {
    check_input(kOp, "temperature", *temperature, draft_tokens);
    check_dtype(kOp, "temperature", *temperature, at::kFloat);
    check_shape("temperature", *temperature, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  check_input(kOp, "rng_key", rng_key, draft_tokens);
  check_dtype(kOp, "rng_key", rng_key, at::kLong);
  TORCH_CHECK(rng_key.numel() == 2, kOp, ": rng_key must be int64 [2] (seed, offset), got shape ", rng_key.sizes());
  if (stop_token_ids) {
    p.stops_i64 = int_tensor("stop_token_ids", *stop_token_ids, draft_tokens);
    TORCH_CHECK(stop_token_ids->dim() == 1, kOp, ": stop_token_ids must be 1-D, got shape ", stop_token_ids->sizes());
    p.num_stops = stop_token_ids->numel();
    p.stop_ids = stop_token_ids->data_ptr();
  }
  TORCH_CHECK(method == "token" || method == "block", kOp, ": method must be 'token' or 'block', got '",
              std::string(method), "'");
  p.block_method = method == "block";
  p.target = target_logits.data_ptr();
  p.draft_tokens = draft_tokens.data_ptr();
  p.rng_key = rng_key.data_ptr<int64_t>();
  p.N = N;
  p.K = K;
  p.V = V;
  const auto opts = draft_tokens.options();
  at::Tensor tokens = at::empty({N, K + 1}, opts.dtype(at::kLong));
  at::Tensor num_accepted = at::empty({N}, opts.dtype(at::kInt));
  at::Tensor accept_mask = at::empty({N, K}, opts.dtype(at::kBool));
  if (N == 0) return {tokens, num_accepted, accept_mask};
  p.out_tokens = tokens.data_ptr<int64_t>();
  p.out_num_accepted = num_accepted.data_ptr<int32_t>();
  p.out_accept_mask = reinterpret_cast<uint8_t*>(accept_mask.data_ptr<bool>());
  const DeviceGuard guard(draft_tokens);
  at::Tensor workspace = at::empty({static_cast<int64_t>(dspark::verify_chain_workspace_bytes(N, K, V))},
                                   opts.dtype(at::kByte));
  check_launch(dspark::launch_verify_chain(p, workspace.data_ptr(), current_stream(draft_tokens)), kOp);
  return {tokens, num_accepted, accept_mask};
}

}  // namespace

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_chain", &verify_chain);
}

}  // namespace dspark_torch
