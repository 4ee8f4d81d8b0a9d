// dspark/dist_draft_step.cuh: one position of the Markov head on one vocabulary shard (dspark_dist::draft_step; no
// torch). The meaning is dspark_kernels/distributed/local_draft.py:draft_step.
//
// The shard holds the global ids [vocab_start, vocab_start + Vl). For each request n and shard column c:
//   logit = U[n, c] + W2[c] . v[n]                        (W2 fp32 / bf16 / fp16 [Vl, R], v float32 [N, R])
//   key   = logit                                          greedy (no temperature, or T <= 0)
//         = logit / T - log(-log u)                        sampled, u = uniform(n, position, DRAFT, global id)
// The shard's winner is the argmax of the key (NaN as -inf, ties to the lowest id), packed so that an integer MAX of
// the packed values over the shards is the package's argmax over the whole vocabulary (pack_key in local_draft.py:
// pack_winner's order, signed); beside it the softmax statistics of logit / T' (T' = T sampled, 1 greedy) with NaN and
// +inf left out and flagged, and the winner's scaled logit (layout.DRAFT_*).
//
// Two launches, no host synchronisation:
//   sweep  the draft_block position sweep (dspark/draft_sweep.cuh) over the shard's Vl rows: the float32 v rows as
//          A (tensor cores, split into hi + lo rows of W2's type) or in registers (CUDA cores, small N or an fp32
//          W2), U's rows `base_stride` apart, ids vocab_start + c, each (request, CTA) Part kept by this rule
//          (add_column) into the workspace [N][slices];
//   merge  a warp per request merges its slices' Parts and writes the packed winner and the statistics.
//
// Defines what dspark/dist_draft_step.h declares: a library includes this header in one translation unit
// (csrc/kernels/draft_block.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_draft_step.h"
#include "draft_part.cuh"
#include "draft_sweep.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

namespace dist_draft {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A CTA the requests n0 .. n0 + NB - 1 (draft::finish_group's NB): its threads over (request t % NB, slices
// t / NB + (256 / NB) i), so that a warp's loads of the [slice][N] records are contiguous; the Parts merged across
// the lanes of a request, then across the warps; the packed winner and the statistics (5 floats a request) written
// by consecutive threads.
__global__ void __launch_bounds__(kThreads) merge_kernel(DistDraftStepParams p, int64_t slices,
                                                        const float4* __restrict__ stats, const int2* __restrict__ ids,
                                                        int NB) {
  DSPARK_SHARED_ARRAY(int64_t, part_mem, (kWarps * draft::kFinishGroup * draft::PartSlots::kBytes + 7) / 8);
  DSPARK_SHARED_ARRAY(float, outs, draft::kFinishGroup * kStatsWidth);
  const draft::PartSlots slots = draft::PartSlots::at(part_mem, kWarps * NB);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, n0 = int64_t(blockIdx.x) * NB, Np = draft::padded_requests(N);
  const int nb = static_cast<int>(N - n0 < NB ? N - n0 : NB), n = t % NB;
  const int nread = static_cast<int>(Np - n0 < NB ? Np - n0 : NB);  // the requests' records with their padding
  grid_dependency_wait();
  draft::Part pt = draft::Part::empty();
  for (int64_t s = t / NB; n < nread && s < slices; s += kThreads / NB) {
    const float4 a = ldg(stats + s * Np + n0 + n);
    const int2 b = ldg(ids + s * Np + n0 + n);
    if (n < nb) pt.merge(draft::Part{SoftmaxStats{a.z, a.w}, ArgMax{a.x, b.x}, a.y, b.y});
  }
  for (int o = NB; o < 32; o <<= 1) pt.merge(shfl_xor(pt, o));
  if (lane < NB) slots.put(warp * NB + lane, pt);
  __syncthreads();
  if (t < nb) {
    draft::Part m = slots.get(t);
    for (int w = 1; w < kWarps; ++w) m.merge(slots.get(w * NB + t));
    // pack_key: pack_winner's unsigned order made signed (the top bit flipped)
    stg(p.packed + n0 + t, static_cast<int64_t>(draft::pack_winner(m.win) ^ (uint64_t(1) << 63)));
    float* out = outs + t * kStatsWidth;
    out[0] = m.stats.m;
    out[1] = m.stats.s;
    out[2] = m.bad ? 1.0f : 0.0f;
    out[3] = m.scaled;
    out[4] = static_cast<float>(m.win.index);
  }
  __syncthreads();
  for (int f = t; f < nb * kStatsWidth; f += kThreads) stg(p.stats + n0 * kStatsWidth + f, outs[f]);
}

// The shard's sweep inputs and outputs.
inline draft::SweepParams sweep_params(const DistDraftStepParams& p, float4* stats, int2* ids, int slices) {
  draft::SweepParams s{};
  s.u = p.base;
  s.u_dtype = p.base_dtype;
  s.u_stride = p.base_stride;
  s.logits = p.logits;
  s.logits_stride = p.Vl;
  s.w2 = p.w2;
  s.w2_dtype = p.w2_dtype;
  s.N = p.N;
  s.V = p.Vl;
  s.R = p.R;
  s.v_w1 = false;
  s.vf = p.v;
  s.temperature = p.temperature;
  s.rng_key = p.rng_key;
  s.position = p.position;
  s.id_offset = p.vocab_start;
  s.slices = slices;
  s.np = draft::padded_requests(p.N);
  s.stats = stats;
  s.ids = ids;
  return s;
}

inline cudaError_t plan(const DistDraftStepParams& p, draft::SweepPlan* pl) {
  return draft::sweep(sweep_params(p, nullptr, nullptr, 1), *pl, true, nullptr, false, "", "");
}

}  // namespace dist_draft

size_t dist_draft_step_workspace_bytes(const DistDraftStepParams& p) {
  draft::SweepPlan pl{};
  if (dist_draft::plan(p, &pl) != cudaSuccess) return 0;
  return 24 * static_cast<size_t>(draft::padded_requests(p.N)) * static_cast<size_t>(pl.slices);
}

cudaError_t launch_dist_draft_step(const DistDraftStepParams& p, void* workspace, cudaStream_t s) {
  if (p.N <= 0) return cudaSuccess;
  draft::SweepPlan pl{};
  cudaError_t err = dist_draft::plan(p, &pl);
  if (err != cudaSuccess) return err;
  auto* stats = static_cast<float4*>(workspace);
  auto* ids = reinterpret_cast<int2*>(stats + draft::padded_requests(p.N) * pl.slices);
  err = draft::sweep(dist_draft::sweep_params(p, stats, ids, pl.slices), pl, false, s, false,
                     "dist_draft_step_sweep[gemv]", "dist_draft_step_sweep[mma]");
  if (err != cudaSuccess) return err;
  const int nb = draft::finish_group(p.N);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.N + nb - 1) / nb));
  cfg.block = dim3(dist_draft::kThreads);
  cfg.stream = s;
  cfg.pdl = true;
  return launch("dist_draft_step_merge", dist_draft::merge_kernel, cfg, p, int64_t(pl.slices), stats, ids, nb);
}

}  // namespace dspark
