// dspark/mma.cuh: one warp-level matrix multiply-accumulate on tensor cores, the same source in both builds.
//
// Shape m32n8k16 (it suits a small group of requests: 8 columns): a warp computes
//   D[32 x 8] (float32) += A[32 x 16] x B[16 x 8],  A and B of one 16-bit type T (__nv_bfloat16 or __half),
// with the operands in SHARED memory:
//   A row-major:    A(i, k) = a[i * lda + k]
//   B column-major: B(k, j) = b[j * ldb + k]   (column j of B is a contiguous row of k values: a request's vector)
//   D column-major: D(i, j) = d[j * ldd + i]   (store: column j = the 32 outputs of request j)
// Operand rules (WMMA's, checked by the SIMT build so a violation fails on the CPU as it would on the GPU):
// a, b 32-byte aligned, lda and ldb multiples of 8 elements; d 32-byte aligned and ldd a multiple of 4 floats.
// Every call is a warp collective: all 32 lanes of the warp must make it together (uniform control flow), like
// __shfl_sync; fragments are opaque (no lane layout is assumed by the callers).
//
// GPU build: nvcuda::wmma (sm_80+): load_matrix_sync / mma_sync / store_matrix_sync, so the per-lane fragment
// layout is the toolkit's business. The tensor cores form each product exactly (16-bit x 16-bit fits a float32
// mantissa) and accumulate in float32.
// SIMT build: an exact emulation. Each entry point is a full-mask warp collective (__syncwarp: a lane that is
// missing or waits elsewhere faults the launch). Lane l holds row l of A and row l of D, so each lane forms 1/32
// of the 32 x 8 x 16 products (its row's 128), in float32 (exact products, float32 sums in k order); the B
// fragment is a private copy of B per lane. The operands are plain shared-memory reads: the global byte counters
// do not see them (they are not global traffic).
#pragma once

#include <stdint.h>

#include "platform.cuh"
#include "vec.cuh"

#if !defined(DSPARK_SIMT) && defined(__CUDACC__)
#include <mma.h>
#endif

namespace dspark {
namespace mma {

constexpr int kM = 32, kN = 8, kK = 16;

#if defined(DSPARK_SIMT)
template <typename T>
struct FragA {
  float a[kK];  // row `lane` of A
};
template <typename T>
struct FragB {
  float b[kN][kK];  // all of B (column-major), a copy per lane
};
struct Acc {
  float d[kN];  // row `lane` of D
};

namespace detail {
inline void check(const void* p, int64_t ld, int ld_multiple, const char* what) {
  if ((reinterpret_cast<uintptr_t>(p) & 31u) != 0u) ::dspark::simt::device_fault(what);
  if (ld <= 0 || ld % ld_multiple != 0) ::dspark::simt::device_fault(what);
}
}  // namespace detail

DSPARK_DEVICE void zero(Acc& acc) {
  __syncwarp();
  for (int j = 0; j < kN; ++j) acc.d[j] = 0.0f;
}
template <typename T>
DSPARK_DEVICE void load_a(FragA<T>& f, const T* a, int lda) {
  __syncwarp();
  detail::check(a, lda, 8, "mma::load_a: A must be 32-byte aligned with lda a multiple of 8 elements");
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int k = 0; k < kK; ++k) f.a[k] = to_float(a[static_cast<int64_t>(lane) * lda + k]);
}
template <typename T>
DSPARK_DEVICE void load_b(FragB<T>& f, const T* b, int ldb) {
  __syncwarp();
  detail::check(b, ldb, 8, "mma::load_b: B must be 32-byte aligned with ldb a multiple of 8 elements");
  for (int j = 0; j < kN; ++j)
    for (int k = 0; k < kK; ++k) f.b[j][k] = to_float(b[static_cast<int64_t>(j) * ldb + k]);
}
template <typename T>
DSPARK_DEVICE void mma(Acc& acc, const FragA<T>& a, const FragB<T>& b) {
  __syncwarp();
  for (int j = 0; j < kN; ++j) {
    float s = acc.d[j];
    for (int k = 0; k < kK; ++k) s += a.a[k] * b.b[j][k];  // exact product, float32 sum
    acc.d[j] = s;
  }
}
DSPARK_DEVICE void store(float* d, int ldd, const Acc& acc) {
  __syncwarp();
  detail::check(d, ldd, 4, "mma::store: D must be 32-byte aligned with ldd a multiple of 4 floats");
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int j = 0; j < kN; ++j) d[static_cast<int64_t>(j) * ldd + lane] = acc.d[j];
}

#elif defined(__CUDACC__)
template <typename T>
using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, kM, kN, kK, T, nvcuda::wmma::row_major>;
template <typename T>
using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, kM, kN, kK, T, nvcuda::wmma::col_major>;
using Acc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kM, kN, kK, float>;

DSPARK_DEVICE void zero(Acc& acc) { nvcuda::wmma::fill_fragment(acc, 0.0f); }
template <typename T>
DSPARK_DEVICE void load_a(FragA<T>& f, const T* a, int lda) {
  nvcuda::wmma::load_matrix_sync(f, a, static_cast<unsigned>(lda));
}
template <typename T>
DSPARK_DEVICE void load_b(FragB<T>& f, const T* b, int ldb) {
  nvcuda::wmma::load_matrix_sync(f, b, static_cast<unsigned>(ldb));
}
template <typename T>
DSPARK_DEVICE void mma(Acc& acc, const FragA<T>& a, const FragB<T>& b) {
  nvcuda::wmma::mma_sync(acc, a, b, acc);
}
DSPARK_DEVICE void store(float* d, int ldd, const Acc& acc) {
  nvcuda::wmma::store_matrix_sync(d, acc, static_cast<unsigned>(ldd), nvcuda::wmma::mem_col_major);
}
#endif

}  // namespace mma
}  // namespace dspark
