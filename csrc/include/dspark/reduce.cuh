// dspark/reduce.cuh: the reductions the kernels share (no torch): the argmax rule, exponential-race / Gumbel
// scores, softmax statistics, the split of a row into chunks, and warp and block all-reduces of any small struct.
//
// One argmax rule everywhere (reference, Triton, CUDA): NaN counts as -inf, infinities stay, ties go to the lowest
// index, and an all -inf / NaN row yields its lowest index (like torch.argmax after NaN -> -inf).
// Categorical sampling is an exponential race: argmax_v w_v / E_v with E_v = -log(u_v) (weights), or in the log
// domain argmax_v l_v - log(-log(u_v)) (scaled logits). The uniforms come from dspark/rng.cuh, keyed by token, so
// the winner does not depend on how the vocabulary is split across threads or CTAs.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "platform.cuh"

namespace dspark {

constexpr unsigned kFullMask = 0xffffffffu;

DSPARK_HOST_DEVICE_FN float neg_inf() { return -INFINITY; }
DSPARK_HOST_DEVICE_FN float nan_to_neg_inf(float s) { return s != s ? neg_inf() : s; }

// Exponential-race score of a non-negative weight: w / -log(u) (NaN -> -inf). Accurate logf, like torch.log.
DSPARK_HOST_DEVICE_FN float race_score(float weight, float u) { return nan_to_neg_inf(weight / -logf(u)); }

// Gumbel-max score of a scaled logit l (= logit / T): l - log(-log(u)) (NaN -> -inf).
DSPARK_HOST_DEVICE_FN float gumbel_score(float scaled_logit, float u) {
  return nan_to_neg_inf(scaled_logit - logf(-logf(u)));
}

// A running argmax with the package's rule. The empty state (index INT64_MAX, value -inf) loses to every real
// candidate.
struct ArgMax {
  float value;
  int64_t index;

  DSPARK_HOST_DEVICE_FN static ArgMax empty() { return ArgMax{neg_inf(), INT64_MAX}; }
  // true if (v, i) beats (value, index); v must already be NaN-free.
  DSPARK_HOST_DEVICE_FN bool beaten_by(float v, int64_t i) const {
    return v > value || (v == value && i < index);
  }
  DSPARK_HOST_DEVICE_FN void update(float v, int64_t i) {
    v = nan_to_neg_inf(v);
    if (beaten_by(v, i)) {
      value = v;
      index = i;
    }
  }
  DSPARK_HOST_DEVICE_FN void merge(const ArgMax& o) {
    if (beaten_by(o.value, o.index)) *this = o;
  }
};

// Softmax statistics of a set of scaled logits: m = max, s = sum exp(l - m) (s = 0 and m = -inf when empty or all
// -inf). Merging is the online-softmax rule.
struct SoftmaxStats {
  float m, s;
  DSPARK_HOST_DEVICE_FN static SoftmaxStats empty() { return SoftmaxStats{neg_inf(), 0.0f}; }
  DSPARK_HOST_DEVICE_FN void update(float l) {
    if (!(l > neg_inf())) return;  // -inf and NaN carry no mass
    if (l > m) {
      s = s * expf(m - l) + 1.0f;
      m = l;
    } else {
      s += expf(l - m);
    }
  }
  DSPARK_HOST_DEVICE_FN void merge(const SoftmaxStats& o) {
    if (!(o.m > neg_inf())) return;
    if (!(m > neg_inf())) {
      *this = o;
      return;
    }
    const float nm = m > o.m ? m : o.m;
    s = s * expf(m - nm) + o.s * expf(o.m - nm);
    m = nm;
  }
  DSPARK_HOST_DEVICE_FN float log_sum_exp() const { return m + logf(s); }
  // log_softmax at a scaled logit x of the set, (x - m) - log s: exact at x = m whatever |m| (m + log s would round
  // to a multiple of ulp(m)).
  DSPARK_HOST_DEVICE_FN float log_softmax_at(float x) const { return (x - m) - logf(s); }
};

// How a row of V elements is split into chunks: `chunk` is a multiple of 32 elements (16-byte vectors of every
// dtype stay aligned inside a row whose start is aligned) and of at least `min_chunk`, chosen so that
// rows * chunks fills `target_ctas`.
struct SplitV {
  int64_t chunk;
  int64_t chunks;
};
DSPARK_HOST_DEVICE_FN SplitV split_v(int64_t V, int64_t rows, int64_t target_ctas, int64_t min_chunk) {
  if (V <= 0) return SplitV{32, 0};
  if (rows < 1) rows = 1;
  int64_t want = (target_ctas + rows - 1) / rows;  // chunks per row
  if (want < 1) want = 1;
  int64_t chunk = (V + want - 1) / want;
  if (chunk < min_chunk) chunk = min_chunk;
  chunk = (chunk + 31) / 32 * 32;
  return SplitV{chunk, (V + chunk - 1) / chunk};
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// ------------------------------------------------------------------------------------------------ exp2
// 2^x for softmax sums: one MUFU.EX2 on the GPU (relative error about 2^-22; results below 2^-126 flush to 0,
// which no sum of terms <= 1 notices); exp2f in the SIMT build.
DSPARK_DEVICE float sum_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// ------------------------------------------------------------------------------------------------ warp / block
// Shuffle any trivially copyable value of a multiple of 4 bytes, word by word: shfl(word) moves one 32-bit word.
template <typename T, typename F>
DSPARK_DEVICE T shfl_words(T v, F&& shfl) {
  static_assert(sizeof(T) % 4 == 0, "a shuffle moves whole 32-bit words");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = shfl(w[i]);
  memcpy(&v, w, sizeof(T));
  return v;
}
template <typename T>
DSPARK_DEVICE T shfl_xor(T v, int lane_mask) {
  return shfl_words(v, [&](uint32_t w) { return __shfl_xor_sync(kFullMask, w, lane_mask); });
}
// The value of lane `src` of a full warp.
template <typename T>
DSPARK_DEVICE T shfl_from(T v, int src) {
  return shfl_words(v, [&](uint32_t w) { return __shfl_sync(kFullMask, w, src); });
}

// Every lane of a full warp ends with the merge of all 32 lanes' values (T has merge(const T&)).
template <typename T>
DSPARK_DEVICE T warp_allreduce(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v.merge(shfl_xor(v, o));
  return v;
}

// Each warp's merge of v into scratch[warp], then a barrier (the block-wide reductions' first half).
template <typename T>
DSPARK_DEVICE void publish_warp_partials(T v, T* scratch) {
  v = warp_allreduce(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
}

// Block-wide all-reduce for blockDim.x a multiple of 32 (<= 1024); every thread gets the result. `scratch` is
// shared memory for 32 values of T; the call starts and ends with a barrier's worth of ordering, so scratch may
// be reused right after it.
template <typename T>
DSPARK_DEVICE T block_allreduce(T v, T* scratch) {
  const int nwarps = blockDim.x >> 5;
  publish_warp_partials(v, scratch);
  T r = scratch[0];
  for (int w = 1; w < nwarps; ++w) r.merge(scratch[w]);
  __syncthreads();
  return r;
}

// block_allreduce with the warps' partials merged by warp 0 alone (the same merges in the same order, so the same
// result), then handed to the block through scratch[0]: for a costly merge (draft_block's Part) in a CTA of many
// warps, nwarps - 1 merges a call instead of nwarps (nwarps - 1), for one more barrier.
template <typename T>
DSPARK_DEVICE T block_allreduce_by_lead(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  publish_warp_partials(v, scratch);
  if (warp == 0) {
    T r = scratch[0];
    for (int w = 1; w < nwarps; ++w) r.merge(scratch[w]);  // warp 0's merge of the warps' partials
    __syncwarp(0xffffffffu);  // every lane has read scratch[0] before lane 0 overwrites it
    if (lane == 0) scratch[0] = r;
  }
  __syncthreads();
  const T r = scratch[0];
  __syncthreads();
  return r;
}

struct Sum {
  float v;
  DSPARK_DEVICE void merge(const Sum& o) { v += o.v; }
};
struct Max {
  float v;
  DSPARK_DEVICE void merge(const Max& o) { v = fmaxf(v, o.v); }
};

// The merge of kN floats (a power of two) by T (Sum, Max) as a tree, pairs kN / 2 apart first: log2 kN dependent
// merges, not kN - 1.
template <typename T, int kN>
DSPARK_DEVICE float tree_merge(const float (&x)[kN]) {
  static_assert(kN > 0 && (kN & (kN - 1)) == 0, "a power of two");
  T t[kN];
#pragma unroll
  for (int e = 0; e < kN; ++e) t[e] = T{x[e]};
#pragma unroll
  for (int w = kN / 2; w > 0; w /= 2)
#pragma unroll
    for (int e = 0; e < w; ++e) t[e].merge(t[e + w]);
  return t[0].v;
}

DSPARK_DEVICE float warp_sum(float v) { return warp_allreduce(Sum{v}).v; }
DSPARK_DEVICE float warp_max(float v) { return warp_allreduce(Max{v}).v; }
// `scratch`: shared float[32].
DSPARK_DEVICE float block_sum(float v, float* scratch) {
  return block_allreduce(Sum{v}, reinterpret_cast<Sum*>(scratch)).v;
}
#endif

}  // namespace dspark
