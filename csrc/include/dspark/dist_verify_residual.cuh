// dspark/dist_verify_residual.cuh: the exact residual pass of a vocabulary-parallel verify_chain over one shard
// (dspark_dist::verify_residual; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_residual.
//
// For each planned slot (request n, slot s) whose NEED flag is set, over the shard's columns c (global id
// vocab_start + c) of target row j = the plan's row and draft row min(j, K-1):
//   p = softmax(target / T')[c] and q = softmax(draft / T')[c] from the plan's merged statistics (NaN for a bad row),
//       or q = [id == d_{j+1}] for one-hot drafts;  T' = T for T > 0, else 1
//   w = max(rho p - q, 0) (NaN kept: block verification reads a NaN mass as "never accept")
// and writes the mass sum_c w and the exponential race's winner (score w / -log(u), u = uniform(n, j, RESIDUAL, id),
// NaN as -inf, ties to the lowest id); (0, -inf, EMPTY_ID) for a slot not needed.
//
// Two launches, no host synchronisation: the sweep (grid: slots x vocabulary chunks; a slot not needed reads
// nothing) writes a (mass, winner) partial per (slot, chunk); the merge (a warp per slot) adds and races them.
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistVerifyResidualParams {
  dist::TargetRows target;
  const void* draft_logits = nullptr;  // [N, K, Vl] or null (one-hot drafts)
  DType draft_dtype = DType::kFloat32;
  const void* draft_tokens = nullptr;  // [N, K] int32 / int64
  bool drafts_i64 = false;
  const float* plan = nullptr;         // [N, S, 9] (layout.PLAN_*)
  const float* temperature = nullptr;  // [N]
  rng::Key rng_key;
  int64_t N = 0, K = 0, S = 0, Vl = 0, vocab_start = 0, vocab_size = 0;
  float* out = nullptr;                // [N, S, 3]: mass, winning score, winning id (float32)
};

namespace dist_residual {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
using namespace dist;  // the layouts' slots
constexpr int64_t kMinChunk = 1024;

struct Partial {
  float mass;
  ArgMax win;
  DSPARK_HOST_DEVICE_FN static Partial empty() { return Partial{0.0f, ArgMax::empty()}; }
  DSPARK_HOST_DEVICE_FN void merge(const Partial& o) {
    mass += o.mass;
    win.merge(o.win);
  }
};

// The plan's row as torch's float -> int64 then clamp(0, K) reads it (NaN -> 0).
DSPARK_DEVICE int64_t plan_row(float r, int64_t K) {
  if (!(r >= 0.0f)) return 0;
  return r < static_cast<float>(K) ? static_cast<int64_t>(r) : K;
}

DSPARK_DEVICE float prob(float x, float m, float s, float bad) { return bad > 0.0f ? NAN : expf(x - m) / s; }

// What a slot's sweep reads of the plan, the temperature, the draft and the key: loaded once per CTA.
struct Slot {
  int32_t need;
  int64_t j, jq, draft_id;
  float t, rho, tm, ts, tb, qm, qs, qb;
  rng::Philox ph;
};

DSPARK_DEVICE Slot load_slot(const DistVerifyResidualParams& p, int64_t slot) {
  Slot o{};
  const float* plan = p.plan + slot * kPlanWidth;
  o.need = ldg(plan + kPlanNeed) > 0.0f;
  if (!o.need) return o;
  const int64_t n = slot / p.S;
  o.j = plan_row(ldg(plan + kPlanRow), p.K);
  o.jq = o.j < p.K - 1 ? o.j : p.K - 1;
  const float t = ldg(p.temperature + n);
  o.t = t > 0.0f ? t : 1.0f;
  o.rho = ldg(plan + kPlanRho);
  o.tm = ldg(plan + kPlanTMax);
  o.ts = ldg(plan + kPlanTSum);
  o.tb = ldg(plan + kPlanTBad);
  o.draft_id = -1;
  if (p.draft_logits != nullptr) {
    o.qm = ldg(plan + kPlanQMax);
    o.qs = ldg(plan + kPlanQSum);
    o.qb = ldg(plan + kPlanQBad);
  } else {
    const int64_t d = load_int(p.draft_tokens, p.drafts_i64, n * p.K + o.jq);
    o.draft_id = d >= 0 && d < p.vocab_size ? d : -1;
  }
  o.ph = rng::load_philox(p.rng_key);
  return o;
}

template <typename TT>  // the target's element type
__global__ void __launch_bounds__(kThreads, 2) sweep_kernel(DistVerifyResidualParams p, int64_t chunk, int64_t chunks,
                                                        Partial* __restrict__ parts) {
  DSPARK_SHARED_ARRAY(Partial, scratch, 32);
  DSPARK_SHARED(Slot, shared_slot);
  const int64_t slot = blockIdx.x, n = slot / p.S;
  if (threadIdx.x == 0) shared_slot = load_slot(p, slot);
  __syncthreads();
  const Slot sl = shared_slot;
  if (!sl.need) return;  // the whole CTA leaves: nothing to read
  const int64_t j = sl.j, jq = sl.jq, draft_id = sl.draft_id;
  const float t = sl.t, rho = sl.rho, tm = sl.tm, ts = sl.ts, tb = sl.tb, qm = sl.qm, qs = sl.qs, qb = sl.qb;
  const rng::Philox ph = sl.ph;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t c1 = c0 + chunk < p.Vl ? c0 + chunk : p.Vl;
  const int64_t drow = (n * p.K + jq) * p.Vl;
  Partial mine = Partial::empty();
  auto visit = [&](int64_t c, float logit) {
    const float pc = prob(logit / t, tm, ts, tb);
    const int64_t id = p.vocab_start + c;
    const float qc = p.draft_logits != nullptr ? prob(load_float(p.draft_logits, p.draft_dtype, drow + c) / t, qm, qs,
                                                         qb)
                                               : (id == draft_id ? 1.0f : 0.0f);
    const float d = rho * pc - qc;
    const float w = d > 0.0f || d != d ? d : 0.0f;
    mine.mass += w;
    mine.win.update(race_score(w, ph.uniform(n, j, rng::kStreamResidual, id)), id);
  };
  const int64_t row = p.target.offset(n, j, p.K, p.Vl);
  if (row >= 0) {
    for_each_element(static_cast<const TT*>(p.target.row(row)), c0, c1, threadIdx.x, kThreads, visit);
  } else {
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) visit(c, 0.0f);
  }
  mine = block_allreduce(mine, scratch);
  if (threadIdx.x == 0) stg(parts + slot * chunks + blockIdx.y, mine);
}

__global__ void __launch_bounds__(kThreads) merge_kernel(DistVerifyResidualParams p, int64_t chunks,
                                                        const Partial* __restrict__ parts) {
  const int lane = threadIdx.x & 31;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (slot >= p.N * p.S) return;  // a whole warp leaves together
  const bool need = ldg(p.plan + slot * kPlanWidth + kPlanNeed) > 0.0f;
  Partial all = Partial::empty();
  if (need) {
    for (int64_t b = lane; b < chunks; b += 32) all.merge(ldg(parts + slot * chunks + b));
    all = warp_allreduce(all);
  }
  if (lane != 0) return;
  float* out = p.out + slot * 3;
  stg(out + 0, need ? all.mass : 0.0f);
  stg(out + 1, need ? all.win.value : neg_inf());
  stg(out + 2, need ? static_cast<float>(all.win.index) : kEmptyId);
}

inline SplitV split(int64_t Vl, int64_t slots) {
  return split_v(Vl, slots, static_cast<int64_t>(device_sm_count()) * 2 * (2048 / kThreads), kMinChunk);
}

}  // namespace dist_residual

inline size_t dist_verify_residual_workspace_bytes(int64_t slots, int64_t Vl) {
  return sizeof(dist_residual::Partial) * static_cast<size_t>(slots) *
         static_cast<size_t>(dist_residual::split(Vl, slots).chunks);
}

// Launch on `s`; the caller checked the arguments (N, K, Vl >= 1, S >= 0, N S < 2^31, the shard inside [0, 2^24))
// and gives dist_verify_residual_workspace_bytes(N S, Vl) bytes of workspace.
inline cudaError_t launch_dist_verify_residual(const DistVerifyResidualParams& p, void* workspace, cudaStream_t s) {
  const int64_t slots = p.N * p.S;
  if (slots <= 0) return cudaSuccess;
  const SplitV sv = dist_residual::split(p.Vl, slots);
  auto* parts = static_cast<dist_residual::Partial*>(workspace);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(slots), static_cast<unsigned>(sv.chunks));
  cfg.block = dim3(dist_residual::kThreads);
  cfg.stream = s;
  cudaError_t err = cudaErrorInvalidValue;
  DSPARK_DISPATCH_FLOAT(p.target.dtype, TT, return cudaErrorInvalidValue, {
    err = launch("dist_verify_residual_sweep", dist_residual::sweep_kernel<TT>, cfg, p, sv.chunk, sv.chunks, parts);
  });
  if (err != cudaSuccess) return err;
  cfg.grid = dim3(static_cast<unsigned>((slots + dist_residual::kWarps - 1) / dist_residual::kWarps));
  return launch("dist_verify_residual_merge", dist_residual::merge_kernel, cfg, p, sv.chunks, parts);
}

}  // namespace dspark
