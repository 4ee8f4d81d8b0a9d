// A batch-invariant linear layer for the decode loop's CPU target: y = x W^T (+ b) where every output element is
// computed by the same instruction sequence whatever the number of rows, the row's place in the batch or the thread
// split. PyTorch's CPU GEMMs choose their kernel (and their accumulation order) by shape and thread count, so a
// verify forward over 8 rows can round a logit differently from a decode forward over 1 row; with bf16 weights that
// flips greedy argmax ties, and speculative output would no longer equal the target's own.
//
// Order of one output (row m, feature j) with AVX2 + FMA: 8 float32 lanes, lane l accumulating x[m, k] * w[j, k]
// for k = l mod 8 in increasing k, then a fixed pairwise tree over the lanes, then the tail k >= 8 floor(K / 8) in
// increasing k, then the bias (without AVX2: the same order, mul then add). With bf16 x and bf16 W on AVX512-BF16:
// 16 lanes of pair dot products instead (dot_block_bf16). A machine takes one path for every call, so results are
// batch-invariant on it (not equal across instruction sets). Each weight row is read once per call and applied to
// every row of x while it sits in L1, so the layer is bound by reading W, as decode is.
//
// x: [M, K] float32 / bfloat16 / float16; w: [N, K] of any of those; b: [N] or none. Returns [M, N] in x's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSPARK_X86 1
#endif

namespace {

constexpr int kLanes = 8;
constexpr int kRows = 4;  // rows of x per pass over a weight row

// The fixed reduction tree of 8 lanes: l + 4, then l + 2, then l + 1 (halve8 is the same in registers).
inline float tree8(const float* l) {
  const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
  return (a0 + a2) + (a1 + a3);
}

// Portable path (no AVX2 / FMA / F16C): the same lanes and tree, mul then add.
template <int R>
void dot_rows_portable(const float* w, const float* x, int64_t k, int64_t ldx, float* out) {
  float acc[R][kLanes] = {};
  const int64_t kv = k / kLanes * kLanes;
  for (int64_t i = 0; i < kv; i += kLanes)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) acc[r][l] += w[i + l] * x[r * ldx + i + l];
  for (int r = 0; r < R; ++r) {
    float s = tree8(acc[r]);
    for (int64_t i = kv; i < k; ++i) s += w[i] * x[r * ldx + i];
    out[r] = s;
  }
}

#ifdef DSPARK_X86
// tree8 in registers: lanes l + 4, then l + 2, then l + 1 (the same sums in the same order).
__attribute__((target("avx2,fma,f16c"))) inline float halve4(__m128 b) {
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
__attribute__((target("avx2,fma,f16c"))) inline float halve8(__m256 a) {
  return halve4(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}
// 16 lanes: l + 8 first, then tree8.
__attribute__((target("avx512f,avx2,fma,f16c"))) inline float halve16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return halve8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

// Eight weights widened to float32: bf16 by a shift, fp16 by F16C, float32 as they are.
template <typename W>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w8(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<W, at::BFloat16>) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <int R, typename W>
__attribute__((target("avx2,fma,f16c"))) void dot_rows_avx2(const W* w, const float* x, int64_t k, int64_t ldx,
                                                             float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t kv = k / kLanes * kLanes;
  for (int64_t i = 0; i < kv; i += kLanes) {
    const __m256 wv = load_w8(w + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ldx + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = halve8(acc[r]);
    for (int64_t i = kv; i < k; ++i) s = std::fma(static_cast<float>(w[i]), x[r * ldx + i], s);
    out[r] = s;
  }
}

bool use_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

bool use_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

template <typename W>
void widen_row(const W* p, int64_t k, float* buf) {
  for (int64_t i = 0; i < k; ++i) buf[i] = static_cast<float>(p[i]);
}

// Every row of x against one weight row: `dot(r, rows, out)` fills out[0..rows) for rows r..r+rows-1 (blocks of
// B rows, then the remainder one at a time); results go to the output column `col` (stride ldo between rows).
template <int B, typename Dot>
void row_blocks(int64_t m, float* col, int64_t ldo, Dot dot) {
  float tmp[B];
  int64_t r = 0;
  for (; r + B <= m; r += B) {
    dot(r, std::integral_constant<int, B>{}, tmp);
    for (int i = 0; i < B; ++i) col[(r + i) * ldo] = tmp[i];
  }
  for (; r < m; ++r) {
    dot(r, std::integral_constant<int, 1>{}, tmp);
    col[r * ldo] = tmp[0];
  }
}

template <typename W>
void apply_row(const W* wrow, float* buf, const float* x, int64_t m, int64_t k, float* col, int64_t ldo) {
#ifdef DSPARK_X86
  if (use_avx2())
    return row_blocks<kRows>(m, col, ldo, [&](int64_t r, auto rows, float* out) {
      dot_rows_avx2<decltype(rows)::value>(wrow, x + r * k, k, k, out);
    });
#endif
  widen_row(wrow, k, buf);
  row_blocks<kRows>(m, col, ldo, [&](int64_t r, auto rows, float* out) {
    dot_rows_portable<decltype(rows)::value>(buf, x + r * k, k, k, out);
  });
}

#ifdef DSPARK_X86
// bf16 x bf16 on AVX512-BF16, C weight rows (output columns) x R rows of x at once. Every output is one float32
// accumulator of 16 lanes, lane l taking the pairs k = 2l, 2l + 1 (mod 32) in increasing k with VDPBF16PS (exact
// products; the instruction's own rounding of each pair sum), then the tree halve16, then the tail k >= 32 floor(K /
// 32): the same sequence whatever C and R, so the blocking (each weight vector loaded once per 32 k for R rows, each
// x vector once for C columns, C * R accumulators in registers) changes no result.
// `next`: C weight rows whose lines are prefetched meanwhile (the next block's; this block's own for the last one).
template <int C, int R>
__attribute__((target("avx512f,avx512bf16,avx2,fma,f16c"))) void dot_block_bf16(
    const at::BFloat16* w, const at::BFloat16* next, const at::BFloat16* x, int64_t k, float* out, int64_t ldo) {
  __m512 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t kv = k / 32 * 32;
  for (int64_t i = 0; i < kv; i += 32) {
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * k + i);
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(next + c * k + i), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c * k + i);
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], wv, xv[r]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float s = halve16(acc[c][r]);
      for (int64_t i = kv; i < k; ++i) s += static_cast<float>(w[c * k + i]) * static_cast<float>(x[r * k + i]);
      out[r * ldo + c] = s;
    }
}

constexpr int kCols16 = 4;  // weight rows per block of the bf16 path
constexpr int kRows16 = 4;  // rows of x per block (kCols16 * kRows16 = 16 of the 32 vector registers)

// Columns j..j+C of every row of x: rows in blocks of kRows16, then the remainder one at a time.
template <int C>
void column_block_bf16(const at::BFloat16* w, const at::BFloat16* next, const at::BFloat16* x, int64_t m,
                       int64_t k, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + kRows16 <= m; r += kRows16) dot_block_bf16<C, kRows16>(w, next, x + r * k, k, out + r * n, n);
  for (; r < m; ++r) dot_block_bf16<C, 1>(w, next, x + r * k, k, out + r * n, n);
}

// The bf16 x bf16 path: x stays bf16 (no float32 copy); threads split the columns in blocks of kCols16.
void linear_columns_bf16(const at::BFloat16* w, const at::BFloat16* x, const float* bias, int64_t m, int64_t n,
                         int64_t k, float* out) {
  const int64_t blocks = (n + kCols16 - 1) / kCols16;
  const int64_t grain = std::max<int64_t>(4, blocks / (8 * at::get_num_threads()));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j = b * kCols16;
      if (j + kCols16 <= n) {
        const bool full_next = j + 2 * kCols16 <= n;
        column_block_bf16<kCols16>(w + j * k, w + (full_next ? j + kCols16 : j) * k, x, m, k, out + j, n);
      } else {
        for (int64_t c = j; c < n; ++c) column_block_bf16<1>(w + c * k, w + c * k, x, m, k, out + c, n);
      }
      if (bias)
        for (int64_t q = 0; q < m; ++q)
          for (int64_t c = j; c < std::min(n, j + kCols16); ++c) out[q * n + c] += bias[c];
    }
  });
}
#endif

template <typename W>
void linear_columns(const W* w, const float* x, const float* bias, int64_t m, int64_t n, int64_t k, float* out) {
  const int64_t grain = std::max<int64_t>(16, n / (8 * at::get_num_threads()));
  at::parallel_for(0, n, grain, [&](int64_t j0, int64_t j1) {
    std::vector<float> buf(k);
    for (int64_t j = j0; j < j1; ++j) {
      apply_row(w + j * k, buf.data(), x, m, k, out + j, n);
      if (bias)
        for (int64_t r = 0; r < m; ++r) out[r * n + j] += bias[j];
    }
  });
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "row_linear: x and weight must be CPU tensors");
  TORCH_CHECK(weight.dim() == 2, "row_linear: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "row_linear: x must be [..., K = ", weight.size(1),
              "], got ", x.sizes());
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
              "row_linear: weight must be float32, bfloat16 or float16, got ", wt);
  const int64_t n = weight.size(0), k = weight.size(1);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "row_linear: bias must be [N = ", n, "]");
  const at::Tensor w = weight.contiguous();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
#ifdef DSPARK_X86
  if (wt == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && use_avx512_bf16()) {
    const at::Tensor xb = x.reshape({-1, k}).contiguous();
    at::Tensor out = at::empty({xb.size(0), n}, xb.options().dtype(at::kFloat));
    if (xb.size(0) > 0 && n > 0)
      linear_columns_bf16(w.data_ptr<at::BFloat16>(), xb.data_ptr<at::BFloat16>(),
                          bias ? bf.data_ptr<float>() : nullptr, xb.size(0), n, k, out.data_ptr<float>());
    return out.to(x.scalar_type()).view(sizes);
  }
#endif
  const at::Tensor xf = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = xf.size(0);
  at::Tensor out = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  if (m > 0 && n > 0) {
    if (wt == at::kFloat) linear_columns(w.data_ptr<float>(), xp, bp, m, n, k, op);
    else if (wt == at::kBFloat16) linear_columns(w.data_ptr<at::BFloat16>(), xp, bp, m, n, k, op);
    else linear_columns(w.data_ptr<at::Half>(), xp, bp, m, n, k, op);
  }
  return out.to(x.scalar_type()).view(sizes);
}

}  // namespace

TORCH_LIBRARY(dspark_decode, m) { m.def("row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(dspark_decode, CPU, m) { m.impl("row_linear", &row_linear); }
