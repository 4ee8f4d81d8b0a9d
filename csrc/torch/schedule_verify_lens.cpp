// Torch launcher of schedule_verify_lens (the kernel lives in dspark/schedule_verify_lens.cuh).
#include "common.h"
#include "dspark/schedule_verify_lens.h"

#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <tuple>

namespace dspark_torch::schedule_verify_lens {

constexpr const char* kOp = "schedule_verify_lens";

std::tuple<at::Tensor, at::Tensor, at::Tensor> launch(
    const std::optional<at::Tensor>& survival, const std::optional<at::Tensor>& conf_logits,
    const std::optional<at::Tensor>& sts_temperatures, const at::Tensor& token_counts,
    const at::Tensor& step_time_ms, double fixed_overhead_ms, int64_t min_len, int64_t max_len,
    const std::string& mode, const std::optional<at::Tensor>& budget_survival, double min_gain,
    const std::optional<at::Tensor>& active) {
  TORCH_CHECK(survival.has_value() != conf_logits.has_value(), kOp,
              ": exactly one of survival and conf_logits must be given");
  const at::Tensor& x = survival.has_value() ? *survival : *conf_logits;
  const char* x_name = survival.has_value() ? "survival" : "conf_logits";
  const dspark::DType x_dtype = check_float(kOp, x_name, x, x, {kAnySize, kAnySize});
  const int64_t N = x.size(0), K = x.size(1);
  constexpr int64_t kLimit = int64_t(1) << 31;  // N*(K+1) below it, compared by division (no overflow)
  TORCH_CHECK(N == 0 || (K < kLimit && K + 1 <= (kLimit - 1) / N), kOp,
              ": N*(K+1) must be < 2^31 (cu_seqlens is int32), got N=", N, " K=", K);
  TORCH_CHECK(mode == "exact" || mode == "argmax", kOp, ": mode must be 'exact' or 'argmax', got '", mode, "'");
  TORCH_CHECK(0 <= min_len && min_len <= max_len && max_len <= K, kOp, ": need 0 <= min_len <= max_len <= K=",
              K, ", got min_len=", min_len, ", max_len=", max_len);
  TORCH_CHECK(min_gain >= 0.0 && min_gain < INFINITY, kOp, ": min_gain must be finite and >= 0, got ", min_gain);
  TORCH_CHECK(fixed_overhead_ms >= 0.0 && fixed_overhead_ms < INFINITY, kOp,
              ": fixed_overhead_ms must be finite and >= 0, got ", fixed_overhead_ms);
  dspark::ScheduleVerifyLensParams p;
  p.N = N;
  p.K = K;
  if (survival.has_value()) {
    p.survival = x.data_ptr();
    p.survival_dtype = x_dtype;
    TORCH_CHECK(!sts_temperatures.has_value(), kOp, ": sts_temperatures is only used with conf_logits");
  } else {
    p.conf_logits = x.data_ptr();
    p.conf_dtype = x_dtype;
    if (sts_temperatures.has_value()) {
      p.sts_dtype = check_float(kOp, "sts_temperatures", *sts_temperatures, x, {K});
      p.sts_temperatures = sts_temperatures->data_ptr();
    }
  }
  for (const auto* t : {&token_counts, &step_time_ms}) {
    const char* name = t == &token_counts ? "token_counts" : "step_time_ms";
    check_tensor(kOp, name, *t, x, at::kFloat, {kAnySize});
    TORCH_CHECK(t->size(0) >= 1, kOp, ": ", name, " must have shape [P], P >= 1, got ", t->sizes());
  }
  TORCH_CHECK(token_counts.size(0) == step_time_ms.size(0), kOp,
              ": token_counts and step_time_ms must have the same length, got ", token_counts.size(0), " and ",
              step_time_ms.size(0));
  p.token_counts = token_counts.data_ptr<float>();
  p.step_time_ms = step_time_ms.data_ptr<float>();
  p.P = token_counts.size(0);
  p.fixed_overhead_ms = fixed_overhead_ms;
  p.min_len = min_len;
  p.max_len = max_len;
  p.exact = mode == "exact";
  if (budget_survival.has_value()) {
    TORCH_CHECK(!p.exact, kOp, ": budget_survival applies to mode='argmax' only");
    p.budget_dtype = check_float(kOp, "budget_survival", *budget_survival, x, {kAnySize, kAnySize});
    p.budget_survival = budget_survival->data_ptr();
    p.has_budget = true;
    p.NB = budget_survival->size(0);
    p.KB = budget_survival->size(1);
    TORCH_CHECK(p.NB == 0 || p.KB <= (kLimit - 1) / p.NB, kOp,
                ": budget_survival must have fewer than 2^31 elements, got ", budget_survival->sizes());
  }
  p.gain = 1.0 + min_gain;
  if (active.has_value()) {
    check_tensor(kOp, "active", *active, x, at::kBool, {N});
    p.active = reinterpret_cast<const uint8_t*>(active->data_ptr<bool>());
  }
  at::Tensor lens = at::empty({N}, x.options().dtype(at::kInt));
  at::Tensor cu = at::empty({N + 1}, x.options().dtype(at::kInt));
  at::Tensor theta = at::empty({}, x.options().dtype(at::kFloat));
  p.verify_lens = lens.data_ptr<int32_t>();
  p.cu_seqlens = cu.data_ptr<int32_t>();
  p.theta = theta.data_ptr<float>();
  const size_t ws_bytes = dspark::schedule_verify_lens_workspace_bytes(p);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const DeviceGuard guard(x);
  check_launch(dspark::launch_schedule_verify_lens(p, ws_bytes ? ws.data_ptr() : nullptr, current_stream(x)),
               kOp);
  return {lens, cu, theta};
}

}  // namespace dspark_torch::schedule_verify_lens

DSPARK_LIBRARY_IMPL(m) {
  m.impl("schedule_verify_lens", &dspark_torch::schedule_verify_lens::launch);
}
