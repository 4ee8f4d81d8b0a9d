// dspark/dist_verify_stats.cuh: the first exchange's send buffer of a vocabulary-parallel verify_chain over one shard
// (dspark_dist::verify_stats; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_stats and
// the layout distributed/layout.py's StatsLayout.
//
// One CTA per target row (request n, row j in 0..K) reads the shard's row once (and draft row j for j < K):
//   the raw argmax (NaN as -inf, the lowest id on ties) and, when sampling (a temperature tensor), the softmax
//   statistics of target / T' (T' = T for T > 0, else 1; NaN and +inf flagged and left out) and of draft / T', the
//   scaled logits at the row's draft d_{j+1} (owned by this shard) and the top_m candidates of the race key
//   target / T' - log(-log u), u = uniform(n, j, RESIDUAL, global id): best first, ties to the lowest id, plus the
//   (top_m + 1)-th key as the bound on every other token's key. The candidates come from one read of the row
//   (dspark/select_top.cuh: the rank keys above a rising floor into a shared buffer, cut back to top_m + 1); their
//   target / T' and draft / T' are read again at the end (top_m scattered elements).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "select_top.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyStatsParams {
  dist::TargetRows target;
  const void* draft_logits = nullptr;  // [N, K, Vl] or null
  DType draft_dtype = DType::kFloat32;
  const void* draft_tokens = nullptr;  // [N, K] int32 / int64
  bool drafts_i64 = false;
  const float* temperature = nullptr;  // [N], or null: greedy only (the argmax fields)
  rng::Key rng_key;
  int64_t N = 0, K = 0, Vl = 0, vocab_start = 0, vocab_size = 0, top_m = 1;
  int64_t width = 2;                   // StatsLayout.width
  float* out = nullptr;                // [N, K+1, width]
};

namespace dist_stats {

constexpr int kThreads = top_select::kThreads;
constexpr int64_t kMaxTopM = top_select::kMaxTop - 1;  // top_m + 1 keys are kept
using namespace dist;  // the layout's slots

// Softmax statistics with the NaN / +inf flag (layout.local_softmax_stats).
struct FlaggedStats {
  SoftmaxStats st;
  int32_t bad;
  DSPARK_HOST_DEVICE_FN static FlaggedStats empty() { return FlaggedStats{SoftmaxStats::empty(), 0}; }
  DSPARK_HOST_DEVICE_FN void add(float x) {
    if (x != x || x == INFINITY) {
      bad = 1;
    } else {
      st.update(x);
    }
  }
  DSPARK_HOST_DEVICE_FN void merge(const FlaggedStats& o) {
    st.merge(o.st);
    bad |= o.bad;
  }
};

struct RowStats {
  ArgMax amax;
  FlaggedStats t, q;
  DSPARK_HOST_DEVICE_FN static RowStats empty() {
    return RowStats{ArgMax::empty(), FlaggedStats::empty(), FlaggedStats::empty()};
  }
  DSPARK_HOST_DEVICE_FN void merge(const RowStats& o) {
    amax.merge(o.amax);
    t.merge(o.t);
    q.merge(o.q);
  }
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// The local column of draft d_{j+1} when this shard owns it (j < K), else -1; a draft outside [0, V) reads token 0.
DSPARK_DEVICE int64_t owned_draft(const DistVerifyStatsParams& p, int64_t n, int64_t j) {
  if (j >= p.K) return -1;
  int64_t d = load_int(p.draft_tokens, p.drafts_i64, n * p.K + j);
  d = d >= 0 && d < p.vocab_size ? d : 0;
  const int64_t c = d - p.vocab_start;
  return c >= 0 && c < p.Vl ? c : -1;
}

template <typename TT>  // the target's element type
__global__ void __launch_bounds__(kThreads, 2) stats_kernel(DistVerifyStatsParams p) {
  DSPARK_SHARED(top_select::SelectScratch, sel);
  DSPARK_SHARED_ARRAY(RowStats, scratch, 32);
  const int64_t row_id = blockIdx.x, n = row_id / (p.K + 1), j = row_id - n * (p.K + 1);
  DSPARK_SHARED(float, shared_t);
  DSPARK_SHARED(rng::Philox, shared_ph);
  const bool sampled = p.temperature != nullptr, draft = p.draft_logits != nullptr;
  if (threadIdx.x == 0 && sampled) {  // read once per CTA
    const float t_raw = ldg(p.temperature + n);
    shared_t = t_raw > 0.0f ? t_raw : 1.0f;
    shared_ph = rng::load_philox(p.rng_key);
  }
  __syncthreads();
  const float t = sampled ? shared_t : 1.0f;
  const rng::Philox ph = sampled ? shared_ph : rng::Philox{};
  const int64_t toff = p.target.offset(n, j, p.K, p.Vl);
  const void* trow = toff >= 0 ? p.target.row(toff) : nullptr;
  const int64_t doff = (n * p.K + (j < p.K - 1 ? j : p.K - 1)) * p.Vl;  // row K reads draft row K-1 (unused)
  const bool read_q = draft && j < p.K;
  auto target_at = [&](int64_t c) {  // scaled; a packed shard without rows reads zeros, as the reference
    return toff >= 0 ? load_float(p.target.data, p.target.dtype, toff + c) / t : 0.0f;
  };
  auto draft_at = [&](int64_t c) { return load_float(p.draft_logits, p.draft_dtype, doff + c) / t; };
  RowStats mine = RowStats::empty();
  auto visit = [&](int64_t c, float logit, uint64_t floor) {
    mine.amax.update(logit, c);
    if (!sampled) return;
    const float x = logit / t;
    mine.t.add(x);
    if (read_q) mine.q.add(draft_at(c));
    const int64_t id = p.vocab_start + c;
    const uint64_t key = top_select::rank_key(gumbel_score(x, ph.uniform(n, j, rng::kStreamResidual, id)), id);
    if (key > floor) top_select::push(sel, key);
  };
  auto sweep = [&](int64_t c0, int64_t c1, uint64_t floor) {
    if (trow != nullptr) {
      for_each_element(static_cast<const TT*>(trow), c0, c1, threadIdx.x, kThreads,
                       [&](int64_t c, float logit) { visit(c, logit, floor); });
    } else {  // a packed shard without rows: the reference reads zeros
      for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) visit(c, 0.0f, floor);
    }
  };
  int64_t kept = 0;
  if (sampled) {
    kept = top_select::select_top(sel, p.Vl, p.top_m + 1, sweep);
    top_select::sort_kept(sel, kept, false);
  } else {
    sweep(0, p.Vl, 0);
  }
  const RowStats all = block_allreduce(mine, scratch);
  float* out = p.out + row_id * p.width;
  if (threadIdx.x == 0) {
    stg(out + kAmaxVal, all.amax.value);
    stg(out + kAmaxId, static_cast<float>(p.vocab_start + all.amax.index));
    if (sampled) {
      stg(out + kTMax, all.t.st.m);
      stg(out + kTSum, all.t.st.s);
      stg(out + kTBad, all.t.bad ? 1.0f : 0.0f);
      const int64_t c = owned_draft(p, n, j);
      stg(out + kTAt, c >= 0 ? target_at(c) : neg_inf());
      if (draft) {
        stg(out + kQMax, read_q ? all.q.st.m : neg_inf());
        stg(out + kQSum, read_q ? all.q.st.s : 0.0f);
        stg(out + kQBad, read_q && all.q.bad ? 1.0f : 0.0f);
        stg(out + kQAt, c >= 0 ? draft_at(c) : neg_inf());
      }
      const int64_t bound = bound_slot(draft);
      stg(out + bound, kept > p.top_m ? top_select::rank_key_value(sel.keys[p.top_m]) : neg_inf());
    }
  }
  if (!sampled) return;
  const int64_t bound = bound_slot(draft), cf = cand_fields(draft);
  for (int64_t i = threadIdx.x; i < p.top_m; i += kThreads) {  // the candidates, best first
    float* cand = out + bound + 1 + i * cf;
    const bool real = i < kept;
    const int64_t id = real ? top_select::rank_key_id(sel.keys[i]) : 0;
    stg(cand, real ? top_select::rank_key_value(sel.keys[i]) : neg_inf());
    stg(cand + 1, real ? target_at(id - p.vocab_start) : neg_inf());
    if (draft) stg(cand + 2, real ? draft_at(id - p.vocab_start) : neg_inf());
    stg(cand + cf - 1, real ? static_cast<float>(id) : dist::kEmptyId);
  }
}
#endif

}  // namespace dist_stats

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Launch on `s`; the caller checked the arguments (N, K, Vl >= 1, N (K+1) < 2^31, 1 <= top_m <= kMaxTopM, the shard
// inside [0, vocab_size), vocab_size <= 2^24) and sized `out` [N, K+1, width].
inline cudaError_t launch_dist_verify_stats(const DistVerifyStatsParams& p, cudaStream_t s) {
  const int64_t rows = p.N * (p.K + 1);
  if (rows <= 0) return cudaSuccess;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(rows));
  cfg.block = dim3(dist_stats::kThreads);
  cfg.stream = s;
  cudaError_t err = cudaErrorInvalidValue;
  DSPARK_DISPATCH_FLOAT(p.target.dtype, TT, return cudaErrorInvalidValue,
                        { err = launch("dist_verify_stats", dist_stats::stats_kernel<TT>, cfg, p); });
  return err;
}
#endif

}  // namespace dspark
