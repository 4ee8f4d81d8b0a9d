// dspark/mma_sync.cuh: the tensor-core instructions of a fast kernel, as warp collectives with the same source in
// both builds: ldmatrix (m8n8, b16; x1 / x2 / x4, with or without .trans) and mma.sync m16n8k16 (bf16 or fp16
// operands, float32 accumulation). PTX ISA names throughout ("lane" = %laneid; g = lane / 4, t = lane % 4).
//
// ldmatrix<kNum, kTrans>(r, row): loads kNum 8 x 8 matrices of 16-bit elements from SHARED memory. Lane
// 8 * i + j (i < kNum, j < 8) supplies `row`, the address of row j of matrix i: 16 contiguous bytes, 16-byte
// aligned (the other lanes' addresses are ignored). Each lane receives one 32-bit register per matrix, two
// elements, low half first:
//   plain   r[i] = { M_i[g][2t],     M_i[g][2t + 1] }
//   .trans  r[i] = { M_i[2t][g],     M_i[2t + 1][g] }
// mma_m16n8k16<T>(d, a, b): d += A[16 x 16] * B[16 x 8] in float32, A and B of one 16-bit type T
// (__nv_bfloat16 or __half), registers as the ISA's fragment tables give them:
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   d[0] = D[g][2t]   d[1] = D[g][2t+1]   d[2] = D[g+8][2t]   d[3] = D[g+8][2t+1]
// So ldmatrix x4 of a row-major A tile (lanes 0-7: rows 0-7 at column 0, 8-15: rows 8-15 at column 0, 16-23:
// rows 0-7 at column 8, 24-31: rows 8-15 at column 8) gives a[0..3], and ldmatrix x2 of B stored as [n][k] rows
// (a request's vector contiguous: lanes 0-7 rows n = 0-7 at k = 0, lanes 8-15 at k = 8) gives b[0..1].
// Every call is a full-warp collective in uniform control flow (.sync.aligned): all 32 lanes make the same call.
//
// GPU build: inline PTX (sm_80 and later; LDSM and HMMA in SASS). SIMT build: an exact emulation that faults
// where the GPU's behaviour would be undefined: a lane missing from the collective (or waiting at another call
// site), or a row address that is not 16-byte aligned. Each supplying lane's shared-memory read is one ordinary
// 16-byte load of its row (what the harness's access model sees and counts as the instruction's wavefronts); the
// lanes' values are exchanged through the harness's warp-collective scratch (never through block shared memory).
// The emulated MMA forms each product exactly (16-bit x 16-bit fits float32's mantissa) and adds them to d in
// float32, k in order; the tensor cores' summation order and rounding may differ within float32 rounding.
#pragma once

#include <stdint.h>

#include "platform.cuh"

namespace dspark {
namespace warp {

#if defined(DSPARK_SIMT)
namespace detail {
// The caller's source location, so that two different call sites never complete one collective together.
struct CallSite {
  simt::Site site;
  // NOLINTNEXTLINE(google-explicit-constructor): built from the default argument only
  CallSite(const char* file = __builtin_FILE(), int line = __builtin_LINE()) : site{file, line} {}
};

// Every lane's 8-byte value (full warp): values[l] is lane l's.
inline void exchange(const CallSite& at, uint64_t mine, uint64_t* values) {
  simt::warp_collective(at.site, 0xffffffffu, mine, values);
}

inline uint32_t lane_id() { return static_cast<uint32_t>(threadIdx.x & 31u); }

inline uint16_t half_of(uint32_t w, int h) { return static_cast<uint16_t>(h ? w >> 16 : w & 0xffffu); }
inline uint32_t pack(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

template <typename T>
inline float b16_to_float(uint16_t bits) {
  T v;
  memcpy(&v, &bits, 2);
  return static_cast<float>(v);
}
}  // namespace detail

template <int kNum, bool kTrans = false>
inline void ldmatrix(uint32_t (&r)[kNum], const void* row, detail::CallSite at = detail::CallSite()) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const uint32_t lane = detail::lane_id();
  uint32_t w[4] = {0, 0, 0, 0};  // this lane's row: 4 words = 8 elements
  if (lane < 8u * kNum) {
    if ((reinterpret_cast<uintptr_t>(row) & 15u) != 0u)
      simt::device_fault("warp::ldmatrix: a row address is not 16-byte aligned");
    const uint4 v = *static_cast<const uint4*>(row);  // the lane's one 16-byte shared-memory read
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
  uint64_t lo[32], hi[32];  // every lane's row: words 0-1, words 2-3
  detail::exchange(at, uint64_t(w[0]) | (uint64_t(w[1]) << 32), lo);
  detail::exchange(at, uint64_t(w[2]) | (uint64_t(w[3]) << 32), hi);
  const auto word = [&](uint32_t src_lane, uint32_t q) -> uint32_t {  // word q of the row lane src_lane loaded
    const uint64_t x = q < 2 ? lo[src_lane] : hi[src_lane];
    return static_cast<uint32_t>((q & 1u) ? x >> 32 : x);
  };
  const uint32_t g = lane >> 2, t = lane & 3u;
  for (int i = 0; i < kNum; ++i) {
    if (!kTrans) {
      r[i] = word(8u * i + g, t);  // M_i[g][2t, 2t+1]
    } else {  // M_i[2t][g], M_i[2t+1][g]: element g of rows 2t and 2t+1
      const uint16_t e0 = detail::half_of(word(8u * i + 2u * t, g >> 1), g & 1u);
      const uint16_t e1 = detail::half_of(word(8u * i + 2u * t + 1u, g >> 1), g & 1u);
      r[i] = detail::pack(e0, e1);
    }
  }
}

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         detail::CallSite at = detail::CallSite()) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "mma_m16n8k16 takes bf16 or fp16 operands");
  uint64_t a01[32], a23[32], bb[32];
  detail::exchange(at, uint64_t(a[0]) | (uint64_t(a[1]) << 32), a01);
  detail::exchange(at, uint64_t(a[2]) | (uint64_t(a[3]) << 32), a23);
  detail::exchange(at, uint64_t(b[0]) | (uint64_t(b[1]) << 32), bb);
  // A[row][k] from the lanes' fragments: row g' = row % 8 lives in lanes 4g'..4g'+3; register by (row >= 8, k >= 8)
  const auto a_at = [&](uint32_t row, uint32_t k) -> float {
    const uint32_t src = 4u * (row & 7u) + ((k & 7u) >> 1);
    const uint32_t reg = (row >> 3) + 2u * (k >> 3);  // a[0]: (g, k<8), a[1]: (g+8, k<8), a[2]: (g, k>=8), ...
    const uint64_t x = reg < 2 ? a01[src] : a23[src];
    const uint32_t w = static_cast<uint32_t>((reg & 1u) ? x >> 32 : x);
    return detail::b16_to_float<T>(detail::half_of(w, k & 1u));
  };
  const auto b_at = [&](uint32_t k, uint32_t col) -> float {  // B[k][col]: lanes 4col..4col+3
    const uint32_t src = 4u * col + ((k & 7u) >> 1);
    const uint32_t w = static_cast<uint32_t>((k >> 3) ? bb[src] >> 32 : bb[src]);
    return detail::b16_to_float<T>(detail::half_of(w, k & 1u));
  };
  const uint32_t lane = detail::lane_id(), g = lane >> 2, t = lane & 3u;
  for (int q = 0; q < 4; ++q) {
    const uint32_t row = g + 8u * (q >> 1), col = 2u * t + (q & 1);
    float s = d[q];
    for (uint32_t k = 0; k < 16; ++k) s += a_at(row, k) * b_at(k, col);  // exact product, float32 sum
    d[q] = s;
  }
}

#elif defined(__CUDACC__)
DSPARK_DEVICE uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <int kNum, bool kTrans = false>
DSPARK_DEVICE void ldmatrix(uint32_t (&r)[kNum], const void* row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const uint32_t s = shared_address(row);
  if constexpr (kNum == 1 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s));
  } else if constexpr (kNum == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s));
  } else if constexpr (kNum == 2 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (kNum == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (!kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  }
}

template <typename T>
DSPARK_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "mma_m16n8k16 takes bf16 or fp16 operands");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
#endif

}  // namespace warp
}  // namespace dspark
