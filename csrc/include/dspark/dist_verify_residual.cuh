// dspark/dist_verify_residual.cuh: the residual pass of a vocabulary-parallel verify_chain over one shard
// (dspark_dist::verify_residual; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_residual.
//
// verify_chain's pass B over a shard (verify_rows.cuh's sample_chunk): for each planned slot (request n, slot s)
// whose NEED flag is set, over the shard's columns c (global id vocab_start + c) of target row j = the plan's row and
// draft row min(j, K-1):
//   p = softmax(target / T')[c] and q = softmax(draft / T')[c] from the plan's merged statistics / normaliser (NaN for
//       a bad row), or q = [id == d_{j+1}] for one-hot drafts;  T' = T for T > 0, else 1
//   w = max(rho p - q, 0) (NaN kept: block verification reads a NaN mass as "never accept")
// and writes the mass sum_c w, the exponential race's winner (score w / -log(u)) and the Gumbel race's (key
// target / T' - log(-log(u))), u = uniform(n, j, RESIDUAL, id), NaN as -inf, ties to the lowest id; (0, -inf,
// EMPTY_ID, -inf, EMPTY_ID) for a slot not needed.
//
// One launch: a CTA per (slot, vocabulary chunk) (a slot not needed reads nothing); the last CTA of a slot (ticket)
// merges its chunks in a fixed order.
//
// Defines what dspark/dist_verify_residual.h declares: a library includes this header in one translation unit
// (csrc/kernels/dist_verify_residual.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "dist_verify_residual.h"
#include "verify_rows.cuh"

namespace dspark {

namespace dist_residual {

using verify::kThreads;
using verify::VStats;
using namespace dist;  // the layouts' slots
constexpr int64_t kMinChunk = 1024;

// The partials of a (slot, chunk), each slot's block 32-byte aligned (cs, ms: its strides).
struct Work {
  ArgMax* res;
  ArgMax* gum;
  float* mass;
  uint32_t* tickets;  // [N S]
  int64_t chunk, chunks, cs, ms;
};

// The plan's row as torch's float -> int64 then clamp(0, K) reads it (NaN -> 0).
DSPARK_DEVICE int64_t plan_row(float r, int64_t K) {
  if (!(r >= 0.0f)) return 0;
  return r < static_cast<float>(K) ? static_cast<int64_t>(r) : K;
}

// What a slot's sweep reads of the plan, the temperature, the draft and the key: loaded once per CTA.
struct Slot {
  int32_t need;
  int64_t j, jq, hot;
  float t, rho;
  VStats pt, pq;
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
  o.pt = VStats{SoftmaxStats{ldg(plan + kPlanTMax), ldg(plan + kPlanTSum)}, ldg(plan + kPlanTBad) > 0.0f ? 1u : 0u,
                0u};
  o.pq = VStats{SoftmaxStats{ldg(plan + kPlanQMax), ldg(plan + kPlanQSum)}, ldg(plan + kPlanQBad) > 0.0f ? 1u : 0u,
                0u};
  o.hot = -1;
  if (p.draft_logits == nullptr) {
    const int64_t d = load_int(p.draft_tokens, p.drafts_i64, n * p.K + o.jq);
    o.hot = d >= 0 && d < p.vocab_size ? d - p.vocab_start : -1;  // a local column (outside the shard: none)
  }
  o.ph = rng::load_philox(p.rng_key);
  return o;
}

// The slot's outputs from its merged partials (warp 0 of its last CTA), or the empty ones.
DSPARK_DEVICE void write_slot(const DistVerifyResidualParams& p, const Work& w, int64_t slot, bool need) {
  const int lane = threadIdx.x & 31;
  verify::SamplePart all = verify::SamplePart::empty();
  for (int64_t c = lane; need && c < w.chunks; c += 32) {
    all.res.merge(verify::ld_part(w.res + slot * w.cs + c));
    all.gum.merge(verify::ld_part(w.gum + slot * w.cs + c));
    all.mass += ld_coherent(w.mass + slot * w.ms + c);
  }
  all = warp_allreduce(all);
  if (lane != 0) return;
  float* out = p.out + slot * kResWidth;
  stg(out + kResMass, need ? all.mass : 0.0f);
  stg(out + kResScore, need ? all.res.value : neg_inf());
  stg(out + kResId, need ? static_cast<float>(all.res.index) : kEmptyId);
  stg(out + kResGScore, need ? all.gum.value : neg_inf());
  stg(out + kResGId, need ? static_cast<float>(all.gum.index) : kEmptyId);
}

template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, 2) residual_kernel(DistVerifyResidualParams p, Work w) {
  DSPARK_SHARED(Slot, s_slot);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(verify::SamplePart, s_part, 32);
  const int64_t slot = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - slot * w.chunks;
  if (threadIdx.x == 0) s_slot = load_slot(p, slot);
  __syncthreads();
  const Slot sl = s_slot;
  if (!sl.need) {  // the whole CTA leaves: nothing to read; chunk 0 writes the empty slot
    if (c == 0 && threadIdx.x < 32) write_slot(p, w, slot, false);
    return;
  }
  const int64_t n = slot / p.S;
  verify::SampleRow sr;
  sr.t = sl.t;
  sr.rho = sl.rho;
  sr.pt = sl.pt;
  verify::QSource qs;
  qs.t = sl.t;
  qs.norm = sl.pq;
  qs.hot = sl.hot;
  qs.kind = p.draft_logits != nullptr ? verify::QKind::kDense : verify::QKind::kOneHot;
  qs.row = p.draft_logits != nullptr ? static_cast<const TD*>(p.draft_logits) + (n * p.K + sl.jq) * p.Vl : nullptr;
  qs.width = p.Vl;
  verify::SampleScan<true> sc;
  sc.part = verify::SamplePart::empty();
  sc.uni.init(sl.ph, n, sl.j);
  sc.id0 = p.vocab_start;
  const int64_t begin = c * w.chunk, end = begin + w.chunk < p.Vl ? begin + w.chunk : p.Vl;
  const int64_t row = p.target.offset(n, sl.j, p.K, p.Vl);
  if (row >= 0) {
    verify::sample_chunk<true, TT, TD>(static_cast<const TT*>(p.target.row(row)), begin, end, sr, qs, sc);
  } else {  // a packed shard without rows: the reference reads zeros
    for (int64_t x = begin + threadIdx.x; x < end; x += blockDim.x) {
      float q[1];
      verify::q_span<TD, 1>(qs, x, q);
      sc.visit(sr, x, 0.f, q[0]);
    }
  }
  const verify::SamplePart part = block_allreduce(sc.part, s_part);
  if (threadIdx.x == 0) {
    verify::st_part(w.res + slot * w.cs + c, part.res);
    verify::st_part(w.gum + slot * w.cs + c, part.gum);
    stg(w.mass + slot * w.ms + c, part.mass);
  }
  if (!verify::last_cta(w.tickets + slot, static_cast<uint32_t>(w.chunks), &s_last)) return;
  if (threadIdx.x < 32) write_slot(p, w, slot, true);
}

}  // namespace dist_residual

// The split of the slots' rows.
inline SplitV dist_verify_residual_split(int64_t slots, int64_t Vl) {
  return split_v(Vl, slots, static_cast<int64_t>(device_sm_count()) * 2, dist_residual::kMinChunk);
}
size_t dist_verify_residual_workspace_bytes(int64_t slots, int64_t Vl) {
  const SplitV sv = dist_verify_residual_split(slots, Vl);
  const size_t cs = static_cast<size_t>((sv.chunks + 1) / 2 * 2), ms = static_cast<size_t>((sv.chunks + 7) / 8 * 8);
  return static_cast<size_t>(slots) * (2 * 16 * cs + 4 * ms);
}

cudaError_t launch_dist_verify_residual(const DistVerifyResidualParams& p, void* workspace, uint32_t* tickets,
                                        cudaStream_t s) {
  const int64_t slots = p.N * p.S;
  if (slots <= 0) return cudaSuccess;
  const SplitV sv = dist_verify_residual_split(slots, p.Vl);
  dist_residual::Work w;
  w.chunk = sv.chunk;
  w.chunks = sv.chunks;
  w.cs = (sv.chunks + 1) / 2 * 2;
  w.ms = (sv.chunks + 7) / 8 * 8;
  w.res = static_cast<ArgMax*>(workspace);
  w.gum = w.res + slots * w.cs;
  w.mass = reinterpret_cast<float*>(w.gum + slots * w.cs);
  w.tickets = tickets;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(slots * sv.chunks));
  cfg.block = dim3(dist_residual::kThreads);
  cfg.stream = s;
  cudaError_t err = cudaErrorInvalidValue;
  const DType dd = p.draft_logits != nullptr ? p.draft_dtype : p.target.dtype;
  DSPARK_DISPATCH_FLOAT(p.target.dtype, TT, return cudaErrorInvalidValue,
    DSPARK_DISPATCH_FLOAT(dd, TD, return cudaErrorInvalidValue,
      err = launch("dist_verify_residual", dist_residual::residual_kernel<TT, TD>, cfg, p, w);
    )
  )
  return err;
}

}  // namespace dspark
