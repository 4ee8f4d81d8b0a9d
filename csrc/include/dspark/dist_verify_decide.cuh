// dspark/dist_verify_decide.cuh: the replicated decide step of a vocabulary-parallel verify_chain
// (dspark_dist::verify_decide; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_decide,
// decision by decision; the layouts are distributed/layout.py's (StatsLayout, PLAN_*, RES_*).
//
// One thread per request reads the request's cells of every shard's first exchange stats [P, N, K+1, F] (and of the
// second exchange residual [P, N, R, 3] when given) and writes dk.verify_chain's outputs and the residual plan:
//   the verify length (rows available, verify_lens, survival >= thresholds); the target argmax of each row over the
//   shards (NaN as -inf, ties to the lowest global id) and the greedy accepted prefix; for a sampled request the
//   merged softmax statistics, p and q of each draft (from the shard that owns it), the accept uniforms, and token
//   acceptance (u q < p) or block acceptance (rho_i, h_i from S_i, tau); the stop-token cut; the emitted token (the
//   argmax; the race over p, the shards' best candidate; the token method's residual race over the P x top_m
//   candidates where its certificate holds, else the second exchange's exact winner; block: the second exchange's).
// The work per request is O(K P top_m) numbers, so a thread is enough; all rows' merges are recomputed where used
// (no per-row arrays).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyDecideParams {
  const float* stats = nullptr;        // [P, N, K+1, F]
  const int64_t* shards = nullptr;     // [P, 2]: (vocab_start, size)
  const float* residual = nullptr;     // [P, N, R, 3] or null
  const void* cu_seqlens = nullptr;    // [N+1] or null (dense)
  bool cu_i64 = false;
  int64_t num_rows = 0;
  const void* draft_tokens = nullptr;  // [N, K]
  bool drafts_i64 = false;
  const float* draft_logprobs = nullptr;  // [N, K] or null
  const void* verify_lens = nullptr;      // [N] or null
  bool lens_i64 = false;
  const void* survival = nullptr;         // [N, K] and thresholds [K], or null
  const void* thresholds = nullptr;
  DType survival_dtype = DType::kFloat32, thresholds_dtype = DType::kFloat32;
  const float* temperature = nullptr;     // [N] or null (greedy)
  rng::Key rng_key;
  const void* stop_ids = nullptr;         // [num_stops] or null
  bool stops_i64 = false;
  int64_t num_stops = 0;
  bool block_method = false, has_draft = false;
  int64_t N = 0, K = 0, P = 0, F = 0, R = 0, top_m = 1, vocab_size = 0;
  int64_t* out_tokens = nullptr;          // [N, K+1]
  int32_t* out_num_accepted = nullptr;    // [N]
  uint8_t* out_accept_mask = nullptr;     // [N, K]
  float* out_plan = nullptr;              // [N, R, 9] (R = 0 greedy, 1 token, K block)
};

namespace dist_decide {

constexpr int kThreads = 128;
using namespace dist;  // the layouts' slots
constexpr float kResidualEps = 1e-6f;                                 // reference.verify_chain.RESIDUAL_EPS
constexpr float kCertifiedEps = static_cast<float>(1e-6 * 1.001);    // the candidates' mass certificate

// Merged softmax statistics of a row (layout.merge_softmax_stats): bad also when no logit is finite.
struct Merged {
  float m, s;
  bool bad;
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
DSPARK_DEVICE float prob(float x, const Merged& st) { return st.bad ? NAN : expf(x - st.m) / st.s; }

// Request n's view of the exchanged buffers.
struct Request {
  const DistVerifyDecideParams& p;
  int64_t n;

  DSPARK_DEVICE float stat(int64_t shard, int64_t row, int64_t slot) const {
    return ldg(p.stats + ((shard * p.N + n) * (p.K + 1) + row) * p.F + slot);
  }
  DSPARK_DEVICE float res(int64_t shard, int64_t slot, int field) const {
    return ldg(p.residual + ((shard * p.N + n) * p.R + slot) * kResWidth + field);
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
  DSPARK_DEVICE Merged draft_stats(int64_t row) const {
    return p.has_draft ? merged(row, kQMax, kQSum, kQBad) : Merged{0.0f, 0.0f, false};
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
    if (p.has_draft) qd = prob(at_owner(j, kQAt), draft_stats(j));
    if (p.draft_logprobs != nullptr) qd = expf(ldg(p.draft_logprobs + n * p.K + j));
  }
  DSPARK_DEVICE float residual_mass(int64_t slot) const {
    float total = 0.0f;
    for (int64_t s = 0; s < p.P; ++s) total += res(s, slot, kResMass);
    return total;
  }
  DSPARK_DEVICE int64_t residual_winner(int64_t slot) const {
    ArgMax best = ArgMax::empty();
    for (int64_t s = 0; s < p.P; ++s) best.update(res(s, slot, kResScore), static_cast<int64_t>(res(s, slot, kResId)));
    return best.index;
  }
};

// The verify length L and whether the request has any target row (local_verify._verify_lengths).
DSPARK_DEVICE int64_t verify_length(const DistVerifyDecideParams& p, int64_t n, bool& has_rows) {
  int64_t last = p.K;
  if (p.cu_seqlens != nullptr) {
    const int64_t start = load_int(p.cu_seqlens, p.cu_i64, n);
    const int64_t count = load_int(p.cu_seqlens, p.cu_i64, n + 1) - start;
    const int64_t left = start >= 0 ? p.num_rows - start : 0;
    last = (count < left ? count : left) - 1;
    last = last < -1 ? -1 : (last > p.K ? p.K : last);
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

// Block verification: tau, writing the plan's K slots (row i, needed for i < L of a sampled request, rho_i, the
// merged statistics) on the way; rho_0 = 1, rho_i = min(rho_{i-1} p / q, 1) (NaN -> 0), h_i = S_i / (S_i + 1 - rho_i)
// (0/0 -> 1, NaN -> 0; S_i from the second exchange, 0 before it), h_L = rho_L; tau = the last i <= L with u <= h_i.
DSPARK_DEVICE int64_t block_tau(const Request& r, int64_t length, bool sampled, const rng::Philox& ph, float* plan) {
  const DistVerifyDecideParams& p = r.p;
  float rho = 1.0f;
  int64_t tau = 0;
  for (int64_t i = 0; i < p.K; ++i) {
    float* slot = plan + i * kPlanWidth;
    const Merged t = r.target_stats(i), q = r.draft_stats(i);
    const float cells[kPlanWidth] = {static_cast<float>(i), sampled && i < length ? 1.0f : 0.0f, rho, t.m, t.s,
                                     t.bad ? 1.0f : 0.0f, q.m, q.s, q.bad ? 1.0f : 0.0f};
    for (int f = 0; f < kPlanWidth; ++f) stg(slot + f, cells[f]);
    float pd, qd;
    r.draft_probs(i, pd, qd);
    float ratio = pd / qd;
    if (ratio != ratio) ratio = 0.0f;
    const float prod = rho * ratio;
    rho = prod != prod ? 0.0f : (prod < 1.0f ? prod : 1.0f);  // rho_{i+1}
    const int64_t idx = i + 1;
    const float mass = (p.residual != nullptr && idx < p.K) ? r.residual_mass(idx) : 0.0f;
    const float denom = mass + 1.0f - rho;
    float h = denom > 0.0f ? mass / denom : (denom == 0.0f ? 1.0f : 0.0f);
    if (idx >= p.K) h = 0.0f;
    if (idx == length) h = rho;
    if (ph.uniform(r.n, i, rng::kStreamAccept, 0) <= h && idx <= length) tau = idx;
  }
  return tau;
}

// Token sampling's emission at row `row` (the candidates' residual race, certified, or the second exchange's exact
// winner); writes the plan's slot. Returns the winner; use_p: the race over p decides instead.
DSPARK_DEVICE int64_t token_emit(const Request& r, int64_t row, bool emits, const rng::Philox& ph, bool& use_p,
                                 float* plan) {
  const DistVerifyDecideParams& p = r.p;
  const int64_t qrow = row < p.K - 1 ? row : p.K - 1;
  const Merged t = r.target_stats(row), q = r.draft_stats(qrow);
  const int64_t draft = r.safe(qrow);
  const bool draft_valid = r.valid(qrow);
  const int64_t bound = bound_slot(p.has_draft), cf = cand_fields(p.has_draft);
  float mass = 0.0f;
  ArgMax best = ArgMax::empty();
  for (int64_t s = 0; s < p.P; ++s) {
    for (int64_t m = 0; m < p.top_m; ++m) {
      const int64_t cell = bound + 1 + m * cf;
      const int64_t id = static_cast<int64_t>(r.stat(s, row, cell + cf - 1));
      const float pc = prob(r.stat(s, row, cell + 1), t);
      const float qc = p.has_draft ? prob(r.stat(s, row, cell + 2), q) : (id == draft && draft_valid ? 1.0f : 0.0f);
      const float d = pc - qc;
      float w = d > 0.0f || d != d ? d : 0.0f;  // clamp(min=0) keeps NaN
      if (static_cast<float>(id) == dist::kEmptyId) w = 0.0f;
      mass += w;
      best.update(race_score(w, ph.uniform(r.n, row, rng::kStreamResidual, id)), id);
    }
  }
  bool certified = true;  // no token outside a shard's candidates can reach the winning score
  for (int64_t s = 0; s < p.P; ++s) {
    const float b = r.stat(s, row, bound);
    const float tol = 1e-3f + 1e-6f * (fabsf(b) + fabsf(t.m));
    const float cap = expf(b - t.m + tol) / t.s * 1.0001f;
    certified = certified && (b > neg_inf() ? best.value > cap : best.value > 0.0f);
  }
  const bool nan_row = t.bad || q.bad;
  const bool need = emits && !nan_row && !(mass >= kCertifiedEps && certified);
  int64_t winner = best.index;
  if (p.residual != nullptr && need) {
    mass = r.residual_mass(0);
    winner = r.residual_winner(0);
  }
  use_p = nan_row || !(mass >= kResidualEps);
  const float cells[kPlanWidth] = {static_cast<float>(row), need ? 1.0f : 0.0f, 1.0f, t.m, t.s, t.bad ? 1.0f : 0.0f,
                                   q.m, q.s, q.bad ? 1.0f : 0.0f};
  for (int f = 0; f < kPlanWidth; ++f) stg(plan + f, cells[f]);
  return winner;
}

__global__ void __launch_bounds__(kThreads, 2) decide_kernel(DistVerifyDecideParams p) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (n >= p.N) return;
  const Request r{p, n};
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
      n_s = block_tau(r, length, sampled, ph, plan);
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
    const bool full = n_acc >= length;
    const int64_t qrow = n_acc < p.K - 1 ? n_acc : p.K - 1;
    const int64_t bound = bound_slot(p.has_draft), cf = cand_fields(p.has_draft);
    const int64_t from_p = r.shard_argmax(n_acc, bound + 1, bound + cf);  // candidate 0: the race over p
    int64_t from_res = from_p;
    bool use_p = full;
    if (p.block_method) {
      if (p.residual != nullptr) {
        from_res = r.residual_winner(qrow);
        use_p = !(r.residual_mass(qrow) >= kResidualEps);
      }
    } else {
      from_res = token_emit(r, n_acc, sampled && has_rows && !stopped && !full, ph, use_p, plan);
    }
    if (sampled) emitted = use_p || full ? from_p : from_res;
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
// Launch on `s`; the caller checked the arguments and sized the outputs.
inline cudaError_t launch_dist_verify_decide(const DistVerifyDecideParams& p, cudaStream_t s) {
  if (p.N <= 0) return cudaSuccess;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.N + dist_decide::kThreads - 1) / dist_decide::kThreads));
  cfg.block = dim3(dist_decide::kThreads);
  cfg.stream = s;
  return launch("dist_verify_decide", dist_decide::decide_kernel, cfg, p);
}
#endif

}  // namespace dspark
