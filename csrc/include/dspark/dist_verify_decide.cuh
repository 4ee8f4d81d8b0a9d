// dspark/dist_verify_decide.cuh: the replicated decide step of a vocabulary-parallel verify_chain
// (dspark_dist::verify_decide; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_decide,
// decision by decision; the layouts are distributed/layout.py's (StatsLayout, PLAN_*, RES_*).
//
// One thread per request reads the request's cells of every shard's first exchange stats [P, N, K+1, F] (and of the
// second exchange residual [P, N, R, 5] when given) and writes dk.verify_chain's outputs and the residual plan:
//   the verify length (rows available, verify_lens, survival >= thresholds); the target argmax of each row over the
//   shards (NaN as -inf, ties to the lowest global id) and the greedy accepted prefix; for a sampled request the
//   merged softmax statistics, p and q of each draft (from the shard that owns it), each draft row's normaliser
//   (the merged statistics, or the drafter's own l(d) - draft_logprob), the accept uniforms, and token acceptance
//   (u q < p) or block acceptance (rho_i, h_i from S_i, tau); the stop-token cut; the plan of the rows to sample
//   from (token: the emitting row; block: every row 0..K, needed up to L); and with the second exchange the emitted
//   token (the race over p after a full acceptance or where the residual's mass is below 1e-6, else the residual's
//   winner; -1 before it).
// The work per request is O(K P) numbers, so one thread does it: a CTA of one warp per request first copies the
// request's cells of both exchanges into shared memory (coalesced: its [K+1, F] block of each shard is contiguous),
// then lane 0 decides reading shared memory; every merge is recomputed where used (no per-row arrays). Cells that do
// not fit in kMaxStagedBytes are read from global memory by lane 0 instead (same results).
//
// Defines what dspark/dist_verify_decide.h declares: a library includes this header in one translation unit
// (csrc/kernels/dist_verify_decide.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "dist_verify_decide.h"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

namespace dist_decide {

constexpr int kThreads = 32;
constexpr size_t kMaxStagedBytes = 48 * 1024;  // the default limit of dynamic shared memory per CTA
using namespace dist;  // the layouts' slots
constexpr float kResidualEps = 1e-6f;  // reference.verify_chain.RESIDUAL_EPS

// Merged softmax statistics of a row (layout.merge_softmax_stats): bad also when no logit is finite.
struct Merged {
  float m, s;
  bool bad;
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
DSPARK_DEVICE float prob(float x, const Merged& st) { return st.bad ? NAN : expf(x - st.m) / st.s; }

// Request n's view of the exchanged buffers: its cells of shard s at st + s * st_stride (stats, [K+1, F]) and
// rs + s * rs_stride (residual, [R, 5]), in shared memory or in the inputs (generic loads read either).
struct Request {
  const DistVerifyDecideParams& p;
  int64_t n;
  const float* st;
  const float* rs;
  int64_t st_stride, rs_stride;

  DSPARK_DEVICE float stat(int64_t shard, int64_t row, int64_t slot) const {
    return st[shard * st_stride + row * p.F + slot];
  }
  DSPARK_DEVICE float res(int64_t shard, int64_t slot, int field) const {
    return rs[shard * rs_stride + slot * kResWidth + field];
  }
  DSPARK_DEVICE int64_t draft(int64_t j) const { return load_int(p.draft_tokens, p.drafts_i64, n * p.K + j); }
  DSPARK_DEVICE bool valid(int64_t j) const {
    const int64_t d = draft(j);
    return d >= 0 && d < p.vocab_size;
  }
  DSPARK_DEVICE int64_t safe(int64_t j) const { return valid(j) ? draft(j) : 0; }

  // The best (value, id) pair over the shards at (row, slots): NaN as -inf, ties to the lowest id.
  DSPARK_DEVICE int64_t shard_argmax(int64_t row, int64_t val_slot, int64_t id_slot) const {
    ArgMax best = ArgMax::empty();
    for (int64_t s = 0; s < p.P; ++s) best.update(stat(s, row, val_slot), static_cast<int64_t>(stat(s, row, id_slot)));
    return best.index;
  }
  DSPARK_DEVICE Merged merged(int64_t row, int slot_m, int slot_s, int slot_bad) const {
    float top = neg_inf();
    for (int64_t s = 0; s < p.P; ++s) top = fmaxf(top, stat(s, row, slot_m));
    float total = 0.0f;
    bool bad = false;
    for (int64_t s = 0; s < p.P; ++s) {
      const float m = stat(s, row, slot_m);
      total += stat(s, row, slot_s) * (m > neg_inf() ? expf(m - top) : 0.0f);
      bad = bad || stat(s, row, slot_bad) > 0.0f;
    }
    return Merged{top, total, bad || !(top > neg_inf())};
  }
  DSPARK_DEVICE Merged target_stats(int64_t row) const { return merged(row, kTMax, kTSum, kTBad); }
  // The normaliser of draft row j < K: the drafter's own (Q_AT - draft_logprob) where draft_logprobs give a finite
  // one for a draft on the vocabulary, else the row's merged statistics.
  DSPARK_DEVICE Merged draft_norm(int64_t j) const {
    if (!p.has_draft) return Merged{0.0f, 0.0f, false};
    if (p.draft_logprobs != nullptr && valid(j)) {
      const float c = at_owner(j, kQAt) - ldg(p.draft_logprobs + n * p.K + j);
      if (isfinite(c)) return Merged{c, 1.0f, false};
    }
    return merged(j, kQMax, kQSum, kQBad);
  }
  // Slot `slot` of row j from the first shard holding the row's draft (shard 0 if none does: layout.owner_of).
  DSPARK_DEVICE float at_owner(int64_t j, int slot) const {
    const int64_t d = safe(j);
    for (int64_t s = 0; s < p.P; ++s) {
      const int64_t start = ldg(p.shards + 2 * s), size = ldg(p.shards + 2 * s + 1);
      if (d >= start && d < start + size) return stat(s, j, slot);
    }
    return stat(0, j, slot);
  }
  // (p(d_{j+1}), q(d_{j+1})) of row j < K.
  DSPARK_DEVICE void draft_probs(int64_t j, float& pd, float& qd) const {
    pd = prob(at_owner(j, kTAt), target_stats(j)) * (valid(j) ? 1.0f : 0.0f);
    qd = valid(j) ? 1.0f : 0.0f;
    if (p.has_draft) qd = prob(at_owner(j, kQAt), merged(j, kQMax, kQSum, kQBad));
    if (p.draft_logprobs != nullptr) qd = expf(ldg(p.draft_logprobs + n * p.K + j));
  }
  DSPARK_DEVICE float residual_mass(int64_t slot) const {
    float total = 0.0f;
    for (int64_t s = 0; s < p.P; ++s) total += res(s, slot, kResMass);
    return total;
  }
  // The best (score, id) over the shards at the second exchange's `slot` (fields val, id).
  DSPARK_DEVICE int64_t residual_winner(int64_t slot, int val, int id) const {
    ArgMax best = ArgMax::empty();
    for (int64_t s = 0; s < p.P; ++s) best.update(res(s, slot, val), static_cast<int64_t>(res(s, slot, id)));
    return best.index;
  }
};

// The verify length L and whether the request has any target row (local_verify._verify_lengths).
DSPARK_DEVICE int64_t verify_length(const DistVerifyDecideParams& p, int64_t n, bool& has_rows) {
  int64_t last = p.K;
  if (p.cu_seqlens != nullptr) {
    last = packed_last_row(load_int(p.cu_seqlens, p.cu_i64, n), load_int(p.cu_seqlens, p.cu_i64, n + 1), p.num_rows,
                           p.K);
  }
  has_rows = last >= 0;
  int64_t length = last > 0 ? last : 0;
  if (p.verify_lens != nullptr) {
    int64_t v = load_int(p.verify_lens, p.lens_i64, n);
    v = v < 0 ? 0 : (v > p.K ? p.K : v);
    length = v < length ? v : length;
  }
  if (p.survival != nullptr && p.thresholds != nullptr) {
    int64_t lead = 0;
    while (lead < p.K && load_float(p.survival, p.survival_dtype, n * p.K + lead) >=
                             load_float(p.thresholds, p.thresholds_dtype, lead)) {
      ++lead;
    }
    length = lead < length ? lead : length;
  }
  return length;
}

// One slot of the plan: the row, whether the second exchange must cover it, rho, the target row's merged statistics
// and the draft row's normaliser (row min(row, K-1)).
DSPARK_DEVICE void store_plan(const Request& r, float* cell, int64_t row, bool need, float rho) {
  const Merged t = r.target_stats(row), q = r.draft_norm(row < r.p.K - 1 ? row : r.p.K - 1);
  const float cells[kPlanWidth] = {static_cast<float>(row), need ? 1.0f : 0.0f, rho, t.m, t.s, t.bad ? 1.0f : 0.0f,
                                   q.m, q.s, q.bad ? 1.0f : 0.0f};
  for (int f = 0; f < kPlanWidth; ++f) stg(cell + f, cells[f]);
}

// Block verification: tau, writing the plan's K+1 slots (row i, needed for i <= L of a sampled request with rows,
// rho_i) on the way; rho_0 = 1, rho_i = min(rho_{i-1} p / q, 1) (NaN -> 0), h_i = S_i / (S_i + 1 - rho_i) (0/0 -> 1,
// NaN -> 0; S_i from the second exchange, 0 before it), h_L = rho_L; tau = the last i <= L with u <= h_i. *rho_tau
// gets rho_tau.
DSPARK_DEVICE int64_t block_tau(const Request& r, int64_t length, bool needed, const rng::Philox& ph, float* plan,
                                float* rho_tau) {
  const DistVerifyDecideParams& p = r.p;
  float rho = 1.0f;
  int64_t tau = 0;
  *rho_tau = 1.0f;
  store_plan(r, plan, 0, needed, 1.0f);
  for (int64_t i = 0; i < p.K; ++i) {
    float pd, qd;
    r.draft_probs(i, pd, qd);
    float ratio = pd / qd;
    if (ratio != ratio) ratio = 0.0f;
    const float prod = rho * ratio;
    rho = prod != prod ? 0.0f : (prod < 1.0f ? prod : 1.0f);  // rho_{i+1}
    const int64_t idx = i + 1;
    store_plan(r, plan + idx * kPlanWidth, idx, needed && idx <= length, rho);
    const float mass = (p.residual != nullptr && idx < p.K) ? r.residual_mass(idx) : 0.0f;
    const float denom = mass + 1.0f - rho;
    float h = denom > 0.0f ? mass / denom : (denom == 0.0f ? 1.0f : 0.0f);
    if (idx >= p.K) h = 0.0f;
    if (idx == length) h = rho;
    if (ph.uniform(r.n, i, rng::kStreamAccept, 0) <= h && idx <= length) {
      tau = idx;
      *rho_tau = rho;
    }
  }
  return tau;
}

#endif

// The shared-memory copy of a request's cells: block s (a shard) of `width` floats at smem + s * pitch + kLead.
constexpr int64_t kLead = 8;  // room for the head of the block's first sector
DSPARK_HOST_DEVICE_FN int64_t stage_pitch(int64_t width) { return (width + 7) / 8 * 8 + 2 * kLead; }

// Bytes of shared memory holding request n's cells of stats and residual (0: they do not fit; read in place).
inline size_t staged_bytes(const DistVerifyDecideParams& p) {
  const int64_t floats = p.P * stage_pitch((p.K + 1) * p.F) +
                         (p.residual != nullptr ? p.P * stage_pitch(p.R * kResWidth) : 0);
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  return bytes <= kMaxStagedBytes ? bytes : 0;
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Copies the blocks [first + s stride, + width) of base[0, total) (s < shards) to dst + s * pitch + kLead, by the
// warp; each block widened to the whole 32-byte sectors it touches inside the tensor, so every load reads whole
// sectors (the widening is at most 7 floats each side, inside the kLead margins).
DSPARK_DEVICE void stage(float* dst, const float* base, int64_t total, int64_t first, int64_t width, int64_t stride,
                         int64_t shards) {
  const int64_t pitch = stage_pitch(width);
  for (int64_t s = 0; s < shards; ++s) {
    const int64_t start = first + s * stride;
    const int64_t head = static_cast<int64_t>((reinterpret_cast<uintptr_t>(base + start) & 31) / sizeof(float));
    const int64_t lo = start - head > 0 ? start - head : 0;
    const int64_t end = lo + (start + width - lo + 7) / 8 * 8;
    const int64_t hi = end < total ? end : total;
    float* out = dst + s * pitch + kLead - start;
    for (int64_t x = lo + threadIdx.x; x < hi; x += kThreads) out[x] = ldg(base + x);
    __syncwarp(0xffffffffu);  // one block's loads are the same warp instructions (lanes leave at different trips)
  }
}

__global__ void __launch_bounds__(kThreads) decide_kernel(DistVerifyDecideParams p, bool staged) {
  DSPARK_DYNAMIC_SMEM(float, smem);
  const int64_t n = blockIdx.x;
  const int64_t st_block = (p.K + 1) * p.F, rs_block = p.R * kResWidth;
  Request r{p, n, p.stats + n * st_block, p.residual != nullptr ? p.residual + n * rs_block : nullptr,
            p.N * st_block, p.N * rs_block};
  if (staged) {
    stage(smem, p.stats, p.P * p.N * st_block, n * st_block, st_block, r.st_stride, p.P);
    float* rs = smem + p.P * stage_pitch(st_block);
    if (p.residual != nullptr) stage(rs, p.residual, p.P * p.N * rs_block, n * rs_block, rs_block, r.rs_stride, p.P);
    __syncthreads();
    r.st = smem + kLead;
    r.rs = rs + kLead;
    r.st_stride = stage_pitch(st_block);
    r.rs_stride = stage_pitch(rs_block);
  }
  if (threadIdx.x != 0) return;
  bool has_rows;
  const int64_t length = verify_length(p, n, has_rows);
  int64_t n_acc = 0;  // the greedy prefix
  while (n_acc < length && r.valid(n_acc) && r.draft(n_acc) == r.shard_argmax(n_acc, kAmaxVal, kAmaxId)) ++n_acc;
  const bool sampling = p.temperature != nullptr;
  const bool sampled = sampling && ldg(p.temperature + n) > 0.0f;
  const rng::Philox ph = sampling ? rng::load_philox(p.rng_key) : rng::Philox{};
  float* plan = sampling ? p.out_plan + n * p.R * kPlanWidth : nullptr;
  if (sampling) {
    int64_t n_s = 0;
    if (p.block_method) {
      float rho_tau;
      n_s = block_tau(r, length, sampled && has_rows, ph, plan, &rho_tau);
    } else {
      for (; n_s < length; ++n_s) {
        float pd, qd;
        r.draft_probs(n_s, pd, qd);
        if (!(ph.uniform(n, n_s, rng::kStreamAccept, 0) * qd < pd)) break;
      }
    }
    if (sampled) n_acc = n_s;
  }
  bool stopped = false;  // acceptance ends right after the first accepted stop token
  for (int64_t j = 0; j < n_acc && !stopped; ++j) {
    for (int64_t s = 0; s < p.num_stops; ++s) {
      if (r.draft(j) == load_int(p.stop_ids, p.stops_i64, s)) {
        stopped = true;
        n_acc = j + 1;
        break;
      }
    }
  }
  int64_t emitted = r.shard_argmax(n_acc, kAmaxVal, kAmaxId);
  if (sampling) {
    if (!p.block_method) store_plan(r, plan, n_acc, sampled && has_rows && !stopped, 1.0f);
    const int64_t slot = p.block_method ? n_acc : 0;
    int64_t token = -1;
    if (p.residual != nullptr) {
      const bool use_p = n_acc >= length || !(r.residual_mass(slot) >= kResidualEps);
      token = use_p ? r.residual_winner(slot, kResGScore, kResGId) : r.residual_winner(slot, kResScore, kResId);
    }
    if (sampled) emitted = token;
  }
  if (!has_rows) n_acc = 0;
  for (int64_t j = 0; j < p.K; ++j) {
    const bool accept = j < n_acc;
    stg(p.out_accept_mask + n * p.K + j, static_cast<uint8_t>(accept));
    stg(p.out_tokens + n * (p.K + 1) + j, accept ? r.draft(j) : int64_t(-1));
  }
  stg(p.out_tokens + n * (p.K + 1) + p.K, int64_t(-1));
  if (has_rows && !stopped) stg(p.out_tokens + n * (p.K + 1) + n_acc, emitted);
  stg(p.out_num_accepted + n, static_cast<int32_t>(n_acc));
}
#endif

}  // namespace dist_decide

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
cudaError_t launch_dist_verify_decide(const DistVerifyDecideParams& p, cudaStream_t s) {
  if (p.N <= 0) return cudaSuccess;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(p.N));
  cfg.block = dim3(dist_decide::kThreads);
  cfg.smem = dist_decide::staged_bytes(p);
  cfg.stream = s;
  return launch("dist_verify_decide", dist_decide::decide_kernel, cfg, p, cfg.smem > 0);
}
#endif

}  // namespace dspark
