// Torch launcher of dspark_C::draft_step, the CUDA backend of dspark_dist::draft_step (one position of the Markov head
// on one vocabulary shard; the kernels live in csrc/include/dspark/dist_draft_step.cuh).
#include "dist_common.h"
#include "dspark/dist_draft_step.cuh"

#include <ATen/ops/empty.h>

#include <tuple>

namespace dspark_torch::dist_draft_step {

using at::Tensor;

constexpr const char* kOp = "draft_step";

std::tuple<Tensor, Tensor, Tensor> launch(const Tensor& base_logits_k, const Tensor& v, const Tensor& w2_shard,
                                          const std::optional<Tensor>& temperature, const Tensor& rng_key,
                                          int64_t position, int64_t vocab_start, bool return_logits) {
  const Tensor& base = base_logits_k;
  const dspark::DType base_dtype = check_float_rows(kOp, "base_logits_k", base, base);
  const int64_t N = base.size(0), Vl = base.size(1);
  TORCH_CHECK(Vl >= 1, kOp, ": base_logits_k must have at least one column (the shard's size)");
  dspark::DistDraftStepParams p;
  p.base_dtype = base_dtype;
  p.base = base.data_ptr();
  p.base_stride = N > 1 ? base.stride(0) : Vl;
  check_tensor(kOp, "v", v, base, at::kFloat, {N, kAnySize});
  const int64_t R = v.size(1);
  TORCH_CHECK(R >= 1 && R <= dspark::dist_draft_step_max_rank(N), kOp, ": v must have r in [1, ",
              dspark::dist_draft_step_max_rank(N), "] columns, got ", R);
  p.w2_dtype = check_float(kOp, "w2_shard", w2_shard, base, {Vl, R});
  if (temperature) {
    check_tensor(kOp, "temperature", *temperature, base, at::kFloat, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  p.rng_key = check_rng_key(kOp, rng_key, base);
  TORCH_CHECK(position >= 0 && position < (int64_t(1) << 24), kOp, ": position must be in [0, 2^24), got ", position);
  check_shard_span(kOp, vocab_start, Vl, kMaxShardedVocab);
  p.v = v.data_ptr<float>();
  p.w2 = w2_shard.data_ptr();
  p.N = N;
  p.Vl = Vl;
  p.R = R;
  p.position = position;
  p.vocab_start = vocab_start;
  const auto opts = base.options();
  Tensor packed = at::empty({N}, opts.dtype(at::kLong));
  Tensor stats = at::empty({N, dspark::dist_draft::kStatsWidth}, opts.dtype(at::kFloat));
  Tensor logits = at::empty(return_logits ? std::vector<int64_t>{N, Vl} : std::vector<int64_t>{0},
                            opts.dtype(at::kFloat));
  if (N == 0) return {packed, stats, logits};
  p.packed = packed.data_ptr<int64_t>();
  p.stats = stats.data_ptr<float>();
  if (return_logits) p.logits = logits.data_ptr<float>();
  const DeviceGuard guard(base);
  const size_t ws_bytes = dspark::dist_draft_step_workspace_bytes(p);
  TORCH_CHECK(ws_bytes > 0, kOp, ": no launch configuration fits this device");
  Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte));
  check_launch(dspark::launch_dist_draft_step(p, workspace.data_ptr(), current_stream(base)), kOp);
  return {packed, stats, logits};
}

}  // namespace dspark_torch::dist_draft_step

DSPARK_LIBRARY_IMPL(m) {
  m.impl("draft_step", &dspark_torch::dist_draft_step::launch);
}
