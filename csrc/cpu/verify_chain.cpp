// CPU kernel of verify_chain (the meaning: dspark_kernels/reference/verify_chain.py).
//
// The target rows are cut into (row, vocabulary chunk) items spread over the threads; every pass reads its rows
// once, in 256-token float blocks that stay in L1:
//   A. per item: the argmax (greedy requests), or the softmax statistics of x / T (max, sum of exp, NaN seen) of the
//      target rows and, without draft_logprobs, of the draft rows the accept tests need (over their own columns:
//      V, Vd of a reduced vocabulary, k of top-k rows);
//   decide: greedy, token or block acceptance per request from the merged statistics and the drafts' logits; with
//      draft_logprobs a draft row's normaliser is the drafter's own, l(d_j) - logprob;
//   B. block verification's residual masses S_i (target and draft rows 1..L-1, once rho is known), and the
//      statistics of a draft row whose log-probability gave no finite normaliser;
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

// exp(x) of a draft row's scaled logit against its normaliser (x > 0 only where a draft_logprob overstates q).
DSPARK_CPU_INLINE float exp_q(float x) { return x > 88.7f ? kInf : exp_nonpos(x); }

// The draft rows as the caller laid them out: dense [N, K, V], reduced [N, K, Vd] (column target_to_draft[x] holds
// target id x), top-k [N, K, k] (column c holds id candidates[r, j, c]).
struct DraftRows {
  enum class Layout { kDense, kReduced, kTopK };
  Layout layout = Layout::kDense;
  const char* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t esize = 4, width = 0;
  const int32_t* inv = nullptr;   // reduced: [V]
  const int64_t* ids = nullptr;   // top-k: [N, K, k]
};

// What a joint sweep over a target row and its draft row needs: w = max(0, rho p - q) (NaN kept, as torch's
// clamp), with q the draft row's softmax at each target id's column (0 where none), or one-hot at `onehot` (-1:
// zero) when there is no draft row. `cols`: a top-k row's (target id, column) pairs by id, the last column of an id.
struct Joint {
  float t = 1.f, rho = 1.f;
  Softmax p, q;
  int64_t onehot = -1;
  std::vector<std::pair<int64_t, int64_t>> cols;
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

// q at target ids b..b+n-1 of a reduced or top-k draft row into tmp.
template <typename TD>
inline void placed_q(const TD* drow, const DraftRows& dr, const Joint& j, int64_t b, int64_t n, float* tmp) {
  auto q_of = [&](int64_t col) { return exp_q(static_cast<float>(drow[col]) / j.t - j.q.shift) * j.q.scale; };
  if (dr.layout == DraftRows::Layout::kReduced) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t col = dr.inv[b + i];
      tmp[i] = col >= 0 && col < dr.width ? q_of(col) : 0.f;
    }
    return;
  }
  std::fill(tmp, tmp + n, 0.f);
  auto it = std::lower_bound(j.cols.begin(), j.cols.end(), std::make_pair(b, int64_t(-1)));
  for (; it != j.cols.end() && it->first < b + n; ++it) tmp[it->first - b] = q_of(it->second);
}

// w[i] = max(0, rho p - q) at tokens b..b+n-1 (tmp, tmp2: scratch).
template <typename TT, typename TD>
DSPARK_CPU_INLINE void residual_weights(const TT* trow, const TD* drow, const DraftRows& dr, const Joint& j, int64_t b,
                                        int64_t n, float* w, float* tmp, float* tmp2) {
  const float t = j.t;  // x / T rounded as the reference rounds it (fold_stats)
  if (drow != nullptr && dr.layout != DraftRows::Layout::kDense) {
    placed_q(drow, dr, j, b, n, tmp);
  } else if (drow != nullptr) {
    const float* z = as_float(drow + b, n, tmp2);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) tmp[i] = exp_q(z[i] / t - j.q.shift) * j.q.scale;
  } else {
    const int64_t hot = j.onehot - b;  // outside [0, n) when the draft is not in this block
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) tmp[i] = i == hot ? 1.f : 0.f;
  }
  prefetch_ahead(trow, b, b + 3 * kBlock);
  if (drow != nullptr && dr.layout == DraftRows::Layout::kDense) prefetch_ahead(drow, b, b + 3 * kBlock);
  const float* x = as_float(trow + b, n, tmp2);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = j.rho * (exp_nonpos(x[i] / t - j.p.shift) * j.p.scale) - tmp[i];
    w[i] = v < 0.f ? 0.f : v;
  }
}

template <typename TT, typename TD>
DSPARK_CPU_CLONES float mass_chunk(const TT* trow, const TD* drow, const DraftRows& dr, const Joint& j, int64_t lo,
                                   int64_t hi) {
  float w[kBlock], tmp[kBlock], tmp2[kBlock];
  float mass = 0.f;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    residual_weights(trow, drow, dr, j, b, n, w, tmp, tmp2);
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
DSPARK_CPU_CLONES Race residual_chunk(const TT* trow, const TD* drow, const DraftRows& dr, const Joint& j,
                                      const Philox& ph, int64_t request, int64_t position, int64_t lo, int64_t hi) {
  float w[kBlock], tmp[kBlock], tmp2[kBlock];
  Race race;
  race.best.index = lo;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    residual_weights(trow, drow, dr, j, b, n, w, tmp, tmp2);
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
  Verifier(const at::Tensor& target, const DraftRows& dr, const at::Tensor& drafts,
           const std::optional<at::Tensor>& logprobs, const at::Tensor& stops, const Philox& ph, bool block)
      : N_(drafts.size(0)), K_(drafts.size(1)), V_(target.size(-1)), ph_(ph), block_(block),
        target_(static_cast<const char*>(target.data_ptr())), tdtype_(target.scalar_type()),
        tsize_(target.element_size()), dr_(dr), drafts_(as_long(drafts)), d_(drafts_.data_ptr<int64_t>()),
        targ_(N_ * (K_ + 1)), tstat_(N_ * (K_ + 1)), dstat_(N_ * K_), qnorm_(N_ * K_), mass_(N_ * K_, 0.f) {
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
  const DraftRows dr_;
  const float* logprobs_ = nullptr;
  const int64_t* stops_ = nullptr;
  int64_t num_stops_ = 0;
  at::Tensor drafts_;
  const int64_t* d_;
  std::vector<Best> targ_;     // [N, K+1] argmax of the greedy requests' rows
  std::vector<Stats> tstat_;   // [N, K+1] softmax statistics of the sampled requests' rows
  std::vector<Stats> dstat_;   // [N, K] of their draft rows (without draft_logprobs, or a normaliser to sum)
  std::vector<Softmax> qnorm_; // [N, K] the normaliser of each draft row (drafter's own, or its statistics)
  std::vector<bool> qown_;     // [N, K] the row's statistics are still to sum (a logprob gave no finite one)
  std::vector<float> mass_;    // [N, K] block verification's S_i
  std::vector<Joint> joint_;   // per task of the current pass

  bool valid(int64_t d) const { return d >= 0 && d < V_; }
  bool has_draft() const { return dr_.data != nullptr; }
  const void* trow(const Request& q, int64_t j) const { return target_ + (q.first_row + j) * V_ * tsize_; }
  const void* drow(int64_t r, int64_t j) const {
    return dr_.data == nullptr ? nullptr : dr_.data + (r * K_ + j) * dr_.width * dr_.esize;
  }
  float accept_uniform(int64_t r, int64_t j) const {
    return ph_.uniform(r, j, dspark::rng::kStreamAccept, 0);
  }
  // The column of draft row j of request r that target id d takes (-1: none).
  int64_t column(int64_t r, int64_t j, int64_t d) const {
    if (!valid(d)) return -1;
    if (dr_.layout == DraftRows::Layout::kDense) return d;
    if (dr_.layout == DraftRows::Layout::kReduced) {
      const int64_t c = dr_.inv[d];
      return c >= 0 && c < dr_.width ? c : -1;
    }
    const int64_t* ids = dr_.ids + (r * K_ + j) * dr_.width;
    for (int64_t c = dr_.width - 1; c >= 0; --c) {
      if (ids[c] == d) return c;
    }
    return -1;
  }

  // The joint sweep's inputs at row j of request r (rho: the request's current rho).
  Joint joint(int64_t r, int64_t j, float rho) const {
    const Request& q = req[r];
    Joint jt;
    jt.t = q.t;
    jt.rho = rho;
    jt.p = Softmax(tstat_[r * (K_ + 1) + j]);
    if (!has_draft()) {
      jt.onehot = valid(draft(r, j)) ? draft(r, j) : -1;
      return jt;
    }
    jt.q = qnorm_[r * K_ + j];
    if (dr_.layout == DraftRows::Layout::kTopK) {
      const int64_t* ids = dr_.ids + (r * K_ + j) * dr_.width;
      for (int64_t c = 0; c < dr_.width; ++c) {
        if (valid(ids[c])) jt.cols.emplace_back(ids[c], c);
      }
      std::stable_sort(jt.cols.begin(), jt.cols.end(), [](auto& a, auto& b) { return a.first < b.first; });
      // of several columns naming one id, the last
      std::vector<std::pair<int64_t, int64_t>> kept;
      for (size_t i = 0; i < jt.cols.size(); ++i) {
        if (i + 1 < jt.cols.size() && jt.cols[i + 1].first == jt.cols[i].first) continue;
        kept.push_back(jt.cols[i]);
      }
      jt.cols.swap(kept);
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

  // Runs the tasks' chunks on the threads, merges each task's partials and stores the result. Draft-row statistics
  // (over the draft rows' own columns) and the other tasks (over V) run as two passes.
  void run_pass(const std::vector<Task>& all) {
    std::vector<Task> target, draft_rows;
    std::vector<Joint> tjoint;
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i].kind == Kind::kDraftStats) {
        draft_rows.push_back(all[i]);
      } else {
        target.push_back(all[i]);
        if (i < joint_.size()) tjoint.push_back(joint_[i]);
      }
    }
    joint_.swap(tjoint);
    run_tasks(target, V_);
    run_tasks(draft_rows, dr_.width);
  }

  void run_tasks(const std::vector<Task>& tasks, int64_t width) {
    if (tasks.empty()) return;
    const int64_t count = static_cast<int64_t>(tasks.size());
    const int64_t chunks = chunks_per_row(count, width);
    std::vector<Partial> parts(count * chunks);
    for_each_chunk(count, width, chunks, [&](int64_t i, int64_t c, int64_t lo, int64_t hi) {
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
        with_float_type(dr_.dtype, [&](auto tag) {
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
          with_float_type(dr_.dtype, [&](auto dtag) {
            using TT = decltype(ttag);
            using TD = decltype(dtag);
            const auto* t = static_cast<const TT*>(trow(q, tk.row));
            const auto* d = static_cast<const TD*>(drow(tk.r, tk.row));
            if (tk.kind == Kind::kMass) {
              out.mass = mass_chunk(t, d, dr_, joint_[i], lo, hi);
            } else {
              const Race race = residual_chunk(t, d, dr_, joint_[i], ph_, tk.r, tk.row, lo, hi);
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
  // its statistics and, without draft_logprobs, those of draft row j) only while d_1..d_j were accepted, so no row
  // after a rejection is read; block requests read rows 0..L-1 (and draft rows 0..L-1) in the first wave.
  void accept_pass() {
    std::vector<int64_t> alive;
    for (int64_t r = 0; r < N_; ++r) {
      if (req[r].has_rows) alive.push_back(r);
    }
    if (block_) rho_.assign(N_ * (K_ + 1), 1.f);
    qown_.assign(N_ * K_, false);
    for (int64_t j = 0; !alive.empty(); ++j) {
      std::vector<Task> tasks;
      for (const int64_t r : alive) add_row_tasks(r, j, tasks);
      joint_.clear();
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
    for (int64_t row = j; row <= (whole_block ? q.length - 1 : j); ++row) {
      if (q.sampled && row >= q.length) continue;  // sampled: row L is only raced over (emit_pass)
      tasks.push_back({r, row, q.sampled ? Kind::kTargetStats : Kind::kArgmax});
      if (q.sampled && has_draft() && logprobs_ == nullptr) tasks.push_back({r, row, Kind::kDraftStats});
    }
  }

  // The normaliser of draft row j (statistics summed, or the drafter's own from its log-probability).
  void set_qnorm(int64_t r, int64_t j) {
    const Request& q = req[r];
    if (!has_draft()) return;
    if (logprobs_ == nullptr) {
      qnorm_[r * K_ + j] = Softmax(dstat_[r * K_ + j]);
      return;
    }
    const int64_t col = column(r, j, draft(r, j));
    const float c = col >= 0 ? load_at(drow(r, j), dr_.dtype, col) / q.t - logprobs_[r * K_ + j] : kNaN;
    if (std::isfinite(c)) {
      qnorm_[r * K_ + j].shift = c;
      qnorm_[r * K_ + j].scale = 1.f;
    } else {
      qown_[r * K_ + j] = true;
    }
  }

  // After request r's row j: accept d_j or not (greedy, token); block's rho_1..rho_L. True: read row j + 1.
  bool advance(int64_t r, int64_t j) {
    Request& q = req[r];
    if (q.sampled && block_) {
      float* rho = &rho_[r * (K_ + 1)];
      for (int64_t i = 1; i <= q.length; ++i) {
        set_qnorm(r, i - 1);
        float ratio = p_draft(q, r, i - 1) / q_draft(q, r, i - 1);
        if (std::isnan(ratio)) ratio = 0.f;
        const float v = rho[i - 1] * ratio;
        rho[i] = std::isnan(v) ? 0.f : std::min(v, 1.f);
      }
      return false;
    }
    if (j >= q.length) return false;
    const int64_t d = draft(r, j);
    if (q.sampled) set_qnorm(r, j);
    const bool accept = q.sampled ? accept_uniform(r, j) * q_draft(q, r, j) < p_draft(q, r, j)
                                  : valid(d) && d == targ_[r * (K_ + 1) + j].index;
    if (!accept) return false;
    q.n_acc = j + 1;
    return !is_stop(d);
  }

  // p(d_j) and q(d_j) of a sampled request (0 at an invalid draft: it is rejected whatever q is).
  float p_draft(const Request& q, int64_t r, int64_t j) const {
    const int64_t d = draft(r, j);
    if (!valid(d)) return 0.f;
    return prob(tstat_[r * (K_ + 1) + j], load_at(trow(q, j), tdtype_, d) / q.t);
  }
  float q_draft(const Request& q, int64_t r, int64_t j) const {
    const int64_t d = draft(r, j);
    if (logprobs_ != nullptr) return std::exp(logprobs_[r * K_ + j]);
    if (!has_draft()) return valid(d) ? 1.f : 0.f;
    const int64_t col = column(r, j, d);
    return col >= 0 ? prob(dstat_[r * K_ + j], load_at(drow(r, j), dr_.dtype, col) / q.t) : 0.f;
  }

  std::vector<float> rho_;  // [N, K+1] block verification's rho_0..rho_L

  // The statistics of the draft rows whose normaliser the drafter's log-probability did not give (rare), among
  // `rows` (request, row) pairs.
  void own_stats(const std::vector<std::pair<int64_t, int64_t>>& rows) {
    std::vector<Task> tasks;
    for (const auto& [r, j] : rows) {
      if (qown_[r * K_ + j]) tasks.push_back({r, j, Kind::kDraftStats});
    }
    joint_.clear();
    run_pass(tasks);
    for (const Task& tk : tasks) qnorm_[tk.r * K_ + tk.row] = Softmax(dstat_[tk.r * K_ + tk.row]);
  }

  // B: block's S_i for i = 1..L-1.
  void middle_pass() {
    if (!block_) return;
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (int64_t r = 0; r < N_; ++r) {
      const Request& q = req[r];
      if (!q.has_rows || !q.sampled) continue;
      for (int64_t i = 1; i < q.length; ++i) rows.emplace_back(r, i);
    }
    own_stats(rows);
    std::vector<Task> tasks;
    joint_.clear();
    for (const auto& [r, i] : rows) {
      tasks.push_back({r, i, Kind::kMass});
      joint_.push_back(joint(r, i, rho_[r * (K_ + 1) + i]));
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
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (int64_t r = 0; r < N_; ++r) {
      const Request& q = req[r];
      if (q.has_rows && !q.stopped && q.sampled && q.n_acc < q.length) rows.emplace_back(r, q.n_acc);
    }
    own_stats(rows);
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
      const int64_t start = c[r], end = c[r + 1];  // compared before subtracting: no int64 pair overflows
      const bool owns = start >= 0 && start < total && end > start;
      last = owns ? std::min(std::min(end, total) - start, K + 1) - 1 : -1;
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
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& target_to_draft,
    const std::optional<at::Tensor>& draft_candidates, const std::optional<at::Tensor>& draft_logprobs,
    const std::optional<at::Tensor>& verify_lens, const std::optional<at::Tensor>& survival,
    const std::optional<at::Tensor>& thresholds, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, const std::optional<at::Tensor>& stop_token_ids, c10::string_view method) {
  TORCH_CHECK(method == "token" || method == "block", "verify_chain: method must be 'token' or 'block'");
  TORCH_CHECK(target_logits.is_contiguous() && draft_tokens.is_contiguous(), "verify_chain: inputs must be contiguous");
  TORCH_CHECK(!draft_logits || draft_logits->is_contiguous(), "verify_chain: draft_logits must be contiguous");
  TORCH_CHECK(!(target_to_draft && draft_candidates), "verify_chain: target_to_draft and draft_candidates exclude "
              "each other");
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
  DraftRows dr;
  at::Tensor ids, inv;
  if (draft_logits) {
    dr.data = static_cast<const char*>(draft_logits->data_ptr());
    dr.dtype = draft_logits->scalar_type();
    dr.esize = draft_logits->element_size();
    dr.width = draft_logits->size(-1);
    if (target_to_draft) {
      inv = target_to_draft->to(at::kInt).contiguous();
      dr.layout = DraftRows::Layout::kReduced;
      dr.inv = inv.data_ptr<int32_t>();
    } else if (draft_candidates) {
      ids = as_long(*draft_candidates);
      dr.layout = DraftRows::Layout::kTopK;
      dr.ids = ids.data_ptr<int64_t>();
    }
  }
  Verifier v(target_logits, dr, draft_tokens, logprobs, stops, philox_of(rng_key), method == "block");
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
