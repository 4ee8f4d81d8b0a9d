// What every CPU kernel shares: the vectorized sweep helpers (float blocks converted from the tensor's dtype,
// exp / log written as plain arithmetic so the compiler vectorizes them), the argmax rule, the counter RNG of
// dspark/rng.cuh (compiled for the host), the threading over row chunks, and the entry points registration.cpp
// registers as the CPU kernels of torch.ops.dspark_cpu.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "dspark/rng.cuh"

// Hot sweeps are compiled three times (x86-64-v4: AVX-512; x86-64-v3: AVX2 + FMA; the baseline) and chosen when the
// library loads (GCC function multiversioning): no flag of the build machine decides the instruction set.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DSPARK_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSPARK_CPU_CLONES
#endif
// Helpers of the cloned sweeps: inlined into each clone, so they vectorize with its instruction set.
#define DSPARK_CPU_INLINE inline __attribute__((always_inline))

namespace dspark_cpu {

constexpr int64_t kBlock = 256;        // tokens converted to float32 at a time (1 KB: stays in L1)
constexpr int64_t kMinChunk = 4096;    // the smallest vocabulary chunk one thread sweeps
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kGumbelBound = 16.7f;  // above -log(-log(u)) for every uniform the generator gives (16.64)

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// exp(x) for x <= 0 (softmax terms): Cody-Waite reduction and a degree-6 polynomial (Cephes expf), within 2 ulp;
// exactly 0 below -87.3 (and for -inf), NaN for NaN.
DSPARK_CPU_INLINE float exp_nonpos(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  const float shifted = xc * 1.44269504f + 12582912.0f;  // round(x / ln 2) in the low mantissa bits
  const float n = shifted - 12582912.0f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float scale = bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  const float y = (p * r * r + r + 1.0f) * scale;
  return x < -87.3f ? 0.0f : y;
}

// log(x) for normal positive x (uniforms and their negative logs): Cephes logf, within 2 ulp.
DSPARK_CPU_INLINE float log_pos(float x) {
  const uint32_t b = float_bits(x);
  int32_t e = static_cast<int32_t>(b >> 23) - 126;
  float m = bits_float((b & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
  const bool low = m < 0.70710678f;
  e -= low ? 1 : 0;
  const float twice = m + m - 1.0f, once = m - 1.0f;
  m = low ? twice : once;
  const float z = m * m;
  float p = 7.0376836292e-2f;
  p = p * m - 1.1514610310e-1f;
  p = p * m + 1.1676998740e-1f;
  p = p * m - 1.2420140846e-1f;
  p = p * m + 1.4249322787e-1f;
  p = p * m - 1.6668057665e-1f;
  p = p * m + 2.0000714765e-1f;
  p = p * m - 2.4999993993e-1f;
  p = p * m + 3.3333331174e-1f;
  const float fe = static_cast<float>(e);
  float y = p * m * z;
  y += fe * -2.12194440e-4f;
  y += -0.5f * z;
  return (m + y) + fe * 0.693359375f;
}

// n elements of src as float32 into dst.
template <typename T>
DSPARK_CPU_INLINE void to_float(const T* src, int64_t n, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Asks for the row's elements [b + ahead, b + ahead + kBlock) (clipped at hi), one request per 64-byte line, so the
// block after next is on its way while this one is computed on (a prefetch never faults).
template <typename T>
DSPARK_CPU_INLINE void prefetch_ahead(const T* row, int64_t b, int64_t hi) {
  constexpr int64_t kAhead = 2 * kBlock, kLine = 64 / sizeof(T);
  const int64_t end = std::min(hi, b + kAhead + kBlock);
  for (int64_t i = b + kAhead; i < end; i += kLine) __builtin_prefetch(row + i);
}

// e4m3 (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7f / 0xff NaN, no infinity) to float32 in integer
// arithmetic the compiler vectorizes: a normal code's exponent and mantissa move into place, a subnormal one is
// mantissa x 2^-9. Exact for every code.
template <>
inline void to_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, int64_t n, float* dst) {
  const uint8_t* x = reinterpret_cast<const uint8_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t c = x[i], sign = (c & 0x80u) << 24, e = (c >> 3) & 0xfu, m = c & 7u;
    const float normal = bits_float(sign | ((e + 120u) << 23) | (m << 20));
    const float sub = bits_float(float_bits(static_cast<float>(m) * 0.001953125f) | sign);
    const float v = e == 0 ? sub : normal;
    dst[i] = (c & 0x7fu) == 0x7fu ? kNaN : v;
  }
}

// src[0..n) as float32: src itself for float32 rows, else converted into buf.
template <typename T>
DSPARK_CPU_INLINE const float* as_float(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, n, buf);
    return buf;
  }
}

// f(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor (or float8_e4m3fn where `fp8`).
template <typename F>
inline void with_float_type(at::ScalarType dtype, F&& f, bool fp8 = false) {
  if (fp8 && dtype == at::kFloat8_e4m3fn) return f(c10::Float8_e4m3fn{});
  switch (dtype) {
    case at::kFloat: f(float{}); return;
    case at::kBFloat16: f(c10::BFloat16{}); return;
    case at::kHalf: f(c10::Half{}); return;
    default: TORCH_CHECK(false, "dspark_cpu: float32, bfloat16 or float16 expected, got ", dtype);
  }
}

// The package's argmax rule over float scores: NaN counts as -inf, ties go to the lowest index (an all -inf row
// gives its first index).
struct Best {
  float value = -kInf;
  int64_t index = 0;
};
inline Best better(const Best& a, const Best& b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

// The best of buf[0..n) (NaN as -inf) against `best`, whose index precedes every one of these (base + i).
DSPARK_CPU_INLINE void fold_best(const float* buf, int64_t n, int64_t base, Best& best) {
  float m = -kInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = buf[i] > m ? buf[i] : m;
  if (!(m > best.value)) return;
  for (int64_t i = 0; i < n; ++i) {
    if (buf[i] == m) {
      best = Best{m, base + i};
      return;
    }
  }
}

// Softmax statistics of x / T over a row or a chunk of one: the largest value (NaN left out), the sum of
// exp(x / T - m), and whether a NaN was seen.
struct Stats {
  float m = -kInf;
  float s = 0.f;
  bool nan = false;
};

inline Stats merge(const Stats& a, const Stats& b) {
  const Stats& hi = b.m > a.m ? b : a;
  const Stats& lo = b.m > a.m ? a : b;
  Stats r{hi.m, hi.s, a.nan || b.nan};
  if (lo.m != -kInf && std::isfinite(hi.m)) r.s += lo.s * std::exp(lo.m - hi.m);
  return r;
}

// After a NaN, a +inf or with no finite value, softmax is NaN everywhere (as torch.softmax gives).
inline bool bad(const Stats& st) { return st.nan || !std::isfinite(st.m); }

// log softmax(x / T) at a value y = x / T of the row.
inline float log_prob(const Stats& st, float y) { return bad(st) ? kNaN : (y - st.m) - std::log(st.s); }

// Folds x[0..n) into st: the maximum is max(x) / T, exactly the maximum of x / T; the sum's terms are exp(x / T - m),
// x / T rounded as the reference rounds it (an ulp of x / T is a large step in exp's argument when T is small).
// At T = inf an infinite x gives x / T = NaN (as in the reference), so it marks the row NaN like a NaN x does.
DSPARK_CPU_INLINE void fold_stats(const float* x, int64_t n, float t, Stats& st) {
  float mx = -kInf;
  int nan = 0;
  const int inf_t = std::isinf(t);
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    nan |= (x[i] != x[i]) | (inf_t & (std::fabs(x[i]) == kInf));
    mx = x[i] > mx ? x[i] : mx;
  }
  st.nan = st.nan || nan;
  const float m = mx / t;
  if (m > st.m) {
    st.s = st.m == -kInf ? 0.f : st.s * std::exp(st.m - m);
    st.m = m;
  }
  if (m == -kInf || !std::isfinite(st.m)) return;
  const float shift = st.m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += exp_nonpos(x[i] / t - shift);
  st.s += sum;
}

// u[i] = uniform(request, position, stream, token0 + i) for i < n; token0 is a multiple of 4. One definition per
// instruction set (GCC picks one when the library loads); both evaluate dspark/rng.cuh's Philox, bit for bit.
void uniforms(const dspark::rng::Philox& ph, uint64_t request, uint64_t position, uint32_t stream, int64_t token0,
              int64_t n, float* u);

inline dspark::rng::Philox philox_of(const at::Tensor& rng_key) {
  TORCH_CHECK(rng_key.scalar_type() == at::kLong && rng_key.numel() == 2,
              "dspark_cpu: rng_key must be int64 [2] (seed, offset)");
  const int64_t* k = rng_key.data_ptr<int64_t>();
  return dspark::rng::Philox::make(static_cast<uint64_t>(k[0]), static_cast<uint64_t>(k[1]));
}

// How many chunks to cut each of `rows` rows of `vocab` tokens into: enough items for every thread about four
// times over, none shorter than kMinChunk tokens.
inline int64_t chunks_per_row(int64_t rows, int64_t vocab) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t most = std::max<int64_t>(1, vocab / kMinChunk);
  const int64_t want = (4 * threads + std::max<int64_t>(rows, 1) - 1) / std::max<int64_t>(rows, 1);
  return std::clamp<int64_t>(want, 1, most);
}

// [lo, hi) of chunk c of `chunks` over `vocab` tokens; chunks start at multiples of kBlock (whole Philox quads).
inline std::pair<int64_t, int64_t> chunk_range(int64_t vocab, int64_t chunks, int64_t c) {
  const int64_t size = ((vocab + chunks - 1) / chunks + kBlock - 1) / kBlock * kBlock;
  const int64_t lo = std::min(vocab, c * size);
  return {lo, std::min(vocab, lo + size)};
}

// fn(task, chunk, lo, hi) for every chunk of `tasks` rows of `vocab` tokens, the items spread over the threads;
// each thread gets at least kSerialElements elements (a token weighs `weight` elements: W2's rank for
// draft_block), so a small pass runs on the calling thread (waking the others costs more than it saves, and much
// more on a machine whose other cores are busy).
constexpr int64_t kSerialElements = 1 << 18;
template <typename F>
inline void for_each_chunk(int64_t tasks, int64_t vocab, int64_t chunks, const F& fn, int64_t weight = 1) {
  const int64_t chunk_elements = std::max<int64_t>(1, (vocab + chunks - 1) / chunks * weight);
  const int64_t grain = std::max<int64_t>(1, kSerialElements / chunk_elements);
  at::parallel_for(0, tasks * chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [lo, hi] = chunk_range(vocab, chunks, i % chunks);
      fn(i / chunks, i % chunks, lo, hi);
    }
  });
}

// An int32 / int64 tensor as contiguous int64 (small per-request inputs).
inline at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }
inline at::Tensor as_float(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// The CPU kernels (one file each), registered by registration.cpp.
void rng_uniform(at::Tensor& out, const at::Tensor& rng_key, int64_t stream);
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_chain(
    const at::Tensor& target_logits, const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& target_to_draft,
    const std::optional<at::Tensor>& draft_candidates, const std::optional<at::Tensor>& draft_logprobs,
    const std::optional<at::Tensor>& verify_lens, const std::optional<at::Tensor>& survival,
    const std::optional<at::Tensor>& thresholds, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, const std::optional<at::Tensor>& stop_token_ids, c10::string_view method);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> accept_prefix_scan(
    const at::Tensor& tokens, const at::Tensor& seq_lens, const std::optional<at::Tensor>& num_accepted,
    const std::optional<at::Tensor>& accept_mask, const std::optional<at::Tensor>& verify_cu_seqlens,
    const std::optional<at::Tensor>& block_table, int64_t block_size, const std::optional<at::Tensor>& max_seq_lens,
    const std::optional<at::Tensor>& stop_token_ids);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_block(
    const at::Tensor& base_logits, const at::Tensor& anchor_tokens, c10::string_view head_kind, const at::Tensor& w1,
    const at::Tensor& w2, const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& draft_to_target,
    const std::optional<at::Tensor>& wg, const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& wj,
    const std::optional<at::Tensor>& bj, const std::optional<at::Tensor>& hidden,
    const std::optional<at::Tensor>& conf_weight, const std::optional<at::Tensor>& conf_bias,
    const std::optional<at::Tensor>& sts_temperatures, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, bool return_logits, int64_t top_k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> schedule_verify_lens(
    const std::optional<at::Tensor>& survival, const std::optional<at::Tensor>& conf_logits,
    const std::optional<at::Tensor>& sts_temperatures, const at::Tensor& token_counts,
    const at::Tensor& step_time_ms, double fixed_overhead_ms, int64_t min_len, int64_t max_len,
    c10::string_view mode, const std::optional<at::Tensor>& budget_survival, double min_gain,
    const std::optional<at::Tensor>& active);

}  // namespace dspark_cpu
