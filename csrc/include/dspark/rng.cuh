// dspark/rng.cuh: the package's counter-based random generator (header-only, no torch).
//
// Philox4x32-10 keyed and counted exactly as dspark_kernels/rng.py (the spec):
//   key     = (seed_lo, seed_hi ^ offset_hi)
//   counter = (token >> 2, position | stream << 24, request, offset_lo)
//   the draw of `token` is output word `token & 3`, so the four tokens of a counter block (a float4 of
//   logits) cost one Philox evaluation;
//   u = ((x >> 8) | 1) * 2^-24 as float32: exact, never 0, never 1.
// Compiles as host C++ (g++, clang) and as CUDA (host and device); python_tests/data/rng_vectors.json holds
// the vectors every implementation reproduces bit for bit.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
#include "platform.cuh"
#define DSPARK_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// plain host C++ (the CPU kernels, the C ABI's host test); always inlined, so it vectorizes inside the CPU sweeps
#define DSPARK_HOST_DEVICE inline __attribute__((always_inline))
#else
#define DSPARK_HOST_DEVICE inline
#endif


namespace dspark {
namespace rng {

// Streams separate independent uses of the same (request, position, token) cell (rng.STREAM_*).
enum Stream : uint32_t {
  kStreamDraft = 0,     // draft_block: sampling a draft token
  kStreamAccept = 1,    // verify_chain: the accept/reject uniform of a position (token 0)
  kStreamResidual = 2,  // verify_chain: the correction or bonus sample
  kStreamUser = 16,     // first stream free for callers of rng_uniform
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;  // 2^-24

struct U32x4 {
  uint32_t x, y, z, w;
};

// Four float32 values; 16-byte aligned so a kernel can store it as one float4.
struct alignas(16) F32x4 {
  float x, y, z, w;
};

DSPARK_HOST_DEVICE void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

// Philox4x32-10 (Salmon et al., 2011; Random123's philox4x32 with 10 rounds).
DSPARK_HOST_DEVICE U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxM0, c.x, hi0, lo0);
    mulhilo32(kPhiloxM1, c.z, hi1, lo1);
    c = U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return c;
}

// The 32-bit word -> float32 uniform in (0, 1): ((x >> 8) | 1) * 2^-24 (both steps exact).
DSPARK_HOST_DEVICE float bits_to_uniform(uint32_t x) {
  return static_cast<float>((x >> 8) | 1u) * kTwoPowMinus24;
}

// A (seed, offset) pair turned into the Philox key and the counter's last word; cheap to build per thread.
struct Philox {
  uint32_t k0, k1, offset_lo;

  DSPARK_HOST_DEVICE static Philox make(uint64_t seed, uint64_t offset) {
    Philox p;
    p.k0 = static_cast<uint32_t>(seed);
    p.k1 = static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32);
    p.offset_lo = static_cast<uint32_t>(offset);
    return p;
  }

  // The counter block holding tokens 4*quad .. 4*quad+3 (quad = token >> 2).
  DSPARK_HOST_DEVICE U32x4 block(uint64_t request, uint64_t position, uint32_t stream, uint64_t quad) const {
    const U32x4 ctr{static_cast<uint32_t>(quad),
                    static_cast<uint32_t>(position) | (stream << 24),
                    static_cast<uint32_t>(request), offset_lo};
    return philox4x32_10(ctr, k0, k1);
  }

  // The uint32 draw of one (request, position, stream, token) cell.
  DSPARK_HOST_DEVICE uint32_t bits(uint64_t request, uint64_t position, uint32_t stream, uint64_t token) const {
    const U32x4 b = block(request, position, stream, token >> 2);
    switch (static_cast<uint32_t>(token) & 3u) {
      case 0: return b.x;
      case 1: return b.y;
      case 2: return b.z;
      default: return b.w;
    }
  }

  DSPARK_HOST_DEVICE float uniform(uint64_t request, uint64_t position, uint32_t stream, uint64_t token) const {
    return bits_to_uniform(bits(request, position, stream, token));
  }

  // The uniforms of tokens 4*quad .. 4*quad+3, in token order (one Philox evaluation).
  DSPARK_HOST_DEVICE F32x4 uniform4(uint64_t request, uint64_t position, uint32_t stream, uint64_t quad) const {
    const U32x4 b = block(request, position, stream, quad);
    return F32x4{bits_to_uniform(b.x), bits_to_uniform(b.y), bits_to_uniform(b.z), bits_to_uniform(b.w)};
  }
};

// The random key as a kernel takes it: (seed, offset) read on the device from an int64 [2] buffer, so that a CUDA
// graph replays with whatever the buffer holds then, or passed by value where the caller gave plain integers (no
// launch builds a key then).
struct Key {
  const int64_t* ptr = nullptr;  // int64 [2] (seed, offset) in device memory, or nullptr
  uint64_t seed = 0, offset = 0;  // the key when ptr is nullptr

  static Key on_device(const int64_t* p) { return Key{p, 0, 0}; }
  static Key by_value(uint64_t s, uint64_t o) { return Key{nullptr, s, o}; }
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
__device__ __forceinline__ Philox load_philox(const Key& key) {
  if (key.ptr == nullptr) return Philox::make(key.seed, key.offset);
  return Philox::make(static_cast<uint64_t>(__ldg(key.ptr)), static_cast<uint64_t>(__ldg(key.ptr + 1)));
}
#endif

}  // namespace rng
}  // namespace dspark
