// dspark/schedule_verify_lens.cuh: the confidence scheduler on the device, one CTA, one launch, no host sync
// (no torch). Meaning: dspark_kernels/reference/schedule_verify_lens.py (the spec).
//
// Every phase gives each thread 4 elements of a tile of 4 x threads (32 threads up to 128 elements N*K, 128 up to
// 512, 512 up to 2048: the decode batches, one tile, everything in registers and shared memory; larger batches loop
// over tiles of 2048 with their arrays in the workspace, L2-resident; 512 threads leave each 128 registers):
//   1. load + clean: each warp reads 32 consecutive elements of the flat [N, K] survival per load (4 in flight),
//      cleans them (NaN -> 0, clamp to [0, 1], -0 -> +0) and takes the running minimum along K as a segmented
//      scan (shuffles, one barrier for the warps' totals); from conf_logits the survival is the segmented product
//      of sigmoid(z / T) in float64, rounded once. Candidates (r, j), min_len <= j < max_len, get the key
//      0x3F800000 - bits(a) (ascending key = descending survival: non-negative float32 bits order like their
//      values), the others 0xFFFFFFFF (after every candidate); the survivals of j < min_len are summed exactly.
//      Inactive requests (the `active` mask) hold no candidate and add nothing: the curve below counts the n'
//      active requests only (their number: one more barrier, with the mask);
//   2. sort: a bitonic network over the tile's keys, strides below 4 inside a thread, up to 64 by shuffles,
//      larger ones through shared memory (one barrier each: log2(tile / 128) (log2(tile / 128) + 1) / 2 of them;
//      10 at N = 256, K = 7). Only the sorted values matter (ties are equal values); the flat tie order comes
//      back in step 5. Larger batches merge tiles with passes over the workspace;
//   3. the curve, 4 consecutive admissions a thread: the reference's float64 tau_m = fl(fl(n' + fl(sum of
//      j < min_len)) + C_m), C_m its sequential cumsum of the sorted survivals. The prefix sums are taken EXACTLY
//      (one block scan) in a two-word fixed point (each float32 split into 2^-H and 2^-(H+L) parts,
//      H = L = 62 - log2(n(K+1))); while every exact prefix is a float64 the sequential sums never rounded and C_m
//      is that prefix; from the first prefix that is not (tiny survivals far below the running sum: rare) one
//      thread continues the sequential float64 sum, so C_m is the reference's cumsum bit for bit. Theta_m =
//      tau_m * SPS(B_m), the cost table interpolated with the reference's float64 operations in its order (no FMA
//      contraction; 1000 / x as reciprocal(x) * 1000); each warp finds its segment once (every lane reading the
//      same entries) and each thread walks from there;
//   4. m*: exact = the first admission that does not strictly raise Theta; argmax = the first maximum (on the
//      budget survival's own curve, computed first with the same code, when given; clamped to M), then the
//      min_gain fall-back to "verify everything": one block reduction of each thread's candidates;
//   5. admitted = candidates whose key precedes the m*-th key: all with a > v* plus the first (m* - #{a > v*})
//      candidates with a == v* in flat order: one block scan of the (a > v*, a == v*) counts in flat order gives,
//      at each row's last candidate, the admissions up to it; then L_r and cu_seqlens per request (with the
//      mask, one block scan per block of requests counts the active requests before each).
// Barriers at N = 256, K = 7 (512 threads): 1 + 10 + 1 + 1 + 2. Float inputs are fp32 / bf16 / fp16
// (dspark::DType, per array). Outputs: verify_lens int32 [N], cu_seqlens int32 [N+1], theta float32 [].
//
// Defines what dspark/schedule_verify_lens.h declares: a library includes this header in one translation unit
// (csrc/kernels/schedule_verify_lens.cu, csrc/capi/dspark_capi.cu).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_scan.cuh"
#include "schedule_verify_lens.h"
#include "utils.cuh"

namespace dspark {

namespace sched {
constexpr int kItems = 4;                          // elements per thread in every phase
constexpr int kMaxThreads = 512;
constexpr int kMaskedTileThreads = 256;        // several tiles with the active mask: 255 registers, no spills
constexpr int64_t kMaxTile = int64_t(kItems) * kMaxThreads;
constexpr int kTableSmem = 256;                    // cost-table points cached in shared memory
constexpr uint32_t kOneBits = 0x3F800000u;         // bits of 1.0f: key = kOneBits - bits(a)
constexpr uint32_t kPadKey = 0xFFFFFFFFu;          // not a candidate: sorts after every candidate

// One survival the launch schedules on: the step's own, or the budget's (argmax).
struct Curve {
  const void* x;
  DType dtype;
  bool from_conf;           // x holds confidence logits
  const void* temps;        // [K] STS temperatures or null (from_conf only)
  DType temps_dtype;
  int64_t n, K, lo, hi;     // candidates j in [lo, hi)
  const uint8_t* active;    // [n] or null (every row active)
};


DSPARK_HOST_DEVICE_FN bool uses_budget(const ScheduleVerifyLensParams& p) { return !p.exact && p.has_budget; }

DSPARK_HOST_DEVICE_FN Curve main_curve(const ScheduleVerifyLensParams& p) {
  const bool conf = p.survival == nullptr;
  return Curve{conf ? p.conf_logits : p.survival, conf ? p.conf_dtype : p.survival_dtype, conf,
               p.sts_temperatures, p.sts_dtype, p.N, p.K, p.min_len, p.max_len, p.active};
}

DSPARK_HOST_DEVICE_FN Curve budget_curve(const ScheduleVerifyLensParams& p) {
  const int64_t hi = p.max_len < p.KB ? p.max_len : p.KB;
  const int64_t lo = p.min_len < hi ? p.min_len : hi;
  return Curve{p.budget_survival, p.budget_dtype, false, nullptr, DType::kFloat32, p.NB, p.KB, lo, hi, nullptr};
}

DSPARK_HOST_DEVICE_FN int threads_for(int64_t elements) {
  return elements <= 128 ? 32 : (elements <= 512 ? 128 : kMaxThreads);
}

DSPARK_HOST_DEVICE_FN int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Sizes and places of one launch's arrays. One tile: all in dynamic shared memory. Several tiles (multi): the
// sort's trading buffer in shared memory, the rest in the workspace.
struct Layout {
  int threads;
  bool multi;
  int64_t elements;   // the larger curve's N*K
  int64_t tile;       // elements a pass holds
  int64_t sort_len;   // keys the sort orders (a power of two)
  int64_t theta_len;  // Theta slots: one per admission, striped per tile, then Theta_0
  size_t theta_off, sorted_off, ukeys_off, admit_off, xbuf_off;  // byte offsets in their region
  size_t smem, workspace;
};

DSPARK_HOST_DEVICE_FN Layout layout(const ScheduleVerifyLensParams& p) {
  Layout l;
  const Curve c = main_curve(p);
  int64_t e = c.n * c.K;
  if (uses_budget(p)) {
    const Curve b = budget_curve(p);
    e = b.n * b.K > e ? b.n * b.K : e;
  }
  l.elements = e;
  l.multi = e > kMaxTile;
  l.threads = l.multi ? (p.active ? kMaskedTileThreads : kMaxThreads) : threads_for(e);
  l.tile = int64_t(kItems) * l.threads;
  l.sort_len = l.multi ? next_pow2(e) : l.tile;
  const int64_t tiles = l.multi ? (e + l.tile - 1) / l.tile : 1;
  l.theta_len = tiles * l.tile + 1;
  const size_t theta = size_t(l.theta_len) * 8, sorted = size_t(l.sort_len) * 4;
  // the admissions per request: read only with candidates (max_len > min_len), so K >= 1 and one tile's N <= 2048
  const size_t admit = c.hi > c.lo ? size_t(c.n) * 4 : 0;
  const size_t ukeys = l.multi ? size_t(e) * 4 : 0, xbuf = size_t(l.tile) * 8;
  auto up16 = [](size_t x) { return (x + 15) / 16 * 16; };
  l.theta_off = 0;
  l.sorted_off = up16(theta);
  l.ukeys_off = l.sorted_off + up16(sorted);
  l.admit_off = l.ukeys_off + up16(ukeys);
  const size_t end = l.admit_off + up16(admit);
  if (l.multi) {
    l.xbuf_off = 0;
    l.smem = xbuf;
    l.workspace = end;
  } else {
    l.xbuf_off = end;
    l.smem = end + xbuf;
    l.workspace = 0;
  }
  return l;
}

// Correctly rounded float64 operations (never contracted into an FMA), as the reference's separate torch ops.
DSPARK_HOST_DEVICE_FN double dadd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
DSPARK_HOST_DEVICE_FN double dsub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
DSPARK_HOST_DEVICE_FN double dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
DSPARK_HOST_DEVICE_FN double ddiv(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
DSPARK_HOST_DEVICE_FN double u64_to_double(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __ull2double_rn(x);
#else
  return static_cast<double>(x);
#endif
}

// ceil(log2(x)) for x >= 1.
DSPARK_HOST_DEVICE_FN int ceil_log2(uint64_t x) {
  int b = 0;
  while ((uint64_t(1) << b) < x && b < 63) ++b;
  return b;
}
}  // namespace sched

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
namespace sched {

// Loads and stores of an array in shared memory (kGlobal false) or in the workspace, written earlier in this
// launch (so never through the read-only path).
template <bool kGlobal, typename T>
DSPARK_DEVICE T mld(const T* p) {
  if constexpr (kGlobal) return ld_coherent(p);
  else return *p;
}
template <bool kGlobal, typename T>
DSPARK_DEVICE void mst(T* p, T v) {
  if constexpr (kGlobal) stg(p, v);
  else *p = v;
}

// NaN -> 0, clamped to [0, 1], -0 -> +0.
DSPARK_DEVICE float clean(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }

DSPARK_DEVICE float key_value(uint32_t key) {
  const uint32_t bits = kOneBits - key;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

DSPARK_DEVICE uint32_t key_of(float a) {
  uint32_t bits;
  memcpy(&bits, &a, 4);
  return kOneBits - bits;
}

// The cost table, in shared memory up to kTableSmem points.
struct Table {
  const double* c_s;
  const double* t_s;
  const float* c_g;
  const float* t_g;
  int64_t P;
  double overhead;
  DSPARK_DEVICE double c(int64_t i) const { return P <= kTableSmem ? c_s[i] : static_cast<double>(ldg(c_g + i)); }
  DSPARK_DEVICE double t(int64_t i) const { return P <= kTableSmem ? t_s[i] : static_cast<double>(ldg(t_g + i)); }
  // #{i : c_i <= x} (torch.searchsorted(right=True)) by bisection: where x is the same in every lane, every lane
  // reads the same entries.
  DSPARK_DEVICE int64_t count_le(double x) const {
    int64_t lo = 0, hi = P;
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (c(mid) <= x) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
  // count_le(x) from cnt = count_le(x') for some x' <= x: a short walk (the warp's lanes read neighbouring entries).
  DSPARK_DEVICE int64_t advance(int64_t cnt, double x) const {
    while (cnt < P && c(cnt) <= x) ++cnt;
    return cnt;
  }
  // SPS(x) = 1000 / (interpolated time + overhead), cnt = count_le(x): the reference's float64 operations in its
  // order.
  DSPARK_DEVICE double sps(double x, int64_t cnt) const {
    double time;
    if (P == 1) {
      time = t(0);
    } else {
      int64_t seg = cnt - 1;
      seg = seg < 0 ? 0 : (seg > P - 2 ? P - 2 : seg);
      const double c0 = c(seg), c1 = c(seg + 1), t0 = t(seg), t1 = t(seg + 1);
      const double slope = ddiv(dsub(t1, t0), dsub(c1, c0));
      const double cf = c(0), cl = c(P - 1);
      const double xc = x > cf ? x : cf;
      const double inside = dadd(t0, dmul(dsub(xc, c0), slope));
      const double above = dadd(t(P - 1), dmul(dsub(xc, cl), slope > 0.0 ? slope : 0.0));
      time = xc > cl ? above : inside;
    }
    return dmul(ddiv(1.0, dadd(time, overhead)), 1000.0);
  }
};

// Fixed-point split of a survival in [0, 1]: a = hi 2^-H + lo 2^-(H+L) + (below 2^-(H+L), dropped).
struct Fixed {
  int H, L;
  double sH, sL, inv;  // 2^H, 2^L, 2^-(H+L)
  DSPARK_DEVICE void split(float a, int64_t* hi, int64_t* lo) const {
    const double s = static_cast<double>(a) * sH;
    const double h = floor(s);
    *hi = static_cast<int64_t>(h);
    *lo = static_cast<int64_t>(floor((s - h) * sL));
  }
  // X = A 2^L + Ls as 128 bits (xh, xl); A, Ls >= 0, A < 2^63, Ls < 2^63.
  DSPARK_DEVICE void wide(int64_t A, int64_t Ls, uint64_t* xh, uint64_t* xl) const {
    const uint64_t ua = static_cast<uint64_t>(A);
    uint64_t h = L == 0 ? 0 : (ua >> (64 - L));
    const uint64_t l0 = L == 0 ? ua : (ua << L);
    const uint64_t l = l0 + static_cast<uint64_t>(Ls);
    h += l < l0 ? 1 : 0;
    *xh = h;
    *xl = l;
  }
  // The float64 nearest to X 2^-(H+L) (one rounding).
  DSPARK_DEVICE double value(int64_t A, int64_t Ls) const {
    uint64_t xh, xl;
    wide(A, Ls, &xh, &xl);
    double v;
    if (xh == 0) {
      v = u64_to_double(xl);
    } else {
      const int s = 64 - __clzll(static_cast<long long>(xh));  // 1 .. 63
      uint64_t top = (xh << (64 - s)) | (xl >> s);
      if ((xl << (64 - s)) != 0) top |= 1;  // sticky bit: one rounding of the whole value
      v = dmul(u64_to_double(top), ldexp(1.0, s));
    }
    return dmul(v, inv);
  }
  // Whether X 2^-(H+L) is exactly a float64 (at most 53 significant bits).
  DSPARK_DEVICE bool exact(int64_t A, int64_t Ls) const {
    uint64_t xh, xl;
    wide(A, Ls, &xh, &xl);
    if (xh == 0 && xl == 0) return true;
    const int tz = xl != 0 ? __ffsll(static_cast<long long>(xl)) - 1 : 64 + __ffsll(static_cast<long long>(xh)) - 1;
    const int len = xh != 0 ? 128 - __clzll(static_cast<long long>(xh)) : 64 - __clzll(static_cast<long long>(xl));
    return len - tz <= 53;
  }
};

DSPARK_DEVICE Fixed make_fixed(int64_t n, int64_t hi_len) {
  const int bits = ceil_log2(static_cast<uint64_t>(n) * static_cast<uint64_t>(hi_len + 1) + 1);
  Fixed f;
  f.H = 62 - bits;
  f.L = 62 - bits;
  f.sH = ldexp(1.0, f.H);
  f.sL = ldexp(1.0, f.L);
  f.inv = ldexp(1.0, -(f.H + f.L));
  return f;
}

// What step 4 needs of a curve, per thread and then reduced over the block.
struct Pick {
  int64_t fail;         // exact: the first m with Theta_{m+1} <= Theta_m, or M (INT64_MAX: none seen)
  double fail_theta;    // Theta_fail
  int64_t best;         // argmax: the first maximum (-1: none seen)
  double best_theta;
  double at[2];         // Theta at M (every candidate admitted) and at a requested admission count
  int32_t has;          // bit i: at[i] is set
  int64_t inexact;      // the first admission whose exact prefix is not a float64 (INT64_MAX: none)
};

DSPARK_DEVICE Pick empty_pick() { return Pick{INT64_MAX, 0.0, -1, 0.0, {0.0, 0.0}, 0, INT64_MAX}; }

DSPARK_DEVICE Pick combine(Pick a, const Pick& b) {
  if (b.fail < a.fail) {
    a.fail = b.fail;
    a.fail_theta = b.fail_theta;
  }
  if (b.best >= 0 && (a.best < 0 || b.best_theta > a.best_theta || (b.best_theta == a.best_theta && b.best < a.best))) {
    a.best = b.best;
    a.best_theta = b.best_theta;
  }
  for (int i = 0; i < 2; ++i)
    if ((b.has >> i) & 1) a.at[i] = b.at[i];
  a.has |= b.has;
  a.inexact = b.inexact < a.inexact ? b.inexact : a.inexact;
  return a;
}

// Adds Theta at admission counts m0 .. m0+4 (th[i] at m0 + i, those <= M) to the thread's pick.
DSPARK_DEVICE void add_thetas(Pick& pk, int64_t m0, const double (&th)[kItems + 1], int64_t M, int64_t want1) {
DSPARK_UNROLL
  for (int i = 0; i <= kItems; ++i) {
    const int64_t m = m0 + i;
    if (m > M) break;
    if (m == M) pk.at[0] = th[i], pk.has |= 1;
    if (m == want1) pk.at[1] = th[i], pk.has |= 2;
    if (pk.best < 0 || th[i] > pk.best_theta) pk.best = m, pk.best_theta = th[i];
    if (pk.fail == INT64_MAX && (m == M || (i < kItems && !(th[i + 1] > th[i])))) pk.fail = m, pk.fail_theta = th[i];
  }
}

template <typename T>
DSPARK_DEVICE T shfl_xor(T v, int o) {
  return __shfl_xor_sync(0xffffffffu, v, o);
}

DSPARK_DEVICE Pick warp_pick(Pick p) {
DSPARK_UNROLL
  for (int o = 16; o > 0; o >>= 1) {
    Pick q;
    q.fail = shfl_xor(p.fail, o);
    q.fail_theta = shfl_xor(p.fail_theta, o);
    q.best = shfl_xor(p.best, o);
    q.best_theta = shfl_xor(p.best_theta, o);
    q.at[0] = shfl_xor(p.at[0], o);
    q.at[1] = shfl_xor(p.at[1], o);
    q.has = shfl_xor(p.has, o);
    q.inexact = shfl_xor(p.inexact, o);
    p = combine(p, q);
  }
  return p;
}

// Shared scratch of the block-wide steps (two of each, alternated: see block_scan.cuh).
struct Scratch {
  int32_t seg_flag[2][32];
  double seg_val[2][32];
  int64_t sum_hi[2][32], sum_lo[2][32];
  uint64_t counts[2][32];
  int64_t tau_hi[32], tau_lo[32];
  int64_t rows[32];
  Pick picks[32];
};

// Which of the two scratch copies the next block-wide step uses (every thread flips it alike).
struct Phase {
  int p = 0;
  DSPARK_DEVICE int next() {
    p ^= 1;
    return p;
  }
};

DSPARK_DEVICE Pick block_pick(Pick p, Scratch& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  p = warp_pick(p);
  if (lane == 0) s.picks[warp] = p;
  __syncthreads();
  Pick r = s.picks[0];
  for (int w = 1; w < nwarps; ++w) r = combine(r, s.picks[w]);
  return r;
}

// Running minimum along K (of cleaned survivals) and running product (of sigmoids), as scan operators.
struct MinOp {
  using V = float;
  static DSPARK_DEVICE V id() { return INFINITY; }
  static DSPARK_DEVICE V f(V a, V b) { return b < a ? b : a; }
};
struct MulOp {
  using V = double;
  static DSPARK_DEVICE V id() { return 1.0; }
  static DSPARK_DEVICE V f(V a, V b) { return dmul(a, b); }
};

// Inclusive segmented scan of a tile in flat order (thread's element u is u * 32 + lane of its warp's 128),
// continuing `carry` (the scan at the end of the previous tile; updated). A row starts where start[u]. One barrier.
template <typename Op>
DSPARK_DEVICE void segmented_scan(typename Op::V (&v)[kItems], const bool (&start)[kItems], typename Op::V& carry,
                                  Scratch& s, Phase& ph) {
  using V = typename Op::V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  bool seen[kItems];  // a row starts at or before this element in the warp's span
  int gf = 0;         // the warp's earlier groups: a row started there, and their running value
  V gv = Op::id();
DSPARK_UNROLL
  for (int u = 0; u < kItems; ++u) {
    int f = start[u] ? 1 : 0;
    V x = v[u];
DSPARK_UNROLL
    for (int o = 1; o < 32; o <<= 1) {
      const V y = __shfl_up_sync(0xffffffffu, x, o);
      const int g = __shfl_up_sync(0xffffffffu, f, o);
      if (lane >= o) {
        if (!f) x = Op::f(y, x);
        f |= g;
      }
    }
    if (!f) x = Op::f(gv, x);
    f |= gf;
    v[u] = x;
    seen[u] = f != 0;
    gf = __shfl_sync(0xffffffffu, f, 31);
    gv = __shfl_sync(0xffffffffu, x, 31);
  }
  const int b = ph.next();
  if (lane == 0) {
    s.seg_flag[b][warp] = gf;
    s.seg_val[b][warp] = static_cast<double>(gv);
  }
  __syncthreads();
  V in = carry, out = carry;
  for (int w = 0; w < nwarps; ++w) {
    const V wv = static_cast<V>(s.seg_val[b][w]);
    out = s.seg_flag[b][w] ? wv : Op::f(out, wv);
    if (w + 1 == warp) in = out;
  }
DSPARK_UNROLL
  for (int u = 0; u < kItems; ++u)
    if (!seen[u]) v[u] = Op::f(in, v[u]);
  carry = out;
}

// Bitonic stages k = k_lo .. k_hi (powers of two) of an ascending sort, over the 4 keys of each thread: element
// base + 4 tid + u (base a multiple of the tile). A stage's first stride is min(k, tile) / 2. Strides of other
// warps trade through xbuf (two tiles of keys, alternated: one barrier each).
template <int kT>
DSPARK_DEVICE void bitonic(uint32_t (&x)[kItems], int64_t base, int64_t k_lo, int64_t k_hi, uint32_t* xbuf,
                           Phase& ph) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t i0 = base + 4 * tid;
  for (int64_t k = k_lo; k <= k_hi; k <<= 1) {
    for (int64_t d = (k < kTile ? k : kTile) >> 1; d > 0; d >>= 1) {
      if (d >= 128) {
        uint32_t* buf = xbuf + ph.next() * kTile;
        *reinterpret_cast<uint4*>(buf + 4 * tid) = make_uint4(x[0], x[1], x[2], x[3]);
        __syncthreads();
        const int m = static_cast<int>(d >> 2);
        const uint4 y4 = *reinterpret_cast<const uint4*>(buf + 4 * (tid ^ m));
        const uint32_t y[kItems] = {y4.x, y4.y, y4.z, y4.w};
        const bool lower = (tid & m) == 0;
DSPARK_UNROLL
        for (int u = 0; u < kItems; ++u) {
          const bool asc = ((i0 + u) & k) == 0;
          x[u] = (lower == asc) ? (y[u] < x[u] ? y[u] : x[u]) : (y[u] > x[u] ? y[u] : x[u]);
        }
      } else if (d >= kItems) {
        const int m = static_cast<int>(d >> 2);
        const bool lower = (lane & m) == 0;
DSPARK_UNROLL
        for (int u = 0; u < kItems; ++u) {
          const uint32_t y = __shfl_xor_sync(0xffffffffu, x[u], m);
          const bool asc = ((i0 + u) & k) == 0;
          x[u] = (lower == asc) ? (y < x[u] ? y : x[u]) : (y > x[u] ? y : x[u]);
        }
      } else {
DSPARK_UNROLL
        for (int u = 0; u < kItems; ++u) {
          const int v = u | static_cast<int>(d);
          if ((u & d) != 0) continue;
          const bool asc = ((i0 + u) & k) == 0;
          const uint32_t a = x[u] < x[v] ? x[u] : x[v], b = x[u] < x[v] ? x[v] : x[u];
          x[u] = asc ? a : b;
          x[v] = asc ? b : a;
        }
      }
    }
  }
}

// Where the arrays of one launch live (see Layout).
struct Bufs {
  double* theta;     // [theta_len]
  uint32_t* sorted;  // [sort_len]
  uint32_t* ukeys;   // [elements] (multi only: the keys in flat order)
  int32_t* admit;    // [N]: admissions up to each row's last candidate
  uint32_t* xbuf;    // [2 tile] (shared)
  int64_t theta_len, sort_len;
};

template <int kT>
DSPARK_DEVICE int64_t theta_slot(int64_t m, int64_t theta_len) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  if (m == 0) return theta_len - 1;
  const int64_t q = m - 1, b = q / kTile * kTile, r = q - b;
  return b + (r & 3) * kT + (r >> 2);
}

// Whether row r (< c.n) is scheduled.
DSPARK_DEVICE bool row_active(const Curve& c, int64_t r) { return c.active == nullptr || ldg(c.active + r) != 0; }

// Step 1 over one tile (element base + u * 32 + lane of each warp's 128): keys (kPadKey where not a candidate)
// and the exact sums of the survivals of j < lo of active rows; cmin / cmul carry the running scans between tiles.
DSPARK_DEVICE void load_keys(const Curve& c, int64_t base, const Fixed& fx, uint32_t (&key)[kItems], float& cmin,
                             double& cmul, int64_t& h0, int64_t& l0, Scratch& s, Phase& ph) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t E = c.n * c.K;
  bool valid[kItems], start[kItems];
  uint32_t j[kItems];
  int64_t f[kItems];
DSPARK_UNROLL
  for (int u = 0; u < kItems; ++u) {
    f[u] = base + warp * 128 + u * 32 + lane;
    valid[u] = f[u] < E;
    j[u] = valid[u] ? static_cast<uint32_t>(static_cast<uint32_t>(f[u]) % static_cast<uint32_t>(c.K)) : 0u;
    start[u] = j[u] == 0;
  }
  float a[kItems];
  if (!c.from_conf) {
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) a[u] = valid[u] ? clean(load_float(c.x, c.dtype, f[u])) : INFINITY;
    segmented_scan<MinOp>(a, start, cmin, s, ph);
  } else {  // survival = cumprod(sigmoid(z / T)) in float64, rounded once (never increasing: no running minimum)
    double prod[kItems];
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) {
      float z = valid[u] ? load_float(c.x, c.dtype, f[u]) : 0.0f;
      if (valid[u] && c.temps) z = z / load_float(c.temps, c.temps_dtype, j[u]);
      prod[u] = valid[u] ? static_cast<double>(1.0f / (1.0f + expf(-z))) : 1.0;
    }
    segmented_scan<MulOp>(prod, start, cmul, s, ph);
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) a[u] = clean(static_cast<float>(prod[u]));
  }
DSPARK_UNROLL
  for (int u = 0; u < kItems; ++u) {
    key[u] = kPadKey;
    if (!valid[u] || !row_active(c, static_cast<uint32_t>(f[u]) / static_cast<uint32_t>(c.K))) continue;
    if (j[u] < c.lo) {
      int64_t h, l;
      fx.split(a[u], &h, &l);
      h0 += h;
      l0 += l;
    } else if (j[u] < c.hi) {
      key[u] = key_of(a[u]);
    }
  }
}

// The curve's active rows: n without a mask, else the count keys_pass left in s.rows (after a barrier).
template <int kT>
DSPARK_DEVICE int64_t active_rows(const Curve& c, const Scratch& s) {
  if (!c.active) return c.n;
  int64_t na = 0;
  for (int w = 0; w < kT / 32; ++w) na += s.rows[w];
  return na;
}

// Exclusive scan over the block of the pair (a, b) in thread order, one barrier; ta / tb get the block's sums.
DSPARK_DEVICE void pair_exclusive_scan(int64_t& a, int64_t& b, int64_t& ta, int64_t& tb, Scratch& s, Phase& ph) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t ia = warp_inclusive_scan(a), ib = warp_inclusive_scan(b);
  const int k = ph.next();
  if (lane == 31) {
    s.sum_hi[k][warp] = ia;
    s.sum_lo[k][warp] = ib;
  }
  __syncthreads();
  int64_t ba = 0, bb = 0;
  ta = tb = 0;
  for (int w = 0; w < nwarps; ++w) {
    const int64_t va = s.sum_hi[k][w], vb = s.sum_lo[k][w];
    ba += w < warp ? va : 0;
    bb += w < warp ? vb : 0;
    ta += va;
    tb += vb;
  }
  a = ba + ia - a;
  b = bb + ib - b;
}

// The sort of a launch with several tiles: the stages up to the tile one tile at a time, then each larger stage's
// strides of a tile or more as passes over the workspace, and its smaller ones per tile again.
template <int kT>
DSPARK_DEVICE void sort_tiles(const Bufs& b, int64_t E, int64_t sort_len, Phase& ph) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int tid = threadIdx.x;
  __syncthreads();  // every thread's keys are in b.sorted
  for (int64_t k = kTile; k <= sort_len; k <<= 1) {
    if (k > kTile) {
      for (int64_t d = k >> 1; d >= kTile; d >>= 1) {
        for (int64_t idx = tid; idx < sort_len / 2; idx += kT) {
          const int64_t i = idx / d * 2 * d + idx % d;
          const uint32_t x = ld_coherent(b.sorted + i), y = ld_coherent(b.sorted + i + d);
          const bool asc = (i & k) == 0;
          stg(b.sorted + i, asc == (x < y) ? x : y);
          stg(b.sorted + i + d, asc == (x < y) ? y : x);
        }
        __syncthreads();
      }
    }
    for (int64_t base = 0; base < sort_len; base += kTile) {
      uint32_t x[kItems];
DSPARK_UNROLL
      for (int u = 0; u < kItems; ++u) {
        const int64_t i = base + 4 * tid + u;
        x[u] = (k > kTile || i < E) ? ld_coherent(b.sorted + i) : kPadKey;
      }
      bitonic<kT>(x, base, k == kTile ? 2 : k, k, b.xbuf, ph);
DSPARK_UNROLL
      for (int u = 0; u < kItems; ++u) stg(b.sorted + base + 4 * tid + u, x[u]);
    }
    __syncthreads();
  }
}

// Thread 0 continues the sequential float64 cumsum from the first admission whose exact prefix is not a float64
// (that prefix, before it, still is), rewriting Theta from there on.
template <int kT, bool kMulti>
DSPARK_DEVICE void sequential_tail(const Curve& c, int64_t na, const Table& tb, const Fixed& fx, const Bufs& b,
                                   double tau0, int64_t first) {
  const int64_t M = na * (c.hi - c.lo);
  const double b0 = static_cast<double>(na * (1 + c.lo));
  int64_t A = 0, L = 0;
  for (int64_t q = 0; q < first; ++q) {
    int64_t h, l;
    fx.split(key_value(mld<kMulti>(b.sorted + q)), &h, &l);
    A += h;
    L += l;
  }
  double sum = fx.value(A, L);
  int64_t cnt = tb.count_le(b0 + static_cast<double>(first));
  for (int64_t q = first; q < M; ++q) {
    sum = dadd(sum, static_cast<double>(key_value(mld<kMulti>(b.sorted + q))));
    const double x = b0 + static_cast<double>(q + 1);
    cnt = tb.advance(cnt, x);
    mst<kMulti>(b.theta + theta_slot<kT>(q + 1, b.theta_len), dmul(dadd(tau0, sum), tb.sps(x, cnt)));
  }
}

// Step 1 over the curve's tiles: the keys (in ukey for a one-tile launch; in b.sorted and b.ukeys otherwise) and
// each warp's exact sum of the survivals of j < lo (s.tau_*, read after the next barrier).
template <int kT, bool kMulti>
DSPARK_DEVICE void keys_pass(const Curve& c, const Fixed& fx, const Bufs& b, Scratch& s, Phase& ph,
                             uint32_t (&ukey)[kItems]) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t E = c.n * c.K;
  int64_t h0 = 0, l0 = 0;
  float cmin = MinOp::id();
  double cmul = MulOp::id();
  for (int64_t base = 0; base == 0 || (kMulti && base < E); base += kTile) {
    load_keys(c, base, fx, ukey, cmin, cmul, h0, l0, s, ph);
    if constexpr (kMulti) {
DSPARK_UNROLL
      for (int u = 0; u < kItems; ++u) {
        const int64_t f = base + warp * 128 + u * 32 + lane;
        if (f < E) {
          stg(b.sorted + f, ukey[u]);
          stg(b.ukeys + f, ukey[u]);
        }
      }
    }
  }
  h0 = warp_sum(h0);
  l0 = warp_sum(l0);
  int64_t rows = 0;
  if (c.active)
    for (int64_t r = threadIdx.x; r < c.n; r += kT) rows += row_active(c, r) ? 1 : 0;
  rows = warp_sum(rows);
  if (lane == 0) {
    s.tau_hi[warp] = h0;
    s.tau_lo[warp] = l0;
    s.rows[warp] = rows;
  }
}

// Step 3 over the sorted keys (x: this thread's 4 of a one-tile launch): Theta after each admission count m,
// 4 consecutive admissions a thread (and m = q0, before them), kept in b.theta; the thread's pick.
template <int kT, bool kMulti>
DSPARK_DEVICE Pick theta_pass(const Curve& c, int64_t na, const Table& tb, const Fixed& fx, const Bufs& b,
                              Scratch& s, Phase& ph, uint32_t (&x)[kItems], int64_t want1, double& tau0) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int tid = threadIdx.x, warp = tid >> 5, nwarps = kT / 32;
  const int64_t M = na * (c.hi - c.lo);
  const double b0 = static_cast<double>(na * (1 + c.lo));
  int64_t carry_h = 0, carry_l = 0;
  Pick pk = empty_pick();
  for (int64_t base = 0; base == 0 || (kMulti && base < M); base += kTile) {
    const int64_t q0 = base + 4 * tid;
    if constexpr (kMulti) {
      const uint4 v = ld_coherent(reinterpret_cast<const uint4*>(b.sorted + q0));
      x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    }
    int64_t hi[kItems], lo[kItems], sa = 0, sb = 0, ta, tl;
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) {
      hi[u] = lo[u] = 0;
      if (q0 + u < M) fx.split(key_value(x[u]), &hi[u], &lo[u]);
      sa += hi[u];
      sb += lo[u];
    }
    pair_exclusive_scan(sa, sb, ta, tl, s, ph);
    if (base == 0) {  // the survivals of j < lo, published by the scan's barrier
      int64_t th = 0, tlo = 0;
      for (int w = 0; w < nwarps; ++w) th += s.tau_hi[w], tlo += s.tau_lo[w];
      tau0 = dadd(static_cast<double>(na), fx.value(th, tlo));
    }
    if (q0 <= M) {
      int64_t A = carry_h + sa, L = carry_l + sb;
      double theta[kItems + 1];
      double xq = b0 + static_cast<double>(q0);
      int64_t cnt = tb.advance(tb.count_le(b0 + static_cast<double>(base + 128 * warp)), xq);
      theta[0] = dmul(dadd(tau0, fx.value(A, L)), tb.sps(xq, cnt));
      if (q0 == 0) mst<kMulti>(b.theta + theta_slot<kT>(0, b.theta_len), theta[0]);
DSPARK_UNROLL
      for (int u = 0; u < kItems; ++u) {
        const int64_t q = q0 + u;
        if (q >= M) break;
        A += hi[u];
        L += lo[u];
        if (pk.inexact == INT64_MAX && !fx.exact(A, L)) pk.inexact = q;
        xq = b0 + static_cast<double>(q + 1);
        cnt = tb.advance(cnt, xq);
        theta[u + 1] = dmul(dadd(tau0, fx.value(A, L)), tb.sps(xq, cnt));
        mst<kMulti>(b.theta + theta_slot<kT>(q + 1, b.theta_len), theta[u + 1]);
      }
      add_thetas(pk, q0, theta, M, want1);
    }
    carry_h += ta;
    carry_l += tl;
  }
  return pk;
}

// The thread's pick again, from b.theta (after sequential_tail rewrote part of it).
template <int kT, bool kMulti>
DSPARK_DEVICE Pick repick(const Curve& c, int64_t na, const Bufs& b, int64_t want1) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int64_t M = na * (c.hi - c.lo);
  Pick pk = empty_pick();
  for (int64_t base = 0; base == 0 || (kMulti && base < M); base += kTile) {
    const int64_t q0 = base + 4 * threadIdx.x;
    if (q0 > M) continue;
    double theta[kItems + 1];
DSPARK_UNROLL
    for (int i = 0; i <= kItems; ++i)
      theta[i] = q0 + i <= M ? mld<kMulti>(b.theta + theta_slot<kT>(q0 + i, b.theta_len)) : 0.0;
    add_thetas(pk, q0, theta, M, want1);
  }
  return pk;
}

// Steps 1-4 for one curve: the keys (in ukey for a one-tile launch, in b.ukeys otherwise), their sort
// (b.sorted), Theta at every admission count, and the block's pick (the same in every thread), which also holds
// Theta at M = n' (hi - lo) (every candidate of the n' active rows admitted) and at min(want1, M).
template <int kT, bool kMulti>
DSPARK_DEVICE Pick curve(const Curve& c, const Table& tb, const Bufs& b, Scratch& s, Phase& ph, int64_t want1,
                         uint32_t (&ukey)[kItems]) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const Fixed fx = make_fixed(c.n, c.hi);
  keys_pass<kT, kMulti>(c, fx, b, s, ph, ukey);
  uint32_t x[kItems] = {ukey[0], ukey[1], ukey[2], ukey[3]};
  if constexpr (!kMulti) {
    bitonic<kT>(x, 0, 2, kTile, b.xbuf, ph);
    *reinterpret_cast<uint4*>(b.sorted + 4 * threadIdx.x) = make_uint4(x[0], x[1], x[2], x[3]);
  } else {
    sort_tiles<kT>(b, c.n * c.K, b.sort_len, ph);
  }
  if (c.active) __syncthreads();  // publishes keys_pass's count of the active rows (a one-warp sort has no barrier)
  const int64_t na = active_rows<kT>(c, s);
  const int64_t M = na * (c.hi - c.lo);
  if (want1 > M) want1 = M;
  double tau0 = 0.0;
  Pick pk = block_pick(theta_pass<kT, kMulti>(c, na, tb, fx, b, s, ph, x, want1, tau0), s);
  if (pk.inexact < M) {  // an exact prefix was not a float64: the sequential sums from there, and pick again
    if (threadIdx.x == 0) sequential_tail<kT, kMulti>(c, na, tb, fx, b, tau0, pk.inexact);
    __syncthreads();
    pk = block_pick(repick<kT, kMulti>(c, na, b, want1), s);
  }
  return pk;
}

// Step 5: at each row's last candidate, the admissions up to it (all candidates with a key below kstar, and the
// first `ties` with kstar, in flat order), by one block scan of the two counts a tile.
template <int kT, bool kMulti>
DSPARK_DEVICE void admissions(const Curve& c, uint32_t kstar, int64_t ties, const uint32_t (&ukey)[kItems],
                              const Bufs& b, Scratch& s, Phase& ph) {
  constexpr int64_t kTile = int64_t(kItems) * kT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = kT / 32;
  const int64_t E = c.n * c.K;
  uint64_t carry = 0;
  for (int64_t base = 0; base == 0 || (kMulti && base < E); base += kTile) {
    uint64_t incl[kItems], g = 0;
    bool last[kItems];
    int64_t row[kItems];
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) {
      const int64_t f = base + warp * 128 + u * 32 + lane;
      const bool valid = f < E;
      uint32_t key = kPadKey, j = 0;
      if (valid) {
        key = kMulti ? ld_coherent(b.ukeys + f) : ukey[u];
        j = static_cast<uint32_t>(f) % static_cast<uint32_t>(c.K);
      }
      const bool cand = valid && j >= c.lo && j < c.hi;
      const uint64_t v = cand ? (uint64_t(key < kstar) << 32) | uint64_t(key == kstar) : 0;
      incl[u] = warp_inclusive_scan(v) + g;
      g = __shfl_sync(0xffffffffu, incl[u], 31);
      last[u] = cand && j + 1 == c.hi;
      row[u] = valid ? static_cast<int64_t>(static_cast<uint32_t>(f) / static_cast<uint32_t>(c.K)) : 0;
    }
    const int k = ph.next();
    if (lane == 31) s.counts[k][warp] = g;
    __syncthreads();
    uint64_t before = carry;
    for (int w = 0; w < nwarps; ++w) {
      const uint64_t v = s.counts[k][w];
      before += w < warp ? v : 0;
      carry += v;
    }
DSPARK_UNROLL
    for (int u = 0; u < kItems; ++u) {
      if (!last[u]) continue;
      const uint64_t t = before + incl[u];
      const int64_t lt = static_cast<int64_t>(t >> 32), eq = static_cast<int64_t>(t & 0xffffffffu);
      mst<kMulti>(b.admit + row[u], static_cast<int32_t>(lt + (eq < ties ? eq : ties)));
    }
  }
  __syncthreads();
}

// Per request: L_r and the prefix sums of its rows, 1 + L_r (none where inactive), from A_r = admissions up to row
// r's last candidate; with the mask, the active rows before each chunk of kT requests by one block scan.
template <int kT, bool kMulti>
DSPARK_DEVICE void requests(const Curve& c, const Bufs& b, const ScheduleVerifyLensParams& p, Scratch& s, Phase& ph) {
  const bool any = c.hi > c.lo;
  uint64_t done = 0;  // active rows before this chunk
  for (int64_t r0 = 0; r0 <= c.n; r0 += kT) {
    const int64_t r = r0 + threadIdx.x;
    const bool on = r < c.n && row_active(c, r);
    uint64_t before = static_cast<uint64_t>(r), chunk = 0;
    if (c.active) {  // uniform: every thread runs the scan
      before = done + block_exclusive_scan<uint64_t>(on ? 1 : 0, s.counts[ph.next()], &chunk);
      done += chunk;
    }
    if (r > c.n) continue;
    const int64_t prev = any && r > 0 ? mld<kMulti>(b.admit + r - 1) : 0;
    if (r < c.n) {
      const int64_t cur = any ? mld<kMulti>(b.admit + r) : 0;
      stg(p.verify_lens + r, static_cast<int32_t>(on ? c.lo + cur - prev : 0));
    }
    stg(p.cu_seqlens + r, static_cast<int32_t>(static_cast<int64_t>(before) * (1 + c.lo) + prev));
  }
}

}  // namespace sched

// kActive: p.active is read (else every request is active and the code is that of an unmasked batch).
template <int kT, bool kMulti, bool kActive>
__global__ void __launch_bounds__(kT, 1)
    schedule_verify_lens_kernel(ScheduleVerifyLensParams p, void* __restrict__ workspace) {
  using namespace sched;
  DSPARK_SHARED_ARRAY(double, table_c, kTableSmem);
  DSPARK_SHARED_ARRAY(double, table_t, kTableSmem);
  DSPARK_SHARED(Scratch, s);
  DSPARK_DYNAMIC_SMEM(unsigned char, dyn);
  const Layout lay = layout(p);
  unsigned char* arrays = kMulti ? static_cast<unsigned char*>(workspace) : dyn;
  const Bufs b{reinterpret_cast<double*>(arrays + lay.theta_off), reinterpret_cast<uint32_t*>(arrays + lay.sorted_off),
               reinterpret_cast<uint32_t*>(arrays + lay.ukeys_off), reinterpret_cast<int32_t*>(arrays + lay.admit_off),
               reinterpret_cast<uint32_t*>(dyn + lay.xbuf_off), lay.theta_len, lay.sort_len};
  const int tid = threadIdx.x;
  for (int64_t i = tid; i < p.P && i < kTableSmem; i += kT) {  // published by step 1's barrier
    table_c[i] = static_cast<double>(ldg(p.token_counts + i));
    table_t[i] = static_cast<double>(ldg(p.step_time_ms + i));
  }
  const Table tb{table_c, table_t, p.token_counts, p.step_time_ms, p.P, p.fixed_overhead_ms};
  Phase ph;
  uint32_t ukey[kItems];
  Curve c = main_curve(p);
  if constexpr (!kActive) c.active = nullptr;

  int64_t budget = -1;  // argmax with a budget: the admission count found on the budget's own curve
  if (uses_budget(p)) budget = curve<kT, kMulti>(budget_curve(p), tb, b, s, ph, -1, ukey).best;
  const Pick pk = curve<kT, kMulti>(c, tb, b, s, ph, budget, ukey);
  const int64_t M = active_rows<kT>(c, s) * (c.hi - c.lo);  // s.rows: the main curve's count, the last
  if (budget > M) budget = M;
  int64_t m;
  double theta;
  if (p.exact) {
    m = pk.fail;
    theta = pk.fail_theta;
  } else {
    m = budget >= 0 ? budget : pk.best;
    theta = budget >= 0 ? pk.at[1] : pk.best_theta;
    if (theta < dmul(p.gain, pk.at[0])) {  // the fall-back: verify everything unless the schedule beats it
      m = M;
      theta = pk.at[0];
    }
  }
  if (tid == 0) stg(p.theta, static_cast<float>(theta));

  // the m*-th admission's key, and how many candidates of that key are admitted (lower_bound: every lane reads
  // the same keys)
  uint32_t kstar = 0;
  int64_t ties = 0;
  if (m > 0) {
    kstar = mld<kMulti>(b.sorted + m - 1);
    int64_t lo = 0, hi = m - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (mld<kMulti>(b.sorted + mid) < kstar) lo = mid + 1;
      else hi = mid;
    }
    ties = m - lo;
  }
  admissions<kT, kMulti>(c, kstar, ties, ukey, b, s, ph);

  requests<kT, kMulti>(c, b, p, s, ph);
}
#endif

size_t schedule_verify_lens_workspace_bytes(const ScheduleVerifyLensParams& p) {
  return sched::layout(p).workspace;
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
namespace sched {
// Opt the kernel in to its dynamic shared memory before each launch that uses any (a host-side attribute, no
// sync): a GPU limits static + dynamic shared memory to 48 KB without it, and the static part (the scratch and
// the cost table) counts too, so no dynamic size is safe to leave out.
template <int kT, bool kMulti, bool kActive>
inline cudaError_t launch_with(const char* name, const ScheduleVerifyLensParams& p, void* workspace,
                               const LaunchConfig& cfg) {
  if (cfg.smem > 0) {
    const cudaError_t e = set_max_dynamic_smem(schedule_verify_lens_kernel<kT, kMulti, kActive>, cfg.smem);
    if (e != cudaSuccess) return e;
  }
  return launch(name, schedule_verify_lens_kernel<kT, kMulti, kActive>, cfg, p, workspace);
}

// One tile of l.threads threads (32, 128 or 512).
template <bool kActive>
inline cudaError_t launch_one_tile(const ScheduleVerifyLensParams& p, const LaunchConfig& cfg) {
  switch (cfg.block.x) {
    case 32: return launch_with<32, false, kActive>("schedule_verify_lens_kernel<32>", p, nullptr, cfg);
    case 128: return launch_with<128, false, kActive>("schedule_verify_lens_kernel<128>", p, nullptr, cfg);
    default: return launch_with<kMaxThreads, false, kActive>("schedule_verify_lens_kernel<512>", p, nullptr, cfg);
  }
}
}  // namespace sched

cudaError_t launch_schedule_verify_lens(const ScheduleVerifyLensParams& p, void* workspace, cudaStream_t stream) {
  using namespace sched;
  const Layout l = layout(p);
  if (l.workspace > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  LaunchConfig cfg;
  cfg.grid = dim3(1);
  cfg.block = dim3(l.threads);
  cfg.smem = l.smem;
  cfg.stream = stream;
  if (l.multi && p.active)
    return launch_with<kMaskedTileThreads, true, true>("schedule_verify_lens_kernel<256, tiles, active>", p,
                                                       workspace, cfg);
  if (l.multi)
    return launch_with<kMaxThreads, true, false>("schedule_verify_lens_kernel<512, tiles>", p, workspace, cfg);
  return p.active ? launch_one_tile<true>(p, cfg) : launch_one_tile<false>(p, cfg);
}
#endif

}  // namespace dspark
