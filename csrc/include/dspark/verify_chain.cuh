// dspark/verify_chain.cuh: chain verification of draft blocks against the target's logits (no torch).
//
// The meaning is dspark_kernels/reference/verify_chain.py (the spec): greedy, token-level rejection sampling and
// block verification (Sun et al. 2024), dense [N, K+1, V] or packed [R, V] + cu_seqlens target rows, draft logits
// (with or without the drafted tokens' log-probabilities) or one-hot drafts, per-request temperatures, verify_lens
// and survival thresholds, stop tokens; fp32 / bf16 / fp16 logits, fp32 math, 64-bit row offsets.
//
// Parallel structure: every row of V logits is split into `chunks` chunks (dspark::split_v) so that even N = 1
// fills the GPU. Kernels, in launch order (the host skips those a call does not need):
//   1. stats   (row, chunk): softmax stats of target/T (and draft/T where whole draft rows are read), raw argmax.
//   2. decide  (request, one warp): merges the chunk partials row by row; p(d_j), q(d_j); greedy / token
//              acceptance, or block's rho_i; stop tokens; writes the outputs of every request already decided.
//   3. mass    (block only; request, row, chunk): S_i = sum max(rho_i p_i - q_i, 0) for rows 1..L-1.
//   4. tau     (block only; request, one warp): h_i, tau, stop tokens.
//   5. qstats  (token with draft_logprobs; request, chunk): softmax stats of the one draft row to sample at.
//   6. sample  (request, chunk): the emitted token's exponential race over max(0, rho p - q) and the Gumbel race
//              over target/T with the same uniforms (uniform(r, row, RESIDUAL, v)), and the residual's mass.
//   7. finish  (request, one warp): picks the residual winner or, for a full acceptance / a residual mass below
//              1e-6, the Gumbel winner; writes the outputs.
// Bytes: greedy reads every verified target row once. Sampling reads every verified target row once, plus the
// emitting row's target and draft rows once more (twice for the draft row with draft_logprobs: stats, then race).
// Winners use the counter RNG keyed by token, so they do not depend on the split; softmax normalisers are merged in
// a fixed order, so equal rows give bit-equal probabilities.
#pragma once

#include <math.h>
#include <stdint.h>

#include "utils.cuh"

namespace dspark {

struct VerifyChainParams {
  const void* target = nullptr;          // [N, K+1, V] or [R, V]
  DType target_dtype = DType::kFloat32;
  const void* cu_seqlens = nullptr;      // [N+1] int32/int64 (packed), or null (dense)
  bool cu_i64 = true;
  int64_t total_rows = 0;                // R (packed)
  const void* draft_tokens = nullptr;    // [N, K] int32/int64
  bool drafts_i64 = true;
  const void* draft_logits = nullptr;    // [N, K, V] or null (one-hot drafts)
  DType draft_dtype = DType::kFloat32;
  const float* draft_logprobs = nullptr; // [N, K] or null
  const void* verify_lens = nullptr;     // [N] int32/int64 or null
  bool lens_i64 = true;
  const void* survival = nullptr;        // [N, K] float or null
  DType survival_dtype = DType::kFloat32;
  const void* thresholds = nullptr;      // [K] float (with survival)
  DType thresholds_dtype = DType::kFloat32;
  const float* temperature = nullptr;    // [N] or null (every request greedy)
  const int64_t* rng_key = nullptr;      // [2]
  const void* stop_ids = nullptr;        // [S] int32/int64 or null
  bool stops_i64 = true;
  int64_t num_stops = 0;
  bool block_method = false;
  int64_t N = 0, K = 0, V = 0;
  int64_t* out_tokens = nullptr;         // [N, K+1]
  int32_t* out_num_accepted = nullptr;   // [N]
  uint8_t* out_accept_mask = nullptr;    // [N, K] (bool)
};

namespace vc {

constexpr int kThreads = 256;
constexpr int kDecideWarps = 4;
constexpr float kResidualEps = 1e-6f;
constexpr int kMaxK = 16;

// Softmax statistics plus a flag for the rows torch's softmax turns into NaN everywhere (a NaN or +inf scaled logit).
struct VStats {
  SoftmaxStats st;
  uint32_t bad;
  DSPARK_HOST_DEVICE_FN static VStats empty() { return VStats{SoftmaxStats::empty(), 0u}; }
  DSPARK_HOST_DEVICE_FN void update(float l) {
    if (l != l || l == INFINITY) bad = 1u;
    st.update(l);
  }
  DSPARK_HOST_DEVICE_FN void merge(const VStats& o) {
    st.merge(o.st);
    bad |= o.bad;
  }
  // softmax(row)[x] for a scaled logit l of the row (NaN for a row softmax makes all-NaN).
  DSPARK_HOST_DEVICE_FN float prob(float l) const {
    if (bad || !(st.m > neg_inf())) return NAN;
    return expf(l - st.m) / st.s;
  }
};

// Phase-1 partial of one (row, chunk).
struct StatsPartial {
  VStats t;     // target / T
  VStats d;     // draft / T (when read)
  ArgMax amax;  // raw target argmax
  DSPARK_HOST_DEVICE_FN static StatsPartial empty() { return StatsPartial{VStats::empty(), VStats::empty(), ArgMax::empty()}; }
  DSPARK_HOST_DEVICE_FN void merge(const StatsPartial& o) {
    t.merge(o.t);
    d.merge(o.d);
    amax.merge(o.amax);
  }
};

// Partial of the sampling pass over one (request, chunk).
struct SamplePartial {
  ArgMax gumbel;  // Gumbel race over target / T
  ArgMax race;    // exponential race over the residual
  float mass;     // residual mass
  uint32_t pad;
  DSPARK_HOST_DEVICE_FN static SamplePartial empty() { return SamplePartial{ArgMax::empty(), ArgMax::empty(), 0.f, 0u}; }
  DSPARK_HOST_DEVICE_FN void merge(const SamplePartial& o) {
    gumbel.merge(o.gumbel);
    race.merge(o.race);
    mass += o.mass;
  }
};

struct Sum1 {
  float v;
  DSPARK_HOST_DEVICE_FN void merge(const Sum1& o) { v += o.v; }
};

// Per-request state between kernels.
enum : int32_t { kHasRows = 1, kSampled = 2, kDone = 4, kFull = 8, kBlockPending = 16 };
struct ReqState {
  int32_t length;    // verify length L
  int32_t n_acc;     // accepted drafts (final once kDone or sampling)
  int32_t emit_row;  // row to sample at (sampling, not kDone)
  int32_t flags;
  float t;           // temperature (1 for greedy requests)
  float rho;         // rho of the emitting row (1 for token)
  int64_t start;     // first target row of the request
};

// Rows of one request, its verify length and temperature (what every kernel needs first).
struct ReqInfo {
  int64_t start;  // first target row (packed) or r * (K+1)
  int32_t last;   // last target row present (-1: none), <= K
  int32_t length; // verify length (0 when no rows)
  float t;        // temperature, or 1 for greedy
  int32_t sampled;
};

struct Workspace {
  StatsPartial* part;     // [N*(K+1), chunks]
  VStats* rowt;           // [N*(K+1)] merged target stats
  VStats* rowd;           // [N*(K+1)] merged draft stats (rows read in phase 1)
  float* rho;             // [N*(K+1)]
  ReqState* state;        // [N]
  VStats* qpart;          // [N, chunks] (qstats)
  float* masspart;        // [N*K, chunks] (block mass)
  SamplePartial* spart;   // [N, chunks]
  int64_t chunk, chunks;
};

template <typename T>
DSPARK_DEVICE const T* target_row(const VerifyChainParams& p, const ReqInfo& ri, int64_t j) {
  return static_cast<const T*>(p.target) + (ri.start + j) * p.V;
}
template <typename T>
DSPARK_DEVICE const T* draft_row(const VerifyChainParams& p, int64_t r, int64_t j) {
  return static_cast<const T*>(p.draft_logits) + (r * p.K + j) * p.V;
}

// ReqInfo of request r, computed by one full warp (every lane gets it). Reads each input once per warp.
DSPARK_DEVICE ReqInfo request_info(const VerifyChainParams& p, int64_t r) {
  const int lane = threadIdx.x & 31;
  const int K = static_cast<int>(p.K);
  ReqInfo ri;
  int64_t a = 0;
  if (p.cu_seqlens != nullptr && lane < 2) a = load_int(p.cu_seqlens, p.cu_i64, r + lane);
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
    const int64_t count = c1 - c0;
    const int64_t rows_left = c0 >= 0 ? p.total_rows - c0 : 0;
    last = (count < rows_left ? count : rows_left) - 1;
    if (last < -1) last = -1;
    if (last > K) last = K;
    ri.start = c0;
  } else {
    ri.start = r * (p.K + 1);
  }
  int64_t len = last < 0 ? 0 : last;
  if (p.verify_lens != nullptr) {
    const int64_t l = lens < 0 ? 0 : (lens > K ? K : lens);
    len = len < l ? len : l;
  }
  if (p.survival != nullptr) {
    const int lead = (~passes) == 0u ? 32 : __ffs(static_cast<int>(~passes)) - 1;
    len = len < lead ? len : lead;
  }
  ri.last = static_cast<int32_t>(last);
  ri.length = static_cast<int32_t>(len);
  ri.sampled = p.temperature != nullptr && t > 0.f;
  ri.t = ri.sampled ? t : 1.f;
  return ri;
}

// POD structs through 32-bit global loads / stores (so any partial can be counted and cached like a float).
template <typename T>
DSPARK_DEVICE T ldg_pod(const T* p) {
  static_assert(sizeof(T) % 4 == 0, "ldg_pod moves whole 32-bit words");
  uint32_t w[sizeof(T) / 4];
  const uint32_t* src = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = ldg(src + i);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}
template <typename T>
DSPARK_DEVICE void stg_pod(T* p, const T& v) {
  static_assert(sizeof(T) % 4 == 0, "stg_pod moves whole 32-bit words");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
  uint32_t* dst = reinterpret_cast<uint32_t*>(p);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) stg(dst + i, w[i]);
}

// Merge `chunks` partials get(c) of one row in a fixed order (lane-strided, then the warp butterfly): the same
// order everywhere, so equal rows give bit-equal statistics. Every lane of a full warp gets the result.
template <typename T, typename Get>
DSPARK_DEVICE T warp_merge_chunks(int64_t chunks, T acc, Get&& get) {
  for (int64_t c = threadIdx.x & 31; c < chunks; c += 32) acc.merge(get(c));
  return warp_allreduce(acc);
}

DSPARK_DEVICE bool in_vocab(int64_t d, int64_t V) { return d >= 0 && d < V; }

// The residual weight max(0, rho p - q) (NaN stays NaN, as torch.clamp keeps it).
DSPARK_DEVICE float residual_weight(float rho, float p, float q) {
  const float w = rho * p - q;
  return w < 0.f ? 0.f : w;
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
// emit), then -1; num_accepted; accept_mask.
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
DSPARK_DEVICE rng::Philox warp_philox(const int64_t* rng_key) {
  long long k[2] = {0, 0};
  if ((threadIdx.x & 31) == 0) {
    k[0] = ldg(rng_key);
    k[1] = ldg(rng_key + 1);
  }
  k[0] = __shfl_sync(kFullMask, k[0], 0);
  k[1] = __shfl_sync(kFullMask, k[1], 0);
  return rng::Philox::make(static_cast<uint64_t>(k[0]), static_cast<uint64_t>(k[1]));
}

// The request state, read by lane 0 and shared with the warp.
DSPARK_DEVICE ReqState warp_state(const ReqState* p) {
  ReqState st{};
  if ((threadIdx.x & 31) == 0) st = ldg_pod(p);
  uint32_t wds[sizeof(ReqState) / 4];
  memcpy(wds, &st, sizeof(ReqState));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(ReqState) / 4); ++i) wds[i] = __shfl_sync(kFullMask, wds[i], 0);
  memcpy(&st, wds, sizeof(ReqState));
  return st;
}

DSPARK_DEVICE int leading_ones(unsigned b) { return ~b == 0u ? 32 : __ffs(static_cast<int>(~b)) - 1; }

// ------------------------------------------------------------------------------------------------ 1. stats
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads) stats_kernel(VerifyChainParams p, Workspace w, bool draft_stats) {
  DSPARK_SHARED(ReqInfo, s_info);
  DSPARK_SHARED_ARRAY(StatsPartial, scratch, 32);
  const int64_t kp1 = p.K + 1;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - slot * w.chunks;
  const int64_t r = slot / kp1, j = slot - r * kp1;
  if (threadIdx.x < 32) {
    const ReqInfo ri = request_info(p, r);
    if (threadIdx.x == 0) s_info = ri;
  }
  __syncthreads();
  const ReqInfo ri = s_info;
  if (j > ri.last || j > ri.length) return;  // a row nobody reads: no bytes
  const int64_t begin = c * w.chunk;
  const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
  StatsPartial part = StatsPartial::empty();
  const float t = ri.t;
  const bool sampled = ri.sampled != 0;
  for_each_element(target_row<TT>(p, ri, j), begin, end, threadIdx.x, blockDim.x, [&](int64_t i, float x) {
    part.amax.update(x, i);
    if (sampled) part.t.update(x / t);
  });
  if (draft_stats && sampled && j < ri.length)
    for_each_element(draft_row<TD>(p, r, j), begin, end, threadIdx.x, blockDim.x,
                     [&](int64_t, float x) { part.d.update(x / t); });
  part = block_allreduce(part, scratch);
  if (threadIdx.x == 0) stg_pod(w.part + slot * w.chunks + c, part);
}

// ------------------------------------------------------------------------------------------------ 2. decide
__global__ void __launch_bounds__(kDecideWarps * 32) decide_kernel(VerifyChainParams p, Workspace w,
                                                                   bool draft_stats) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kDecideWarps + (threadIdx.x >> 5);
  if (r >= p.N) return;  // whole warps
  const ReqInfo ri = request_info(p, r);
  const int K = static_cast<int>(p.K), L = ri.length;
  const int64_t kp1 = p.K + 1;
  const int64_t d = lane < K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane) : int64_t(-1);
  ReqState st{};
  st.length = L;
  st.t = ri.t;
  st.rho = 1.f;
  st.start = ri.start;
  if (ri.last < 0) {  // no target rows: nothing accepted, nothing emitted
    write_outputs(p, r, 0, d, false, 0);
    st.flags = kDone;
    if (lane == 0) stg_pod(w.state + r, st);
    return;
  }
  st.flags = kHasRows | (ri.sampled ? kSampled : 0);
  // Row j's merged statistics end in lane j (j <= L <= K < 32).
  StatsPartial mine = StatsPartial::empty();
  for (int j = 0; j <= L; ++j) {
    const int64_t slot = r * kp1 + j;
    const StatsPartial row = warp_merge_chunks(w.chunks, StatsPartial::empty(),
                                               [&](int64_t c) { return ldg_pod(w.part + slot * w.chunks + c); });
    if (lane == j) mine = row;
  }
  if (ri.sampled && lane <= L) {
    stg_pod(w.rowt + r * kp1 + lane, mine.t);
    if (draft_stats && lane < L) stg_pod(w.rowd + r * kp1 + lane, mine.d);
  }
  const bool valid = in_vocab(d, p.V);
  const int64_t safe = valid ? d : 0;
  int n_acc;
  if (!ri.sampled) {
    n_acc = leading_ones(__ballot_sync(kFullMask, lane < L && valid && d == mine.amax.index));
  } else {
    const float t = ri.t;
    float p_d = 0.f, q_d = 0.f;
    if (lane < L) {
      const int64_t row = ri.start + lane;
      p_d = mine.t.prob(load_float(p.target, p.target_dtype, row * p.V + safe) / t) * (valid ? 1.f : 0.f);
      if (p.draft_logprobs != nullptr) {
        q_d = expf(ldg(p.draft_logprobs + r * p.K + lane));
      } else if (p.draft_logits != nullptr) {
        q_d = mine.d.prob(load_float(p.draft_logits, p.draft_dtype, (r * p.K + lane) * p.V + safe) / t);
      } else {
        q_d = valid ? 1.f : 0.f;
      }
    }
    const rng::Philox ph = warp_philox(p.rng_key);
    const float u = lane < L ? ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(lane), rng::kStreamAccept, 0)
                             : 1.f;
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
      if (lane <= L) stg(w.rho + r * kp1 + lane, my_rho);
      st.flags |= kBlockPending;
      if (lane == 0) stg_pod(w.state + r, st);
      return;  // tau after the mass pass
    }
  }
  bool stopped = false;
  n_acc = stop_cut(p, n_acc, d, &stopped);
  st.n_acc = n_acc;
  if (!ri.sampled || stopped) {
    const int64_t emitted = __shfl_sync(kFullMask, static_cast<long long>(mine.amax.index), n_acc);
    write_outputs(p, r, n_acc, d, !stopped, emitted);
    st.flags |= kDone;
  } else {
    st.emit_row = n_acc;
    if (n_acc >= L) st.flags |= kFull;
  }
  if (lane == 0) stg_pod(w.state + r, st);
}

// ------------------------------------------------------------------------------------------------ 3. mass (block)
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads) mass_kernel(VerifyChainParams p, Workspace w) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED_ARRAY(float, s_scalars, 1);
  DSPARK_SHARED_ARRAY(VStats, s_stats, 2);
  DSPARK_SHARED(int64_t, s_dq);
  DSPARK_SHARED_ARRAY(Sum1, scratch, 32);
  const int64_t km1 = p.K - 1, kp1 = p.K + 1;
  const int64_t item = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - item * w.chunks;
  const int64_t r = item / km1, i = item - r * km1 + 1;  // row 1..K-1
  if (threadIdx.x == 0) {
    s_st = ldg_pod(w.state + r);
    if ((s_st.flags & kBlockPending) && i < s_st.length) {
      s_scalars[0] = ldg(w.rho + r * kp1 + i);
      s_stats[0] = ldg_pod(w.rowt + r * kp1 + i);
      s_stats[1] = p.draft_logits != nullptr ? ldg_pod(w.rowd + r * kp1 + i) : VStats::empty();
      s_dq = p.draft_logits != nullptr ? int64_t(-1) : load_int(p.draft_tokens, p.drafts_i64, r * p.K + i);
    }
  }
  __syncthreads();
  const ReqState st = s_st;
  if (!(st.flags & kBlockPending) || i >= st.length) return;
  const float rho = s_scalars[0], t = st.t;
  const VStats pt = s_stats[0], pq = s_stats[1];
  const bool onehot = p.draft_logits == nullptr;
  const int64_t dq = s_dq;
  const int64_t begin = c * w.chunk;
  const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
  const TT* trow = static_cast<const TT*>(p.target) + (st.start + i) * p.V;
  const TD* drow = onehot ? nullptr : draft_row<TD>(p, r, i);
  float mass = 0.f;
  for_each_element(trow, begin, end, threadIdx.x, blockDim.x, [&](int64_t x, float v) {
    const float q = onehot ? (x == dq ? 1.f : 0.f) : pq.prob(to_float(ldg(drow + x)) / t);
    mass += residual_weight(rho, pt.prob(v / t), q);
  });
  mass = block_allreduce(Sum1{mass}, scratch).v;
  if (threadIdx.x == 0) stg(w.masspart + (r * p.K + i) * w.chunks + c, mass);
}

// ------------------------------------------------------------------------------------------------ 4. tau (block)
__global__ void __launch_bounds__(kDecideWarps * 32) tau_kernel(VerifyChainParams p, Workspace w) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kDecideWarps + (threadIdx.x >> 5);
  if (r >= p.N) return;
  ReqState st = warp_state(w.state + r);
  if (!(st.flags & kBlockPending)) return;
  const int L = st.length, K = static_cast<int>(p.K);
  const int64_t kp1 = p.K + 1;
  const float my_rho = lane <= L ? ldg(w.rho + r * kp1 + lane) : 0.f;
  float h = 0.f;
  if (lane >= 1 && lane < L) {
    float s = 0.f;
    for (int64_t c = 0; c < w.chunks; ++c) s += ldg(w.masspart + (r * p.K + lane) * w.chunks + c);
    const float denom = s + 1.f - my_rho;
    h = denom > 0.f ? s / denom : (denom == 0.f ? 1.f : 0.f);
  } else if (lane == L && L >= 1) {
    h = my_rho;
  }
  const rng::Philox ph = warp_philox(p.rng_key);
  const bool ok = lane >= 1 && lane <= L &&
                  ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(lane - 1), rng::kStreamAccept, 0) <= h;
  const unsigned b = __ballot_sync(kFullMask, ok);
  int n_acc = b ? 31 - __clz(static_cast<int>(b)) : 0;
  const float rho_tau = __shfl_sync(kFullMask, my_rho, n_acc);
  const int64_t d = lane < K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane) : int64_t(-1);
  bool stopped = false;
  n_acc = stop_cut(p, n_acc, d, &stopped);
  st.flags &= ~kBlockPending;
  st.n_acc = n_acc;
  if (stopped) {
    write_outputs(p, r, n_acc, d, false, 0);
    st.flags |= kDone;
  } else {
    st.emit_row = n_acc;
    st.rho = rho_tau;
    if (n_acc >= L) st.flags |= kFull;
  }
  if (lane == 0) stg_pod(w.state + r, st);
}

// ------------------------------------------------------------------------------------------------ 5. qstats
template <typename TD>
__global__ void __launch_bounds__(kThreads) qstats_kernel(VerifyChainParams p, Workspace w) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED_ARRAY(VStats, scratch, 32);
  const int64_t r = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - r * w.chunks;
  if (threadIdx.x == 0) s_st = ldg_pod(w.state + r);
  __syncthreads();
  const ReqState st = s_st;
  if ((st.flags & (kDone | kFull)) || !(st.flags & kSampled)) return;
  const int64_t begin = c * w.chunk;
  const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
  VStats s = VStats::empty();
  const float t = st.t;
  for_each_element(draft_row<TD>(p, r, st.emit_row), begin, end, threadIdx.x, blockDim.x,
                   [&](int64_t, float x) { s.update(x / t); });
  s = block_allreduce(s, scratch);
  if (threadIdx.x == 0) stg_pod(w.qpart + r * w.chunks + c, s);
}

// ------------------------------------------------------------------------------------------------ 6. sample
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, 1) sample_kernel(VerifyChainParams p, Workspace w, bool q_from_qpart) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED_ARRAY(VStats, s_stats, 2);
  DSPARK_SHARED(int64_t, s_dq);
  DSPARK_SHARED_ARRAY(SamplePartial, scratch, 32);
  const int64_t kp1 = p.K + 1;
  const int64_t r = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - r * w.chunks;
  DSPARK_SHARED(rng::Philox, s_ph);
  if (threadIdx.x == 0) {
    const ReqState st0 = ldg_pod(w.state + r);
    s_st = st0;
    const bool active = !(st0.flags & kDone) && (st0.flags & kSampled);
    if (active) {
      s_stats[0] = ldg_pod(w.rowt + r * kp1 + st0.emit_row);
      s_ph = rng::load_philox(p.rng_key);
    }
    const bool need_q = active && !(st0.flags & kFull);
    s_stats[1] = need_q && p.draft_logits != nullptr && !q_from_qpart ? ldg_pod(w.rowd + r * kp1 + st0.emit_row)
                                                                      : VStats::empty();
    s_dq = need_q && p.draft_logits == nullptr ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + st0.emit_row)
                                               : int64_t(-1);
  }
  __syncthreads();
  if (q_from_qpart && threadIdx.x < 32) {  // the emitting draft row's statistics, merged as decide merges rows
    const ReqState st0 = s_st;
    if (!(st0.flags & (kDone | kFull)) && (st0.flags & kSampled)) {
      const VStats pq = warp_merge_chunks(w.chunks, VStats::empty(),
                                          [&](int64_t cc) { return ldg_pod(w.qpart + r * w.chunks + cc); });
      if (threadIdx.x == 0) s_stats[1] = pq;
    }
  }
  __syncthreads();
  const ReqState st = s_st;
  if ((st.flags & kDone) || !(st.flags & kSampled)) return;
  const bool full = (st.flags & kFull) != 0;
  const VStats pt = s_stats[0], pq = s_stats[1];
  const int64_t dq = s_dq;
  const bool onehot = p.draft_logits == nullptr;
  const float t = st.t, rho = st.rho;
  const int64_t row = st.emit_row;
  const int64_t begin = c * w.chunk;
  const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
  const TT* trow = static_cast<const TT*>(p.target) + (st.start + row) * p.V;
  const TD* drow = (onehot || full) ? nullptr : draft_row<TD>(p, r, row);
  const rng::Philox ph = s_ph;
  SamplePartial part = SamplePartial::empty();
  // One Philox block per 4 consecutive tokens (chunks start at multiples of 32 tokens): thread i takes quads
  // i, i + blockDim.x, ... of the chunk, element by element (this pass reads one row per request).
  const int64_t nquads = (end - begin + 3) >> 2;
  for (int64_t qi = threadIdx.x; qi < nquads; qi += blockDim.x) {
    const int64_t x0 = begin + (qi << 2);
    const rng::U32x4 bits = ph.block(static_cast<uint64_t>(r), static_cast<uint64_t>(row), rng::kStreamResidual,
                                     static_cast<uint64_t>(x0 >> 2));
#pragma unroll 1
    for (int k = 0; k < 4; ++k) {
      const int64_t x = x0 + k;
      if (x >= end) break;
      const uint32_t wk = k == 0 ? bits.x : (k == 1 ? bits.y : (k == 2 ? bits.z : bits.w));
      const float e = -logf(rng::bits_to_uniform(wk));
      const float l = to_float(ldg(trow + x)) / t;
      part.gumbel.update(l - logf(e), x);
      if (!full) {
        const float q = onehot ? (x == dq ? 1.f : 0.f) : pq.prob(to_float(ldg(drow + x)) / t);
        const float wgt = residual_weight(rho, pt.prob(l), q);
        part.mass += wgt;
        part.race.update(wgt / e, x);
      }
    }
  }
  part = block_allreduce(part, scratch);
  if (threadIdx.x == 0) stg_pod(w.spart + r * w.chunks + c, part);
}

// ------------------------------------------------------------------------------------------------ 7. finish
__global__ void __launch_bounds__(kDecideWarps * 32) finish_kernel(VerifyChainParams p, Workspace w) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kDecideWarps + (threadIdx.x >> 5);
  if (r >= p.N) return;
  const ReqState st = warp_state(w.state + r);
  if ((st.flags & kDone) || !(st.flags & kSampled)) return;
  const SamplePartial s = warp_merge_chunks(w.chunks, SamplePartial::empty(),
                                            [&](int64_t c) { return ldg_pod(w.spart + r * w.chunks + c); });
  const bool use_p = (st.flags & kFull) || !(s.mass >= kResidualEps);
  const int64_t emitted = use_p ? s.gumbel.index : s.race.index;
  const int64_t d = lane < p.K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane) : int64_t(-1);
  write_outputs(p, r, st.n_acc, d, true, emitted);
}

// ------------------------------------------------------------------------------------------------ host side
struct Plan {
  SplitV split;
  int threads;  // per CTA of the split-V kernels: enough 16-byte vectors for one pass over a chunk, 32..256
  size_t off[8];
  size_t total;
};

inline size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

inline Plan make_plan(int64_t N, int64_t K, int64_t V) {
  Plan pl;
  const int64_t rows = N * (K + 1);
  pl.split = split_v(V, rows, static_cast<int64_t>(device_sm_count()) * 4, 2048);
  const int64_t vecs = (pl.split.chunk + 3) / 4;  // 16-byte fp32 vectors (bf16 rows take half as many)
  pl.threads = static_cast<int>(vecs >= kThreads ? kThreads : (vecs + 31) / 32 * 32);
  const size_t ch = static_cast<size_t>(pl.split.chunks > 0 ? pl.split.chunks : 1);
  const size_t sizes[8] = {
      sizeof(StatsPartial) * static_cast<size_t>(rows) * ch,  // part
      sizeof(VStats) * static_cast<size_t>(rows),             // rowt
      sizeof(VStats) * static_cast<size_t>(rows),             // rowd
      sizeof(float) * static_cast<size_t>(rows),              // rho
      sizeof(ReqState) * static_cast<size_t>(N),              // state
      sizeof(VStats) * static_cast<size_t>(N) * ch,           // qpart
      sizeof(float) * static_cast<size_t>(N * K) * ch,        // masspart
      sizeof(SamplePartial) * static_cast<size_t>(N) * ch,    // spart
  };
  size_t o = 0;
  for (int i = 0; i < 8; ++i) {
    pl.off[i] = o;
    o += align_up(sizes[i]);
  }
  pl.total = o;
  return pl;
}

}  // namespace vc

// Workspace of a launch_verify_chain call with these shapes (device memory, no initialisation needed).
inline size_t verify_chain_workspace_bytes(int64_t N, int64_t K, int64_t V) { return vc::make_plan(N, K, V).total; }

// Launch on `stream`; the caller has checked shapes and dtypes (K in [1, 16], V >= 1, N >= 0). Returns the first
// failing launch's status.
inline cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, cudaStream_t stream) {
  using namespace vc;
  if (p.N <= 0) return cudaSuccess;
  if (p.K < 1 || p.K > kMaxK || p.V < 1) return cudaErrorInvalidValue;
  const Plan pl = make_plan(p.N, p.K, p.V);
  char* base = static_cast<char*>(workspace);
  Workspace w;
  w.part = reinterpret_cast<StatsPartial*>(base + pl.off[0]);
  w.rowt = reinterpret_cast<VStats*>(base + pl.off[1]);
  w.rowd = reinterpret_cast<VStats*>(base + pl.off[2]);
  w.rho = reinterpret_cast<float*>(base + pl.off[3]);
  w.state = reinterpret_cast<ReqState*>(base + pl.off[4]);
  w.qpart = reinterpret_cast<VStats*>(base + pl.off[5]);
  w.masspart = reinterpret_cast<float*>(base + pl.off[6]);
  w.spart = reinterpret_cast<SamplePartial*>(base + pl.off[7]);
  w.chunk = pl.split.chunk;
  w.chunks = pl.split.chunks;

  const bool sampling = p.temperature != nullptr;
  const bool has_logits = p.draft_logits != nullptr;
  const bool draft_stats = sampling && has_logits && (p.draft_logprobs == nullptr || p.block_method);
  const bool qstats = sampling && has_logits && !p.block_method && p.draft_logprobs != nullptr;
  const int64_t rows = p.N * (p.K + 1);
  const unsigned row_grid = static_cast<unsigned>(rows * w.chunks);
  const unsigned req_grid = static_cast<unsigned>(p.N * w.chunks);
  const unsigned warp_grid = static_cast<unsigned>((p.N + kDecideWarps - 1) / kDecideWarps);
  LaunchConfig big, small;
  big.grid = dim3(row_grid);
  big.block = dim3(static_cast<unsigned>(pl.threads));
  big.stream = stream;
  small.grid = dim3(warp_grid);
  small.block = dim3(kDecideWarps * 32);
  small.stream = stream;
  cudaError_t err = cudaSuccess;
#define DSPARK_VC_TRY(expr)         \
  do {                              \
    err = (expr);                   \
    if (err != cudaSuccess) return err; \
  } while (0)
  DSPARK_DISPATCH_FLOAT(p.target_dtype, TT, return cudaErrorInvalidValue,
    DSPARK_DISPATCH_FLOAT(p.draft_dtype, TD, return cudaErrorInvalidValue,
      DSPARK_VC_TRY(launch("verify_chain_stats", stats_kernel<TT, TD>, big, p, w, draft_stats));
      DSPARK_VC_TRY(launch("verify_chain_decide", decide_kernel, small, p, w, draft_stats));
      if (sampling && p.block_method) {
        if (p.K > 1) {
          LaunchConfig m = big;
          m.grid = dim3(static_cast<unsigned>(p.N * (p.K - 1) * w.chunks));
          DSPARK_VC_TRY(launch("verify_chain_mass", mass_kernel<TT, TD>, m, p, w));
        }
        DSPARK_VC_TRY(launch("verify_chain_tau", tau_kernel, small, p, w));
      }
      if (qstats) {
        LaunchConfig q = big;
        q.grid = dim3(req_grid);
        DSPARK_VC_TRY(launch("verify_chain_qstats", qstats_kernel<TD>, q, p, w));
      }
      if (sampling) {
        LaunchConfig s = big;
        s.grid = dim3(req_grid);
        DSPARK_VC_TRY(launch("verify_chain_sample", sample_kernel<TT, TD>, s, p, w, qstats));
        DSPARK_VC_TRY(launch("verify_chain_finish", finish_kernel, small, p, w));
      }
    )
  )
#undef DSPARK_VC_TRY
  return err;
}

}  // namespace dspark
