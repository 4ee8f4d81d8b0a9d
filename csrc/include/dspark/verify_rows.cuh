// dspark/verify_rows.cuh: the row passes of chain verification (no torch), shared by verify_chain and the
// vocabulary-parallel pieces (dist_verify_*).
//
// Pass A reads a chunk of a row once: its raw argmax (greedy rows) or the softmax statistics of x / T (RowScan:
// max, sum of exp, NaN / +inf seen), with kLoadsInFlight 16-byte loads in flight per thread. Pass B reads a chunk of
// the one row a request samples from (sample_chunk): the exponential race over the residual max(0, rho p - q)
// (uniforms uniform(request, row, RESIDUAL, token), keyed by token, so the split does not matter), its mass, and the
// Gumbel race over p with the same uniforms; the mass pass of block verification is the same sweep without the
// races. q comes from a draft row in its own layout (QSource: dense [V], reduced [Vd] through the target -> draft
// column table, top-k [k] through a per-CTA filter of its candidates) or is one-hot at the draft. A thread computes
// a token's uniform only where the race could still take it: the Gumbel key is at most l + 16.7, the residual's
// score at most w / 5.96e-8.
// A "last CTA" ticket merges the CTAs' partials of a request in a fixed order; the last CTA resets its ticket, so a
// ticket buffer zeroed once serves every later launch (in stream order).
#pragma once

#include <math.h>
#include <stdint.h>

#include "utils.cuh"
#include "verify_chain.h"  // verify::kMaxTopK

namespace dspark {
namespace verify {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;      // independent 16-byte loads per thread per step of a row sweep
constexpr float kResidualEps = 1e-6f;  // reference.verify_chain.RESIDUAL_EPS
constexpr float kMaxGumbel = 16.7f;    // > -log(-log(u)) for every uniform u <= 1 - 2^-24 the generator gives
constexpr float kMaxInvExp = 1.7e7f;   // > 1 / -log(u) for every such u (1 / 5.96e-8)
constexpr int kFilterWords = 2048;     // the top-k filter: one bit per token id modulo 65536

// Softmax statistics of scaled logits plus a flag for the rows torch's softmax turns into NaN everywhere (a NaN or
// +inf scaled logit). Also the normaliser of a draft row whose log-probability gave it: {c, 1, 0}.
struct alignas(16) VStats {
  SoftmaxStats st;
  uint32_t bad;
  uint32_t pad;
  DSPARK_HOST_DEVICE_FN static VStats empty() { return VStats{SoftmaxStats::empty(), 0u, 0u}; }
  DSPARK_HOST_DEVICE_FN static VStats implied(float c) { return VStats{SoftmaxStats{c, 1.f}, 0u, 0u}; }
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

// ------------------------------------------------------------------------------------------------ pass A
// One thread's scan of the elements it visits of one (row, chunk), in increasing index order: the raw maximum (NaN
// ignored, as fmaxf does) and the lowest index holding it (a thread that saw only -inf / NaN takes the first index
// it visited), and, for sampled rows, s = sum exp((x - mx) / T) = sum 2^((x - mx) * c) with c = log2(e) / T, NaN
// once a NaN or a +inf enters (what makes the row bad). Per batch of elements the maximum comes first, so a new
// maximum rescales s once.
struct RowScan {
  float mx, s, c;
  uint32_t nan;  // a NaN seen while every element so far was -inf / NaN (the sum does not see those)
  int64_t amx;
  int64_t first;  // the first index the thread visited (INT64_MAX: none)
  DSPARK_DEVICE void init(float t) {
    mx = neg_inf();
    s = 0.f;
    const float cc = 1.4426950408889634f / t;
    c = cc < 3.4e38f ? cc : 3.4e38f;  // a denormal T: differences still scale to -inf, and 0 * c stays 0
    nan = 0u;
    amx = INT64_MAX;
    first = INT64_MAX;
  }
  // Max and argmax of a batch x[kU][kN] (element (k, e) at index at + k * stride + e), of which the first `valid`
  // vectors are the row's (those past its end are -inf: the sum leaves them out, as at T = inf their term
  // (-inf - mx) * 0 is NaN).
  template <bool kSum, int kU, int kN>
  DSPARK_DEVICE void batch(const float (&x)[kU][kN], int64_t at, int64_t stride, int valid = kU) {
    if (first == INT64_MAX) first = at;
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
      if (kSum) s = mx > neg_inf() ? s * sum_exp2((mx - bm) * c) : 0.f;  // s is 0 until a finite maximum
      mx = bm;
      amx = where;
    }
    if (kSum) {
      if (mx > neg_inf()) {
#pragma unroll
        for (int k = 0; k < kU; ++k) {
          const float ck = k < valid ? c : 1.f;  // past the end: (-inf - mx) * 1, a term of 0
#pragma unroll
          for (int e = 0; e < kN; ++e) s += sum_exp2((x[k][e] - mx) * ck);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kU; ++k)
#pragma unroll
          for (int e = 0; e < kN; ++e) nan |= x[k][e] != x[k][e] ? 1u : 0u;
      }
    }
  }
  DSPARK_DEVICE ArgMax argmax() const { return mx > neg_inf() ? ArgMax{mx, amx} : ArgMax{neg_inf(), first}; }
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
    v.bad = (nan != 0u || s != s || v.st.m == INFINITY) ? 1u : 0u;
    return v;
  }
};

// This thread's scan of elements [begin, end) of `row` (all threads of the CTA take part).
// The body starts at a 32-byte boundary, so that each warp's 16-byte loads cover whole sectors.
template <bool kSum, typename T>
DSPARK_DEVICE void scan_chunk(const T* row, int64_t begin, int64_t end, RowScan& sc) {
  for_each_batch<kLoadsInFlight, 32>(
      row, begin, end, threadIdx.x, blockDim.x,
      [&](const auto& x, int64_t at, int64_t stride, int valid) { sc.template batch<kSum>(x, at, stride, valid); },
      [&](int64_t i, float v) {
        const float x[1][1] = {{v}};
        sc.template batch<kSum>(x, i, int64_t(1));
      });
}

// The CTA's argmax of the raw values [begin, end) of `row` (NaN as -inf, ties to the lowest index; an all -inf /
// NaN chunk gives its first index). `scratch`: shared ArgMax[32].
template <typename T>
DSPARK_DEVICE ArgMax chunk_argmax(const T* row, int64_t begin, int64_t end, ArgMax* scratch) {
  RowScan sc;
  sc.init(1.f);
  scan_chunk<false>(row, begin, end, sc);
  return block_allreduce(sc.argmax(), scratch);
}

// The CTA's softmax statistics of [begin, end) of `row` / t. `scratch`: shared VStats[32].
template <typename T>
DSPARK_DEVICE VStats chunk_stats(const T* row, int64_t begin, int64_t end, float t, VStats* scratch) {
  RowScan sc;
  sc.init(t);
  scan_chunk<true>(row, begin, end, sc);
  return block_allreduce(sc.stats(t), scratch);
}

// ------------------------------------------------------------------------------------------------ tickets
// The "last CTA done" ticket: every CTA of a request's work in this launch calls it once, after its partials are
// stored; true in the CTA that completes the request, which then sees every partial (ld_coherent) and leaves the
// ticket at 0 for the next launch. `total` must be the same in every CTA of the request.
DSPARK_DEVICE bool last_cta(uint32_t* ticket, uint32_t total, int32_t* s_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(ticket, 1u) == total - 1u;
    if (last) atomicExch(ticket, 0u);
    *s_last = last ? 1 : 0;
  }
  __syncthreads();
  const bool last = *s_last != 0;
  if (last) __threadfence();
  return last;
}

// A 16-byte partial (VStats, ArgMax) stored by one CTA and read by the request's last CTA (after its ticket): one
// 16-byte access each way; the read goes to L2 (not the read-only path), where the writer's fence put it.
template <typename T>
DSPARK_DEVICE void st_part(T* p, const T& v) {
  static_assert(sizeof(T) == 16, "a partial is one 16-byte word");
  uint4 raw;
  memcpy(&raw, &v, 16);
  stg(reinterpret_cast<uint4*>(p), raw);
}
template <typename T>
DSPARK_DEVICE T ld_part(const T* p) {
  static_assert(sizeof(T) == 16, "a partial is one 16-byte word");
#if defined(DSPARK_SIMT)
  const uint4 raw = ld_coherent(reinterpret_cast<const uint4*>(p));
#else
  const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p));
#endif
  T v;
  memcpy(&v, &raw, 16);
  return v;
}

// ------------------------------------------------------------------------------------------------ pass B
// The residual weight max(0, rho p - q) (NaN stays NaN, as torch.clamp keeps it).
DSPARK_HOST_DEVICE_FN float residual_weight(float rho, float p, float q) {
  const float w = rho * p - q;
  return w < 0.f ? 0.f : w;
}

// A (row, chunk)'s part of pass B: the residual race (score w / E), its mass, and the Gumbel race over p (key
// l - log E), E = -log(uniform(request, row, RESIDUAL, token)).
struct SamplePart {
  ArgMax res;
  ArgMax gum;
  float mass;
  uint32_t pad;
  DSPARK_HOST_DEVICE_FN static SamplePart empty() { return SamplePart{ArgMax::empty(), ArgMax::empty(), 0.f, 0u}; }
  DSPARK_HOST_DEVICE_FN void merge(const SamplePart& o) {
    res.merge(o.res);
    gum.merge(o.gum);
    mass += o.mass;
  }
};

// Where q of a target row comes from.
enum class QKind : int32_t { kNone = 0, kOneHot = 1, kDense = 2, kReduced = 3, kTopK = 4 };

// The draft side of a (row, chunk) sweep: q(x) = norm.prob(draft[col(x)] / t) at the column col(x) of target id x
// (x itself, target_to_draft[x], or the top-k column naming x), 0 where there is none; one-hot: q(x) = [x == hot].
struct QSource {
  QKind kind = QKind::kNone;
  const void* row = nullptr;          // the draft row's W columns
  int64_t width = 0;                  // W
  const int32_t* inv = nullptr;       // kReduced: target_to_draft [V]
  const uint32_t* filter = nullptr;   // kTopK: shared bits of the row's candidate ids (modulo 65536)
  const int32_t* ids = nullptr;       // kTopK: shared ids of the row's columns (-1: outside [0, V))
  int64_t hot = -1;                   // kOneHot: the draft (-1: none)
  VStats norm;
  float t = 1.f;
};

// Uniforms of one (request, row) by token, one Philox block per 4 tokens (the last block kept).
struct Uniforms {
  rng::Philox ph;
  uint64_t r, row, quad;
  rng::U32x4 bits;
  DSPARK_DEVICE void init(const rng::Philox& p, int64_t request, int64_t position) {
    ph = p;
    r = static_cast<uint64_t>(request);
    row = static_cast<uint64_t>(position);
    quad = UINT64_MAX;
  }
  // E = -log(u) of token x.
  DSPARK_DEVICE float exp1(int64_t x) {
    const uint64_t q = static_cast<uint64_t>(x) >> 2;
    if (q != quad) {
      quad = q;
      bits = ph.block(r, row, rng::kStreamResidual, q);
    }
    const uint32_t k = static_cast<uint32_t>(x) & 3u;
    const uint32_t w = k == 0 ? bits.x : (k == 1 ? bits.y : (k == 2 ? bits.z : bits.w));
    return -logf(rng::bits_to_uniform(w));
  }
};

// What a (row, chunk) sweep of pass B needs besides the rows.
struct SampleRow {
  float t = 1.f, rho = 1.f;
  VStats pt;          // the target row's statistics (p = pt.prob(x / t))
  bool full = false;  // only the race over p (a full acceptance): no q, no residual
};

template <typename TD>
DSPARK_DEVICE float q_at_column(const QSource& qs, int64_t col) {
  return qs.norm.prob(to_float(ldg(static_cast<const TD*>(qs.row) + col)) / qs.t);
}

// The top-k column naming id x (the last one), -1 for none (a filter hit without a match: another id modulo 65536).
DSPARK_DEVICE int64_t topk_column(const QSource& qs, int64_t x) {
  for (int64_t c = qs.width - 1; c >= 0; --c)
    if (qs.ids[c] == x) return c;
  return -1;
}

// kS elements at p as one access of kS * sizeof(T) = 4, 8 or 16 bytes (p aligned to it).
template <typename T, int kS>
DSPARK_DEVICE void load_elems(const T* p, T (&out)[kS]) {
  constexpr int kBytes = static_cast<int>(kS * sizeof(T));
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "one 4-, 8- or 16-byte access");
  using Word = typename std::conditional<kBytes == 16, uint4,
                                         typename std::conditional<kBytes == 8, uint2, uint32_t>::type>::type;
  const Word raw = ldg(reinterpret_cast<const Word*>(p));
  memcpy(out, &raw, kBytes);
}

// kS elements at p: one access where they make 4, 8 or 16 bytes (the vector path of a sweep), else one access per
// element.
template <typename T, int kS>
DSPARK_DEVICE void load_span(const T* p, T (&out)[kS]) {
  constexpr size_t kBytes = kS * sizeof(T);
  if constexpr (kS > 1 && (kBytes == 4 || kBytes == 8 || kBytes == 16)) {
    load_elems<T, kS>(p, out);
  } else {
#pragma unroll
    for (int e = 0; e < kS; ++e) out[e] = ldg(p + e);
  }
}

// q at target ids x0 .. x0 + kS - 1 (kS = 1: one element).
template <typename TD, int kS>
DSPARK_DEVICE void q_span(const QSource& qs, int64_t x0, float (&q)[kS]) {
  switch (qs.kind) {
    case QKind::kOneHot:
#pragma unroll
      for (int e = 0; e < kS; ++e) q[e] = x0 + e == qs.hot ? 1.f : 0.f;
      return;
    case QKind::kDense: {
      TD v[kS];
      load_span<TD, kS>(static_cast<const TD*>(qs.row) + x0, v);
#pragma unroll
      for (int e = 0; e < kS; ++e) q[e] = qs.norm.prob(to_float(v[e]) / qs.t);
      return;
    }
    case QKind::kReduced: {
      int32_t col[kS];
      load_span<int32_t, kS>(qs.inv + x0, col);
#pragma unroll
      for (int e = 0; e < kS; ++e) q[e] = col[e] >= 0 && col[e] < qs.width ? q_at_column<TD>(qs, col[e]) : 0.f;
      return;
    }
    case QKind::kTopK: {
      const uint32_t h = static_cast<uint32_t>(x0) & (kFilterWords * 32u - 1u);
      const uint32_t w0 = qs.filter[h >> 5], w1 = qs.filter[((h >> 5) + 1u) & (kFilterWords - 1u)];
      const uint64_t win = ((static_cast<uint64_t>(w1) << 32) | w0) >> (h & 31u);
#pragma unroll
      for (int e = 0; e < kS; ++e) {
        q[e] = 0.f;
        if ((win >> e) & 1u) {  // rare: k ids in a row of V
          const int64_t c = topk_column(qs, x0 + e);
          if (c >= 0) q[e] = q_at_column<TD>(qs, c);
        }
      }
      return;
    }
    default:
#pragma unroll
      for (int e = 0; e < kS; ++e) q[e] = 0.f;
  }
}

// The top-k filter and ids of a draft row's candidates `cands` (k = qs->width columns) in shared memory (all
// threads call it; ends with a barrier).
DSPARK_DEVICE void build_topk_filter(const void* cands, bool i64, int64_t vocab, uint32_t* filter, int32_t* ids,
                                     QSource* qs) {
  for (int w = threadIdx.x; w < kFilterWords; w += blockDim.x) filter[w] = 0u;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < qs->width; c += blockDim.x) {
    const int64_t id = load_int(cands, i64, c);
    const bool valid = id >= 0 && id < vocab;
    ids[c] = valid ? static_cast<int32_t>(id) : -1;
    if (valid) {
      const uint32_t h = static_cast<uint32_t>(id) & (kFilterWords * 32u - 1u);
      atomicOr(filter + (h >> 5), 1u << (h & 31u));
    }
  }
  __syncthreads();
  qs->filter = filter;
  qs->ids = ids;
}

// One thread's pass-B state over the elements it visits; kRace: the races (else the residual mass only). Token ids
// are id0 + the element's index (a vocabulary shard's first id). A weight of 0 scores 0 whatever its uniform.
template <bool kRace>
struct SampleScan {
  SamplePart part;
  Uniforms uni;
  int64_t id0 = 0;
  DSPARK_DEVICE void visit(const SampleRow& sr, int64_t x, float a, float q) {
    const float l = a / sr.t;
    const int64_t id = id0 + x;
    if (kRace && !(l + kMaxGumbel < part.gum.value)) part.gum.update(l - logf(uni.exp1(id)), id);
    if (sr.full) return;
    const float w = residual_weight(sr.rho, sr.pt.prob(l), q);
    part.mass += w;
    if (kRace && !(w * kMaxInvExp < part.res.value)) part.res.update(w > 0.f ? w / uni.exp1(id) : w, id);
  }
};

// The vector path of a pass-B sweep: steps of kS elements from `body` (32-byte aligned in the target row; the q row
// read beside it aligned to its step), two steps in flight per thread, step i to thread i % nthreads.
template <bool kRace, int kS, typename TT, typename TD>
DSPARK_DEVICE void sample_steps(const TT* trow, int64_t body, int64_t steps, const SampleRow& sr, const QSource& qs,
                                SampleScan<kRace>& sc) {
  constexpr int kU = 2;
  const int t = threadIdx.x, n = blockDim.x;
  for (int64_t i = t; i < steps; i += static_cast<int64_t>(kU) * n) {
    TT v[kU][kS];
    float q[kU][kS];
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t si = i + static_cast<int64_t>(k) * n;
      if (si < steps) load_span<TT, kS>(trow + body + si * kS, v[k]);
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t si = i + static_cast<int64_t>(k) * n;
      if (si < steps && !sr.full) q_span<TD, kS>(qs, body + si * kS, q[k]);
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t si = i + static_cast<int64_t>(k) * n;
      if (si >= steps) continue;
#pragma unroll
      for (int e = 0; e < kS; ++e) sc.visit(sr, body + si * kS + e, to_float(v[k][e]), sr.full ? 0.f : q[k][e]);
    }
  }
}

// Elements [begin, end) one at a time, element x to thread (x - begin) % nthreads (each warp's loads contiguous).
template <bool kRace, typename TT, typename TD>
DSPARK_DEVICE void sample_elements(const TT* trow, int64_t begin, int64_t end, const SampleRow& sr,
                                   const QSource& qs, SampleScan<kRace>& sc) {
  for (int64_t x = begin + threadIdx.x; x < end; x += blockDim.x) {
    float q[1] = {0.f};
    if (!sr.full) q_span<TD, 1>(qs, x, q);
    sc.visit(sr, x, to_float(ldg(trow + x)), q[0]);
  }
}

// A sweep whose q row (QBytes a q element, 0: none read beside the target) steps with the target row: 16 bytes of
// the wider of the two a step. The vector path where the q row's steps line up with the target row's 32-byte body;
// else element by element (rows whose 16-byte grids differ: V x element size not a multiple of 16).
template <bool kRace, int QBytes, typename TT, typename TD>
DSPARK_DEVICE void sample_aligned(const TT* trow, int64_t begin, int64_t end, const SampleRow& sr, const QSource& qs,
                                  SampleScan<kRace>& sc) {
  constexpr int kS = static_cast<int>(16 / (sizeof(TT) > QBytes ? sizeof(TT) : QBytes));
  const int64_t head = scalar_head<TT, 32>(trow, begin, end), body = begin + head;
  if constexpr (QBytes > 0) {
    const uintptr_t q0 = qs.kind == QKind::kDense ? reinterpret_cast<uintptr_t>(qs.row) + body * QBytes
                                                   : reinterpret_cast<uintptr_t>(qs.inv) + body * QBytes;
    if (q0 % (kS * QBytes) != 0 || (reinterpret_cast<uintptr_t>(trow + body) % sizeof(TT)) != 0) {
      sample_elements<kRace, TT, TD>(trow, begin, end, sr, qs, sc);
      return;
    }
  }
  sample_elements<kRace, TT, TD>(trow, begin, body, sr, qs, sc);
  const int64_t steps = (end - body) / kS;
  sample_steps<kRace, kS, TT, TD>(trow, body, steps, sr, qs, sc);
  sample_elements<kRace, TT, TD>(trow, body + steps * kS, end, sr, qs, sc);
}

// This thread's pass-B sweep of target elements [begin, end) of `trow` (all threads of the CTA take part), q from
// `qs` (unused when sr.full).
template <bool kRace, typename TT, typename TD>
DSPARK_DEVICE void sample_chunk(const TT* trow, int64_t begin, int64_t end, const SampleRow& sr, const QSource& qs,
                                SampleScan<kRace>& sc) {
  if (end <= begin) return;
  if (!sr.full && qs.kind == QKind::kDense) {
    sample_aligned<kRace, static_cast<int>(sizeof(TD)), TT, TD>(trow, begin, end, sr, qs, sc);
  } else if (!sr.full && qs.kind == QKind::kReduced) {
    sample_aligned<kRace, 4, TT, TD>(trow, begin, end, sr, qs, sc);
  } else {
    sample_aligned<kRace, 0, TT, TD>(trow, begin, end, sr, qs, sc);
  }
}

}  // namespace verify
}  // namespace dspark
