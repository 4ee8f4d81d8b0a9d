// dspark/select_top.cuh: the `top` largest of a row's 64-bit rank keys in one read of the row, by one block of
// kThreads (no torch). Used by draft_block's top-k proposals (draft_block_topk.cuh) and by the vocabulary-parallel
// statistics pass (dist_verify_stats.cuh).
//
// A rank key is a float's order key above an inverted id (rank_key): distinct per element, and the larger key ranks
// first: the higher value (-0 equal to +0, NaN below -inf), the lower id on ties. select_top streams the row in
// chunks of kChunk elements; the caller's visitor pushes every key above the current floor into a shared buffer of
// kBuf keys, which is cut back to its `top` largest (a bitonic sort; the floor rises to the smallest kept) whenever
// the next chunk might not fit. A random row pushes about top ln(V / top) keys, a row in increasing order a whole
// chunk each time (a compaction each): correct either way.
#pragma once

#include <math.h>
#include <stdint.h>

#include "platform.cuh"

namespace dspark {
namespace top_select {

constexpr int kThreads = 256;
constexpr int kChunk = kThreads * 8;  // row elements between two looks at the buffer
constexpr int kBuf = 4096;            // keys the buffer holds (32 KB)
constexpr int64_t kMaxTop = kBuf - kChunk;  // the kept keys and a chunk must fit together

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// The order key of a float: unsigned order = the float order, -0 = +0, NaN = 0 (below -inf, 0x007fffff).
DSPARK_DEVICE uint32_t order_key(float x) {
  if (x != x) return 0u;
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float of an order key (NaN's key gives NaN back; -0 comes back as +0).
DSPARK_DEVICE float order_value(uint32_t key) {
  if (key == 0u) return NAN;
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The rank key of element i holding x. Every key is > 0.
DSPARK_DEVICE uint64_t rank_key(float x, int64_t i) {
  return (uint64_t(order_key(x)) << 32) | uint64_t(0xffffffffu - static_cast<uint32_t>(i));
}
DSPARK_DEVICE int64_t rank_key_id(uint64_t key) { return int64_t(0xffffffffu - static_cast<uint32_t>(key)); }
DSPARK_DEVICE float rank_key_value(uint64_t key) { return order_value(static_cast<uint32_t>(key >> 32)); }

struct SelectScratch {
  uint64_t keys[kBuf];  // keys above `floor`, in arrival order (slots from an atomic counter)
  uint32_t count;
  uint64_t floor;       // the top-th largest key seen at the last compaction (0 before it)
};

// A key above the floor, from any thread of the block.
DSPARK_DEVICE void push(SelectScratch& s, uint64_t key) { s.keys[atomicAdd(&s.count, 1u)] = key; }

// Sorts keys[0, n) descending, n a power of two: by the whole key, or (by_id) by the low word, which is increasing id
// order. The whole block; keys[] written before a barrier.
DSPARK_DEVICE void bitonic_desc(uint64_t* keys, int n, bool by_id) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += kThreads) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const uint64_t a = keys[lo], b = keys[hi];
        const bool less = by_id ? static_cast<uint32_t>(a) < static_cast<uint32_t>(b) : a < b;
        if (less == ((lo & size) == 0)) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

DSPARK_DEVICE int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Keeps the `top` largest of the `count` buffered keys (count >= top): sorted, then count = top and floor = the
// smallest kept. The whole block (count read before a barrier).
DSPARK_DEVICE void compact(SelectScratch& s, int64_t count, int64_t top) {
  const int n = pow2_at_least(count);
  for (int64_t i = count + threadIdx.x; i < n; i += kThreads) s.keys[i] = 0;  // below every key
  __syncthreads();
  bitonic_desc(s.keys, n, false);
  if (threadIdx.x == 0) {
    s.count = static_cast<uint32_t>(top);
    s.floor = s.keys[top - 1];
  }
  __syncthreads();
}

// One pass over [0, V): visit(c0, c1, floor) must push (push()) the rank key of every element of [c0, c1) whose key
// is above `floor`. Returns how many keys s.keys[0, count) holds: min(top, the keys pushed), the `top` largest, in no
// particular order. 1 <= top <= kMaxTop. The whole block.
template <typename Visit>
DSPARK_DEVICE int64_t select_top(SelectScratch& s, int64_t V, int64_t top, Visit&& visit) {
  if (threadIdx.x == 0) {
    s.count = 0;
    s.floor = 0;
  }
  __syncthreads();
  uint64_t floor = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    visit(c0, c0 + kChunk < V ? c0 + kChunk : V, floor);
    __syncthreads();
    const int64_t count = s.count;
    __syncthreads();  // every thread has read count before a compaction changes it
    if (count > kBuf - kChunk) compact(s, count, top);
    floor = s.floor;
  }
  __syncthreads();
  const int64_t count = s.count;
  __syncthreads();
  if (count > top) compact(s, count, top);
  return count < top ? count : top;
}

// Sorts the first `count` keys descending (by_id: by increasing id), the slots past them up to a power of two
// padded with 0 (below every key; id 2^32 - 1, after every id). The whole block.
DSPARK_DEVICE void sort_kept(SelectScratch& s, int64_t count, bool by_id) {
  const int n = pow2_at_least(count);
  for (int64_t i = count + threadIdx.x; i < n; i += kThreads) s.keys[i] = 0;
  __syncthreads();
  bitonic_desc(s.keys, n, by_id);
}
#endif

}  // namespace top_select
}  // namespace dspark
