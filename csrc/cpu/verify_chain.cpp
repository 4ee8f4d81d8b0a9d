// CPU kernel of verify_chain (the meaning: dspark_kernels/reference/verify_chain.py).
//
// The target rows are cut into (row, vocabulary chunk) items spread over the threads; every pass reads its rows
// once, in 256-token float blocks that stay in L1:
//   A. per item: the argmax (greedy requests), or the softmax statistics of x / T (max, sum of exp, NaN seen) of the
//      target rows and of the draft rows the accept tests need;
//   decide: greedy, token or block acceptance per request from the merged statistics and the drafts' logits;
//   B. block verification's residual masses S_i (target and draft rows 1..L-1, once rho is known), and the
//      statistics of the one draft row a request samples its correction from when draft_logprobs gave q(d_j);
//   C. the emitted token: the exponential race over max(0, rho p - q) at the rejecting row (with its mass), or the
//      Gumbel race over p after a full acceptance; blocks whose best logit cannot reach the leading key skip the
//      random numbers;
//   D. the race over p for the rare rows whose residual mass is below RESIDUAL_EPS.
// Random numbers come from dspark/rng.cuh keyed as in the reference, so the races have the reference's winners.
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "common.h"

namespace dspark_cpu {
namespace {

using dspark::rng::Philox;
constexpr float kResidualEps = 1e-6f;  // reference.verify_chain.RESIDUAL_EPS

// p (or q) of one token whose scaled logit is y.
float prob(const Stats& st, float y) { return bad(st) ? kNaN : std::exp(y - st.m) / st.s; }

// One side of a joint sweep: p = exp(y - shift) * scale with scale NaN for a bad row.
struct Softmax {
  float shift = 0.f, scale = kNaN;
  explicit Softmax(const Stats& st) {
    if (!bad(st)) shift = st.m, scale = 1.f / st.s;
  }
  Softmax() = default;
};

// What a joint sweep over a target row and its draft row needs: w = max(0, rho p - q) (NaN kept, as torch's
// clamp), with q the softmax of the draft row, or one-hot at `onehot` (-1: zero) when there is no draft row.
struct Joint {
  float t = 1.f, rho = 1.f;
  Softmax p, q;
  int64_t onehot = -1;
};

float load_at(const void* row, at::ScalarType dtype, int64_t i) {
  float v = 0.f;
  with_float_type(dtype, [&](auto tag) { v = static_cast<float>(static_cast<const decltype(tag)*>(row)[i]); });
  return v;
}

template <typename T>
DSPARK_CPU_CLONES Best argmax_chunk(const T* row, int64_t lo, int64_t hi) {
  float buf[kBlock];
  Best best{-kInf, lo};
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    prefetch_ahead(row, b, hi);
    fold_best(as_float(row + b, n, buf), n, b, best);
  }
  return best;
}

template <typename T>
DSPARK_CPU_CLONES Stats stats_chunk(const T* row, int64_t lo, int64_t hi, float t) {
  float buf[kBlock];
  Stats st;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    prefetch_ahead(row, b, hi);
    fold_stats(as_float(row + b, n, buf), n, t, st);
  }
  return st;
}

// w[i] = max(0, rho p - q) at tokens b..b+n-1 (tmp, tmp2: scratch).
template <typename TT, typename TD>
DSPARK_CPU_INLINE void residual_weights(const TT* trow, const TD* drow, const Joint& j, int64_t b, int64_t n, float* w,
                                        float* tmp, float* tmp2) {
  const float inv_t = 1.f / j.t;
  if (drow != nullptr) {
    const float* z = as_float(drow + b, n, tmp2);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) tmp[i] = exp_nonpos(z[i] * inv_t - j.q.shift) * j.q.scale;
  } else {
    const int64_t hot = j.onehot - b;  // outside [0, n) when the draft is not in this block
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) tmp[i] = i == hot ? 1.f : 0.f;
  }
  prefetch_ahead(trow, b, b + 3 * kBlock);
  if (drow != nullptr) prefetch_ahead(drow, b, b + 3 * kBlock);
  const float* x = as_float(trow + b, n, tmp2);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = j.rho * (exp_nonpos(x[i] * inv_t - j.p.shift) * j.p.scale) - tmp[i];
    w[i] = v < 0.f ? 0.f : v;
  }
}

template <typename TT, typename TD>
DSPARK_CPU_CLONES float mass_chunk(const TT* trow, const TD* drow, const Joint& j, int64_t lo, int64_t hi) {
  float w[kBlock], tmp[kBlock], tmp2[kBlock];
  float mass = 0.f;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    residual_weights(trow, drow, j, b, n, w, tmp, tmp2);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += w[i];
    mass += s;
  }
  return mass;
}

// The residual's mass over a chunk and its exponential-race winner, argmax w / -log(u).
struct Race {
  float mass = 0.f;
  Best best;
};

template <typename TT, typename TD>
DSPARK_CPU_CLONES Race residual_chunk(const TT* trow, const TD* drow, const Joint& j, const Philox& ph,
                                      int64_t request, int64_t position, int64_t lo, int64_t hi) {
  float w[kBlock], tmp[kBlock], tmp2[kBlock];
  Race race;
  race.best.index = lo;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    residual_weights(trow, drow, j, b, n, w, tmp, tmp2);
    float s = 0.f, top = 0.f;
#pragma omp simd reduction(+ : s) reduction(max : top)
    for (int64_t i = 0; i < n; ++i) {
      s += w[i];
      top = w[i] > top ? w[i] : top;
    }
    race.mass += s;
    if (!(top > 0.f)) continue;  // zeros cannot win against the positive weight a used race has
    uniforms(ph, request, position, dspark::rng::kStreamResidual, b, n, tmp);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) tmp[i] = w[i] / -log_pos(tmp[i]);
    fold_best(tmp, n, b, race.best);
  }
  return race;
}

// The Gumbel race over softmax(x / T): argmax x / T - log(-log(u)).
template <typename T>
DSPARK_CPU_CLONES Best gumbel_chunk(const T* row, float t, const Philox& ph, int64_t request, int64_t position,
                                    int64_t lo, int64_t hi) {
  float y[kBlock], u[kBlock];
  Best best{-kInf, lo};
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    prefetch_ahead(row, b, hi);
    to_float(row + b, n, y);
    float m = -kInf;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) {
      y[i] = y[i] / t;
      m = y[i] > m ? y[i] : m;
    }
    if (m + kGumbelBound < best.value) continue;  // no key of this block can reach the leader
    uniforms(ph, request, position, dspark::rng::kStreamResidual, b, n, u);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) u[i] = y[i] - log_pos(-log_pos(u[i]));
    fold_best(u, n, b, best);
  }
  return best;
}

// Per request: where its rows are, what it verifies, and what it decides.
struct Request {
  int64_t first_row = 0;  // the row of target_logits holding its row 0
  int64_t length = 0;     // L, the drafts it verifies
  bool has_rows = false, sampled = false, stopped = false;
  float t = 1.f, rho = 1.f;
  int64_t n_acc = 0, emitted = 0;
};

enum class Kind { kArgmax, kTargetStats, kDraftStats, kMass, kResidual, kGumbel };

struct Task {
  int64_t r, row;
  Kind kind;
};

class Verifier {
 public:
  Verifier(const at::Tensor& target, const std::optional<at::Tensor>& draft_logits, const at::Tensor& drafts,
           const std::optional<at::Tensor>& logprobs, const at::Tensor& stops, const Philox& ph, bool block)
      : N_(drafts.size(0)), K_(drafts.size(1)), V_(target.size(-1)), ph_(ph), block_(block),
        target_(static_cast<const char*>(target.data_ptr())), tdtype_(target.scalar_type()),
        tsize_(target.element_size()), drafts_(as_long(drafts)), d_(drafts_.data_ptr<int64_t>()),
        targ_(N_ * (K_ + 1)), tstat_(N_ * (K_ + 1)), dstat_(N_ * K_), mass_(N_ * K_, 0.f) {
    if (draft_logits) {
      draft_ = static_cast<const char*>(draft_logits->data_ptr());
      ddtype_ = draft_logits->scalar_type();
      dsize_ = draft_logits->element_size();
    }
    if (logprobs) logprobs_ = logprobs->data_ptr<float>();
    if (stops.defined()) stops_ = stops.data_ptr<int64_t>(), num_stops_ = stops.numel();
  }

  std::vector<Request> req;

  void run() {
    accept_pass();
    middle_pass();
    for (int64_t r = 0; r < N_; ++r) decide_second(r, req[r]);
    emit_pass();
  }

  int64_t draft(int64_t r, int64_t j) const { return d_[r * K_ + j]; }

 private:
  const int64_t N_, K_, V_;
  const Philox ph_;
  const bool block_;
  const char* target_;
  at::ScalarType tdtype_;
  int64_t tsize_;
  const char* draft_ = nullptr;
  at::ScalarType ddtype_ = at::kFloat;
  int64_t dsize_ = 4;
  const float* logprobs_ = nullptr;
  const int64_t* stops_ = nullptr;
  int64_t num_stops_ = 0;
  at::Tensor drafts_;
  const int64_t* d_;
  std::vector<Best> targ_;    // [N, K+1] argmax of the greedy requests' rows
  std::vector<Stats> tstat_;  // [N, K+1] softmax statistics of the sampled requests' rows
  std::vector<Stats> dstat_;  // [N, K] of their draft rows
  std::vector<float> mass_;   // [N, K] block verification's S_i
  std::vector<Joint> joint_;  // per task of the current pass

  bool valid(int64_t d) const { return d >= 0 && d < V_; }
  const void* trow(const Request& q, int64_t j) const { return target_ + (q.first_row + j) * V_ * tsize_; }
  const void* drow(int64_t r, int64_t j) const {
    return draft_ == nullptr ? nullptr : draft_ + (r * K_ + j) * V_ * dsize_;
  }
  float accept_uniform(int64_t r, int64_t j) const {
    return ph_.uniform(r, j, dspark::rng::kStreamAccept, 0);
  }

  // The joint sweep's inputs at row j of request r (rho: the request's current rho).
  Joint joint(int64_t r, int64_t j, float rho) const {
    const Request& q = req[r];
    Joint jt;
    jt.t = q.t;
    jt.rho = rho;
    jt.p = Softmax(tstat_[r * (K_ + 1) + j]);
    if (draft_ != nullptr) {
      jt.q = Softmax(dstat_[r * K_ + j]);
    } else {
      jt.onehot = valid(draft(r, j)) ? draft(r, j) : -1;
    }
    return jt;
  }

  // A pass's result per task (one struct for every kind of task).
  struct Partial {
    Best best;
    Stats stats;
    float mass = 0.f;
  };
  std::vector<Partial> residual_;  // [N] the emitting row's residual mass and race winner

  static Partial merge_partial(const Partial& a, const Partial& b) {
    return Partial{better(a.best, b.best), merge(a.stats, b.stats), a.mass + b.mass};
  }

  // Runs the tasks' chunks on the threads, merges each task's partials and stores the result.
  void run_pass(const std::vector<Task>& tasks) {
    if (tasks.empty()) return;
    const int64_t count = static_cast<int64_t>(tasks.size());
    const int64_t chunks = chunks_per_row(count, V_);
    std::vector<Partial> parts(count * chunks);
    for_each_chunk(count, V_, chunks, [&](int64_t i, int64_t c, int64_t lo, int64_t hi) {
      parts[i * chunks + c] = sweep(i, tasks[i], lo, hi);
    });
    for (int64_t i = 0; i < count; ++i) {
      Partial acc = parts[i * chunks];
      for (int64_t c = 1; c < chunks; ++c) acc = merge_partial(acc, parts[i * chunks + c]);
      store(tasks[i], acc);
    }
  }

  void store(const Task& tk, const Partial& p) {
    switch (tk.kind) {
      case Kind::kArgmax: targ_[tk.r * (K_ + 1) + tk.row] = p.best; break;
      case Kind::kTargetStats: tstat_[tk.r * (K_ + 1) + tk.row] = p.stats; break;
      case Kind::kDraftStats: dstat_[tk.r * K_ + tk.row] = p.stats; break;
      case Kind::kMass: mass_[tk.r * K_ + tk.row] = p.mass; break;
      case Kind::kResidual: residual_[tk.r] = p; break;
      case Kind::kGumbel: req[tk.r].emitted = p.best.index; break;
    }
  }

  Partial sweep(int64_t i, const Task& tk, int64_t lo, int64_t hi) const {
    Partial out;
    out.best.index = lo;
    const Request& q = req[tk.r];
    switch (tk.kind) {
      case Kind::kArgmax:
        with_float_type(tdtype_, [&](auto tag) {
          out.best = argmax_chunk(static_cast<const decltype(tag)*>(trow(q, tk.row)), lo, hi);
        });
        break;
      case Kind::kTargetStats:
        with_float_type(tdtype_, [&](auto tag) {
          out.stats = stats_chunk(static_cast<const decltype(tag)*>(trow(q, tk.row)), lo, hi, q.t);
        });
        break;
      case Kind::kDraftStats:
        with_float_type(ddtype_, [&](auto tag) {
          out.stats = stats_chunk(static_cast<const decltype(tag)*>(drow(tk.r, tk.row)), lo, hi, q.t);
        });
        break;
      case Kind::kGumbel:
        with_float_type(tdtype_, [&](auto tag) {
          out.best = gumbel_chunk(static_cast<const decltype(tag)*>(trow(q, tk.row)), q.t, ph_, tk.r, tk.row, lo, hi);
        });
        break;
      case Kind::kMass:
      case Kind::kResidual:
        with_float_type(tdtype_, [&](auto ttag) {
          with_float_type(ddtype_, [&](auto dtag) {
            using TT = decltype(ttag);
            using TD = decltype(dtag);
            const auto* t = static_cast<const TT*>(trow(q, tk.row));
            const auto* d = static_cast<const TD*>(drow(tk.r, tk.row));
            if (tk.kind == Kind::kMass) {
              out.mass = mass_chunk(t, d, joint_[i], lo, hi);
            } else {
              const Race race = residual_chunk(t, d, joint_[i], ph_, tk.r, tk.row, lo, hi);
              out.mass = race.mass;
              out.best = race.best;
            }
          });
        });
        break;
    }
    return out;
  }

  // A: the rows acceptance reads, a wave per row position j. Greedy and token requests read row j (its argmax, or
  // its statistics and those of draft row j when q(d_j) comes from it) only while d_1..d_j were accepted, so no row
  // after a rejection is read; block requests read rows 0..L and draft rows 0..L-1 in the first wave.
  void accept_pass() {
    std::vector<int64_t> alive;
    for (int64_t r = 0; r < N_; ++r) {
      if (req[r].has_rows) alive.push_back(r);
    }
    if (block_) rho_.assign(N_ * (K_ + 1), 1.f);
    for (int64_t j = 0; !alive.empty(); ++j) {
      std::vector<Task> tasks;
      for (const int64_t r : alive) add_row_tasks(r, j, tasks);
      run_pass(tasks);
      std::vector<int64_t> next;
      for (const int64_t r : alive) {
        if (advance(r, j)) next.push_back(r);
      }
      alive.swap(next);
    }
  }

  void add_row_tasks(int64_t r, int64_t j, std::vector<Task>& tasks) const {
    const Request& q = req[r];
    const bool whole_block = q.sampled && block_;
    for (int64_t row = j; row <= (whole_block ? q.length : j); ++row) {
      tasks.push_back({r, row, q.sampled ? Kind::kTargetStats : Kind::kArgmax});
      if (q.sampled && draft_ != nullptr && row < q.length && (block_ || logprobs_ == nullptr)) {
        tasks.push_back({r, row, Kind::kDraftStats});
      }
    }
  }

  // After request r's row j: accept d_j or not (greedy, token); block's rho_1..rho_L. True: read row j + 1.
  bool advance(int64_t r, int64_t j) {
    Request& q = req[r];
    if (q.sampled && block_) {
      float* rho = &rho_[r * (K_ + 1)];
      for (int64_t i = 1; i <= q.length; ++i) {
        float ratio = p_draft(q, r, i - 1) / q_draft(q, r, i - 1);
        if (std::isnan(ratio)) ratio = 0.f;
        const float v = rho[i - 1] * ratio;
        rho[i] = std::isnan(v) ? 0.f : std::min(v, 1.f);
      }
      return false;
    }
    if (j >= q.length) return false;
    const int64_t d = draft(r, j);
    const bool accept = q.sampled ? accept_uniform(r, j) * q_draft(q, r, j) < p_draft(q, r, j)
                                  : valid(d) && d == targ_[r * (K_ + 1) + j].index;
    if (!accept) return false;
    q.n_acc = j + 1;
    return !is_stop(d);
  }

  // p(d_j) and q(d_j) of a sampled request (p is 0 at an invalid draft; NaN stays NaN, as p * valid does).
  float p_draft(const Request& q, int64_t r, int64_t j) const {
    const int64_t d = draft(r, j);
    const float y = load_at(trow(q, j), tdtype_, valid(d) ? d : 0) / q.t;
    const float p = prob(tstat_[r * (K_ + 1) + j], y);
    return valid(d) ? p : p * 0.f;
  }
  float q_draft(const Request& q, int64_t r, int64_t j) const {
    const int64_t d = draft(r, j);
    if (logprobs_ != nullptr) return std::exp(logprobs_[r * K_ + j]);
    if (draft_ == nullptr) return valid(d) ? 1.f : 0.f;
    return prob(dstat_[r * K_ + j], load_at(drow(r, j), ddtype_, valid(d) ? d : 0) / q.t);
  }

  std::vector<float> rho_;  // [N, K+1] block verification's rho_0..rho_L

  // B: block's S_i for i = 1..L-1; token sampling with draft_logprobs: the statistics of the draft row the
  // correction is sampled from.
  void middle_pass() {
    std::vector<Task> tasks;
    joint_.clear();
    for (int64_t r = 0; r < N_; ++r) {
      const Request& q = req[r];
      if (!q.has_rows || !q.sampled) continue;
      if (block_) {
        for (int64_t i = 1; i < q.length; ++i) {
          tasks.push_back({r, i, Kind::kMass});
          joint_.push_back(joint(r, i, rho_[r * (K_ + 1) + i]));
        }
      } else if (draft_ != nullptr && logprobs_ != nullptr && q.n_acc < q.length) {
        tasks.push_back({r, q.n_acc, Kind::kDraftStats});
        joint_.emplace_back();
      }
    }
    run_pass(tasks);
  }

  // Block's tau and rho_tau; the stop cut for every request.
  void decide_second(int64_t r, Request& q) {
    if (!q.has_rows) return;
    if (q.sampled && block_) {
      const float* rho = &rho_[r * (K_ + 1)];
      int64_t tau = 0;
      for (int64_t i = 1; i <= q.length; ++i) {
        float h = rho[i];
        if (i < q.length) {
          const float s = mass_[r * K_ + i];
          const float denom = s + 1.f - rho[i];
          h = denom > 0.f ? s / denom : (denom == 0.f ? 1.f : 0.f);
        }
        if (accept_uniform(r, i - 1) <= h) tau = i;
      }
      q.n_acc = tau;
      q.rho = rho[tau];
    }
    for (int64_t j = 0; j < q.n_acc; ++j) {
      if (is_stop(draft(r, j))) {
        q.stopped = true;
        q.n_acc = j + 1;
        break;
      }
    }
  }

  bool is_stop(int64_t d) const {
    for (int64_t s = 0; s < num_stops_; ++s) {
      if (stops_[s] == d) return true;
    }
    return false;
  }

  // C and D: the emitted tokens.
  void emit_pass() {
    std::vector<Task> tasks;
    joint_.clear();
    residual_.assign(N_, Partial{});
    for (int64_t r = 0; r < N_; ++r) {
      Request& q = req[r];
      if (!q.has_rows || q.stopped) continue;
      if (!q.sampled) {
        q.emitted = targ_[r * (K_ + 1) + q.n_acc].index;
      } else if (q.n_acc >= q.length) {
        tasks.push_back({r, q.n_acc, Kind::kGumbel});
        joint_.emplace_back();
      } else {
        tasks.push_back({r, q.n_acc, Kind::kResidual});
        joint_.push_back(joint(r, q.n_acc, q.rho));
      }
    }
    run_pass(tasks);
    std::vector<Task> fallback;
    for (const Task& tk : tasks) {
      if (tk.kind != Kind::kResidual) continue;
      if (residual_[tk.r].mass >= kResidualEps) {
        req[tk.r].emitted = residual_[tk.r].best.index;
      } else {
        fallback.push_back({tk.r, tk.row, Kind::kGumbel});
      }
    }
    joint_.assign(fallback.size(), Joint{});
    run_pass(fallback);
  }
};

// Per request: its first row, its verify length L and whether it samples (the reference's rules for lengths).
std::vector<Request> plan(const at::Tensor& target, const std::optional<at::Tensor>& cu_seqlens, int64_t N,
                          int64_t K, const std::optional<at::Tensor>& verify_lens,
                          const std::optional<at::Tensor>& survival, const std::optional<at::Tensor>& thresholds,
                          const std::optional<at::Tensor>& temperature) {
  std::vector<Request> req(N);
  at::Tensor cu, lens, surv, thr, temp;
  if (cu_seqlens) cu = as_long(*cu_seqlens);
  if (verify_lens) lens = as_long(*verify_lens);
  if (survival && thresholds) surv = as_float(*survival), thr = as_float(*thresholds);
  if (temperature) temp = as_float(*temperature);
  const int64_t total = target.size(0);
  for (int64_t r = 0; r < N; ++r) {
    Request& q = req[r];
    int64_t last = K;
    q.first_row = r * (K + 1);
    if (cu_seqlens) {
      const int64_t* c = cu.data_ptr<int64_t>();
      const int64_t start = c[r], count = c[r + 1] - c[r];
      const int64_t rows_left = start >= 0 ? total - start : 0;
      last = std::clamp<int64_t>(std::min(count, rows_left) - 1, -1, K);
      q.first_row = start;
    }
    q.has_rows = last >= 0;
    q.length = std::max<int64_t>(last, 0);
    if (verify_lens) q.length = std::min(q.length, std::clamp<int64_t>(lens.data_ptr<int64_t>()[r], 0, K));
    if (surv.defined()) {
      int64_t pass = 0;
      while (pass < K && surv.data_ptr<float>()[r * K + pass] >= thr.data_ptr<float>()[pass]) ++pass;
      q.length = std::min(q.length, pass);
    }
    if (temp.defined()) {
      const float t = temp.data_ptr<float>()[r];
      q.sampled = t > 0.f;
      q.t = q.sampled ? t : 1.f;
    }
  }
  return req;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_chain(
    const at::Tensor& target_logits, const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& draft_logprobs,
    const std::optional<at::Tensor>& verify_lens, const std::optional<at::Tensor>& survival,
    const std::optional<at::Tensor>& thresholds, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, const std::optional<at::Tensor>& stop_token_ids, c10::string_view method) {
  TORCH_CHECK(method == "token" || method == "block", "verify_chain: method must be 'token' or 'block'");
  TORCH_CHECK(target_logits.is_contiguous() && draft_tokens.is_contiguous(), "verify_chain: inputs must be contiguous");
  TORCH_CHECK(!draft_logits || draft_logits->is_contiguous(), "verify_chain: draft_logits must be contiguous");
  const int64_t N = draft_tokens.size(0), K = draft_tokens.size(1);
  auto opts = draft_tokens.options();
  at::Tensor tokens = at::full({N, K + 1}, -1, opts.dtype(at::kLong));
  at::Tensor num_accepted = at::zeros({N}, opts.dtype(at::kInt));
  at::Tensor accept_mask = at::zeros({N, K}, opts.dtype(at::kBool));
  if (N == 0) return {tokens, num_accepted, accept_mask};

  std::optional<at::Tensor> logprobs;
  if (draft_logprobs) logprobs = as_float(*draft_logprobs);
  at::Tensor stops;
  if (stop_token_ids) stops = as_long(*stop_token_ids);
  Verifier v(target_logits, draft_logits, draft_tokens, logprobs, stops, philox_of(rng_key), method == "block");
  v.req = plan(target_logits, cu_seqlens, N, K, verify_lens, survival, thresholds, temperature);
  v.run();

  int64_t* tok = tokens.data_ptr<int64_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  bool* mask = accept_mask.data_ptr<bool>();
  for (int64_t r = 0; r < N; ++r) {
    const Request& q = v.req[r];
    if (!q.has_rows) continue;
    acc[r] = static_cast<int32_t>(q.n_acc);
    for (int64_t j = 0; j < q.n_acc; ++j) {
      mask[r * K + j] = true;
      tok[r * (K + 1) + j] = v.draft(r, j);
    }
    if (!q.stopped) tok[r * (K + 1) + q.n_acc] = q.emitted;
  }
  return {tokens, num_accepted, accept_mask};
}

}  // namespace dspark_cpu
