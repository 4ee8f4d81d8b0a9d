// Torch launcher of dspark_C::draft_block (the kernel lives in csrc/include/dspark/draft_block.cuh).
#include "common.h"
#include "dspark/draft_block.cuh"

#include <ATen/ops/empty.h>

#include <tuple>

namespace dspark_torch {
namespace {

using at::Tensor;
using OptT = std::optional<Tensor>;

Tensor contig(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  Tensor c = t.contiguous();
  check_input(op, name, c, like);
  return c;
}

void check_shape(const char* op, const char* name, const Tensor& t, std::initializer_list<int64_t> shape) {
  TORCH_CHECK(t.dim() == static_cast<int64_t>(shape.size()), op, ": ", name, " must have ", shape.size(),
              " dimensions, got shape ", t.sizes());
  int i = 0;
  for (int64_t s : shape) {
    TORCH_CHECK(t.size(i) == s, op, ": ", name, " must have shape ", c10::IntArrayRef(shape), ", got ", t.sizes());
    ++i;
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> draft_block(
    const Tensor& base_logits, const Tensor& anchor_tokens, c10::string_view head_kind, const Tensor& w1,
    const Tensor& w2, const OptT& wg, const OptT& bg, const OptT& wj, const OptT& bj, const OptT& hidden,
    const OptT& conf_weight, const OptT& conf_bias, const OptT& sts_temperatures, const OptT& temperature,
    const Tensor& rng_key, bool return_logits) {
  constexpr const char* op = "draft_block";
  TORCH_CHECK(base_logits.dim() == 3, op, ": base_logits must have 3 dimensions [N, K, V], got shape ",
              base_logits.sizes());
  const Tensor base = contig(op, "base_logits", base_logits, base_logits);
  const int64_t N = base.size(0), K = base.size(1), V = base.size(2);
  TORCH_CHECK(K < (int64_t(1) << 24), op, ": base_logits.size(1) (positions) must be < 2^24, got ", K);
  TORCH_CHECK(V < (int64_t(1) << 31), op, ": base_logits.size(2) (vocabulary) must be < 2^31, got ", V);
  dspark::DraftBlockParams p{};
  p.N = N;
  p.K = K;
  p.V = V;
  p.base = base.data_ptr();
  p.base_dtype = float_dtype(op, "base_logits", base);
  const Tensor anchors = contig(op, "anchor_tokens", anchor_tokens, base);
  check_shape(op, "anchor_tokens", anchors, {N});
  TORCH_CHECK(anchors.scalar_type() == at::kLong || anchors.scalar_type() == at::kInt, op,
              ": anchor_tokens must be int32 or int64, got ", anchors.scalar_type());
  p.anchors = anchors.data_ptr();
  p.anchors_int64 = anchors.scalar_type() == at::kLong;
  if (head_kind == "vanilla") {
    p.head = dspark::draft::kVanilla;
  } else if (head_kind == "gated") {
    p.head = dspark::draft::kGated;
  } else {
    TORCH_CHECK(head_kind == "rnn", op, ": head_kind must be vanilla, gated or rnn, got ", head_kind);
    p.head = dspark::draft::kRnn;
  }
  TORCH_CHECK(w1.dim() == 2, op, ": w1 must have 2 dimensions [V, r], got shape ", w1.sizes());
  const int64_t R = w1.size(1);
  p.R = R;
  const Tensor w1c = contig(op, "w1", w1, base), w2c = contig(op, "w2", w2, base);
  check_shape(op, "w1", w1c, {V, R});
  check_shape(op, "w2", w2c, {V, R});
  p.w1 = w1c.data_ptr();
  p.w1_dtype = float_dtype(op, "w1", w1c);
  p.w2 = w2c.data_ptr();
  p.w2_dtype = float_dtype(op, "w2", w2c);
  const bool has_conf = conf_weight.has_value();
  const bool needs_hidden = p.head != dspark::draft::kVanilla || has_conf;
  Tensor h;
  int64_t D = 0;
  if (needs_hidden) {
    TORCH_CHECK(hidden.has_value(), op, ": hidden [N, K, d] is required by the ", head_kind,
                " head or the confidence head");
    h = contig(op, "hidden", *hidden, base);
    TORCH_CHECK(h.dim() == 3, op, ": hidden must have 3 dimensions [N, K, d], got shape ", h.sizes());
    D = h.size(2);
    check_shape(op, "hidden", h, {N, K, D});
    p.hidden = h.data_ptr();
    p.hidden_dtype = float_dtype(op, "hidden", h);
  }
  p.D = D;
  Tensor wgc, bgc, wjc, bjc, cw, cb, sts, temps;
  if (p.head == dspark::draft::kGated) {
    TORCH_CHECK(wg.has_value() && bg.has_value(), op, ": the gated head needs wg and bg");
    wgc = contig(op, "wg", *wg, base);
    bgc = contig(op, "bg", *bg, base);
    check_shape(op, "wg", wgc, {R, D + R});
    check_shape(op, "bg", bgc, {R});
    p.wg = wgc.data_ptr();
    p.wg_dtype = float_dtype(op, "wg", wgc);
    p.bg = bgc.data_ptr();
    p.bg_dtype = float_dtype(op, "bg", bgc);
  } else if (p.head == dspark::draft::kRnn) {
    TORCH_CHECK(wj.has_value() && bj.has_value(), op, ": the rnn head needs wj and bj");
    wjc = contig(op, "wj", *wj, base);
    bjc = contig(op, "bj", *bj, base);
    check_shape(op, "wj", wjc, {3 * R, 2 * R + D});
    check_shape(op, "bj", bjc, {3 * R});
    p.wj = wjc.data_ptr();
    p.wj_dtype = float_dtype(op, "wj", wjc);
    p.bj = bjc.data_ptr();
    p.bj_dtype = float_dtype(op, "bj", bjc);
  }
  if (has_conf) {
    cw = contig(op, "conf_weight", *conf_weight, base);
    TORCH_CHECK(cw.numel() == D + R, op, ": conf_weight must have d + r = ", D + R, " elements, got ", cw.numel());
    p.conf_w = cw.data_ptr();
    p.conf_w_dtype = float_dtype(op, "conf_weight", cw);
    TORCH_CHECK(conf_bias.has_value(), op, ": conf_bias is required with conf_weight");
    cb = contig(op, "conf_bias", *conf_bias, base);
    TORCH_CHECK(cb.numel() == 1, op, ": conf_bias must have one element, got shape ", cb.sizes());
    p.conf_b = cb.data_ptr();
    p.conf_b_dtype = float_dtype(op, "conf_bias", cb);
    if (sts_temperatures.has_value()) {
      sts = contig(op, "sts_temperatures", *sts_temperatures, base);
      check_shape(op, "sts_temperatures", sts, {K});
      p.sts = sts.data_ptr();
      p.sts_dtype = float_dtype(op, "sts_temperatures", sts);
    }
  }
  if (temperature.has_value()) {
    temps = contig(op, "temperature", *temperature, base);
    check_dtype(op, "temperature", temps, at::kFloat);
    check_shape(op, "temperature", temps, {N});
    p.temperature = temps.data_ptr<float>();
  }
  const Tensor key = contig(op, "rng_key", rng_key, base);
  check_dtype(op, "rng_key", key, at::kLong);
  TORCH_CHECK(key.numel() == 2, op, ": rng_key must be int64 [2] (seed, offset), got shape ", key.sizes());
  p.rng_key = key.data_ptr<int64_t>();

  const auto f32 = base.options().dtype(at::kFloat);
  Tensor tokens = at::empty({N, K}, base.options().dtype(at::kLong));
  Tensor logprobs = at::empty({N, K}, f32);
  Tensor logits = return_logits ? at::empty({N, K, V}, f32) : at::empty({0}, f32);
  Tensor conf = has_conf ? at::empty({N, K}, f32) : at::empty({0}, f32);
  Tensor survival = has_conf ? at::empty({N, K}, f32) : at::empty({0}, f32);
  if (N == 0 || K == 0 || V == 0) return {tokens, logits, conf, survival, logprobs};
  p.tokens = tokens.data_ptr<int64_t>();
  p.logprobs = logprobs.data_ptr<float>();
  p.logits = return_logits ? logits.data_ptr<float>() : nullptr;
  p.conf = has_conf ? conf.data_ptr<float>() : nullptr;
  p.survival = has_conf ? survival.data_ptr<float>() : nullptr;

  const DeviceGuard guard(base);
  const size_t ws_bytes = dspark::draft_block_workspace_bytes(p);
  TORCH_CHECK(ws_bytes > 0, op, ": no launch configuration fits this device");
  Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, base.options().dtype(at::kByte));
  check_launch(dspark::launch_draft_block(p, workspace.data_ptr(), current_stream(base)), op);
  return {tokens, logits, conf, survival, logprobs};
}

}  // namespace

DSPARK_LIBRARY_IMPL(m) {
  m.impl("draft_block", &draft_block);
}

}  // namespace dspark_torch
