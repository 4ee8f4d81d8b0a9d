// dspark/schedule_verify_lens.cuh: the confidence scheduler on the device, one CTA, one launch, no host sync
// (no torch). Meaning: dspark_kernels/reference/schedule_verify_lens.py (the spec).
//
// One CTA does everything (256 threads up to 4096 candidates, 512 above); its arrays (cleaned candidate survival, sort keys, the Theta curve) live
// in shared memory when they fit (N*K up to about 8000 candidates: the decode case, N = 256, K = 7 is 1792) and in
// the workspace (global memory, L2-resident) otherwise, so any N*K works (no cap; 20 bytes per candidate).
//   1. load + clean (NaN -> 0, clamp to [0, 1], -0 -> +0), running minimum along K (or, from conf_logits,
//      a_k = prod_{i<=k} sigmoid(z_i / T_i)), one thread per request; the survivals of j < min_len are summed,
//      each candidate (r, j), min_len <= j < max_len, gets the key 0x3F800000 - bits(a): ascending key =
//      descending survival (non-negative float32 bit patterns order like their values);
//   2. a stable LSD radix sort of the keys (8-bit digits, up to 4 passes; a pass whose digit is equal in every key
//      is skipped): each warp owns a contiguous segment, ranks by ballots (peer masks of equal digits), per-warp
//      digit counters in shared memory, one block scan of the 256 x 32 counters per pass. Stable = ties stay in
//      flat (r, j) order, the reference's stable sort;
//   3. the curve: the reference's float64 tau_m = fl(fl(n + fl(sum of j < min_len)) + C_m), C_m its sequential
//      float64 cumsum of the sorted survivals. The prefix sums are first taken EXACTLY (8 consecutive sorted
//      survivals per thread, one block scan per 8 x blockDim) in a two-word fixed point (each float32 split into
//      2^-H and 2^-(H+L) parts, H = L = 62 - log2(n(K+1)): 2^-86 resolution at N*K = 2^18); while every exact
//      prefix is a float64, the sequential sums never rounded and C_m is that prefix; from the first prefix that
//      is not (tiny survivals far below the running sum), one thread continues the sequential float64 sum, so C_m
//      is the reference's cumsum bit for bit (survivals below 2^-(H+L) count as 0 in the exactness test: they can
//      move tau only where n + the sum lies within ~2^-70 of a float64 rounding midpoint). The sum of j < min_len
//      is rounded once, which is torch's .sum() whenever its pairwise partial sums are exact; Theta_m = tau_m * SPS(B_m)
//      with the cost table interpolated by the reference's float64 operations in its order (no FMA contraction;
//      1000 / x as reciprocal(x) * 1000, as torch evaluates it);
//   4. m*: exact = the first admission that does not strictly raise Theta; argmax = the first maximum (on the
//      budget survival's own curve, computed first with the same code, when given; clamped to M), then the
//      min_gain fall-back to "verify everything";
//   5. per request: admitted = candidates whose key precedes the m*-th key: all with a > v* plus the first
//      (m* - #{a > v*}) candidates with a == v* in flat order (a block scan of the per-request tie counts), and
//      the exclusive prefix sums of 1 + L_r.
// Float inputs are fp32 / bf16 / fp16 (dspark::DType, per array). Outputs: verify_lens int32 [N], cu_seqlens
// int32 [N+1], theta float32 [].
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_scan.cuh"
#include "utils.cuh"

namespace dspark {

struct ScheduleVerifyLensParams {
  int64_t N = 0, K = 0;
  const void* survival = nullptr;          // [N, K] or null (then conf_logits)
  DType survival_dtype = DType::kFloat32;
  const void* conf_logits = nullptr;       // [N, K] or null
  DType conf_dtype = DType::kFloat32;
  const void* sts_temperatures = nullptr;  // [K] or null (only with conf_logits)
  DType sts_dtype = DType::kFloat32;
  const float* token_counts = nullptr;     // [P] strictly ascending
  const float* step_time_ms = nullptr;     // [P] positive
  int64_t P = 0;
  double fixed_overhead_ms = 0.0;
  int64_t min_len = 0, max_len = 0;        // 0 <= min_len <= max_len <= K
  bool exact = true;                       // "exact" or "argmax"
  const void* budget_survival = nullptr;   // [NB, KB] (argmax only; may be null when NB * KB == 0)
  bool has_budget = false;                 // argmax count from budget_survival
  DType budget_dtype = DType::kFloat32;
  int64_t NB = 0, KB = 0;
  double gain = 1.0;                       // 1 + min_gain (argmax only)
  int32_t* verify_lens = nullptr;          // [N]
  int32_t* cu_seqlens = nullptr;           // [N+1]
  float* theta = nullptr;                  // []
};

namespace sched {
constexpr int kSmallThreads = 256;            // M <= kSmallM: a 256-thread CTA (fewer warps in every barrier)
constexpr int kThreads = 512;                 // larger M (512: up to 128 registers, no spills)
constexpr int64_t kSmallM = 4096;
constexpr int kItems = 8;                     // consecutive sorted survivals per thread in the Theta scan
constexpr int kTableSmem = 256;               // cost-table points cached in shared memory
constexpr size_t kSmemLimit = 160 * 1024;     // arrays in shared memory up to this size
constexpr uint32_t kOneBits = 0x3F800000u;    // bits of 1.0f: key = kOneBits - bits(a)

// Sizes of one launch.
struct Layout {
  int64_t M, Mb, Mmax;  // candidates of the survival, of the budget, the larger
  size_t bytes;         // theta (double) [Mmax+1], keys (u32) [2 Mmax], cleaned survival (float) [M]
  bool smem;
};
DSPARK_HOST_DEVICE_FN Layout layout(const ScheduleVerifyLensParams& p) {
  Layout l;
  l.M = p.N * (p.max_len - p.min_len);
  l.Mb = 0;
  if (!p.exact && p.has_budget) {
    const int64_t hib = p.max_len < p.KB ? p.max_len : p.KB;
    const int64_t lob = p.min_len < hib ? p.min_len : hib;
    l.Mb = p.NB * (hib - lob);
  }
  l.Mmax = l.M > l.Mb ? l.M : l.Mb;
  l.bytes = size_t(l.Mmax + 1) * 8 + size_t(l.Mmax) * 8 + size_t(l.M) * 4;
  l.bytes = (l.bytes + 15) / 16 * 16;
  l.smem = l.bytes <= kSmemLimit;
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

template <bool kSmem, typename T>
DSPARK_DEVICE T bld(const T* p) {
  if constexpr (kSmem) return *p;
  else return ld_coherent(p);
}
template <bool kSmem, typename T>
DSPARK_DEVICE void bst(T* p, T v) {
  if constexpr (kSmem) *p = v;
  else stg(p, v);
}

// NaN -> 0, clamped to [0, 1], -0 -> +0.
DSPARK_DEVICE float clean(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }

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
  // SPS(x) = 1000 / (interpolated time + overhead), the reference's float64 operations in its order.
  DSPARK_DEVICE double sps(double x) const {
    double time;
    if (P == 1) {
      time = t(0);
    } else {
      int64_t lo = 0, hi = P;  // searchsorted(c, x, right=True): how many c_i <= x
      while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if (c(mid) <= x) lo = mid + 1;
        else hi = mid;
      }
      int64_t seg = lo - 1;
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

DSPARK_DEVICE float key_value(uint32_t key) {
  const uint32_t bits = kOneBits - key;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

// The lowest lane of each group of lanes holding the same 8-bit digit, and the group's mask.
DSPARK_DEVICE unsigned peer_mask(bool valid, unsigned d) {
  unsigned peers = __ballot_sync(0xffffffffu, valid);
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const bool bit = (d >> b) & 1u;
    const unsigned bb = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? bb : ~bb;
  }
  return peers;
}

// One stable LSD pass over keys src[0, M) -> dst by the digit (key >> shift) & 255.
template <int kThreads, bool kSmem>
DSPARK_DEVICE void radix_pass(const uint32_t* src, uint32_t* dst, int64_t M, int shift, int32_t* counts,
                              int64_t* scratch) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t seg = (M + kWarps - 1) / kWarps;
  const int64_t s0 = warp * seg, s1 = (s0 + seg < M ? s0 + seg : M);
  for (int i = tid; i < 256 * kWarps; i += kThreads) counts[i] = 0;
  __syncthreads();
  for (int64_t base = s0; base < s1; base += 32) {
    const int64_t idx = base + lane;
    const bool valid = idx < s1;
    const unsigned d = valid ? (bld<kSmem>(src + idx) >> shift) & 255u : 0u;
    const unsigned peers = peer_mask(valid, d);
    if (valid && (__ffs(static_cast<int>(peers)) - 1) == lane) counts[d * kWarps + warp] += __popc(peers);
    __syncwarp(0xffffffffu);
  }
  __syncthreads();
  // exclusive scan of counts in (digit, warp) order; 8 entries per thread
  constexpr int kPer = 256 * kWarps / kThreads;
  int32_t loc[kPer];
  int64_t sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    loc[k] = counts[tid * kPer + k];
    sum += loc[k];
  }
  int64_t run = block_exclusive_scan(sum, scratch, static_cast<int64_t*>(nullptr));
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    counts[tid * kPer + k] = static_cast<int32_t>(run);
    run += loc[k];
  }
  __syncthreads();
  for (int64_t base = s0; base < s1; base += 32) {
    const int64_t idx = base + lane;
    const bool valid = idx < s1;
    const uint32_t key = valid ? bld<kSmem>(src + idx) : 0u;
    const unsigned d = (key >> shift) & 255u;
    const unsigned peers = peer_mask(valid, d);
    const bool leader = valid && (__ffs(static_cast<int>(peers)) - 1) == lane;
    if (valid) {
      const int32_t rank = counts[d * kWarps + warp] + __popc(peers & ((1u << lane) - 1u));
      bst<kSmem>(dst + rank, key);
    }
    __syncwarp(0xffffffffu);
    if (leader) counts[d * kWarps + warp] += __popc(peers);
    __syncwarp(0xffffffffu);
  }
  __syncthreads();
}

template <int kThreads>
DSPARK_DEVICE uint32_t block_or_u32(uint32_t v, int64_t* scratch) {
  constexpr int kWarps = kThreads / 32;
  v = __reduce_or_sync(0xffffffffu, v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = static_cast<int64_t>(v);
  __syncthreads();
  uint32_t r = 0;
  for (int w = 0; w < kWarps; ++w) r |= static_cast<uint32_t>(scratch[w]);
  __syncthreads();
  return r;
}

// The admission curve of one survival: cleaned candidates -> sorted keys (returned) and theta[0..M].
// Returns the buffer holding the sorted keys. abuf (optional) receives the cleaned candidates [n, W].
template <int kThreads, bool kSmem>
DSPARK_DEVICE const uint32_t* curve(const ScheduleVerifyLensParams& p, bool budget, const Table& tb, double* theta,
                                    uint32_t* ka, uint32_t* kb, float* abuf, int32_t* counts, int64_t* scratch) {
  const int tid = threadIdx.x;
  const int64_t n = budget ? p.NB : p.N;
  const int64_t K = budget ? p.KB : p.K;
  int64_t hi = p.max_len, lo = p.min_len;
  if (budget) {
    hi = p.max_len < p.KB ? p.max_len : p.KB;
    lo = p.min_len < hi ? p.min_len : hi;
  }
  const int64_t W = hi - lo, M = n * W;
  const Fixed fx = make_fixed(n, hi);
  // 1. clean, running minimum, keys
  int64_t h0 = 0, l0 = 0;
  uint32_t kor = 0, kand = 0xffffffffu;
  for (int64_t r = tid; r < n; r += kThreads) {
    float run = 0.0f;
    double prod = 1.0;
    for (int64_t j = 0; j < hi; ++j) {
      float x;
      if (!budget && p.survival == nullptr) {  // survival = cumprod(sigmoid(z / T)) in float32 (double product)
        float z = load_float(p.conf_logits, p.conf_dtype, r * K + j);
        if (p.sts_temperatures) z = z / load_float(p.sts_temperatures, p.sts_dtype, j);
        const float s = 1.0f / (1.0f + expf(-z));
        prod *= static_cast<double>(s);
        x = static_cast<float>(prod);
      } else {
        x = budget ? load_float(p.budget_survival, p.budget_dtype, r * K + j)
                   : load_float(p.survival, p.survival_dtype, r * K + j);
      }
      x = clean(x);
      run = j == 0 ? x : (x < run ? x : run);
      if (j < lo) {
        int64_t a, b;
        fx.split(run, &a, &b);
        h0 += a;
        l0 += b;
      } else {
        uint32_t bits;
        memcpy(&bits, &run, 4);
        const uint32_t key = kOneBits - bits;
        bst<kSmem>(ka + r * W + (j - lo), key);
        if (abuf) bst<kSmem>(abuf + r * W + (j - lo), run);
        kor |= key;
        kand &= key;
      }
    }
  }
  h0 = block_sum_int(h0, scratch);
  l0 = block_sum_int(l0, scratch);
  const uint32_t diff = block_or_u32<kThreads>(kor, scratch) & block_or_u32<kThreads>(~kand, scratch);  // bits that differ
  // 2. stable radix sort of the keys (ascending key = descending survival, ties in flat order)
  uint32_t* src = ka;
  uint32_t* dst = kb;
  if (M > 1) {
    for (int shift = 0; shift < 32; shift += 8) {
      if (((diff >> shift) & 255u) == 0) continue;  // every key has the same digit: the pass is the identity
      radix_pass<kThreads, kSmem>(src, dst, M, shift, counts, scratch);
      uint32_t* t = src;
      src = dst;
      dst = t;
    }
  }
  // 3. Theta after each admission, rounded as the reference rounds: tau0 = n + fl(sum of j < min_len),
  // C_m = its sequential float64 cumsum of the sorted survivals, tau_m = tau0 + C_m. The exact prefix sums give
  // C_m wherever every prefix up to m is exactly a float64 (then the sequential sums never rounded); from the
  // first prefix that is not, one thread continues the sequential float64 sum (tiny survivals far below the
  // running sum: rare, and short).
  const double tau0 = dadd(static_cast<double>(n), fx.value(h0, l0));
  const double b0 = static_cast<double>(n * (1 + lo));
  if (tid == 0) bst<kSmem>(theta, dmul(tau0, tb.sps(b0)));
  int64_t carry_h = 0, carry_l = 0, first_inexact = M;
  for (int64_t base = 0; base < M; base += int64_t(kThreads) * kItems) {
    const int64_t q0 = base + int64_t(tid) * kItems;  // this thread's kItems consecutive admissions
    int64_t sa = 0, sb = 0;
    for (int u = 0; u < kItems && q0 + u < M; ++u) {
      int64_t a, b;
      fx.split(key_value(bld<kSmem>(src + q0 + u)), &a, &b);
      sa += a;
      sb += b;
    }
    int64_t th, tl;
    int64_t ea = block_exclusive_scan(sa, scratch, &th);
    int64_t eb = block_exclusive_scan(sb, scratch, &tl);
    for (int u = 0; u < kItems && q0 + u < M; ++u) {
      const int64_t q = q0 + u;
      int64_t a, b;
      fx.split(key_value(bld<kSmem>(src + q)), &a, &b);
      ea += a;
      eb += b;
      const int64_t A = carry_h + ea, Ls = carry_l + eb;
      if (!fx.exact(A, Ls) && q < first_inexact) first_inexact = q;
      bst<kSmem>(theta + q + 1, fx.value(A, Ls));  // C_{q+1}
    }
    carry_h += th;
    carry_l += tl;
  }
  first_inexact = block_min_int(first_inexact, scratch);
  if (first_inexact < M && tid == 0) {
    // (0 admissions of 1792 at N = 256, K = 7 with calibrated survival; ~500 of 4096 at K = 16 when the
    // confidences are uniform on (0, 1) and the deep survivals reach 1e-20; the loads are independent of c)
    double c = first_inexact == 0 ? 0.0 : bld<kSmem>(theta + first_inexact);
#pragma unroll 4
    for (int64_t q = first_inexact; q < M; ++q) {
      c = dadd(c, static_cast<double>(key_value(bld<kSmem>(src + q))));
      bst<kSmem>(theta + q + 1, c);
    }
  }
  __syncthreads();
  for (int64_t q = tid; q < M; q += kThreads) {
    const double c = bld<kSmem>(theta + q + 1);
    bst<kSmem>(theta + q + 1, dmul(dadd(tau0, c), tb.sps(dadd(b0, static_cast<double>(q + 1)))));
  }
  __syncthreads();
  return src;
}

// First maximum of theta[0..M] (every thread gets the index).
template <int kThreads, bool kSmem>
DSPARK_DEVICE int64_t first_argmax(const double* theta, int64_t M, double* dscratch, int64_t* scratch) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double best = -INFINITY;
  int64_t bi = INT64_MAX;
  for (int64_t q = tid; q <= M; q += kThreads) {
    const double v = bld<kSmem>(theta + q);
    if (v > best || bi == INT64_MAX) {
      best = v;
      bi = q;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) {
      best = ov;
      bi = oi;
    }
  }
  if (lane == 0) {
    dscratch[warp] = best;
    scratch[warp] = bi;
  }
  __syncthreads();
  double rb = dscratch[0];
  int64_t ri = scratch[0];
  for (int w = 1; w < kWarps; ++w) {
    if (dscratch[w] > rb || (dscratch[w] == rb && scratch[w] < ri)) {
      rb = dscratch[w];
      ri = scratch[w];
    }
  }
  __syncthreads();
  return ri;
}

}  // namespace sched

template <int kThreads, bool kSmem>
__global__ void __launch_bounds__(kThreads, 1)
    schedule_verify_lens_kernel(ScheduleVerifyLensParams p, void* __restrict__ workspace) {
  using namespace sched;
  DSPARK_SHARED_ARRAY(int32_t, counts, 256 * (kThreads / 32));
  DSPARK_SHARED_ARRAY(int64_t, scratch, 32);
  DSPARK_SHARED_ARRAY(double, dscratch, 32);
  DSPARK_SHARED_ARRAY(double, table_c, kTableSmem);
  DSPARK_SHARED_ARRAY(double, table_t, kTableSmem);
  DSPARK_DYNAMIC_SMEM(unsigned char, dyn);
  const Layout lay = layout(p);
  unsigned char* base = kSmem ? dyn : static_cast<unsigned char*>(workspace);
  double* theta = reinterpret_cast<double*>(base);
  uint32_t* ka = reinterpret_cast<uint32_t*>(theta + lay.Mmax + 1);
  uint32_t* kb = ka + lay.Mmax;
  float* abuf = reinterpret_cast<float*>(kb + lay.Mmax);
  const int tid = threadIdx.x;

  for (int64_t i = tid; i < p.P && i < kTableSmem; i += kThreads) {
    table_c[i] = static_cast<double>(ldg(p.token_counts + i));
    table_t[i] = static_cast<double>(ldg(p.step_time_ms + i));
  }
  __syncthreads();
  const Table tb{table_c, table_t, p.token_counts, p.step_time_ms, p.P, p.fixed_overhead_ms};
  const int64_t M = lay.M, W = p.max_len - p.min_len;

  int64_t m_budget = 0;
  if (!p.exact && p.has_budget) {
    curve<kThreads, kSmem>(p, true, tb, theta, ka, kb, nullptr, counts, scratch);
    m_budget = first_argmax<kThreads, kSmem>(theta, lay.Mb, dscratch, scratch);
  }
  const uint32_t* sorted = curve<kThreads, kSmem>(p, false, tb, theta, ka, kb, abuf, counts, scratch);

  int64_t m_star;
  if (p.exact) {
    int64_t first = M;
    for (int64_t q = tid; q < M; q += kThreads)
      if (!(bld<kSmem>(theta + q + 1) > bld<kSmem>(theta + q)) && q < first) first = q;
    m_star = block_min_int(first, scratch);
  } else {
    m_star = p.has_budget ? (m_budget < M ? m_budget : M) : first_argmax<kThreads, kSmem>(
                                                                      theta, M, dscratch, scratch);
    if (bld<kSmem>(theta + m_star) < dmul(p.gain, bld<kSmem>(theta + M))) m_star = M;
  }
  if (tid == 0) stg(p.theta, static_cast<float>(bld<kSmem>(theta + m_star)));

  // the m*-th admission: its survival v*, and how many of its ties are admitted
  float v_star = 2.0f;  // m* = 0: nothing is admitted (every survival <= 1 < 2)
  int64_t ties_admitted = 0;
  if (m_star > 0) {
    const uint32_t key = bld<kSmem>(sorted + m_star - 1);
    int64_t before = 0;
    for (int64_t q = tid; q < M; q += kThreads) before += bld<kSmem>(sorted + q) < key ? 1 : 0;
    before = block_sum_int(before, scratch);  // candidates with a > v*
    ties_admitted = m_star - before;
    const uint32_t bits = kOneBits - key;
    memcpy(&v_star, &bits, 4);
  }

  // per request: L_r and the prefix sums of 1 + L_r
  if (tid == 0) stg(p.cu_seqlens, int32_t(0));
  int64_t carry_eq = 0, carry_rows = 0;
  for (int64_t r0 = 0; r0 < p.N; r0 += kThreads) {
    const int64_t r = r0 + tid;
    int64_t gt = 0, eq = 0;
    if (r < p.N) {
      for (int64_t c = 0; c < W; ++c) {
        const float a = bld<kSmem>(abuf + r * W + c);
        gt += a > v_star ? 1 : 0;
        eq += a == v_star ? 1 : 0;
      }
    }
    int64_t tile_eq, tile_rows;
    const int64_t eq_before = carry_eq + block_exclusive_scan(eq, scratch, &tile_eq);
    int64_t adm = ties_admitted - eq_before;
    adm = adm < 0 ? 0 : (adm > eq ? eq : adm);
    const int64_t len = p.min_len + gt + adm;
    const int64_t rows = r < p.N ? 1 + len : 0;
    const int64_t rows_before = carry_rows + block_exclusive_scan(rows, scratch, &tile_rows);
    if (r < p.N) {
      stg(p.verify_lens + r, static_cast<int32_t>(len));
      stg(p.cu_seqlens + r + 1, static_cast<int32_t>(rows_before + rows));
    }
    carry_eq += tile_eq;
    carry_rows += tile_rows;
  }
}
#endif

// Workspace bytes (0 when the arrays fit in shared memory).
inline size_t schedule_verify_lens_workspace_bytes(const ScheduleVerifyLensParams& p) {
  const sched::Layout l = sched::layout(p);
  return l.smem ? 0 : l.bytes;
}

namespace sched {
// Opt `kernel` in to `bytes` of dynamic shared memory before each launch that uses any (a host-side attribute, no
// sync): a GPU limits static + dynamic shared memory to 48 KB without it, and the kernel's static part (its
// block-scan scratch) counts too, so no dynamic size is safe to leave out.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  return bytes > 0 ? set_max_dynamic_smem(kernel, bytes) : cudaSuccess;
}
}  // namespace sched

// Launch on `stream`; the caller has checked the arguments (see ScheduleVerifyLensParams). One CTA.
inline cudaError_t launch_schedule_verify_lens(const ScheduleVerifyLensParams& p, void* workspace,
                                               cudaStream_t stream) {
  using namespace sched;
  const Layout l = layout(p);
  if (!l.smem && workspace == nullptr) return cudaErrorInvalidValue;
  LaunchConfig cfg;
  cfg.grid = dim3(1);
  cfg.stream = stream;
  cfg.smem = l.smem ? l.bytes : 0;
  if (l.Mmax <= kSmallM && l.smem) {
    cfg.block = dim3(kSmallThreads);
    const cudaError_t e = allow_dynamic_smem(schedule_verify_lens_kernel<kSmallThreads, true>, cfg.smem);
    if (e != cudaSuccess) return e;
    return launch("schedule_verify_lens_kernel<256, smem>", schedule_verify_lens_kernel<kSmallThreads, true>, cfg, p,
                  workspace);
  }
  cfg.block = dim3(kThreads);
  if (l.smem) {
    const cudaError_t e = allow_dynamic_smem(schedule_verify_lens_kernel<kThreads, true>, cfg.smem);
    if (e != cudaSuccess) return e;
    return launch("schedule_verify_lens_kernel<512, smem>", schedule_verify_lens_kernel<kThreads, true>, cfg, p,
                  workspace);
  }
  return launch("schedule_verify_lens_kernel<512, global>", schedule_verify_lens_kernel<kThreads, false>, cfg, p,
                workspace);
}

}  // namespace dspark
