// CPU kernel of schedule_verify_lens (the meaning: dspark_kernels/reference/schedule_verify_lens.py), on the
// survival (the Python side turns conf_logits into it first, with torch's own float32 ops). The reference's float64
// operations are repeated in its order: the cost table's interpolation op by op (no FMA contraction in this file),
// Theta_m = (tau0 + C_m) * SPS(B_0 + m) with C_m the sequential sum of the sorted survivals, as torch.cumsum takes
// it. tau0's sum over the first min_len columns is sequential here and pairwise in torch: equal whenever the float64
// sums of these float32 values are exact (always for min_len = 0, and whenever no survival there is below about
// 2^-17 of the largest). Inactive requests hold no candidate and count in neither B nor tau.
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <utility>
#include <vector>

#include "common.h"

namespace dspark_cpu {

namespace {

// The cost table as float64, and SPS(B) = 1000 / (time_ms(B) + overhead) by calibration.interp_step_time_ms.
struct CostTable {
  std::vector<double> c, t;
  double overhead;

  double time_ms(double x) const {
    const int64_t p = static_cast<int64_t>(c.size());
    if (p == 1) return t[0];
    const int64_t right = std::upper_bound(c.begin(), c.end(), x) - c.begin();  // searchsorted(right=True)
    const int64_t seg = std::clamp<int64_t>(right - 1, 0, p - 2);
    const double slope = (t[seg + 1] - t[seg]) / (c[seg + 1] - c[seg]);
    const double xc = std::max(x, c[0]);
    const double inside = t[seg] + (xc - c[seg]) * slope;
    const double above = t[p - 1] + (xc - c[p - 1]) * std::max(slope, 0.0);
    return xc > c[p - 1] ? above : inside;
  }
  double sps(double x) const { return 1000.0 / (time_ms(x) + overhead); }
};

// float64 [N, K]: NaN -> 0, clamped to [0, 1], then the running minimum along K.
std::vector<double> clean_survival(const at::Tensor& survival) {
  const at::Tensor a = as_float(survival);
  const int64_t N = a.size(0), K = a.size(1);
  std::vector<double> out(N * K);
  for (int64_t r = 0; r < N; ++r) {
    double run = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      double v = static_cast<double>(a.data_ptr<float>()[r * K + j]);
      v = std::isnan(v) ? 0.0 : std::min(std::max(v, 0.0), 1.0);
      run = j == 0 ? v : std::min(run, v);
      out[r * K + j] = run;
    }
  }
  return out;
}

// The admission order (the active requests' candidates (r, j), min_len < j <= max_len, as indices into the
// r-major [N, max_len - min_len] grid, best first, stable) and theta[m] after m admissions.
struct Curve {
  std::vector<int64_t> order;
  std::vector<double> theta;
};

// active: [N] or empty (every request active).
Curve admission_curve(const std::vector<double>& a, int64_t N, int64_t K, int64_t min_len, int64_t max_len,
                      const CostTable& table, const std::vector<bool>& active) {
  const int64_t W = max_len - min_len;
  std::vector<double> cand(N * W);
  std::vector<int64_t> order;
  double head = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (!active.empty() && !active[r]) continue;
    ++n;
    for (int64_t j = 0; j < min_len; ++j) head += a[r * K + j];
    for (int64_t c = 0; c < W; ++c) {
      cand[r * W + c] = a[r * K + min_len + c];
      order.push_back(r * W + c);
    }
  }
  Curve cv;
  cv.order = std::move(order);
  std::stable_sort(cv.order.begin(), cv.order.end(), [&](int64_t x, int64_t y) { return cand[x] > cand[y]; });
  const int64_t M = static_cast<int64_t>(cv.order.size());
  const double b0 = static_cast<double>(n * (1 + min_len));
  const double tau0 = static_cast<double>(n) + head;
  cv.theta.resize(M + 1);
  double cum = 0.0;
  cv.theta[0] = (tau0 + 0.0) * table.sps(b0);
  for (int64_t m = 0; m < M; ++m) {
    cum += cand[cv.order[m]];
    cv.theta[m + 1] = (tau0 + cum) * table.sps(b0 + static_cast<double>(m + 1));
  }
  return cv;
}

// torch.argmax: the first maximum, a NaN counting as the maximum.
int64_t first_argmax(const std::vector<double>& x) {
  int64_t best = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> schedule_verify_lens(
    const std::optional<at::Tensor>& survival, const std::optional<at::Tensor>& conf_logits,
    const std::optional<at::Tensor>& sts_temperatures, const at::Tensor& token_counts,
    const at::Tensor& step_time_ms, double fixed_overhead_ms, int64_t min_len, int64_t max_len,
    c10::string_view mode, const std::optional<at::Tensor>& budget_survival, double min_gain,
    const std::optional<at::Tensor>& active) {
  TORCH_CHECK(survival.has_value() && !conf_logits && !sts_temperatures,
              "schedule_verify_lens (cpu): pass the survival (dspark_kernels turns conf_logits into it)");
  TORCH_CHECK(mode == "exact" || mode == "argmax", "schedule_verify_lens: mode must be 'exact' or 'argmax'");
  const int64_t N = survival->size(0), K = survival->size(1);
  const at::Tensor counts = token_counts.to(at::kDouble).contiguous();
  const at::Tensor times = step_time_ms.to(at::kDouble).contiguous();
  CostTable table{{counts.data_ptr<double>(), counts.data_ptr<double>() + counts.numel()},
                  {times.data_ptr<double>(), times.data_ptr<double>() + times.numel()},
                  fixed_overhead_ms};
  std::vector<bool> act;
  if (active) {
    const at::Tensor flags = active->to(at::kBool).contiguous();
    act.assign(flags.data_ptr<bool>(), flags.data_ptr<bool>() + N);
  }
  const Curve cv = admission_curve(clean_survival(*survival), N, K, min_len, max_len, table, act);
  const int64_t M = static_cast<int64_t>(cv.order.size());

  int64_t m_star = 0;
  if (mode == "exact") {
    while (m_star < M && cv.theta[m_star + 1] > cv.theta[m_star]) ++m_star;
  } else {
    if (budget_survival) {
      const int64_t Kb = budget_survival->size(1), budget_max = std::min(max_len, Kb);
      const Curve cb = admission_curve(clean_survival(*budget_survival), budget_survival->size(0), Kb,
                                       std::min(min_len, budget_max), budget_max, table, {});
      m_star = std::min(first_argmax(cb.theta), M);
    } else {
      m_star = first_argmax(cv.theta);
    }
    if (cv.theta[m_star] < (1.0 + min_gain) * cv.theta[M]) m_star = M;
  }

  const auto opts = survival->options();
  at::Tensor verify_lens = at::empty({N}, opts.dtype(at::kInt));
  at::Tensor cu_seqlens = at::empty({N + 1}, opts.dtype(at::kInt));
  std::vector<int64_t> admitted(N, 0);
  const int64_t W = max_len - min_len;
  for (int64_t m = 0; m < m_star; ++m) ++admitted[cv.order[m] / std::max<int64_t>(W, 1)];
  int32_t* lens = verify_lens.data_ptr<int32_t>();
  int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  cu[0] = 0;
  for (int64_t r = 0; r < N; ++r) {
    const bool on = act.empty() || act[r];
    lens[r] = on ? static_cast<int32_t>(min_len + admitted[r]) : 0;
    cu[r + 1] = cu[r] + (on ? 1 + lens[r] : 0);
  }
  at::Tensor theta = at::scalar_tensor(static_cast<float>(cv.theta[m_star]), opts.dtype(at::kFloat));
  return {verify_lens, cu_seqlens, theta};
}

}  // namespace dspark_cpu
