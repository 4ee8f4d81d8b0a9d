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
// lanes' values are exchanged through per-warp scratch of the emulation and one warp collective per instruction
// (never through block shared memory; the exchange is not instrumented, so the access model does not count it).
// The emulated MMA forms each product exactly (16-bit x 16-bit fits float32's mantissa) and adds them to d in
// float32, k in order; the tensor cores' summation order and rounding may differ within float32 rounding.
#pragma once

#include <stdint.h>

#include "platform.cuh"

#if defined(DSPARK_SIMT)
#include <stdlib.h>
#include <string.h>

#include <new>
#endif

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

// The lane exchange of the emulated instructions, outside block shared memory (and outside what the harness's
// access model counts): per warp of the running launch, two buffers per lane used alternately. A lane writes its
// words into its next buffer and deposits that buffer's parity in ONE warp collective; after it, every lane reads
// the others' words. A lane can run at most one collective ahead of another (the next one waits for all lanes), so
// it rewrites a buffer only after every lane has read it.
struct WarpScratch {
  uint32_t words[2][32][8];
  unsigned char parity[32];
};

// The table is a plain array grown by hand: no std container code (instrumented on its own, outside this function)
// may touch it, or the access model would count the emulation's own bookkeeping as the kernel's global accesses.
__attribute__((noinline, no_sanitize_address)) inline WarpScratch& warp_scratch() {
  static WarpScratch** all = nullptr;  // indexed by (linear block, warp); grown, never shrunk
  static size_t size = 0;
  const simt::ThreadCtx& c = simt::ctx();
  const size_t block = (size_t(c.block_idx.z) * c.grid_dim.y + c.block_idx.y) * c.grid_dim.x + c.block_idx.x;
  const size_t key = block * 32 + c.warp;
  if (key >= size) {
    const size_t n = key + 1 > 2 * size ? key + 1 : 2 * size;
    WarpScratch** grown = static_cast<WarpScratch**>(calloc(n, sizeof(WarpScratch*)));
    if (grown == nullptr) throw std::bad_alloc();
    if (size > 0) memcpy(grown, all, size * sizeof(WarpScratch*));
    free(all);
    all = grown;
    size = n;
  }
  if (all[key] == nullptr) {
    all[key] = static_cast<WarpScratch*>(calloc(1, sizeof(WarpScratch)));
    if (all[key] == nullptr) throw std::bad_alloc();
  }
  return *all[key];
}

// Deposits this lane's kWords words; afterwards from[l] points at lane l's (valid until the next exchange).
template <int kWords>
__attribute__((noinline, no_sanitize_address)) inline void exchange(const CallSite& at, const uint32_t* mine,
                                                                   const uint32_t* (&from)[32]) {
  static_assert(kWords <= 8, "up to 8 words per lane");
  WarpScratch& s = warp_scratch();
  const unsigned lane = simt::ctx().lane;
  const unsigned par = s.parity[lane];
  s.parity[lane] = static_cast<unsigned char>(par ^ 1u);
  memcpy(s.words[par][lane], mine, kWords * sizeof(uint32_t));
  uint64_t parities[32];
  simt::warp_collective(at.site, 0xffffffffu, par, parities);  // full warp: a missing lane faults
  for (int l = 0; l < 32; ++l) from[l] = s.words[parities[l] & 1u][l];
}

inline uint32_t lane_id() { return static_cast<uint32_t>(threadIdx.x & 31u); }

inline uint16_t half_of(uint32_t w, uint32_t h) { return static_cast<uint16_t>(h ? w >> 16 : w & 0xffffu); }
inline uint32_t pack(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

template <typename T>
inline float b16_to_float(uint16_t bits) {
  T v;
  memcpy(&v, &bits, 2);
  return static_cast<float>(v);
}

// The registers of ldmatrix from the supplying lanes' rows (row[l] = the 4 words lane l loaded).
template <int kNum, bool kTrans>
__attribute__((noinline, no_sanitize_address)) inline void ldmatrix_gather(uint32_t (&r)[kNum],
                                                                          const uint32_t* const (&row)[32]) {
  const uint32_t lane = lane_id(), g = lane >> 2, t = lane & 3u;
  for (int i = 0; i < kNum; ++i) {
    if (!kTrans) {
      r[i] = row[8u * i + g][t];  // M_i[g][2t, 2t+1]
    } else {  // M_i[2t][g], M_i[2t+1][g]: element g of rows 2t and 2t+1
      const uint16_t e0 = half_of(row[8u * i + 2u * t][g >> 1], g & 1u);
      const uint16_t e1 = half_of(row[8u * i + 2u * t + 1u][g >> 1], g & 1u);
      r[i] = pack(e0, e1);
    }
  }
}

// d += A B from the lanes' fragments (frag[l] = lane l's a[0..3], b[0..1]).
template <typename T>
__attribute__((noinline, no_sanitize_address)) inline void mma_gather(float (&d)[4], const uint32_t* const (&frag)[32]) {
  // A[row][k]: row % 8 lives in lanes 4 (row % 8) .. + 3, register (row >= 8) + 2 (k >= 8), half k & 1;
  // B[k][col]: lanes 4 col .. + 3, register 4 + (k >= 8). (No lambdas: their bodies would be instrumented.)
  const uint32_t lane = lane_id(), g = lane >> 2, t = lane & 3u;
  for (int q = 0; q < 4; ++q) {
    const uint32_t row = g + 8u * (q >> 1), col = 2u * t + (q & 1);
    float s = d[q];
    for (uint32_t k = 0; k < 16; ++k) {  // exact product, float32 sum
      const uint32_t* fa = frag[4u * (row & 7u) + ((k & 7u) >> 1)];
      const uint32_t* fb = frag[4u * col + ((k & 7u) >> 1)];
      const float a = b16_to_float<T>(half_of(fa[(row >> 3) + 2u * (k >> 3)], k & 1u));
      const float b = b16_to_float<T>(half_of(fb[4u + (k >> 3)], k & 1u));
      s += a * b;
    }
    d[q] = s;
  }
}
}  // namespace detail

template <int kNum, bool kTrans = false>
inline void ldmatrix(uint32_t (&r)[kNum], const void* row, detail::CallSite at = detail::CallSite()) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
  uint32_t w[4] = {0, 0, 0, 0};  // this lane's row: 4 words = 8 elements
  if (detail::lane_id() < 8u * kNum) {
    if ((reinterpret_cast<uintptr_t>(row) & 15u) != 0u)
      simt::device_fault("warp::ldmatrix: a row address is not 16-byte aligned");
    const uint4 v = *static_cast<const uint4*>(row);  // the lane's one 16-byte shared-memory read
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
  const uint32_t* from[32];
  detail::exchange<4>(at, w, from);
  detail::ldmatrix_gather<kNum, kTrans>(r, from);
}

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         detail::CallSite at = detail::CallSite()) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "mma_m16n8k16 takes bf16 or fp16 operands");
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const uint32_t* from[32];
  detail::exchange<6>(at, mine, from);
  detail::mma_gather<T>(d, from);
  simt::count_mma();
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
