// Torch launcher of dspark_C::verify_residual, the CUDA backend of dspark_dist::verify_residual (the exact residual
// pass over one vocabulary shard; the kernels live in dspark/dist_verify_residual.cuh).
#include "dist_common.h"
#include "dspark/dist_verify_residual.h"
#include "tickets.h"

#include <ATen/ops/empty.h>

namespace dspark_torch::dist_verify_residual {

using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "verify_residual";
constexpr int64_t kPlanWidth = dspark::dist::kPlanWidth;
constexpr int64_t kResWidth = dspark::dist::kResWidth;

Tensor launch(const Tensor& target_shard, const OptT& cu_seqlens, const Tensor& draft_tokens,
              const OptT& draft_logits_shard, const Tensor& plan, const Tensor& temperature, const Tensor& rng_key,
              int64_t vocab_start, int64_t vocab_size) {
  dspark::DistVerifyResidualParams p;
  p.drafts_i64 = check_int(kOp, "draft_tokens", draft_tokens, draft_tokens, {kAnySize, kAnySize});
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(K >= 1, kOp, ": draft_tokens must have K >= 1 columns");
  p.target = check_target_shard(kOp, target_shard, cu_seqlens, draft_tokens, N, K);
  const int64_t Vl = target_shard.size(-1);
  check_shard_span(kOp, vocab_start, Vl, vocab_size);
  if (draft_logits_shard) {
    p.draft_dtype = check_float(kOp, "draft_logits_shard", *draft_logits_shard, draft_tokens, {N, K, Vl});
    p.draft_logits = draft_logits_shard->data_ptr();
  }
  check_tensor(kOp, "plan", plan, draft_tokens, at::kFloat, {N, kAnySize, kPlanWidth});
  const int64_t S = plan.size(1);
  TORCH_CHECK(N * S < (int64_t(1) << 31), kOp, ": N * plan.size(1) must be < 2^31, got ", N * S);
  check_tensor(kOp, "temperature", temperature, draft_tokens, at::kFloat, {N});
  p.rng_key = check_rng_key(kOp, rng_key, draft_tokens);
  p.draft_tokens = draft_tokens.data_ptr();
  p.plan = plan.data_ptr<float>();
  p.temperature = temperature.data_ptr<float>();
  p.N = N;
  p.K = K;
  p.S = S;
  p.Vl = Vl;
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  Tensor out = at::empty({N, S, kResWidth}, draft_tokens.options().dtype(at::kFloat));
  if (N * S == 0) return out;
  p.out = out.data_ptr<float>();
  const DeviceGuard guard(draft_tokens);
  Tensor workspace = at::empty({static_cast<int64_t>(dspark::dist_verify_residual_workspace_bytes(N * S, Vl))},
                               draft_tokens.options().dtype(at::kByte));
  check_launch(dspark::launch_dist_verify_residual(p, workspace.data_ptr(), zeroed_tickets(draft_tokens, N * S),
                                                   current_stream(draft_tokens)),
               kOp);
  return out;
}

}  // namespace dspark_torch::dist_verify_residual

DSPARK_LIBRARY_IMPL(m) {
  m.impl("verify_residual", &dspark_torch::dist_verify_residual::launch);
}
