// dspark/verify_chain.cuh: chain verification of draft blocks against the target's logits (no torch).
//
// The meaning is dspark_kernels/reference/verify_chain.py (the spec): greedy, token-level rejection sampling and
// block verification (Sun et al. 2024), dense [N, K+1, V] or packed [R, V] + cu_seqlens target rows, draft rows
// (dense [N, K, V], reduced [N, K, Vd] with the target -> draft column table, top-k [N, K, k] with their candidate
// ids; with or without the drafted tokens' log-probabilities) or one-hot drafts, per-request temperatures,
// verify_lens and survival thresholds, stop tokens; fp32 / bf16 / fp16 logits, fp32 math, 64-bit row offsets.
//
// Only the emitting row of a request is ever sampled, so sampling is two passes (verify_rows.cuh has their sweeps):
//   A. rows    (request, row, vocabulary chunk) CTAs, split so that N = 1 fills the GPU: the raw argmax of greedy
//              rows 0..L, or the softmax statistics of target / T of sampled rows 0..L-1 and the target logit at the
//              row's draft (by the chunk holding it); without draft_logprobs also the statistics of draft rows
//              0..L-1 over their own columns, and the draft logit at each draft's column. The last CTA of a request
//              (ticket) merges the partials in a fixed order and runs the chain: greedy acceptance (and writes
//              every output: greedy is this one launch), token acceptance (u q(d) < p(d), q(d) = exp(logprob) or
//              from the draft row), or block verification's rho_i; stop tokens; then names the emitting row and
//              its normalisers for pass B. The draft rows' normaliser with draft_logprobs is the drafter's own,
//              c = l(d) - logprob (no draft row is read in A).
//   M. mass    (block verification with L >= 2; request, row 1..K-1, chunk): S_i = sum max(rho_i p_i - q_i, 0);
//              the request's last CTA takes tau, the stop cut and the outputs.
//   B. sample  (request, chunk) over the emitting row only (and its draft row): the residual race and its mass,
//              and the Gumbel race over p with the same uniforms; the last CTA keeps the race the rule asks for
//              and writes the emitted token.
// Launches: greedy 1 (A), token sampling 2 (A, B), block verification 3 (A, M, B). Bytes: the verified target rows
// once (sampled requests: rows 0..L-1 in A, the emitting row in B), the draft row the correction is sampled from,
// every verified draft row without draft_logprobs, and block's rows 1..L-1 again in M; partials are a few bytes
// per (row, chunk). Winners use the counter RNG keyed by token, so they do not depend on the split; normalisers and
// masses are merged in a fixed order, so equal rows give bit-equal results.
// The tickets (3 N words) must be zero before the first launch; every launch leaves them at zero.
//
// Defines what dspark/verify_chain.h declares: a library includes this header in one translation unit
// (csrc/kernels/verify_chain.cu, csrc/capi/dspark_capi.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include "packed_rows.cuh"
#include "verify_chain.h"
#include "verify_rows.cuh"

namespace dspark {
namespace verify {

constexpr int kCtasPerSm = 2;              // design occupancy of the row sweeps: <= 128 registers at 256 threads
constexpr int64_t kMinChunk = 2048;        // elements per chunk of passes A and M
constexpr int64_t kMinSampleChunk = 1024;  // elements per chunk of pass B
constexpr uint32_t kOwnStats = 2u;         // VStats::bad of a draft normaliser pass B must sum itself

// Rows of one request, its verify length and temperature (what every kernel needs first).
struct ReqInfo {
  int64_t start;  // first target row (packed) or r * (K+1)
  int32_t last;   // last target row present (-1: none), <= K
  int32_t length; // verify length (0 when no rows)
  float t;        // temperature, or 1 for greedy
  int32_t sampled;
};

// What passes M and B need of a request.
enum : int32_t { kEmit = 1, kFull = 2, kPending = 4 };
struct alignas(16) EmitState {
  int32_t row;    // the emitting row (= accepted drafts); the verify length L while kPending
  int32_t flags;
  float t, rho;
  VStats pt, pq;  // target statistics and draft normaliser of the emitting row (not kFull)
  int64_t start;  // first target row of the request
  int64_t hot;    // one-hot q: the draft at the emitting row (-1: none)
};

// The partials between CTAs. Each request's (and each row's) block starts at a 32-byte boundary (the strides are
// padded), so the warp that merges a block reads whole sectors; 16-byte partials are read as one access.
struct Workspace {
  ArgMax* amax;         // [N*(K+1), cs] greedy rows
  VStats* tpart;        // [N*(K+1), cs] sampled target rows
  VStats* dpart;        // [N*K, dcs] draft rows (without draft_logprobs)
  float* at_t;          // [N, ks] the target logit at each draft
  float* atq;           // [N, ks] the draft logit at each draft's column
  int32_t* atq_col;     // [N, ks] that column (-1: the draft has none)
  VStats* rowt;         // [N, ks] block: merged target statistics of rows 0..L-1
  VStats* rowq;         // [N, ks] block: draft normalisers of rows 0..L-1
  float* rho;           // [N, ks1] block
  EmitState* state;     // [N]
  float* masspart;      // [N, chunks, ks] block: S_i partials
  ArgMax* res;          // [N, bcs] pass B: residual race
  ArgMax* gum;          // [N, bcs] pass B: race over p
  float* bmass;         // [N, bms] pass B: residual mass
  uint32_t* tickets;    // [3N]: pass A, M, B
  int64_t chunk, chunks, cs;         // target rows (A, M)
  int64_t dchunk, dchunks, dcs;      // draft rows (A)
  int64_t bchunk, bchunks, bcs, bms; // the emitting row (B)
  int64_t ks, ks1;                   // per-request strides of K and K+1 floats
};

DSPARK_HOST_DEVICE_FN int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Flags {
  bool draft_stats;  // pass A reads the verified draft rows (sampling, draft logits, no draft_logprobs)
  QKind qkind;       // where q comes from
};

template <typename T>
DSPARK_DEVICE const T* target_row(const VerifyChainParams& p, int64_t start, int64_t j) {
  return static_cast<const T*>(p.target) + (start + j) * p.V;
}
template <typename T>
DSPARK_DEVICE const T* draft_row(const VerifyChainParams& p, int64_t r, int64_t j) {
  return static_cast<const T*>(p.draft_logits) + (r * p.K + j) * p.draft_width;
}
DSPARK_DEVICE bool in_vocab(int64_t d, int64_t V) { return d >= 0 && d < V; }
DSPARK_DEVICE int leading_ones(unsigned b) { return ~b == 0u ? 32 : __ffs(static_cast<int>(~b)) - 1; }

// ReqInfo of request r, computed by one full warp (every lane gets it). Reads each input once per warp.
DSPARK_DEVICE ReqInfo request_info(const VerifyChainParams& p, int64_t r) {
  const int lane = threadIdx.x & 31;
  const int K = static_cast<int>(p.K);
  ReqInfo ri;
  int64_t a = 0;  // lanes 0 and 1: cu_seqlens[r], [r + 1] (two loads: a pair may straddle a sector)
  if (p.cu_seqlens != nullptr && lane == 0) a = load_int(p.cu_seqlens, p.cu_i64, r);
  if (p.cu_seqlens != nullptr && lane == 1) a = load_int(p.cu_seqlens, p.cu_i64, r + 1);
  int64_t lens = K;
  if (p.verify_lens != nullptr && lane == 2) lens = load_int(p.verify_lens, p.lens_i64, r);
  float t = 0.f;
  if (p.temperature != nullptr && lane == 3) t = ldg(p.temperature + r);
  bool pass = false;
  if (p.survival != nullptr && lane < K)
    pass = load_float(p.survival, p.survival_dtype, r * p.K + lane) >=
           load_float(p.thresholds, p.thresholds_dtype, lane);
  const unsigned passes = __ballot_sync(kFullMask, pass);
  const int64_t c0 = __shfl_sync(kFullMask, static_cast<long long>(a), 0);
  const int64_t c1 = __shfl_sync(kFullMask, static_cast<long long>(a), 1);
  lens = __shfl_sync(kFullMask, static_cast<long long>(lens), 2);
  t = __shfl_sync(kFullMask, t, 3);
  int64_t last = K;
  if (p.cu_seqlens != nullptr) {
    last = packed_last_row(c0, c1, p.total_rows, K);
    ri.start = c0;
  } else {
    ri.start = r * (p.K + 1);
  }
  int64_t len = last < 0 ? 0 : last;
  if (p.verify_lens != nullptr) {
    const int64_t l = lens < 0 ? 0 : (lens > K ? K : lens);
    len = len < l ? len : l;
  }
  if (p.survival != nullptr) len = len < leading_ones(passes) ? len : leading_ones(passes);
  ri.last = static_cast<int32_t>(last);
  ri.length = static_cast<int32_t>(len);
  ri.sampled = p.temperature != nullptr && t > 0.f;
  ri.t = ri.sampled ? t : 1.f;
  return ri;
}

// Target rows pass A reads: 0..L (greedy: the bonus argmax) or 0..L-1 (sampled: row L is raced over in pass B).
DSPARK_DEVICE int rows_read(const ReqInfo& ri) {
  return ri.last < 0 ? 0 : (ri.sampled ? ri.length : ri.length + 1);
}
DSPARK_DEVICE int draft_rows_read(const ReqInfo& ri, const Flags& f) {
  return ri.last >= 0 && ri.sampled && f.draft_stats ? ri.length : 0;
}

// The stop-token cut of a warp whose lane j (< K) holds draft d_j: returns the new accepted count; *stopped.
DSPARK_DEVICE int stop_cut(const VerifyChainParams& p, int n_acc, int64_t d, bool* stopped) {
  const int lane = threadIdx.x & 31;
  bool is_stop = false;
  if (lane < n_acc)
    for (int64_t s = 0; s < p.num_stops && !is_stop; ++s) is_stop = load_int(p.stop_ids, p.stops_i64, s) == d;
  const unsigned b = __ballot_sync(kFullMask, is_stop);
  *stopped = b != 0u;
  return b != 0u ? __ffs(static_cast<int>(b)) : n_acc;  // first stop + 1
}

// Outputs of request r (one warp; lane j < K holds draft d_j): accepted drafts, then `emitted` at n_acc (when
// emit; else -1, for pass B to fill), then -1; num_accepted; accept_mask.
DSPARK_DEVICE void write_outputs(const VerifyChainParams& p, int64_t r, int n_acc, int64_t d, bool emit,
                                 int64_t emitted) {
  const int lane = threadIdx.x & 31;
  const int K = static_cast<int>(p.K);
  if (lane <= K) {
    const int64_t tok = lane < n_acc ? d : (lane == n_acc && emit ? emitted : int64_t(-1));
    stg(p.out_tokens + r * (p.K + 1) + lane, tok);
  }
  if (lane < K) stg(p.out_accept_mask + r * p.K + lane, static_cast<uint8_t>(lane < n_acc));
  if (lane == 0) stg(p.out_num_accepted + r, static_cast<int32_t>(n_acc));
}

// The Philox key, read by lane 0 and shared with the warp.
DSPARK_DEVICE rng::Philox warp_philox(const rng::Key& key) {
  long long k[2] = {static_cast<long long>(key.seed), static_cast<long long>(key.offset)};
  if ((threadIdx.x & 31) == 0 && key.ptr != nullptr) {
    k[0] = ldg(key.ptr);
    k[1] = ldg(key.ptr + 1);
  }
  k[0] = __shfl_sync(kFullMask, k[0], 0);
  k[1] = __shfl_sync(kFullMask, k[1], 0);
  return rng::Philox::make(static_cast<uint64_t>(k[0]), static_cast<uint64_t>(k[1]));
}

// Block verification's tau for a warp whose lane i holds rho_i (i <= L) and S_i (1 <= i < L): the accepted count;
// *rho_tau gets rho_tau.
DSPARK_DEVICE int block_tau(const VerifyChainParams& p, int64_t r, int L, float my_rho, float s, float* rho_tau) {
  const int lane = threadIdx.x & 31;
  float h = 0.f;
  if (lane >= 1 && lane < L) {
    const float denom = s + 1.f - my_rho;
    h = denom > 0.f ? s / denom : (denom == 0.f ? 1.f : 0.f);
  } else if (lane == L && L >= 1) {
    h = my_rho;
  }
  const rng::Philox ph = warp_philox(p.rng_key);
  const bool ok = lane >= 1 && lane <= L &&
                  ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(lane - 1), rng::kStreamAccept, 0) <= h;
  const unsigned b = __ballot_sync(kFullMask, ok);
  const int n_acc = b ? 31 - __clz(static_cast<int>(b)) : 0;
  *rho_tau = __shfl_sync(kFullMask, my_rho, n_acc);
  return n_acc;
}

// ------------------------------------------------------------------------------------------------ A. rows
struct MaxCol {
  int64_t v;
  DSPARK_DEVICE void merge(const MaxCol& o) { v = o.v > v ? o.v : v; }
};

// The column of draft d (valid) in row j of request r: d itself, target_to_draft[d], or the last top-k column
// naming d (all threads of the CTA call it); -1 for none.
DSPARK_DEVICE int64_t draft_column(const VerifyChainParams& p, int64_t r, int64_t j, int64_t d, MaxCol* scratch) {
  if (p.layout == DraftLayout::kTopK) {
    MaxCol best{-1};
    const int64_t base = (r * p.K + j) * p.draft_width;
    for (int64_t c = threadIdx.x; c < p.draft_width; c += blockDim.x)
      if (load_int(p.draft_candidates, p.cands_i64, base + c) == d) best.v = c;
    return block_allreduce(best, scratch).v;
  }
  if (!in_vocab(d, p.V)) return -1;
  if (p.layout == DraftLayout::kDense) return d;
  const int64_t col = ldg(p.target_to_draft + d);
  return col >= 0 && col < p.draft_width ? col : -1;
}

// A target CTA of a sampled row j < L: after its statistics, the target logit at d_j (the chunk holding it) and,
// in chunk 0, the draft logit at d_j's column.
template <typename TT, typename TD>
DSPARK_DEVICE void draft_logits_at(const VerifyChainParams& p, const Workspace& w, int64_t r, int64_t j, int64_t c,
                                   const TT* row, int64_t d, MaxCol* scratch) {
  const int64_t begin = c * w.chunk;
  if (threadIdx.x == 0 && in_vocab(d, p.V) && d >= begin && d < begin + w.chunk)
    stg(w.at_t + r * w.ks + j, to_float(ldg(row + d)));
  if (c != 0 || p.draft_logits == nullptr || !in_vocab(d, p.V)) return;
  const int64_t col = draft_column(p, r, j, d, scratch);
  if (threadIdx.x == 0) {
    stg(w.atq + r * w.ks + j, col >= 0 ? to_float(ldg(draft_row<TD>(p, r, j) + col)) : 0.f);
    stg(w.atq_col + r * w.ks + j, static_cast<int32_t>(col));
  }
}

// The merges of request r's row partials: row j by warp j % warps, lane-strided over the chunks then the warp
// butterfly (a fixed order), into s_amax[j] (greedy rows 0..L), or s_tst[j] / s_dst[j] (sampled rows 0..L-1: target
// statistics, draft statistics when pass A read the draft rows).
DSPARK_DEVICE void merge_rows(const VerifyChainParams& p, const Workspace& w, int64_t r, const ReqInfo& ri,
                              const Flags& f, ArgMax* s_amax, VStats* s_tst, VStats* s_dst) {
  const int lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  const int rows = rows_read(ri), drows = draft_rows_read(ri, f);
  for (int j = static_cast<int>(threadIdx.x >> 5); j < rows; j += warps) {
    const int64_t base = (r * (p.K + 1) + j) * w.cs;
    if (!ri.sampled) {
      ArgMax a = ArgMax::empty();
      for (int64_t c = lane; c < w.chunks; c += 32) a.merge(ld_part(w.amax + base + c));
      a = warp_allreduce(a);
      if (lane == 0) s_amax[j] = a;
      continue;
    }
    VStats t = VStats::empty(), q = VStats::empty();
    const int64_t dbase = (r * p.K + j) * w.dcs;
    for (int64_t c = lane; c < w.chunks; c += 32) t.merge(ld_part(w.tpart + base + c));
    if (j < drows)
      for (int64_t c = lane; c < w.dchunks; c += 32) q.merge(ld_part(w.dpart + dbase + c));
    t = warp_allreduce(t);
    q = warp_allreduce(q);
    if (lane == 0) {
      s_tst[j] = t;
      s_dst[j] = q;
    }
  }
}

// Lane j (< L) of warp 0: p(d_j), q(d_j) and the normaliser of draft row j (the drafter's own c = l(d_j) - logprob
// where that is finite, the row's statistics from pass A, or kOwnStats: pass B sums them).
DSPARK_DEVICE void draft_probs(const VerifyChainParams& p, const Workspace& w, int64_t r, const ReqInfo& ri,
                               const VStats& tst, const VStats& dst, int64_t d, float* p_d, float* q_d,
                               VStats* qn) {
  const int lane = threadIdx.x & 31;
  const bool valid = in_vocab(d, p.V);
  const float t = ri.t;
  *p_d = valid ? tst.prob(ld_coherent(w.at_t + r * w.ks + lane) / t) : 0.f;
  *qn = VStats::empty();
  if (p.draft_logits == nullptr) {
    *q_d = valid ? 1.f : 0.f;
    return;
  }
  const int32_t col = valid ? ld_coherent(w.atq_col + r * w.ks + lane) : -1;
  const float logit = valid ? ld_coherent(w.atq + r * w.ks + lane) : 0.f;
  if (p.draft_logprobs != nullptr) {
    const float lp = ldg(p.draft_logprobs + r * p.K + lane);
    *q_d = expf(lp);
    const float c = col >= 0 ? logit / t - lp : NAN;
    *qn = isfinite(c) ? VStats::implied(c) : VStats{SoftmaxStats::empty(), kOwnStats, 0u};
    return;
  }
  *q_d = col >= 0 ? dst.prob(logit / t) : 0.f;
  *qn = dst;
}

// The state pass B reads for a sampled request that emits at row e = n_acc (warp 0; every lane calls it).
DSPARK_DEVICE void store_emit(const Workspace& w, int64_t r, const ReqInfo& ri, int n_acc, bool stopped, float rho,
                              const VStats& tst, const VStats& qn, int64_t d) {
  const int lane = threadIdx.x & 31;
  const int e = n_acc < 31 ? n_acc : 31;
  EmitState st{};
  st.row = n_acc;
  st.flags = stopped ? 0 : (kEmit | (n_acc >= ri.length ? kFull : 0));
  st.t = ri.t;
  st.rho = rho;
  st.pt = shfl_from(tst, e);
  st.pq = shfl_from(qn, e);
  st.start = ri.start;
  st.hot = __shfl_sync(kFullMask, static_cast<long long>(d), e);
  if (lane == 0) stg(w.state + r, st);
}

// The chain of request r once its rows are merged (warp 0).
DSPARK_DEVICE void finish_chain(const VerifyChainParams& p, const Workspace& w, int64_t r, const ReqInfo& ri,
                                const ArgMax* s_amax, const VStats* s_tst, const VStats* s_dst) {
  const int lane = threadIdx.x & 31;
  const int L = ri.length;
  const int64_t d = lane < p.K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane) : int64_t(-1);
  const bool valid = in_vocab(d, p.V);
  if (ri.last < 0 || !ri.sampled) {  // no rows: nothing accepted, nothing emitted; greedy: every output here
    const ArgMax a = ri.last >= 0 && lane <= L ? s_amax[lane] : ArgMax::empty();
    int n_acc = ri.last < 0 ? 0 : leading_ones(__ballot_sync(kFullMask, lane < L && valid && d == a.index));
    bool stopped = false;
    if (ri.last >= 0) n_acc = stop_cut(p, n_acc, d, &stopped);
    const int64_t emitted = __shfl_sync(kFullMask, static_cast<long long>(a.index), n_acc < 31 ? n_acc : 31);
    write_outputs(p, r, n_acc, d, ri.last >= 0 && !stopped, emitted);
    if (p.temperature != nullptr && lane == 0) stg(w.state + r, EmitState{});
    return;
  }
  const VStats tst = lane < L ? s_tst[lane] : VStats::empty();
  float p_d = 0.f, q_d = 0.f;
  VStats qn = VStats::empty();
  if (lane < L) draft_probs(p, w, r, ri, tst, lane < L ? s_dst[lane] : VStats::empty(), d, &p_d, &q_d, &qn);
  const rng::Philox ph = warp_philox(p.rng_key);
  const float u = lane < L ? ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(lane), rng::kStreamAccept, 0)
                           : 1.f;
  int n_acc = 0;
  float rho_tau = 1.f;
  if (!p.block_method) {
    n_acc = leading_ones(__ballot_sync(kFullMask, lane < L && u * q_d < p_d));
  } else {
    // rho_i = min(rho_{i-1} p(d_i) / q(d_i), 1) with NaN -> 0; lane i keeps rho_i.
    float ratio = p_d / q_d;
    if (ratio != ratio) ratio = 0.f;
    float rho = 1.f, my_rho = 1.f;
    for (int i = 1; i <= L; ++i) {
      const float v = rho * __shfl_sync(kFullMask, ratio, i - 1);
      rho = v != v ? 0.f : (v < 1.f ? v : 1.f);
      if (lane == i) my_rho = rho;
    }
    if (L >= 2) {  // S_1 .. S_{L-1} first (pass M)
      if (lane <= L) stg(w.rho + r * w.ks1 + lane, my_rho);
      if (lane < L) {
        st_part(w.rowt + r * w.ks + lane, tst);
        st_part(w.rowq + r * w.ks + lane, qn);
      }
      EmitState st{};
      st.row = L;
      st.flags = kPending;
      st.t = ri.t;
      st.start = ri.start;
      if (lane == 0) stg(w.state + r, st);
      return;
    }
    n_acc = block_tau(p, r, L, my_rho, 0.f, &rho_tau);
  }
  bool stopped = false;
  n_acc = stop_cut(p, n_acc, d, &stopped);
  write_outputs(p, r, n_acc, d, false, 0);
  store_emit(w, r, ri, n_acc, stopped, rho_tau, tst, qn, valid ? d : int64_t(-1));
}

// Pass A: one CTA per (request, row, chunk) of the target rows, then per (request, row, chunk) of the draft rows
// when it reads them; a CTA whose row the request does not verify leaves at once (the request's CTA (0, 0) always
// takes its ticket, so a request with nothing to read still gets its finisher).
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) rows_kernel(VerifyChainParams p, Workspace w, Flags f) {
  DSPARK_SHARED(ReqInfo, s_info);
  DSPARK_SHARED(int64_t, s_d);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(ArgMax, s_amax, 32);
  DSPARK_SHARED_ARRAY(VStats, s_tst, 32);
  DSPARK_SHARED_ARRAY(VStats, s_dst, kMaxK);
  DSPARK_SHARED_ARRAY(MaxCol, s_col, 32);
  const int64_t kp1 = p.K + 1, titems = kp1 * w.chunks;
  const int64_t per_req = titems + (f.draft_stats ? p.K * w.dchunks : 0);
  const int64_t r = static_cast<int64_t>(blockIdx.x) / per_req, item = static_cast<int64_t>(blockIdx.x) - r * per_req;
  const bool is_target = item < titems;
  const int64_t j = is_target ? item / w.chunks : (item - titems) / w.dchunks;
  const int64_t c = is_target ? item - j * w.chunks : item - titems - j * w.dchunks;
  if (threadIdx.x < 32) {
    const ReqInfo ri = request_info(p, r);
    if (threadIdx.x == 0) s_info = ri;
    if (threadIdx.x == 1)
      s_d = is_target && ri.sampled && j < p.K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + j) : -1;
  }
  __syncthreads();
  const ReqInfo ri = s_info;
  const int rows = rows_read(ri), drows = draft_rows_read(ri, f);
  const bool work = is_target ? j < rows : j < drows;
  if (!work && item != 0) return;  // the same for the whole CTA
  if (work && is_target) {
    const TT* row = target_row<TT>(p, ri.start, j);
    const int64_t begin = c * w.chunk, end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
    const int64_t slot = (r * kp1 + j) * w.cs + c;
    if (!ri.sampled) {
      const ArgMax a = chunk_argmax(row, begin, end, s_amax);
      if (threadIdx.x == 0) st_part(w.amax + slot, a);
    } else {
      const VStats st = chunk_stats(row, begin, end, ri.t, s_tst);
      if (threadIdx.x == 0) st_part(w.tpart + slot, st);
      draft_logits_at<TT, TD>(p, w, r, j, c, row, s_d, s_col);
    }
  } else if (work) {
    const TD* row = draft_row<TD>(p, r, j);
    const int64_t begin = c * w.dchunk, end = begin + w.dchunk < p.draft_width ? begin + w.dchunk : p.draft_width;
    const VStats st = chunk_stats(row, begin, end, ri.t, s_tst);
    if (threadIdx.x == 0) st_part(w.dpart + (r * p.K + j) * w.dcs + c, st);
  }
  const int64_t total = (rows > 0 ? rows * w.chunks : 1) + drows * w.dchunks;
  if (!last_cta(w.tickets + r, static_cast<uint32_t>(total), &s_last)) return;
  merge_rows(p, w, r, ri, f, s_amax, s_tst, s_dst);
  __syncthreads();
  if (threadIdx.x < 32) finish_chain(p, w, r, ri, s_amax, s_tst, s_dst);
}

// ------------------------------------------------------------------------------------------------ q of a row
// The QSource of draft row j of request r with normaliser `norm` (all threads of the CTA call it): its statistics
// summed here when norm says kOwnStats (a draft_logprob that gave no finite normaliser: rare), the top-k filter
// built in `filter` / `ids`.
template <typename TD>
DSPARK_DEVICE QSource q_source(const VerifyChainParams& p, const Flags& f, int64_t r, int64_t j, float t,
                               const VStats& norm, int64_t hot, uint32_t* filter, int32_t* ids, VStats* scratch) {
  QSource qs;
  qs.kind = f.qkind;
  qs.t = t;
  qs.hot = hot;
  qs.norm = norm;
  if (f.qkind == QKind::kOneHot) return qs;
  qs.row = draft_row<TD>(p, r, j);
  qs.width = p.draft_width;
  qs.inv = p.target_to_draft;
  if (norm.bad == kOwnStats) qs.norm = chunk_stats(draft_row<TD>(p, r, j), 0, p.draft_width, t, scratch);
  if (f.qkind == QKind::kTopK)
    build_topk_filter(static_cast<const char*>(p.draft_candidates) +
                          (r * p.K + j) * p.draft_width * (p.cands_i64 ? 8 : 4),
                      p.cands_i64, p.V, filter, ids, &qs);
  return qs;
}

// ------------------------------------------------------------------------------------------------ M. mass
struct MassCta {
  EmitState st;
  float rho;
  VStats pt, pq;
  int64_t hot;
};

// (request, row 1..K-1, chunk): S_i = sum max(rho_i p_i - q_i, 0); the CTA finishing a request's last item takes
// tau, the stop cut, the outputs and the state of pass B.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) mass_kernel(VerifyChainParams p, Workspace w, Flags f) {
  DSPARK_SHARED(MassCta, s);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(Sum, s_sum, 32);
  DSPARK_SHARED_ARRAY(VStats, s_vs, 32);
  DSPARK_SHARED_ARRAY(uint32_t, s_filter, kFilterWords);
  DSPARK_SHARED_ARRAY(int32_t, s_ids, kMaxTopK);
  const int64_t km1 = p.K - 1;
  const int64_t item = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - item * w.chunks;
  const int64_t r = item / km1, i = item - r * km1 + 1;  // row 1..K-1
  if (threadIdx.x == 0) {
    s.st = ldg(w.state + r);
    if ((s.st.flags & kPending) && i < s.st.row) {  // row: the verify length L of a pending request
      s.rho = ldg(w.rho + r * w.ks1 + i);
      s.pt = ldg(w.rowt + r * w.ks + i);
      s.pq = ldg(w.rowq + r * w.ks + i);
      s.hot = f.qkind == QKind::kOneHot ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + i) : -1;
      if (!in_vocab(s.hot, p.V)) s.hot = -1;
    }
  }
  __syncthreads();
  const int L = s.st.row;
  if (!(s.st.flags & kPending) || i >= L) return;  // the same for the whole CTA
  {
    const float t = s.st.t;
    const QSource qs = q_source<TD>(p, f, r, i, t, s.pq, s.hot, s_filter, s_ids, s_vs);
    SampleRow sr;
    sr.t = t;
    sr.rho = s.rho;
    sr.pt = s.pt;
    SampleScan<false> sc;
    sc.part = SamplePart::empty();
    const int64_t begin = c * w.chunk, end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
    sample_chunk<false, TT, TD>(target_row<TT>(p, s.st.start, i), begin, end, sr, qs, sc);
    const float mass = block_allreduce(Sum{sc.part.mass}, s_sum).v;
    if (threadIdx.x == 0) stg(w.masspart + (r * w.chunks + c) * w.ks + i, mass);
  }
  if (!last_cta(w.tickets + p.N + r, static_cast<uint32_t>((L - 1) * w.chunks), &s_last)) return;
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const float my_rho = lane <= L ? ldg(w.rho + r * w.ks1 + lane) : 0.f;
  float mass = 0.f;
  for (int64_t cc = 0; cc < w.chunks; ++cc)
    if (lane >= 1 && lane < L) mass += ld_coherent(w.masspart + (r * w.chunks + cc) * w.ks + lane);
  float rho_tau = 1.f;
  int n_acc = block_tau(p, r, L, my_rho, mass, &rho_tau);
  const int64_t d = lane < p.K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane) : int64_t(-1);
  bool stopped = false;
  n_acc = stop_cut(p, n_acc, d, &stopped);
  write_outputs(p, r, n_acc, d, false, 0);
  ReqInfo ri;
  ri.start = s.st.start;
  ri.length = L;
  ri.t = s.st.t;
  const VStats tst = lane < L ? ldg(w.rowt + r * w.ks + lane) : VStats::empty();
  const VStats qn = lane < L ? ldg(w.rowq + r * w.ks + lane) : VStats::empty();
  store_emit(w, r, ri, n_acc, stopped, rho_tau, tst, qn, in_vocab(d, p.V) ? d : int64_t(-1));
}

// ------------------------------------------------------------------------------------------------ B. sample
// (request, chunk) of the emitting row: the races and the residual mass; the request's last CTA writes the token.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) sample_kernel(VerifyChainParams p, Workspace w, Flags f) {
  DSPARK_SHARED(EmitState, s_st);
  DSPARK_SHARED(rng::Philox, s_ph);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(SamplePart, s_part, 32);
  DSPARK_SHARED_ARRAY(VStats, s_vs, 32);
  DSPARK_SHARED_ARRAY(uint32_t, s_filter, kFilterWords);
  DSPARK_SHARED_ARRAY(int32_t, s_ids, kMaxTopK);
  const int64_t r = static_cast<int64_t>(blockIdx.x) / w.bchunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - r * w.bchunks;
  if (threadIdx.x == 0) {
    s_st = ldg(w.state + r);
    s_ph = rng::load_philox(p.rng_key);
  }
  __syncthreads();
  const EmitState st = s_st;
  if (!(st.flags & kEmit)) return;  // the same for every CTA of the request
  SampleRow sr;
  sr.t = st.t;
  sr.rho = st.rho;
  sr.pt = st.pt;
  sr.full = (st.flags & kFull) != 0;
  QSource qs;
  if (!sr.full) qs = q_source<TD>(p, f, r, st.row, st.t, st.pq, st.hot, s_filter, s_ids, s_vs);
  SampleScan<true> sc;
  sc.part = SamplePart::empty();
  sc.uni.init(s_ph, r, st.row);
  const int64_t begin = c * w.bchunk, end = begin + w.bchunk < p.V ? begin + w.bchunk : p.V;
  sample_chunk<true, TT, TD>(target_row<TT>(p, st.start, st.row), begin, end, sr, qs, sc);
  const SamplePart part = block_allreduce(sc.part, s_part);
  if (threadIdx.x == 0) {
    st_part(w.res + r * w.bcs + c, part.res);
    st_part(w.gum + r * w.bcs + c, part.gum);
    stg(w.bmass + r * w.bms + c, part.mass);
  }
  if (!last_cta(w.tickets + 2 * p.N + r, static_cast<uint32_t>(w.bchunks), &s_last)) return;
  if (threadIdx.x >= 32) return;
  SamplePart all = SamplePart::empty();
  for (int64_t cc = threadIdx.x; cc < w.bchunks; cc += 32) {
    all.res.merge(ld_part(w.res + r * w.bcs + cc));
    all.gum.merge(ld_part(w.gum + r * w.bcs + cc));
    all.mass += ld_coherent(w.bmass + r * w.bms + cc);
  }
  all = warp_allreduce(all);
  const bool use_p = sr.full || !(all.mass >= kResidualEps);
  if (threadIdx.x == 0) stg(p.out_tokens + r * (p.K + 1) + st.row, use_p ? all.gum.index : all.res.index);
}

// ------------------------------------------------------------------------------------------------ host side
enum Buffer { kAmax, kTpart, kDpart, kAtT, kAtQ, kAtQCol, kRowT, kRowQ, kRho, kState, kMass, kRes, kGum, kBMass,
              kBuffers };

struct Plan {
  SplitV split;   // target rows (A, M)
  SplitV dsplit;  // draft rows (A)
  SplitV bsplit;  // the emitting row (B)
  size_t off[kBuffers];
  size_t total;
};

inline size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// The splits: enough (row, chunk) CTAs for kCtasPerSm a multiprocessor when every row is read (N = 1 included),
// chunks no shorter than kMinChunk (pass B: kMinSampleChunk); W: the draft rows' columns.
inline Plan make_plan(int64_t N, int64_t K, int64_t V, int64_t W) {
  Plan pl;
  const int64_t ctas = static_cast<int64_t>(device_sm_count()) * kCtasPerSm;
  pl.split = split_v(V, N * (K + 1), ctas, kMinChunk);
  pl.dsplit = split_v(W > 0 ? W : 1, N * K, ctas, kMinChunk);
  pl.bsplit = split_v(V, N, ctas, kMinSampleChunk);
  const size_t n = static_cast<size_t>(N), rows = static_cast<size_t>(N * (K + 1)), drafts = static_cast<size_t>(N * K);
  const size_t cs = static_cast<size_t>(round_up(pl.split.chunks, 2)), dcs = static_cast<size_t>(round_up(pl.dsplit.chunks, 2));
  const size_t bcs = static_cast<size_t>(round_up(pl.bsplit.chunks, 2)), bms = static_cast<size_t>(round_up(pl.bsplit.chunks, 8));
  const size_t ks = static_cast<size_t>(round_up(K, 8)), ks1 = static_cast<size_t>(round_up(K + 1, 8));
  const size_t sizes[kBuffers] = {
      sizeof(ArgMax) * rows * cs,  sizeof(VStats) * rows * cs, sizeof(VStats) * drafts * dcs, sizeof(float) * n * ks,
      sizeof(float) * n * ks,      sizeof(int32_t) * n * ks,   sizeof(VStats) * n * ks,       sizeof(VStats) * n * ks,
      sizeof(float) * n * ks1,     sizeof(EmitState) * n,      sizeof(float) * n * static_cast<size_t>(pl.split.chunks) * ks,
      sizeof(ArgMax) * n * bcs,    sizeof(ArgMax) * n * bcs,   sizeof(float) * n * bms,
  };
  size_t o = 0;
  for (int i = 0; i < kBuffers; ++i) {
    pl.off[i] = o;
    o += align_up(sizes[i]);
  }
  pl.total = o;
  return pl;
}

// CTAs per request of pass A, the widest launch: one per (row, vocabulary chunk), plus one per (draft row, draft
// chunk) where it gathers the draft rows' statistics.
inline int64_t rows_ctas_per_request(int64_t K, const Plan& pl, bool draft_stats) {
  return (K + 1) * pl.split.chunks + (draft_stats ? K * pl.dsplit.chunks : 0);
}

inline QKind q_kind(const VerifyChainParams& p) {
  if (p.draft_logits == nullptr) return QKind::kOneHot;
  return p.layout == DraftLayout::kReduced ? QKind::kReduced
                                           : (p.layout == DraftLayout::kTopK ? QKind::kTopK : QKind::kDense);
}

}  // namespace verify

size_t verify_chain_workspace_bytes(int64_t N, int64_t K, int64_t V, int64_t W) {
  return verify::make_plan(N, K, V, W).total;
}

bool verify_chain_grid_fits(int64_t N, int64_t K, int64_t V, int64_t W) {
  return N <= kMaxGridX / verify::rows_ctas_per_request(K, verify::make_plan(N, K, V, W), true);
}

cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, uint32_t* tickets,
                                cudaStream_t stream) {
  using namespace verify;
  if (p.N <= 0) return cudaSuccess;
  if (p.K < 1 || p.K > kMaxK || p.V < 1) return cudaErrorInvalidValue;
  const int64_t W = p.draft_logits != nullptr ? p.draft_width : p.V;
  if (W < 1 || (p.layout == DraftLayout::kTopK && W > kMaxTopK)) return cudaErrorInvalidValue;
  const Plan pl = make_plan(p.N, p.K, p.V, W);
  char* base = static_cast<char*>(workspace);
  Workspace w;
  w.amax = reinterpret_cast<ArgMax*>(base + pl.off[kAmax]);
  w.tpart = reinterpret_cast<VStats*>(base + pl.off[kTpart]);
  w.dpart = reinterpret_cast<VStats*>(base + pl.off[kDpart]);
  w.at_t = reinterpret_cast<float*>(base + pl.off[kAtT]);
  w.atq = reinterpret_cast<float*>(base + pl.off[kAtQ]);
  w.atq_col = reinterpret_cast<int32_t*>(base + pl.off[kAtQCol]);
  w.rowt = reinterpret_cast<VStats*>(base + pl.off[kRowT]);
  w.rowq = reinterpret_cast<VStats*>(base + pl.off[kRowQ]);
  w.rho = reinterpret_cast<float*>(base + pl.off[kRho]);
  w.state = reinterpret_cast<EmitState*>(base + pl.off[kState]);
  w.masspart = reinterpret_cast<float*>(base + pl.off[kMass]);
  w.res = reinterpret_cast<ArgMax*>(base + pl.off[kRes]);
  w.gum = reinterpret_cast<ArgMax*>(base + pl.off[kGum]);
  w.bmass = reinterpret_cast<float*>(base + pl.off[kBMass]);
  w.tickets = tickets;
  w.chunk = pl.split.chunk;
  w.chunks = pl.split.chunks;
  w.cs = round_up(w.chunks, 2);
  w.dchunk = pl.dsplit.chunk;
  w.dchunks = pl.dsplit.chunks;
  w.dcs = round_up(w.dchunks, 2);
  w.bchunk = pl.bsplit.chunk;
  w.bchunks = pl.bsplit.chunks;
  w.bcs = round_up(w.bchunks, 2);
  w.bms = round_up(w.bchunks, 8);
  w.ks = round_up(p.K, 8);
  w.ks1 = round_up(p.K + 1, 8);
  const bool sampling = p.temperature != nullptr;
  Flags f;
  f.draft_stats = sampling && p.draft_logits != nullptr && p.draft_logprobs == nullptr;
  f.qkind = q_kind(p);
  const int64_t per_req = rows_ctas_per_request(p.K, pl, f.draft_stats);
  if (p.N > kMaxGridX / per_req) return cudaErrorInvalidValue;
  LaunchConfig cfg;
  cfg.block = dim3(kThreads);
  cfg.stream = stream;
  cudaError_t err = cudaSuccess;
  DSPARK_DISPATCH_FLOAT(p.target_dtype, TT, return cudaErrorInvalidValue,
    DSPARK_DISPATCH_FLOAT(p.draft_dtype, TD, return cudaErrorInvalidValue,
      cfg.grid = dim3(static_cast<unsigned>(p.N * per_req));
      err = launch("verify_chain_rows", rows_kernel<TT, TD>, cfg, p, w, f);
      if (err != cudaSuccess || !sampling) return err;
      if (p.block_method && p.K > 1) {
        cfg.grid = dim3(static_cast<unsigned>(p.N * (p.K - 1) * w.chunks));
        err = launch("verify_chain_mass", mass_kernel<TT, TD>, cfg, p, w, f);
        if (err != cudaSuccess) return err;
      }
      cfg.grid = dim3(static_cast<unsigned>(p.N * w.bchunks));
      err = launch("verify_chain_sample", sample_kernel<TT, TD>, cfg, p, w, f);
    )
  )
  return err;
}

}  // namespace dspark
