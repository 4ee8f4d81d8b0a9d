// Torch launchers of dspark_C::draft_block (the kernels live in dspark/draft_block.cuh and, for top_k,
// draft_block_topk.cuh) and of dspark_C::draft_step, the CUDA backend of dspark_dist::draft_step (one position of the
// Markov head on one vocabulary shard: dist_draft_step.cuh). One kernel unit compiles both
// (csrc/kernels/draft_block.cu): they launch the same sweep kernels (draft_sweep.cuh).
#include "dist_common.h"
#include "dspark/dist_draft_step.h"
#include "dspark/draft_block.h"

#include <ATen/ops/empty.h>

#include <tuple>

namespace dspark_torch::draft_block {

using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "draft_block";

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> launch(
    const Tensor& base_logits, const Tensor& anchor_tokens, c10::string_view head_kind, const Tensor& w1,
    const Tensor& w2, const OptT& w2_scale, const OptT& draft_to_target, const OptT& wg, const OptT& bg,
    const OptT& wj, const OptT& bj, const OptT& hidden, const OptT& conf_weight, const OptT& conf_bias,
    const OptT& sts_temperatures, const OptT& temperature, const Tensor& rng_key, bool return_logits,
    int64_t top_k) {
  check_shape(kOp, "base_logits", base_logits, {kAnySize, kAnySize, kAnySize});
  const Tensor& base = base_logits;
  const int64_t N = base.size(0), K = base.size(1), V = base.size(2);
  TORCH_CHECK(K < (int64_t(1) << 24), kOp, ": base_logits.size(1) (positions) must be < 2^24, got ", K);
  TORCH_CHECK(V < (int64_t(1) << 31), kOp, ": base_logits.size(2) (vocabulary) must be < 2^31, got ", V);
  dspark::DraftBlockParams p{};
  p.N = N;
  p.K = K;
  p.V = V;
  p.base = base.data_ptr();
  p.base_dtype = check_float(kOp, "base_logits", base, base);
  p.anchors_int64 = check_int(kOp, "anchor_tokens", anchor_tokens, base, {N});
  p.anchors = anchor_tokens.data_ptr();
  if (head_kind == "vanilla") {
    p.head = dspark::draft::kVanilla;
  } else if (head_kind == "gated") {
    p.head = dspark::draft::kGated;
  } else {
    TORCH_CHECK(head_kind == "rnn", kOp, ": head_kind must be vanilla, gated or rnn, got ", head_kind);
    p.head = dspark::draft::kRnn;
  }
  if (draft_to_target.has_value()) {
    p.d2t_int64 = check_int(kOp, "draft_to_target", *draft_to_target, base, {V});
    p.d2t = draft_to_target->data_ptr();
    check_shape(kOp, "w1", w1, {kAnySize, kAnySize});
  } else {
    check_shape(kOp, "w1", w1, {V, kAnySize});
  }
  const int64_t R = w1.size(1);
  p.R = R;
  p.VT = w1.size(0);
  p.w1_dtype = check_float(kOp, "w1", w1, base);
  if (w2.scalar_type() == at::kFloat8_e4m3fn) {
    check_tensor(kOp, "w2", w2, base, at::kFloat8_e4m3fn, {V, R});
    TORCH_CHECK(w2_scale.has_value(), kOp, ": a float8_e4m3fn w2 needs w2_scale (float32 [V], one scale per row)");
    check_tensor(kOp, "w2_scale", *w2_scale, base, at::kFloat, {V});
    p.w2_dtype = dspark::DType::kFloat8E4M3;
    p.w2_scale = w2_scale->data_ptr<float>();
  } else {
    p.w2_dtype = check_float(kOp, "w2", w2, base, {V, R});
    TORCH_CHECK(!w2_scale.has_value(), kOp, ": w2_scale is only for a float8_e4m3fn w2, got w2 of ",
                w2.scalar_type());
  }
  p.w1 = w1.data_ptr();
  p.w2 = w2.data_ptr();
  const bool has_conf = conf_weight.has_value();
  const bool needs_hidden = p.head != dspark::draft::kVanilla || has_conf;
  int64_t D = 0;
  if (needs_hidden) {
    TORCH_CHECK(hidden.has_value(), kOp, ": hidden [N, K, d] is required by the ", head_kind,
                " head or the confidence head");
    p.hidden_dtype = check_float(kOp, "hidden", *hidden, base, {N, K, kAnySize});
    D = hidden->size(2);
    p.hidden = hidden->data_ptr();
  }
  p.D = D;
  if (p.head == dspark::draft::kGated) {
    TORCH_CHECK(wg.has_value() && bg.has_value(), kOp, ": the gated head needs wg and bg");
    p.wg_dtype = check_float(kOp, "wg", *wg, base, {R, D + R});
    p.bg_dtype = check_float(kOp, "bg", *bg, base, {R});
    p.wg = wg->data_ptr();
    p.bg = bg->data_ptr();
  } else if (p.head == dspark::draft::kRnn) {
    TORCH_CHECK(wj.has_value() && bj.has_value(), kOp, ": the rnn head needs wj and bj");
    p.wj_dtype = check_float(kOp, "wj", *wj, base, {3 * R, 2 * R + D});
    p.bj_dtype = check_float(kOp, "bj", *bj, base, {3 * R});
    p.wj = wj->data_ptr();
    p.bj = bj->data_ptr();
  }
  if (has_conf) {
    p.conf_w_dtype = check_float(kOp, "conf_weight", *conf_weight, base);
    TORCH_CHECK(conf_weight->numel() == D + R, kOp, ": conf_weight must have d + r = ", D + R, " elements, got ",
                conf_weight->numel());
    p.conf_w = conf_weight->data_ptr();
    TORCH_CHECK(conf_bias.has_value(), kOp, ": conf_bias is required with conf_weight");
    p.conf_b_dtype = check_float(kOp, "conf_bias", *conf_bias, base);
    TORCH_CHECK(conf_bias->numel() == 1, kOp, ": conf_bias must have one element, got shape ", conf_bias->sizes());
    p.conf_b = conf_bias->data_ptr();
    if (sts_temperatures.has_value()) {
      p.sts_dtype = check_float(kOp, "sts_temperatures", *sts_temperatures, base, {K});
      p.sts = sts_temperatures->data_ptr();
    }
  }
  if (temperature.has_value()) {
    check_tensor(kOp, "temperature", *temperature, base, at::kFloat, {N});
    p.temperature = temperature->data_ptr<float>();
  }
  p.rng_key = check_rng_key(kOp, rng_key, base);
  TORCH_CHECK(top_k >= 0 && top_k <= std::min(V, dspark::draft_topk::kMaxTopK), kOp,
              ": top_k must be 0 (the full proposal) or in [1, min(V, ", dspark::draft_topk::kMaxTopK, ")], got ",
              top_k);
  p.top_k = top_k;

  const auto f32 = base.options().dtype(at::kFloat);
  Tensor tokens = at::empty({N, K}, base.options().dtype(at::kLong));
  Tensor logprobs = at::empty({N, K}, f32);
  const int64_t width = top_k > 0 ? top_k : V;
  Tensor logits = return_logits ? at::empty({N, K, width}, f32) : at::empty({0}, f32);
  const bool sparse = return_logits && top_k > 0;
  const auto i64 = base.options().dtype(at::kLong);
  Tensor candidates = sparse ? at::empty({N, K, top_k}, i64) : at::empty({0}, i64);
  Tensor conf = has_conf ? at::empty({N, K}, f32) : at::empty({0}, f32);
  Tensor survival = has_conf ? at::empty({N, K}, f32) : at::empty({0}, f32);
  if (N == 0 || K == 0 || V == 0) return {tokens, logits, conf, survival, logprobs, candidates};
  p.tokens = tokens.data_ptr<int64_t>();
  p.logprobs = logprobs.data_ptr<float>();
  p.logits = return_logits ? logits.data_ptr<float>() : nullptr;
  p.conf = has_conf ? conf.data_ptr<float>() : nullptr;
  p.survival = has_conf ? survival.data_ptr<float>() : nullptr;
  p.candidates = sparse ? candidates.data_ptr<int64_t>() : nullptr;

  const DeviceGuard guard(base);
  const size_t ws_bytes = dspark::draft_block_workspace_bytes(p);
  TORCH_CHECK(ws_bytes > 0, kOp, ": no launch configuration fits this device");
  Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, base.options().dtype(at::kByte));
  check_launch(dspark::launch_draft_block(p, workspace.data_ptr(), current_stream(base)), kOp);
  return {tokens, logits, conf, survival, logprobs, candidates};
}

}  // namespace dspark_torch::draft_block

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
  m.impl("draft_block", &dspark_torch::draft_block::launch);
  m.impl("draft_step", &dspark_torch::dist_draft_step::launch);
}
