// The counter RNG of dspark/rng.cuh over a run of tokens, for the CPU sweeps: the portable loop over Philox blocks,
// and an AVX2 version that evaluates eight counter blocks (32 tokens) per vector of 32-bit lanes.
#include <immintrin.h>

#include "common.h"

namespace dspark_cpu {

namespace {

void put(const dspark::rng::F32x4& f, int64_t count, float* u) {
  const float v[4] = {f.x, f.y, f.z, f.w};
  std::copy(v, v + count, u);
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// (hi, lo) 32-bit halves of a * b in each 32-bit lane.
__attribute__((target("avx2"))) inline void mulhilo(__m256i a, __m256i b, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, b);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

__attribute__((target("avx2"))) inline __m256 to_uniform(__m256i x) {
  const __m256i bits = _mm256_or_si256(_mm256_srli_epi32(x, 8), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(dspark::rng::kTwoPowMinus24));
}

// Eight counter blocks quad0 .. quad0 + 7 in the lanes; their 32 uniforms in token order.
__attribute__((target("avx2"))) void philox8(const dspark::rng::Philox& ph, uint32_t c1, uint32_t c2, uint32_t quad0,
                                             float* u) {
  __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(quad0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i y = _mm256_set1_epi32(static_cast<int>(c1));
  __m256i z = _mm256_set1_epi32(static_cast<int>(c2));
  __m256i w = _mm256_set1_epi32(static_cast<int>(ph.offset_lo));
  uint32_t k0 = ph.k0, k1 = ph.k1;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(dspark::rng::kPhiloxM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(dspark::rng::kPhiloxM1));
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo(x, m0, hi0, lo0);
    mulhilo(z, m1, hi1, lo1);
    x = _mm256_xor_si256(_mm256_xor_si256(hi1, y), _mm256_set1_epi32(static_cast<int>(k0)));
    y = lo1;
    z = _mm256_xor_si256(_mm256_xor_si256(hi0, w), _mm256_set1_epi32(static_cast<int>(k1)));
    w = lo0;
    k0 += dspark::rng::kPhiloxW0;
    k1 += dspark::rng::kPhiloxW1;
  }
  // words (x, y, z, w) of blocks 0..7 -> tokens 4b + word
  const __m256i t0 = _mm256_unpacklo_epi32(x, y), t1 = _mm256_unpackhi_epi32(x, y);
  const __m256i t2 = _mm256_unpacklo_epi32(z, w), t3 = _mm256_unpackhi_epi32(z, w);
  const __m256i r0 = _mm256_unpacklo_epi64(t0, t2), r1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i r2 = _mm256_unpacklo_epi64(t1, t3), r3 = _mm256_unpackhi_epi64(t1, t3);
  _mm256_storeu_ps(u, to_uniform(_mm256_permute2x128_si256(r0, r1, 0x20)));
  _mm256_storeu_ps(u + 8, to_uniform(_mm256_permute2x128_si256(r2, r3, 0x20)));
  _mm256_storeu_ps(u + 16, to_uniform(_mm256_permute2x128_si256(r0, r1, 0x31)));
  _mm256_storeu_ps(u + 24, to_uniform(_mm256_permute2x128_si256(r2, r3, 0x31)));
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

}  // namespace

void uniforms(const dspark::rng::Philox& ph, uint64_t request, uint64_t position, uint32_t stream, int64_t token0,
              int64_t n, float* u) {
  const int64_t quad0 = token0 >> 2, whole = n / 4;
  int64_t q = 0;
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  if (has_avx2()) {
    const uint32_t c1 = static_cast<uint32_t>(position) | (stream << 24), c2 = static_cast<uint32_t>(request);
    for (; q + 8 <= whole; q += 8) philox8(ph, c1, c2, static_cast<uint32_t>(quad0 + q), u + 4 * q);
  }
#endif
  for (; q < whole; ++q) put(ph.uniform4(request, position, stream, quad0 + q), 4, u + 4 * q);
  if (n > 4 * whole) put(ph.uniform4(request, position, stream, quad0 + whole), n - 4 * whole, u + 4 * whole);
}

}  // namespace dspark_cpu
