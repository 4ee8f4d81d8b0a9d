// dspark/verify_chain.cuh: chain verification of draft blocks against the target's logits (no torch).
//
// The meaning is dspark_kernels/reference/verify_chain.py (the spec): greedy, token-level rejection sampling and
// block verification (Sun et al. 2024), dense [N, K+1, V] or packed [R, V] + cu_seqlens target rows, draft logits
// (with or without the drafted tokens' log-probabilities) or one-hot drafts, per-request temperatures, verify_lens
// and survival thresholds, stop tokens; fp32 / bf16 / fp16 logits, fp32 math, 64-bit row offsets.
//
// Parallel structure: every row of V logits is split into `chunks` chunks (stats_split) so that even N = 1 fills the
// GPU. Kernels, in launch order (the host skips those a call does not need):
//   1. stats   persistent (the resident CTAs, walking (row, chunk) work items): per item the raw argmax (greedy
//              rows) or softmax stats of target/T (and draft/T where whole draft rows are read); for sampled rows
//              also the chunk's kTopM best tokens by the race key over p alone, l - log(E) with E from the row's
//              RESIDUAL uniforms, and a bound on every other token's key. Each thread keeps kLoadsInFlight 16-byte
//              loads in flight, takes the max of a batch first (argmax by value, the tie rule only at merges;
//              one rescale per new max), sums 2^((x - max) * log2(e) / T), and lets the batch max decide whether
//              any of the batch's tokens can enter its candidates (only then keys, uniforms and logs).
//   2. decide  (request, one CTA): the rows' chunk partials merged in parallel across warps (each warp's rows in one
//              round trip, the drafts and the logits at them loaded meanwhile by warp 0); then warp 0: p(d_j),
//              q(d_j); greedy / token acceptance, or block's rho_i; stop tokens; then the CTA emits the sampled
//              token (emit_sampled) of every request already decided, unless its draft row's statistics are still
//              to come (qstats).
//   3. mass    (block with K > 1; request, row, chunk): S_i = sum max(rho_i p_i - q_i, 0) for rows 1..L-1; the
//              last CTA of a request (atomic ticket) takes tau, the stop cut and emits.
//   3'. qstats (token sampling with draft_logprobs; persistent over (request, chunk) items of its own split of the
//              one draft row to sample at): softmax stats of that row; the last CTA of a request emits.
// emit_sampled: the emitted token is the winner of an exponential race with uniforms uniform(r, row, RESIDUAL, v)
// over max(0, rho p - q) (or over p: the Gumbel race, for a full acceptance or a residual mass below 1e-6). Since
// max(0, rho p - q) <= p, a token's residual score is at most exp(key - log Z_p): the race is run over the kept
// candidates only (their draft logits gathered), and its winner is certified when it beats every chunk's bound; the
// mass is certified when the candidates alone reach 1e-6. What is not certified (rare) falls back to an exact
// joint pass over target and draft row of the chunks concerned (the whole row for the mass).
// Bytes: greedy reads every verified target row once. Token sampling reads every verified target row once, plus
// every verified draft row once (draft rows) or the rejecting request's draft row once (draft_logprobs), plus
// O(rows * chunks * kTopM) bookkeeping and gathers, plus the rare fallback. Block verification also reads target
// and draft rows 1..L-1 a second time (S_i needs rho_i, known only after the first pass).
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
  rng::Key rng_key;      // [2]
  const void* stop_ids = nullptr;        // [S] int32/int64 or null
  bool stops_i64 = true;
  int64_t num_stops = 0;
  bool block_method = false;
  int64_t N = 0, K = 0, V = 0;
  int64_t* out_tokens = nullptr;         // [N, K+1]
  int32_t* out_num_accepted = nullptr;   // [N]
  uint8_t* out_accept_mask = nullptr;    // [N, K] (bool)
};

namespace verify {

constexpr int kThreads = 256;
constexpr int kStatsCtasPerSm = 2;  // the stats / qstats kernels' design occupancy: <= 128 registers at 256 threads
constexpr int kLoadsInFlight = 4;   // independent 16-byte loads per thread per step of a row sweep
constexpr int64_t kMinChunk = 4096;  // elements per stats chunk: a full CTA's thread gets 4 fp32 / 2 bf16 vectors
constexpr int64_t kMinQChunk = 1024; // elements per qstats chunk (its bookkeeping is a 12-byte partial per chunk)
constexpr int64_t kItemCost = 4096;  // a work item's fixed cost (first loads' round trip, CTA merges), in elements
constexpr float kResidualEps = 1e-6f;
constexpr int kMaxK = 16;
constexpr int kTopM = 8;        // candidates kept per (row, chunk) for the emitted token
constexpr int kThreadTop = 4;   // candidates a thread keeps before the CTA merges them
constexpr float kMaxGumbel = 16.7f;  // > -log(-log(u)) for every uniform u <= 1 - 2^-24 the generator gives

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

// Softmax statistics of a sampled row's target / T and draft / T (phase 1 keeps one per (row, chunk) in separate
// arrays, with the raw argmax of greedy rows in a third, so each reader reads only what it needs).
struct StatsPair {
  VStats t;
  VStats d;
  DSPARK_HOST_DEVICE_FN static StatsPair empty() { return StatsPair{VStats::empty(), VStats::empty()}; }
  DSPARK_HOST_DEVICE_FN void merge(const StatsPair& o) {
    t.merge(o.t);
    d.merge(o.d);
  }
};

// One candidate of a (row, chunk) for the emitted token: its race key base = l - log(E) over p alone (l = a / T,
// E = -log(uniform(r, row, RESIDUAL, token))), its scaled logit l and its token. Ordered by the argmax rule.
struct Cand {
  float key;
  float lg;
  int64_t idx;
  DSPARK_HOST_DEVICE_FN static Cand empty() { return Cand{-INFINITY, 0.f, INT64_MAX}; }
  DSPARK_HOST_DEVICE_FN bool beats(const Cand& o) const { return key > o.key || (key == o.key && idx < o.idx); }
  DSPARK_HOST_DEVICE_FN void merge(const Cand& o) {
    if (o.beats(*this)) *this = o;
  }
};

// The kTopM best candidates of a (row, chunk) by key, best first (empty slots: Cand::empty()), and an upper bound
// of the key of every other token of the chunk (-inf: there is none with a finite key).
struct TopList {
  Cand c[kTopM];
  float bound;
  uint32_t pad;
};

// A thread's kThreadTop best candidates (sorted, best first, by the Cand::beats order) and the best key it dropped,
// held in registers: the slots are indexed by compile-time constants only (unrolled loops; a register array indexed
// at run time would go to local memory). A slot keeps its token as an offset from the chunk's first token (a chunk
// has at most 2^30 tokens), 12 bytes; a row sweep compares every token with the last slot's key (last()).
struct ThreadTop {
  static constexpr int32_t kNone = INT32_MAX;  // the offset of an empty slot (after every token, as INT64_MAX)
  struct Slot {
    float key;
    float lg;
    int32_t off;  // token - begin
    DSPARK_DEVICE bool beats(const Slot& o) const { return key > o.key || (key == o.key && off < o.off); }
  };
  Slot c[kThreadTop];
  int64_t begin;  // the chunk's first token
  float rest;
  DSPARK_DEVICE void init(int64_t chunk_begin) {
#pragma unroll
    for (int s = 0; s < kThreadTop; ++s) c[s] = Slot{-INFINITY, 0.f, kNone};
    begin = chunk_begin;
    rest = -INFINITY;
  }
  DSPARK_DEVICE float last() const { return c[kThreadTop - 1].key; }
  DSPARK_DEVICE Cand head() const { return Cand{c[0].key, c[0].lg, c[0].off == kNone ? INT64_MAX : begin + c[0].off}; }
  DSPARK_DEVICE void insert(float key, float lg, int64_t idx) {
    const Slot n{key, lg, static_cast<int32_t>(idx - begin)};
    if (!n.beats(c[kThreadTop - 1])) {
      rest = fmaxf(rest, key);
      return;
    }
    rest = fmaxf(rest, last());
    // The list is sorted, so n beats a suffix of it: the first slot of that suffix takes n, each later one the slot
    // above it (the last slot's candidate drops out).
    bool b[kThreadTop];
#pragma unroll
    for (int s = 0; s < kThreadTop; ++s) b[s] = n.beats(c[s]);
#pragma unroll
    for (int s = kThreadTop - 1; s > 0; --s)
      if (b[s]) c[s] = b[s - 1] ? c[s - 1] : n;
    if (b[0]) c[0] = n;
  }
  DSPARK_DEVICE void pop() {
#pragma unroll
    for (int s = 0; s + 1 < kThreadTop; ++s) c[s] = c[s + 1];
    c[kThreadTop - 1] = Slot{-INFINITY, 0.f, kNone};
  }
};

// The residual race and its mass over a set of tokens.
struct RaceMass {
  ArgMax race;  // exponential race over max(0, rho p - q)
  float mass;
  uint32_t pad;
  DSPARK_HOST_DEVICE_FN static RaceMass empty() { return RaceMass{ArgMax::empty(), 0.f, 0u}; }
  DSPARK_HOST_DEVICE_FN void merge(const RaceMass& o) {
    race.merge(o.race);
    mass += o.mass;
  }
};

struct OrFlag {
  int v;
  DSPARK_HOST_DEVICE_FN void merge(const OrFlag& o) { v |= o.v; }
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
  ArgMax* amax;           // [N*(K+1), chunks] greedy rows
  VStats* tpart;          // [N*(K+1), chunks] sampled rows: target / T
  VStats* dpart;          // [N*(K+1), chunks] sampled rows read in phase 1: draft / T
  VStats* rowt;           // [N*(K+1)] merged target stats
  VStats* rowd;           // [N*(K+1)] merged draft stats (rows read in phase 1)
  float* rho;             // [N*(K+1)]
  ReqState* state;        // [N]
  VStats* qpart;          // [N, qchunks] (qstats)
  float* masspart;        // [N*K, chunks] (block mass)
  TopList* tops;          // [N*(K+1), chunks] candidates of the emitted token (sampled rows)
  uint32_t* counter;      // [N] CTAs of the request done in the last launch (zeroed by decide)
  int64_t chunk, chunks;  // the split of target rows (stats, decide, mass, emit)
  int64_t qchunk, qchunks;  // the split of the draft row of qstats
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

// Merge `chunks` partials get(c) of one row in a fixed order (lane-strided, then the warp butterfly): the same
// order everywhere, so equal rows give bit-equal statistics. Every lane of a full warp gets the result.
template <typename T, typename Get>
DSPARK_DEVICE T warp_merge_chunks(int64_t chunks, T acc, Get&& get) {
  for (int64_t c = threadIdx.x & 31; c < chunks; c += 32) acc.merge(get(c));
  return warp_allreduce(acc);
}

// The chunk partials of up to R rows (row i when live[i]) merged by one full warp, each row in warp_merge_chunks'
// order, with every row's loads of a lane-strided step issued before any is merged (R rows, one round trip).
template <int R, typename T, typename Get>
DSPARK_DEVICE void warp_merge_rows(int64_t chunks, const bool (&live)[R], T (&acc)[R], Get&& get) {
  for (int64_t c = threadIdx.x & 31; c < chunks; c += 32) {
    T x[R];
#pragma unroll
    for (int i = 0; i < R; ++i) x[i] = live[i] ? get(i, c) : acc[i];
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (live[i]) acc[i].merge(x[i]);
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (live[i]) acc[i] = warp_allreduce(acc[i]);
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

DSPARK_DEVICE int leading_ones(unsigned b) { return ~b == 0u ? 32 : __ffs(static_cast<int>(~b)) - 1; }

// Visit elements [begin, end) of a target row `a` and a draft row `b` together: f(index, a[x], b[x]) as float32
// (b[x] = 0 when b is null). 16-byte vectors of both rows when they have one dtype and the same alignment (the
// common case), else 16-byte vectors of `a` and scalar loads of `b`.
template <typename TT, typename TD, typename F>
DSPARK_DEVICE void for_each_pair(const TT* a, const TD* b, int64_t begin, int64_t end, int t, int n, F&& f) {
  if (end <= begin) return;
  if constexpr (std::is_same<TT, TD>::value) {
    const uintptr_t aa = reinterpret_cast<uintptr_t>(a) + static_cast<uintptr_t>(begin) * sizeof(TT);
    const uintptr_t ba = reinterpret_cast<uintptr_t>(b) + static_cast<uintptr_t>(begin) * sizeof(TT);
    if (b != nullptr && aa % 16 == ba % 16 && aa % sizeof(TT) == 0) {
      constexpr int kN = Vec16<TT>::kN;
      int64_t head = aa % 16 == 0 ? 0 : static_cast<int64_t>((16 - aa % 16) / sizeof(TT));
      if (head > end - begin) head = end - begin;
      for (int64_t i = t; i < head; i += n) f(begin + i, to_float(ldg(a + begin + i)), to_float(ldg(b + begin + i)));
      const int64_t body = begin + head;
      const int64_t nvec = (end - body) / kN;
      for (int64_t i = t; i < nvec; i += n) {
        const Vec16<TT> va = load16(a + body + i * kN);
        const Vec16<TT> vb = load16(b + body + i * kN);
#pragma unroll
        for (int k = 0; k < kN; ++k) f(body + i * kN + k, to_float(va.v[k]), to_float(vb.v[k]));
      }
      const int64_t tail = body + nvec * kN;
      for (int64_t i = tail + t; i < end; i += n) f(i, to_float(ldg(a + i)), to_float(ldg(b + i)));
      return;
    }
  }
  for_each_element(a, begin, end, t, n,
                   [&](int64_t x, float v) { f(x, v, b != nullptr ? to_float(ldg(b + x)) : 0.f); });
}

// The exponential E_x = -log(uniform(r, row, RESIDUAL, x)) of token x, one Philox block per 4 tokens (cached).
struct ResidualExp {
  rng::Philox ph;
  uint64_t r, row, quad;
  rng::U32x4 bits;
  DSPARK_DEVICE float operator()(int64_t x) {
    const uint64_t q = static_cast<uint64_t>(x) >> 2;
    if (q != quad) {
      quad = q;
      bits = ph.block(r, row, rng::kStreamResidual, q);
    }
    const uint32_t k = static_cast<uint32_t>(x) & 3u;
    const uint32_t wk = k == 0 ? bits.x : (k == 1 ? bits.y : (k == 2 ? bits.z : bits.w));
    return -logf(rng::bits_to_uniform(wk));
  }
};
DSPARK_DEVICE ResidualExp residual_exp(const rng::Philox& ph, int64_t r, int64_t row) {
  return ResidualExp{ph, static_cast<uint64_t>(r), static_cast<uint64_t>(row), UINT64_MAX, rng::U32x4{0u, 0u, 0u, 0u}};
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

// True when no token of a chunk whose keys are all <= bound can reach the race score `win` of the best candidate.
// A token's residual score is w / E <= p / E = exp(key - m) / s (r = max(0, rho p - q) <= p); the margin covers the
// float rounding of the key, the probability and the score (ties and near-ties are not certified).
DSPARK_DEVICE bool chunk_certified(float bound, float win, const VStats& pt) {
  if (!(bound > neg_inf())) return win > 0.f;
  const float tol = 1e-3f + 1e-6f * (fabsf(bound) + fabsf(pt.st.m));
  const float cap = expf(bound - pt.st.m + tol) / pt.st.s * 1.0001f;
  return win > cap;
}

// The emitted token of a sampled request whose emitting row st.emit_row is known (all threads of the CTA call it):
// pt / pq are the softmax statistics of target / draft row emit_row. A full acceptance (or a row torch's softmax
// turns into NaN) takes the race over p: the best head of the row's candidate lists. Otherwise the residual race
// over max(0, rho p - q) is run over the row's candidates only (gathering their draft logits); its winner is
// certified when it beats every chunk's bound, and the residual mass is certified >= RESIDUAL_EPS when the
// candidates alone reach it. Anything not certified falls back to a joint pass over target and draft row emit_row:
// the chunks not certified, or the whole row when the mass is not certified. Writes the request's outputs.
template <typename TT, typename TD>
DSPARK_DEVICE void emit_sampled(const VerifyChainParams& p, const Workspace& w, int64_t r, const ReqState& st,
                                const VStats& pt, const VStats& pq) {
  DSPARK_SHARED(rng::Philox, s_ph);
  DSPARK_SHARED(int64_t, s_dq);
  DSPARK_SHARED(int32_t, s_flag);
  DSPARK_SHARED_ARRAY(Cand, s_cand, 32);
  DSPARK_SHARED_ARRAY(RaceMass, s_rm, 32);
  DSPARK_SHARED_ARRAY(OrFlag, s_or, 32);
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t j = st.emit_row;
  const bool full = (st.flags & kFull) != 0;
  const bool onehot = p.draft_logits == nullptr;
  if (tid == 0) {
    s_ph = rng::load_philox(p.rng_key);
    s_dq = !full && onehot ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + j) : int64_t(-1);
  }
  __syncthreads();
  const TopList* tops = w.tops + (r * (p.K + 1) + j) * w.chunks;
  Cand g = Cand::empty();
  for (int64_t c = tid; c < w.chunks; c += nt) g.merge(ldg(&tops[c].c[0]));
  g = block_allreduce(g, s_cand);
  const bool nan_row = pt.bad || !(pt.st.m > neg_inf()) ||
                       (!full && !onehot && (pq.bad || !(pq.st.m > neg_inf())));
  int64_t emitted = g.idx;
  if (!full && !nan_row) {
    const rng::Philox ph = s_ph;
    const int64_t dq = s_dq;
    const float t = st.t, rho = st.rho;
    const TD* drow = onehot ? nullptr : draft_row<TD>(p, r, j);
    auto score = [&](RaceMass& acc, int64_t x, float l, float e, float b) {
      const float q = onehot ? (x == dq ? 1.f : 0.f) : pq.prob(b / t);
      const float wgt = residual_weight(rho, pt.prob(l), q);
      acc.mass += wgt;
      acc.race.update(wgt / e, x);
    };
    RaceMass cand = RaceMass::empty();
    for (int64_t k = tid; k < w.chunks * kTopM; k += nt) {
      const int64_t c = k / kTopM;
      const Cand cd = ldg(&tops[c].c[k - c * kTopM]);
      if (cd.idx == INT64_MAX) continue;  // a chunk with fewer than kTopM tokens
      const float e = -logf(ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(j), rng::kStreamResidual,
                                       static_cast<uint64_t>(cd.idx)));
      score(cand, cd.idx, cd.lg, e, onehot ? 0.f : to_float(ldg(drow + cd.idx)));
    }
    cand = block_allreduce(cand, s_rm);
    // 1.001: the full row's float sum of non-negative terms cannot fall below the candidates' by that much.
    const bool mass_ok = cand.mass >= kResidualEps * 1.001f;
    OrFlag open{0};
    for (int64_t c = tid; c < w.chunks; c += nt) open.v |= !chunk_certified(ldg(&tops[c].bound), cand.race.value, pt);
    open = block_allreduce(open, s_or);
    RaceMass res = cand;
    if (!mass_ok || open.v) {  // the exact fallback: a joint pass over the chunks not certified (all: mass)
      const TT* trow = static_cast<const TT*>(p.target) + (st.start + j) * p.V;
      ResidualExp ex = residual_exp(ph, r, j);
      RaceMass fb = RaceMass::empty();
      for (int64_t c = 0; c < w.chunks; ++c) {
        if (mass_ok) {
          if (tid == 0) s_flag = !chunk_certified(ldg(&tops[c].bound), cand.race.value, pt);
          __syncthreads();
          const bool skip = s_flag == 0;
          __syncthreads();
          if (skip) continue;
        }
        const int64_t begin = c * w.chunk;
        const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
        for_each_pair(trow, drow, begin, end, tid, nt,
                      [&](int64_t x, float a, float b) { score(fb, x, a / t, ex(x), b); });
      }
      fb = block_allreduce(fb, s_rm);
      if (mass_ok) {
        res.race.merge(fb.race);  // candidates of certified chunks beat everything else there
      } else {
        res = fb;                 // the whole row
      }
    }
    if (res.mass >= kResidualEps) emitted = res.race.index;
  }
  if (tid < 32) {
    const int64_t d = tid < p.K ? load_int(p.draft_tokens, p.drafts_i64, r * p.K + tid) : int64_t(-1);
    write_outputs(p, r, st.n_acc, d, true, emitted);
  }
}

// ------------------------------------------------------------------------------------------------ 1. stats
// One thread's scan of the elements it visits of one (row, chunk), in increasing index order: the raw maximum (NaN
// ignored, as fmaxf does) and the lowest index holding it (ties inside a thread need no rule: a later equal value
// never replaces; a thread that saw only -inf / NaN takes the first index it visited), and, for sampled rows,
// s = sum exp((x - mx) / T) = sum 2^((x - mx) * c) with c = log2(e) / T: one subtraction, one multiply and one
// exp2 per element, exact for x = mx, and NaN once a NaN or a +inf enters (what makes the row bad). Per batch of
// elements the maximum comes first, so a new maximum rescales s once.
struct RowScan {
  float mx, s, c;
  uint32_t nan;  // a NaN seen while every element so far was -inf / NaN (the sum does not see those)
  int64_t amx;
  DSPARK_DEVICE void init(float t) {
    mx = neg_inf();
    s = 0.f;
    const float cc = 1.4426950408889634f / t;
    c = cc < 3.4e38f ? cc : 3.4e38f;  // a denormal T: differences still scale to -inf, and 0 * c stays 0
    nan = 0u;
    amx = INT64_MAX;
  }
  // Max and argmax of a batch x[kU][kN] (element (k, e) at index at + k * stride + e; vectors >= nv are -inf).
  // Returns the batch maximum.
  template <bool kSum, int kU, int kN>
  DSPARK_DEVICE float batch(const float (&x)[kU][kN], int64_t at, int64_t stride) {
    float bm = neg_inf();
#pragma unroll
    for (int k = 0; k < kU; ++k)
#pragma unroll
      for (int e = 0; e < kN; ++e) bm = fmaxf(bm, x[k][e]);
    if (bm > mx) {  // rare once a thread has seen a few vectors
      int64_t where = INT64_MAX;
#pragma unroll
      for (int k = kU - 1; k >= 0; --k)
#pragma unroll
        for (int e = kN - 1; e >= 0; --e)
          if (x[k][e] == bm) where = at + k * stride + e;
      if (kSum) s *= sum_exp2((mx - bm) * c);
      mx = bm;
      amx = where;
    }
    if (kSum) {
      if (mx > neg_inf()) {
#pragma unroll
        for (int k = 0; k < kU; ++k)
#pragma unroll
          for (int e = 0; e < kN; ++e) s += sum_exp2((x[k][e] - mx) * c);
      } else {
#pragma unroll
        for (int k = 0; k < kU; ++k)
#pragma unroll
          for (int e = 0; e < kN; ++e) nan |= x[k][e] != x[k][e] ? 1u : 0u;
      }
    }
    return bm;
  }
  // `first`: the first index the thread visited (first_visited).
  DSPARK_DEVICE ArgMax argmax(int64_t first) const {
    return mx > neg_inf() ? ArgMax{mx, amx} : ArgMax{neg_inf(), first};
  }
  // The softmax statistics of x / T: m = fl(mx / T) (the largest scaled logit, as torch computes it); s refers to
  // exp(mx / T), so it is scaled by exp(mx / T - m) (the division's exact remainder, through fmaf).
  DSPARK_DEVICE VStats stats(float t) const {
    VStats v = VStats::empty();
    if (!(mx > neg_inf())) {
      v.bad = nan;
      return v;
    }
    v.st.m = mx / t;
    const float rem = fmaf(-v.st.m, t, mx) / t;
    v.st.s = fabsf(rem) < 1e-3f ? fmaf(s, rem, s) : s;
    v.bad = (s != s || v.st.m == INFINITY) ? 1u : 0u;
    return v;
  }
};

// The scan of a row's chunk [begin, end) by this thread, batch by batch; on_batch(x, at, stride, nv, bm) sees each
// batch after the scan did (kU = 1, kN = 1 for the scalar head and tail).
template <bool kSum, typename T, typename F>
DSPARK_DEVICE void scan_chunk(const T* row, int64_t begin, int64_t end, RowScan& sc, F&& on_batch) {
  for_each_batch<kLoadsInFlight>(
      row, begin, end, threadIdx.x, blockDim.x,
      [&](const auto& x, int64_t at, int64_t stride, int nv) {
        on_batch(x, at, stride, nv, sc.template batch<kSum>(x, at, stride));
      },
      [&](int64_t i, float v) {
        const float x[1][1] = {{v}};
        on_batch(x, i, int64_t(1), 1, sc.template batch<kSum>(x, i, int64_t(1)));
      });
}

// The CTA's best kTopM candidates over its threads' lists, best first, into out->c (Cand::empty() where there are
// fewer), and into out->bound the best key of everything else: the candidates not written and the tokens the lists
// dropped. Each warp takes its own best kTopM by kTopM warp reductions (shuffles; the winning lane pops), then warp 0
// takes the CTA's from the warps' lists in `s_wtop` (kThreads / 32 * kTopM entries, two per lane): the same
// candidates as kTopM block reductions, which would cost 2 kTopM barriers and every warp reading every warp's partial.
DSPARK_DEVICE void emit_top(ThreadTop& top, Cand* s_wtop, Max* s_max, TopList* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int entries = (blockDim.x >> 5) * kTopM;
#pragma unroll 1
  for (int m = 0; m < kTopM; ++m) {
    const Cand mine = top.head();
    const Cand best = warp_allreduce(mine);
    if (best.idx != INT64_MAX && mine.idx == best.idx) top.pop();
    if (lane == 0) s_wtop[warp * kTopM + m] = best;
  }
  // every list's best left (the barriers inside also publish s_wtop to warp 0)
  const float rest = block_allreduce(Max{fmaxf(top.rest, top.head().key)}, s_max).v;
  if (warp != 0) return;
  static_assert(kThreads / 32 * kTopM <= 64, "emit_top: two warp-list entries per lane");
  Cand a = lane < entries ? s_wtop[lane] : Cand::empty();
  Cand b = lane + 32 < entries ? s_wtop[lane + 32] : Cand::empty();
  if (b.beats(a)) {
    const Cand c = a;
    a = b;
    b = c;
  }
#pragma unroll 1
  for (int m = 0; m < kTopM; ++m) {
    const Cand best = warp_allreduce(a);
    if (best.idx != INT64_MAX && a.idx == best.idx) {
      a = b;
      b = Cand::empty();
    }
    if (lane == 0) stg(&out->c[m], best);
  }
  const float left = warp_allreduce(Max{a.key}).v;  // the warps' candidates not written
  if (lane == 0) stg(&out->bound, fmaxf(rest, left));
}

// Persistent: the grid is the resident CTAs (or fewer when there are fewer work items), each walking the (row,
// chunk) items blockIdx.x, blockIdx.x + gridDim.x, ... Greedy rows: the chunk's raw argmax. Sampled rows: softmax
// stats of target / T (and of draft / T where whole draft rows are read) and the chunk's best kTopM tokens by the
// race key over p alone (E from the row's RESIDUAL uniforms) with a bound on every other token's key, for the
// emitted token if this row turns out to emit.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, kStatsCtasPerSm) stats_kernel(VerifyChainParams p, Workspace w,
                                                                         bool draft_stats) {
  DSPARK_SHARED(ReqInfo, s_info);
  DSPARK_SHARED(rng::Philox, s_ph);
  DSPARK_SHARED_ARRAY(ArgMax, s_amax, 32);
  DSPARK_SHARED_ARRAY(StatsPair, s_pair, 32);
  DSPARK_SHARED_ARRAY(Cand, s_wtop, kThreads / 32 * kTopM);  // each warp's best kTopM candidates (emit_top)
  DSPARK_SHARED_ARRAY(Max, s_max, 32);
  const int64_t kp1 = p.K + 1;
  const int64_t items = p.N * kp1 * w.chunks;
  int64_t info_r = -1;  // the request s_info holds
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t slot = item / w.chunks;
    const int64_t c = item - slot * w.chunks;
    const int64_t r = slot / kp1, j = slot - r * kp1;
    if (r != info_r) {  // the same for the whole CTA
      __syncthreads();
      if (threadIdx.x < 32) {
        const ReqInfo ri = request_info(p, r);
        if (threadIdx.x == 0) {
          s_info = ri;
          if (ri.sampled) s_ph = rng::load_philox(p.rng_key);
        }
      }
      __syncthreads();
      info_r = r;
    }
    const ReqInfo ri = s_info;
    if (j > ri.last || j > ri.length) continue;  // a row nobody reads: no bytes
    const int64_t begin = c * w.chunk;
    const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
    const TT* trow = target_row<TT>(p, ri, j);
    const float t = ri.t;
    RowScan sc;
    sc.init(t);
    if (!ri.sampled) {
      scan_chunk<false>(trow, begin, end, sc, [](const auto&, int64_t, int64_t, int, float) {});
      const ArgMax a = block_allreduce(sc.argmax(first_visited(trow, begin, end, threadIdx.x)), s_amax);
      if (threadIdx.x == 0) stg(w.amax + item, a);
      continue;
    }
    ThreadTop top;
    top.init(begin);
    scan_chunk<true>(trow, begin, end, sc, [&](const auto& x, int64_t at, int64_t stride, int nv, float bm) {
      // -log(E) <= -log(-log(1 - 2^-24)) < 16.7, so key <= l + 16.7: a token that far below the thread's 4th best
      // key cannot enter and needs neither its uniform nor the logs (most of a real row); the 4th best bounds it.
      // The batch maximum decides for the whole batch (x / T is monotone in x); else token by token.
      if (bm / t + kMaxGumbel < top.last()) {
        top.rest = fmaxf(top.rest, top.last());
        return;
      }
      constexpr int kU = static_cast<int>(sizeof(x) / sizeof(x[0]));
      constexpr int kN = static_cast<int>(sizeof(x[0]) / sizeof(float));
      // The tokens that pass against the 4th best key as it stands (a superset of those that enter), then token by
      // token in index order; a token's value is picked out of the batch by compile-time indices (a register array
      // indexed at run time would go to local memory).
      uint32_t open = 0u;
#pragma unroll
      for (int k = 0; k < kU; ++k)
#pragma unroll
        for (int e = 0; e < kN; ++e)
          if (k < nv && !(x[k][e] / t + kMaxGumbel < top.last())) open |= 1u << (k * kN + e);
      top.rest = fmaxf(top.rest, top.last());  // the tokens not open: below the 4th best key by the bound
      if (open == 0u) return;
      ResidualExp ex = residual_exp(s_ph, r, j);  // built here: no registers held across the sweep
      while (open != 0u) {
        const int q = __ffs(static_cast<int>(open)) - 1;
        open &= open - 1u;
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < kU; ++k)
#pragma unroll
          for (int e = 0; e < kN; ++e)
            if (q == k * kN + e) v = x[k][e];
        const float l = v / t;
        const int64_t i = at + (q / kN) * stride + q % kN;
        if (l + kMaxGumbel < top.last()) {
          top.rest = fmaxf(top.rest, top.last());
        } else {
          top.insert(nan_to_neg_inf(l - logf(ex(i))), l, i);
        }
      }
    });
    VStats dst = VStats::empty();
    if (draft_stats && j < ri.length) {
      RowScan sd;
      sd.init(t);
      scan_chunk<true>(draft_row<TD>(p, r, j), begin, end, sd, [](const auto&, int64_t, int64_t, int, float) {});
      dst = sd.stats(t);
    }
    const StatsPair part = block_allreduce(StatsPair{sc.stats(t), dst}, s_pair);
    TopList* out = w.tops + item;
    if (threadIdx.x == 0) {
      stg(w.tpart + item, part.t);
      if (draft_stats && j < ri.length) stg(w.dpart + item, part.d);
    }
    emit_top(top, s_wtop, s_max, out);
  }
}

// ------------------------------------------------------------------------------------------------ 2. decide
constexpr int kDecideWarps = kThreads / 32;
constexpr int kRowsPerWarp = (kMaxK + 1 + kDecideWarps - 1) / kDecideWarps;  // rows j, j + 8, j + 16 of warp j

// decide's merges of request r's row partials: row j by warp j % warps, every row of a warp in one round trip
// (warp_merge_rows), into s_amax[j] (greedy rows) or s_pair[j] (sampled: target / T, and draft / T for j < L when
// the stats pass read whole draft rows).
DSPARK_DEVICE void merge_rows(const VerifyChainParams& p, const Workspace& w, int64_t r, const ReqInfo& ri,
                              bool draft_stats, ArgMax* s_amax, StatsPair* s_pair) {
  constexpr int R = kRowsPerWarp;
  const int lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (int j0 = static_cast<int>(threadIdx.x >> 5); ri.last >= 0 && j0 <= ri.length; j0 += R * warps) {
    const int64_t base = (r * (p.K + 1) + j0) * w.chunks, row_step = warps * w.chunks;
    if (!ri.sampled) {
      bool live[R];
      ArgMax a[R];
#pragma unroll
      for (int i = 0; i < R; ++i) live[i] = j0 + i * warps <= ri.length, a[i] = ArgMax::empty();
      warp_merge_rows(w.chunks, live, a, [&](int i, int64_t c) { return ldg(w.amax + base + i * row_step + c); });
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (lane == 0 && live[i]) s_amax[j0 + i * warps] = a[i];
    } else {  // slots 0..R-1: target / T of the rows; R..2R-1: their draft / T
      bool live[2 * R];
      VStats st[2 * R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int j = j0 + i * warps;
        live[i] = j <= ri.length;
        live[R + i] = draft_stats && j < ri.length;
        st[i] = st[R + i] = VStats::empty();
      }
      warp_merge_rows(w.chunks, live, st, [&](int i, int64_t c) {
        return i < R ? ldg(w.tpart + base + i * row_step + c) : ldg(w.dpart + base + (i - R) * row_step + c);
      });
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (lane == 0 && live[i]) s_pair[j0 + i * warps] = StatsPair{st[i], st[R + i]};
    }
  }
}

// One CTA per request: its rows' chunk partials are merged in parallel (row j by warp j % warps, lane-strided over
// the chunks, then the warp butterfly: a fixed order); then warp 0 takes p(d_j), q(d_j); greedy / token acceptance,
// or block's rho_i (and tau when L <= 1); stop tokens; writes the outputs of every request it decides. Then the
// whole CTA emits the sampled token of a decided request (emit_sampled) unless `q_later` (token sampling with
// draft_logprobs: the draft row's statistics come from qstats) and the request rejected a draft.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, 1) decide_kernel(VerifyChainParams p, Workspace w, bool draft_stats,
                                                          bool q_later) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED(ReqInfo, s_info);
  DSPARK_SHARED_ARRAY(VStats, s_rs, 2);
  DSPARK_SHARED_ARRAY(ArgMax, s_amax, kMaxK + 1);
  DSPARK_SHARED_ARRAY(StatsPair, s_pair, kMaxK + 1);
  const int64_t r = blockIdx.x;
  const int64_t kp1 = p.K + 1;
  // Warp 0, before the merges: the request's info and drafts, and in sampled rows the raw target logit at d_j and
  // q's input (the draft logit at d_j, or its log-prob), so these loads overlap the merges' instead of following them.
  int64_t d = -1;
  float at_t = 0.f, at_q = 0.f;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    if (lane < p.K) d = load_int(p.draft_tokens, p.drafts_i64, r * p.K + lane);
    const ReqInfo ri = request_info(p, r);
    if (lane == 0) s_info = ri;
    if (ri.last >= 0 && ri.sampled && lane < ri.length) {
      const int64_t safe = in_vocab(d, p.V) ? d : 0;
      at_t = load_float(p.target, p.target_dtype, (ri.start + lane) * p.V + safe);
      if (p.draft_logprobs != nullptr)
        at_q = ldg(p.draft_logprobs + r * p.K + lane);
      else if (p.draft_logits != nullptr)
        at_q = load_float(p.draft_logits, p.draft_dtype, (r * p.K + lane) * p.V + safe);
    }
  }
  __syncthreads();
  merge_rows(p, w, r, s_info, draft_stats, s_amax, s_pair);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const ReqInfo ri = s_info;
    const int L = ri.length;
    ReqState st{};
    st.length = L;
    st.t = ri.t;
    st.rho = 1.f;
    st.start = ri.start;
    // Row j's merged statistics in lane j (j <= L <= K < 32).
    const bool has = ri.last >= 0 && lane <= L;
    const ArgMax amax = has && !ri.sampled ? s_amax[lane] : ArgMax::empty();
    const StatsPair mine = has && ri.sampled ? s_pair[lane] : StatsPair::empty();
    if (ri.last < 0) {  // no target rows: nothing accepted, nothing emitted
      write_outputs(p, r, 0, d, false, 0);
      st.flags = kDone;
    } else {
      st.flags = kHasRows | (ri.sampled ? kSampled : 0);
      if (ri.sampled && lane <= L) {
        stg(w.rowt + r * kp1 + lane, mine.t);
        if (draft_stats && lane < L) stg(w.rowd + r * kp1 + lane, mine.d);
      }
      const bool valid = in_vocab(d, p.V);
      int n_acc = 0;
      bool pending = false;
      if (!ri.sampled) {
        n_acc = leading_ones(__ballot_sync(kFullMask, lane < L && valid && d == amax.index));
      } else {
        const float t = ri.t;
        float p_d = 0.f, q_d = 0.f;
        if (lane < L) {
          p_d = mine.t.prob(at_t / t) * (valid ? 1.f : 0.f);
          if (p.draft_logprobs != nullptr) {
            q_d = expf(at_q);
          } else if (p.draft_logits != nullptr) {
            q_d = mine.d.prob(at_q / t);
          } else {
            q_d = valid ? 1.f : 0.f;
          }
        }
        const rng::Philox ph = warp_philox(p.rng_key);
        const float u =
            lane < L ? ph.uniform(static_cast<uint64_t>(r), static_cast<uint64_t>(lane), rng::kStreamAccept, 0) : 1.f;
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
          if (L >= 2) {  // S_1 .. S_{L-1} first (mass kernel)
            if (lane <= L) stg(w.rho + r * kp1 + lane, my_rho);
            st.flags |= kBlockPending;
            pending = true;
          } else {
            n_acc = block_tau(p, r, L, my_rho, 0.f, &st.rho);
          }
        }
      }
      if (!pending) {
        bool stopped = false;
        n_acc = stop_cut(p, n_acc, d, &stopped);
        st.n_acc = n_acc;
        if (!ri.sampled || stopped) {
          const int64_t emitted = __shfl_sync(kFullMask, static_cast<long long>(amax.index), n_acc);
          write_outputs(p, r, n_acc, d, !stopped, emitted);
          st.flags |= kDone;
        } else {
          st.emit_row = n_acc;
          if (n_acc >= L) st.flags |= kFull;
        }
      }
    }
    if (lane == 0) {
      stg(w.state + r, st);
      stg(w.counter + r, 0u);
      s_st = st;
    }
    if (!(st.flags & (kDone | kBlockPending)) && lane == st.emit_row) {
      s_rs[0] = mine.t;
      s_rs[1] = mine.d;
    }
  }
  __syncthreads();
  const ReqState st = s_st;
  if (st.flags & (kDone | kBlockPending)) return;
  if (q_later && !(st.flags & kFull)) return;
  emit_sampled<TT, TD>(p, w, r, st, s_rs[0], s_rs[1]);
}

// The "last CTA done" ticket: every CTA of request r's work in this launch calls it once (thread 0 after the CTA's
// partial is stored); true in the CTA that completes the request, which then sees every partial (ld_coherent).
DSPARK_DEVICE bool last_cta(uint32_t* counter, uint32_t total, int32_t* s_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *s_last = atomicAdd(counter, 1u) == total - 1u;
  }
  __syncthreads();
  const bool last = *s_last != 0;
  if (last) __threadfence();
  return last;
}

// ------------------------------------------------------------------------------------------------ 3. mass (block)
// (request, row 1..K-1, chunk): S_i = sum max(rho_i p_i - q_i, 0); the CTA finishing a request's last (row, chunk)
// takes tau, the stop cut and the emitted token.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, 1) mass_kernel(VerifyChainParams p, Workspace w) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED_ARRAY(float, s_scalars, 1);
  DSPARK_SHARED_ARRAY(VStats, s_stats, 2);
  DSPARK_SHARED(int64_t, s_dq);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(Sum, scratch, 32);
  const int64_t km1 = p.K - 1, kp1 = p.K + 1;
  const int64_t item = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - item * w.chunks;
  const int64_t r = item / km1, i = item - r * km1 + 1;  // row 1..K-1
  if (threadIdx.x == 0) {
    s_st = ldg(w.state + r);
    if ((s_st.flags & kBlockPending) && i < s_st.length) {
      s_scalars[0] = ldg(w.rho + r * kp1 + i);
      s_stats[0] = ldg(w.rowt + r * kp1 + i);
      s_stats[1] = p.draft_logits != nullptr ? ldg(w.rowd + r * kp1 + i) : VStats::empty();
      s_dq = p.draft_logits != nullptr ? int64_t(-1) : load_int(p.draft_tokens, p.drafts_i64, r * p.K + i);
    }
  }
  __syncthreads();
  ReqState st = s_st;
  if (!(st.flags & kBlockPending)) return;  // the same for every CTA of the request
  if (i < st.length) {
    const float rho = s_scalars[0], t = st.t;
    const VStats pt = s_stats[0], pq = s_stats[1];
    const bool onehot = p.draft_logits == nullptr;
    const int64_t dq = s_dq;
    const int64_t begin = c * w.chunk;
    const int64_t end = begin + w.chunk < p.V ? begin + w.chunk : p.V;
    const TT* trow = static_cast<const TT*>(p.target) + (st.start + i) * p.V;
    const TD* drow = onehot ? nullptr : draft_row<TD>(p, r, i);
    float mass = 0.f;
    for_each_pair(trow, drow, begin, end, threadIdx.x, blockDim.x, [&](int64_t x, float a, float b) {
      const float q = onehot ? (x == dq ? 1.f : 0.f) : pq.prob(b / t);
      mass += residual_weight(rho, pt.prob(a / t), q);
    });
    mass = block_allreduce(Sum{mass}, scratch).v;
    if (threadIdx.x == 0) stg(w.masspart + (r * p.K + i) * w.chunks + c, mass);
  }
  if (!last_cta(w.counter + r, static_cast<uint32_t>(km1 * w.chunks), &s_last)) return;
  if (threadIdx.x < 32) {  // tau
    const int lane = threadIdx.x;
    const int L = st.length, K = static_cast<int>(p.K);
    const float my_rho = lane <= L ? ldg(w.rho + r * kp1 + lane) : 0.f;
    float s = 0.f;
    if (lane >= 1 && lane < L)
      for (int64_t cc = 0; cc < w.chunks; ++cc) s += ld_coherent(w.masspart + (r * p.K + lane) * w.chunks + cc);
    float rho_tau = 1.f;
    int n_acc = block_tau(p, r, L, my_rho, s, &rho_tau);
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
      if (lane == 0) {
        s_stats[0] = ldg(w.rowt + r * kp1 + n_acc);
        s_stats[1] = n_acc < L && p.draft_logits != nullptr ? ldg(w.rowd + r * kp1 + n_acc) : VStats::empty();
      }
    }
    if (lane == 0) s_st = st;
  }
  __syncthreads();
  st = s_st;
  if (st.flags & kDone) return;
  emit_sampled<TT, TD>(p, w, r, st, s_stats[0], s_stats[1]);
}

// ------------------------------------------------------------------------------------------------ 4. qstats
// Token sampling with draft_logprobs: softmax statistics of the one draft row a rejecting request samples its
// correction from, over its own split of the vocabulary (N rows only, so chunks of its own); persistent like stats,
// walking (request, chunk) items. The CTA finishing a request's last chunk (atomic ticket) emits its token.
template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, kStatsCtasPerSm) qstats_kernel(VerifyChainParams p, Workspace w) {
  DSPARK_SHARED(ReqState, s_st);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(VStats, s_rs, 2);
  DSPARK_SHARED_ARRAY(VStats, scratch, 32);
  const int64_t items = p.N * w.qchunks;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t r = item / w.qchunks;
    const int64_t c = item - r * w.qchunks;
    __syncthreads();  // s_st of the previous item
    if (threadIdx.x == 0) s_st = ldg(w.state + r);
    __syncthreads();
    const ReqState st = s_st;
    if ((st.flags & (kDone | kFull)) || !(st.flags & kSampled)) continue;  // the same for every CTA of the request
    const int64_t begin = c * w.qchunk;
    const int64_t end = begin + w.qchunk < p.V ? begin + w.qchunk : p.V;
    RowScan sc;
    sc.init(st.t);
    scan_chunk<true>(draft_row<TD>(p, r, st.emit_row), begin, end, sc, [](const auto&, int64_t, int64_t, int, float) {});
    const VStats s = block_allreduce(sc.stats(st.t), scratch);
    if (threadIdx.x == 0) stg(w.qpart + item, s);
    if (!last_cta(w.counter + r, static_cast<uint32_t>(w.qchunks), &s_last)) continue;
    if (threadIdx.x < 32) {
      const VStats pq = warp_merge_chunks(w.qchunks, VStats::empty(),
                                          [&](int64_t cc) { return ld_coherent(w.qpart + r * w.qchunks + cc); });
      if (threadIdx.x == 0) {
        s_rs[0] = ldg(w.rowt + r * (p.K + 1) + st.emit_row);
        s_rs[1] = pq;
      }
    }
    __syncthreads();
    emit_sampled<TT, TD>(p, w, r, st, s_rs[0], s_rs[1]);
  }
}

// ------------------------------------------------------------------------------------------------ host side
struct Plan {
  SplitV split;   // target rows (stats): rows * chunks work items for the resident stats CTAs
  SplitV qsplit;  // the draft row of each request (qstats)
  int threads;    // per CTA of stats and mass
  int qthreads;   // per CTA of qstats
  size_t off[11];
  size_t total;
};

inline size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// The split of `rows` rows into chunks of at least min_chunk elements (and at most 2^30) that a persistent grid of
// the stats kernel's resident CTAs (at its design occupancy) sweeps fastest: the least per-CTA cost
// waves * (chunk + kItemCost) over 1 .. 4x the chunks that give about one item per resident CTA, ties to fewer
// chunks (fewer partials for decide to merge). For N = 1, K = 15 that is one wave of 16 x 16 items rather than two
// of 16 x 33: the same bytes per CTA within 4 %, half the items' fixed costs.
inline SplitV stats_split(int64_t V, int64_t rows, int64_t min_chunk) {
  const int64_t resident = static_cast<int64_t>(device_sm_count()) * kStatsCtasPerSm;
  if (rows < 1) rows = 1;
  const SplitV first = split_v(V, rows, resident, min_chunk);
  SplitV best = first;
  int64_t best_cost = INT64_MAX;
  for (int64_t want = 1; want <= 4 * first.chunks; ++want) {
    const SplitV s = split_v(V, 1, want, min_chunk);
    const int64_t waves = (rows * s.chunks + resident - 1) / resident;
    const int64_t cost = waves * (s.chunk + kItemCost);
    if (cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  const int64_t cap = int64_t(1) << 30;
  if (best.chunk > cap) best = SplitV{cap, (V + cap - 1) / cap};
  return best;
}

// Threads per CTA of a split-V kernel: enough 16-byte fp32 vectors for one pass over a chunk, 32..256.
inline int chunk_threads(int64_t chunk) {
  const int64_t vecs = (chunk + 3) / 4;
  return static_cast<int>(vecs >= kThreads ? kThreads : (vecs + 31) / 32 * 32);
}

inline Plan make_plan(int64_t N, int64_t K, int64_t V) {
  Plan pl;
  const int64_t rows = N * (K + 1);
  pl.split = stats_split(V, rows, kMinChunk);
  pl.qsplit = stats_split(V, N, kMinQChunk);
  pl.threads = chunk_threads(pl.split.chunk);
  pl.qthreads = chunk_threads(pl.qsplit.chunk);
  const size_t items = static_cast<size_t>(rows) * static_cast<size_t>(pl.split.chunks > 0 ? pl.split.chunks : 1);
  const size_t qitems = static_cast<size_t>(N) * static_cast<size_t>(pl.qsplit.chunks > 0 ? pl.qsplit.chunks : 1);
  const size_t ch = static_cast<size_t>(pl.split.chunks > 0 ? pl.split.chunks : 1);
  const size_t sizes[11] = {
      sizeof(ArgMax) * items,                                 // amax
      sizeof(VStats) * items,                                 // tpart
      sizeof(VStats) * items,                                 // dpart
      sizeof(VStats) * static_cast<size_t>(rows),             // rowt
      sizeof(VStats) * static_cast<size_t>(rows),             // rowd
      sizeof(float) * static_cast<size_t>(rows),              // rho
      sizeof(ReqState) * static_cast<size_t>(N),              // state
      sizeof(VStats) * qitems,                                // qpart
      sizeof(float) * static_cast<size_t>(N * K) * ch,        // masspart
      sizeof(TopList) * items,                                // tops
      sizeof(uint32_t) * static_cast<size_t>(N),              // counter
  };
  size_t o = 0;
  for (int i = 0; i < 11; ++i) {
    pl.off[i] = o;
    o += align_up(sizes[i]);
  }
  pl.total = o;
  return pl;
}

// A persistent grid: the CTAs of `kernel` resident at once at the design occupancy (the occupancy query, capped at
// kStatsCtasPerSm: what a GPU gives these kernels at their <= 128 registers, and what the SIMT harness, whose
// occupancy query knows registers only from a loaded SASS report, would otherwise exceed), or `items` when that is
// fewer; 0 when the occupancy query fails (the launcher then refuses the launch).
template <typename Kernel>
inline unsigned resident_grid(Kernel kernel, int threads, int64_t items) {
  const int per_sm = max_active_blocks_per_sm(kernel, threads, 0);
  const int64_t resident =
      static_cast<int64_t>(device_sm_count()) * (per_sm < kStatsCtasPerSm ? per_sm : kStatsCtasPerSm);
  const int64_t g = items < resident ? items : resident;
  return static_cast<unsigned>(g > 0 ? g : 0);
}

}  // namespace verify

// Workspace of a launch_verify_chain call with these shapes (device memory, no initialisation needed).
inline size_t verify_chain_workspace_bytes(int64_t N, int64_t K, int64_t V) {
  return verify::make_plan(N, K, V).total;
}

// Launch on `stream`; the caller has checked shapes and dtypes (K in [1, 16], V >= 1, N >= 0). Returns the first
// failing launch's status. Launches: stats, decide (greedy, and token sampling without draft_logprobs: 2), + qstats
// (token sampling with draft_logprobs: 3), + mass (block verification with K > 1: 3).
inline cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, cudaStream_t stream) {
  using namespace verify;
  if (p.N <= 0) return cudaSuccess;
  if (p.K < 1 || p.K > kMaxK || p.V < 1) return cudaErrorInvalidValue;
  const Plan pl = make_plan(p.N, p.K, p.V);
  char* base = static_cast<char*>(workspace);
  Workspace w;
  w.amax = reinterpret_cast<ArgMax*>(base + pl.off[0]);
  w.tpart = reinterpret_cast<VStats*>(base + pl.off[1]);
  w.dpart = reinterpret_cast<VStats*>(base + pl.off[2]);
  w.rowt = reinterpret_cast<VStats*>(base + pl.off[3]);
  w.rowd = reinterpret_cast<VStats*>(base + pl.off[4]);
  w.rho = reinterpret_cast<float*>(base + pl.off[5]);
  w.state = reinterpret_cast<ReqState*>(base + pl.off[6]);
  w.qpart = reinterpret_cast<VStats*>(base + pl.off[7]);
  w.masspart = reinterpret_cast<float*>(base + pl.off[8]);
  w.tops = reinterpret_cast<TopList*>(base + pl.off[9]);
  w.counter = reinterpret_cast<uint32_t*>(base + pl.off[10]);
  w.chunk = pl.split.chunk;
  w.chunks = pl.split.chunks;
  w.qchunk = pl.qsplit.chunk;
  w.qchunks = pl.qsplit.chunks;

  const bool sampling = p.temperature != nullptr;
  const bool has_logits = p.draft_logits != nullptr;
  const bool draft_stats = sampling && has_logits && (p.draft_logprobs == nullptr || p.block_method);
  const bool qstats = sampling && has_logits && !p.block_method && p.draft_logprobs != nullptr;
  const int64_t rows = p.N * (p.K + 1);
  LaunchConfig big, per_req;
  big.block = dim3(static_cast<unsigned>(pl.threads));
  big.stream = stream;
  per_req.grid = dim3(static_cast<unsigned>(p.N));
  per_req.block = dim3(kThreads);
  per_req.stream = stream;
  cudaError_t err = cudaSuccess;
#define DSPARK_VC_TRY(expr)         \
  do {                              \
    err = (expr);                   \
    if (err != cudaSuccess) return err; \
  } while (0)
  DSPARK_DISPATCH_FLOAT(p.target_dtype, TT, return cudaErrorInvalidValue,
    DSPARK_DISPATCH_FLOAT(p.draft_dtype, TD, return cudaErrorInvalidValue,
      LaunchConfig st = big;
      st.grid = dim3(resident_grid(stats_kernel<TT, TD>, pl.threads, rows * w.chunks));
      if (st.grid.x == 0) return cudaErrorInvalidConfiguration;
      DSPARK_VC_TRY(launch("verify_chain_stats", stats_kernel<TT, TD>, st, p, w, draft_stats));
      DSPARK_VC_TRY(launch("verify_chain_decide", decide_kernel<TT, TD>, per_req, p, w, draft_stats, qstats));
      if (sampling && p.block_method && p.K > 1) {
        LaunchConfig m = big;
        m.grid = dim3(static_cast<unsigned>(p.N * (p.K - 1) * w.chunks));
        DSPARK_VC_TRY(launch("verify_chain_mass", mass_kernel<TT, TD>, m, p, w));
      }
      if (qstats) {
        LaunchConfig q = big;
        q.block = dim3(static_cast<unsigned>(pl.qthreads));
        q.grid = dim3(resident_grid(qstats_kernel<TT, TD>, pl.qthreads, p.N * w.qchunks));
        if (q.grid.x == 0) return cudaErrorInvalidConfiguration;
        DSPARK_VC_TRY(launch("verify_chain_qstats", qstats_kernel<TT, TD>, q, p, w));
      }
    )
  )
#undef DSPARK_VC_TRY
  return err;
}

}  // namespace dspark
