// dspark/draft_part.cuh: the per-request partial of a slice of the vocabulary that the drafting kernels reduce
// (dspark/draft_block.cuh, dspark/dist_draft_step.cuh; no torch), and the packed form of its winner.
#pragma once

#include <math.h>
#include <stdint.h>

#include "platform.cuh"
#include "reduce.cuh"

namespace dspark {
namespace draft {

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// The highest of kN floats (NaN ignored, NaN only when all are) and their sum, each as a tree (reduce.cuh's
// tree_merge): log2 kN dependent steps, not kN - 1, so that a lone warp on its scheduler is not held by a chain of
// fixed-latency instructions (the draft sweep's top stall on the H200: bench/records/h200_ncu_draft_sections.csv).
template <int kN>
DSPARK_DEVICE float max_of(const float (&x)[kN]) { return tree_merge<Max>(x); }
template <int kN>
DSPARK_DEVICE float sum_of(const float (&x)[kN]) { return tree_merge<Sum>(x); }
#endif

// Per-request running partial of a slice of the vocabulary, built from reduce.cuh's pieces: the softmax statistics
// of the scaled logits (SoftmaxStats: -inf and NaN carry no mass), the winner (ArgMax of the logits, or of the race
// scores; the package's tie rule) with the winner's scaled logit, and whether a NaN was seen.
struct Part {
  SoftmaxStats stats;
  ArgMax win;
  float scaled;
  int32_t bad;

  DSPARK_HOST_DEVICE_FN static Part empty() { return Part{SoftmaxStats::empty(), ArgMax::empty(), neg_inf(), 0}; }
  // `sc` is NaN-free; `x` is the scaled logit of token `i`.
  DSPARK_HOST_DEVICE_FN void add(float x, float sc, int64_t i) {
    if (win.beaten_by(sc, i)) {
      win = ArgMax{sc, i};
      scaled = x;
    }
    if (x != x) bad = 1;
    stats.update(x);
  }
#if defined(__CUDACC__) || defined(DSPARK_SIMT)
  // add() of kN tokens i..i+kN-1 in turn (x: scaled logits, sc: their NaN-free scores; a token past the row's end
  // has -inf in both), at the cost of one winner test per call and a softmax rescale only when the call raises the
  // maximum: s gains 2^((x - m) log2 e) per token (sum_exp2), and turns NaN once a NaN or a +inf enters with m
  // finite (the row's log-probability is then NaN, as logprob() says of bad rows); a NaN met while m is still -inf
  // sets bad.
  template <int kN>
  DSPARK_DEVICE void add_n(const float (&x)[kN], const float (&sc)[kN], int64_t i) {
    // the first highest score, by selects (an index into x or sc would put them in local memory)
    float top = sc[0], top_x = x[0];
    int best = 0;
#pragma unroll
    for (int e = 1; e < kN; ++e) {
      const bool higher = sc[e] > top;
      top = higher ? sc[e] : top;
      top_x = higher ? x[e] : top_x;
      best = higher ? e : best;
    }
    if (win.beaten_by(top, i + best)) {
      win = ArgMax{top, i + best};
      scaled = top_x;
    }
    float qm = x[0];
#pragma unroll
    for (int e = 1; e < kN; ++e) qm = fmaxf(qm, x[e]);  // NaN ignored
    if (qm > stats.m) {  // rare once a thread has seen a few calls; from m = -inf, s stays 0
      stats.s *= sum_exp2((stats.m - qm) * kLog2e);
      stats.m = qm;
    }
    add_exp(x);
  }
  // add() of kN greedy logits x (the score is the logit, NaN as -inf) of tokens i + (e ^ perm) (perm 0, or kN / 2
  // when x holds its halves swapped; -inf past the row's end), whose highest score is pm. A partial that only
  // this takes keeps win.value == stats.m, so one test (pm >= m) finds the rare calls that move the winner or the
  // maximum (a new maximum, a tie, or nothing above -inf yet); the others only add 2^(x log2 e - m log2 e) per token.
  template <int kN>
  DSPARK_DEVICE void add_greedy(const float (&x)[kN], float pm, int64_t i, int perm) {
    if (pm >= stats.m) {
      const int first = pm > neg_inf() ? first_at(x, pm, perm) : 0;  // (-inf: every token ties, NaN as -inf)
      if (win.beaten_by(pm, i + first)) {
        win = ArgMax{pm, i + first};
        scaled = pm;
      }
      if (pm > stats.m) {
        stats.s *= sum_exp2((stats.m - pm) * kLog2e);
        stats.m = pm;
      }
    }
    add_exp(x);
  }
  // The lowest token offset of x (tokens i + (e ^ perm)) holding pm, which some x[e] equals. Halves as they stand
  // (perm 0: a constant where the caller never swaps them): a select from the last element down; else the ties by
  // element (constant shifts), turned into token order (a rotation by perm: e ^ kN / 2 = e -+ kN / 2).
  template <int kN>
  DSPARK_DEVICE static int first_at(const float (&x)[kN], float pm, int perm) {
    static_assert(kN <= 16, "the rotation's two copies of the tie mask fit 32 bits");
    if (perm == 0) {
      int first = kN - 1;
#pragma unroll
      for (int e = kN - 2; e >= 0; --e) first = x[e] == pm ? e : first;
      return first;
    }
    uint32_t at = 0;
#pragma unroll
    for (int e = 0; e < kN; ++e) at |= x[e] == pm ? 1u << e : 0u;
    at = ((at | at << kN) >> perm) & ((1u << kN) - 1u);
    return __ffs(static_cast<int>(at)) - 1;
  }

  static constexpr float kLog2e = 1.4426950408889634f;
  // The softmax sum's terms of x at the current maximum m (an FADD, an FMUL and one MUFU.EX2 a token), added as a
  // tree before they reach s (log2 kN + 1 dependent FADDs, not kN), or, while m is still -inf (nothing to sum),
  // whether a NaN came.
  template <int kN>
  DSPARK_DEVICE void add_exp(const float (&x)[kN]) {
    if (stats.m > neg_inf()) {
      add_exp_at(x, stats.m);
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) bad |= x[e] != x[e] ? 1 : 0;
    }
  }
  // add_exp's sum at a maximum m above -inf. Each term is 2^((x - m) log2 e), x - m formed first: exact near the
  // maximum whatever |m| (at T = 1e-6, |m| reaches 2^24).
  template <int kN>
  DSPARK_DEVICE void add_exp_at(const float (&x)[kN], float m) {
    float t[kN];
#pragma unroll
    for (int e = 0; e < kN; ++e) t[e] = sum_exp2((x[e] - m) * kLog2e);
    stats.s += sum_of(t);
  }
#endif
  DSPARK_HOST_DEVICE_FN void merge(const Part& o) {
    if (win.beaten_by(o.win.value, o.win.index)) {
      win = o.win;
      scaled = o.scaled;
    }
    bad |= o.bad;
    stats.merge(o.stats);
  }
  // log_softmax(x)[winner] as torch computes it: NaN for a row with a NaN or +inf entry, or only -inf ones.
  DSPARK_HOST_DEVICE_FN float logprob() const {
    if (bad || !(stats.m > neg_inf()) || !(stats.m < INFINITY)) return NAN;
    return stats.log_softmax_at(scaled);
  }
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// A winner as one integer whose unsigned order is the package's argmax order (the larger value, NaN-free; the
// lower index on ties; -0 equal to +0), so the winner over slices is a max of integers; 0 for an empty partial.
// Indices are below 2^31 (the launcher checks V).
DSPARK_DEVICE uint64_t pack_winner(const ArgMax& w) {
  if (w.index == INT64_MAX) return 0;
  const uint32_t b = __float_as_uint(w.value + 0.0f);
  const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(ord) << 32) | uint64_t(0x7fffffffu - static_cast<uint32_t>(w.index));
}
DSPARK_DEVICE int64_t winner_index(uint64_t key) { return int64_t(0x7fffffffu - static_cast<uint32_t>(key)); }
#endif

}  // namespace draft
}  // namespace dspark
