// Self-test kernels of dspark/mma_sync.cuh (ldmatrix, mma.sync m16n8k16), one warp each. Their inputs and outputs
// are raw 32-bit words (python_tests/test_mma_sync.py passes int32 tensors viewed as float32), so the tests can
// compare lane layouts bit for bit against the PTX ISA's fragment tables written on the Python side.
#pragma once

#include "dspark/mma_sync.cuh"
#include "dspark/utils.cuh"

namespace dspark {
namespace selftest {

struct alignas(16) SmemWords16 {
  uint32_t w[4];
};

// ldmatrix: x = [perm (32 words) | rows (32 x 4 words)]; the rows are staged in shared memory with a padded
// stride (6 words) and lane l supplies the address of staged row perm[l]. y[4 * lane + i] = register i.
// variant: bits 0-2 the matrix count (1, 2, 4), bit 3 .trans, bit 4 a misaligned address from lane 5 (broken),
// bit 5 lane 31 skipping the call (broken).
template <int kNum, bool kTrans>
DSPARK_DEVICE void ldmatrix_case(const uint32_t* rows, const uint32_t* perm, float* y, int variant) {
  const int lane = threadIdx.x & 31;
  const char* addr = reinterpret_cast<const char*>(rows + ldg(perm + lane) * 8u);
  if ((variant & 16) && lane == 5) addr += 8;
  if ((variant & 32) && lane == 31) return;
  uint32_t r[kNum];
  warp::ldmatrix<kNum, kTrans>(r, addr);
  for (int i = 0; i < kNum; ++i) stg(reinterpret_cast<uint32_t*>(y) + 4 * lane + i, r[i]);
}

__global__ void ldmatrix_kernel(const float* x, float* y, int variant) {
  constexpr int kStrideWords = 8;  // 32 bytes per staged row: 16 bytes of data, 16 of padding
  DSPARK_SHARED_ARRAY(SmemWords16, smem, 32 * kStrideWords / 4);
  uint32_t* rows = reinterpret_cast<uint32_t*>(smem);
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x);
  const int lane = threadIdx.x & 31;
  for (int q = 0; q < 4; ++q) rows[lane * kStrideWords + q] = ldg(xw + 32 + 4 * lane + q);
  for (int q = 4; q < kStrideWords; ++q) rows[lane * kStrideWords + q] = 0u;
  __syncthreads();
  const bool trans = (variant & 8) != 0;
  switch (variant & 7) {
    case 1: trans ? ldmatrix_case<1, true>(rows, xw, y, variant) : ldmatrix_case<1, false>(rows, xw, y, variant); break;
    case 2: trans ? ldmatrix_case<2, true>(rows, xw, y, variant) : ldmatrix_case<2, false>(rows, xw, y, variant); break;
    default: trans ? ldmatrix_case<4, true>(rows, xw, y, variant) : ldmatrix_case<4, false>(rows, xw, y, variant);
  }
}

// mma.sync on raw fragments: x = [a (32 lanes x 4 words) | b (32 x 2 words) | c (32 x 4 floats)], y = d (32 x 4
// floats); variant 0: bf16, 1: fp16, 2: bf16 with lane 7 skipping the call (broken).
template <typename T>
__global__ void mma_sync_kernel(const float* x, float* y, int variant) {
  const int lane = threadIdx.x & 31;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x);
  uint32_t a[4], b[2];
  float d[4];
  for (int q = 0; q < 4; ++q) a[q] = ldg(xw + 4 * lane + q);
  for (int q = 0; q < 2; ++q) b[q] = ldg(xw + 128 + 2 * lane + q);
  for (int q = 0; q < 4; ++q) d[q] = ldg(x + 192 + 4 * lane + q);
  if (variant == 2 && lane == 7) return;
  warp::mma_m16n8k16<T>(d, a, b);
  for (int q = 0; q < 4; ++q) stg(y + 4 * lane + q, d[q]);
}

// ldmatrix + mma.sync from shared memory, the way a kernel uses them: x = [K | A (16 x K row-major) | B (K x 8
// row-major)] as floats, K a multiple of 16 (<= 64); y = A @ B (16 x 8 row-major). A is staged row-major and
// loaded with ldmatrix x4; B is staged as [n][k] rows (variant 0: bf16, 1: fp16; ldmatrix x2) or as [k][n] rows
// (variant 2: bf16, 3: fp16; ldmatrix x2 .trans). Strides are padded by 16 bytes (conflict-free rows).
template <typename T>
__global__ void mma_tile_kernel(const float* x, float* y, int variant) {
  constexpr int kMaxK = 64, kLda = kMaxK + 8, kLdbN = kMaxK + 8, kLdbK = 8 + 8;
  DSPARK_SHARED_ARRAY(SmemWords16, a_raw, 16 * kLda * 2 / 16);
  DSPARK_SHARED_ARRAY(SmemWords16, b_raw, (8 * kLdbN > kMaxK * kLdbK ? 8 * kLdbN : kMaxK * kLdbK) * 2 / 16);
  T* as = reinterpret_cast<T*>(a_raw);
  T* bs = reinterpret_cast<T*>(b_raw);
  const int K = static_cast<int>(ldg(x));
  const float* A = x + 1;
  const float* B = A + 16 * K;
  const bool b_trans = variant >= 2;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 16 * K; i += 32) as[(i / K) * kLda + i % K] = from_float<T>(ldg(A + i));
  for (int i = lane; i < K * 8; i += 32) {
    const int k = i / 8, n = i % 8;
    bs[b_trans ? k * kLdbK + n : n * kLdbN + k] = from_float<T>(ldg(B + i));
  }
  __syncthreads();
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4], b[2];
    const int m = lane >> 3, j = lane & 7;  // lane supplies row j of matrix m
    warp::ldmatrix<4>(a, as + ((m & 1) * 8 + j) * kLda + k0 + (m >> 1) * 8);
    if (b_trans) {
      warp::ldmatrix<2, true>(b, bs + (k0 + (m & 1) * 8 + j) * kLdbK);  // rows k of B, 8 n each
    } else {
      warp::ldmatrix<2>(b, bs + j * kLdbN + k0 + (m & 1) * 8);  // rows n of B^T, 8 k each
    }
    warp::mma_m16n8k16<T>(d, a, b);
  }
  for (int q = 0; q < 4; ++q) stg(y + (g + 8 * (q >> 1)) * 8 + 2 * t + (q & 1), d[q]);
}

}  // namespace selftest
}  // namespace dspark
