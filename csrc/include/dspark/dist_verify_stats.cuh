// dspark/dist_verify_stats.cuh: the first exchange's send buffer of a vocabulary-parallel verify_chain over one shard
// (dspark_dist::verify_stats; no torch). The meaning is dspark_kernels/distributed/local_verify.py:verify_stats and
// the layout distributed/layout.py's StatsLayout.
//
// verify_chain's pass A over a shard (verify_rows.cuh): one CTA per (request, row j in 0..K, vocabulary chunk), split
// so that N = 1 fills the GPU, reads its chunk of the shard's target row once (and of draft row j for j < K): the
// raw argmax (NaN as -inf, the lowest id on ties) and, when sampling (a temperature tensor), the softmax statistics
// of target / T' (T' = T for T > 0, else 1) and of draft / T', NaN and +inf flagged and left out. The last CTA of a
// row (ticket) merges the chunks in a fixed order and writes the row's slots, with the scaled logits at the row's
// draft d_{j+1} where the shard owns it.
//
// Defines what dspark/dist_verify_stats.h declares: a library includes this header in one translation unit
// (csrc/kernels/dist_verify_stats.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include "dist_rows.cuh"
#include "dist_verify_stats.h"
#include "verify_rows.cuh"

namespace dspark {

namespace dist_stats {

using verify::kThreads;
using verify::VStats;
using namespace dist;  // the layout's slots
constexpr int64_t kMinChunk = 1024;

// The partials of a (row, chunk), each row's block 32-byte aligned (cs: its stride).
struct Work {
  ArgMax* amax;
  VStats* t;
  VStats* q;
  uint32_t* tickets;  // [N (K+1)]
  int64_t chunk, chunks, cs;
};

// One thread's scan of a chunk: the raw argmax, and the statistics of the row with NaN and +inf left out (flagged).
struct ShardScan {
  verify::RowScan raw, clean;
  uint32_t bad;
  DSPARK_DEVICE void init(float t) {
    raw.init(1.f);
    clean.init(t);
    bad = 0u;
  }
  template <bool kSum, int kU, int kN>
  DSPARK_DEVICE void batch(const float (&x)[kU][kN], int64_t at, int64_t stride, int valid = kU) {
    raw.template batch<false>(x, at, stride);
    if constexpr (kSum) {
      float c[kU][kN];
#pragma unroll
      for (int k = 0; k < kU; ++k)
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const bool odd = x[k][e] != x[k][e] || x[k][e] == INFINITY;
          bad |= odd ? 1u : 0u;
          c[k][e] = odd ? neg_inf() : x[k][e];
        }
      clean.template batch<true>(c, at, stride, valid);
    }
  }
  DSPARK_DEVICE VStats stats(float t) const {
    VStats v = clean.stats(t);
    v.bad = bad;
    return v;
  }
};

// This thread's part of [begin, end) of a row (zeros where `row` is null: a packed shard without rows).
template <bool kSum, typename T>
DSPARK_DEVICE void scan_shard(const T* row, int64_t begin, int64_t end, ShardScan& sc) {
  if (row == nullptr) {
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float x[1][1] = {{0.f}};
      sc.template batch<kSum>(x, i, int64_t(1));
    }
    return;
  }
  for_each_batch<verify::kLoadsInFlight, 32>(
      row, begin, end, threadIdx.x, blockDim.x,
      [&](const auto& x, int64_t at, int64_t stride, int valid) { sc.template batch<kSum>(x, at, stride, valid); },
      [&](int64_t i, float v) {
        const float x[1][1] = {{v}};
        sc.template batch<kSum>(x, i, int64_t(1));
      });
}

// The local column of draft d_{j+1} when this shard owns it (j < K), else -1; a draft outside [0, V) reads token 0.
DSPARK_DEVICE int64_t owned_draft(const DistVerifyStatsParams& p, int64_t n, int64_t j) {
  if (j >= p.K) return -1;
  int64_t d = load_int(p.draft_tokens, p.drafts_i64, n * p.K + j);
  d = d >= 0 && d < p.vocab_size ? d : 0;
  const int64_t c = d - p.vocab_start;
  return c >= 0 && c < p.Vl ? c : -1;
}

// The row's slots from its merged partials (warp 0 of the row's last CTA).
DSPARK_DEVICE void write_row(const DistVerifyStatsParams& p, const Work& w, int64_t row_id, float t) {
  const int lane = threadIdx.x & 31;
  const int64_t n = row_id / (p.K + 1), j = row_id - n * (p.K + 1);
  const bool sampled = p.temperature != nullptr, read_q = sampled && p.draft_logits != nullptr && j < p.K;
  ArgMax a = ArgMax::empty();
  VStats ts = VStats::empty(), qs = VStats::empty();
  for (int64_t c = lane; c < w.chunks; c += 32) {
    a.merge(verify::ld_part(w.amax + row_id * w.cs + c));
    if (sampled) ts.merge(verify::ld_part(w.t + row_id * w.cs + c));
    if (read_q) qs.merge(verify::ld_part(w.q + row_id * w.cs + c));
  }
  a = warp_allreduce(a);
  ts = warp_allreduce(ts);
  qs = warp_allreduce(qs);
  if (lane != 0) return;
  float* out = p.out + row_id * p.width;
  stg(out + kAmaxVal, a.value);
  stg(out + kAmaxId, static_cast<float>(p.vocab_start + a.index));
  if (!sampled) return;
  const int64_t toff = p.target.offset(n, j, p.K, p.Vl), col = owned_draft(p, n, j);
  stg(out + kTMax, ts.st.m);
  stg(out + kTSum, ts.st.s);
  stg(out + kTBad, ts.bad ? 1.0f : 0.0f);
  // the logit at the draft is read only where this shard owns it (a packed shard without rows reads zeros)
  const float t_at = toff >= 0 && col >= 0 ? load_float(p.target.data, p.target.dtype, toff + col) / t : 0.f;
  stg(out + kTAt, col >= 0 ? t_at : neg_inf());
  if (p.draft_logits == nullptr) return;
  stg(out + kQMax, read_q ? qs.st.m : neg_inf());
  stg(out + kQSum, read_q ? qs.st.s : 0.0f);
  stg(out + kQBad, read_q && qs.bad ? 1.0f : 0.0f);
  const float q_at = col >= 0 ? load_float(p.draft_logits, p.draft_dtype, (n * p.K + j) * p.Vl + col) / t : 0.f;
  stg(out + kQAt, col >= 0 ? q_at : neg_inf());
}

template <typename TT, typename TD>
__global__ void __launch_bounds__(kThreads, 2) stats_kernel(DistVerifyStatsParams p, Work w) {
  DSPARK_SHARED(float, s_t);
  DSPARK_SHARED(int32_t, s_last);
  DSPARK_SHARED_ARRAY(ArgMax, s_amax, 32);
  DSPARK_SHARED_ARRAY(VStats, s_vs, 32);
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) / w.chunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) - row_id * w.chunks;
  const int64_t n = row_id / (p.K + 1), j = row_id - n * (p.K + 1);
  const bool sampled = p.temperature != nullptr;
  if (threadIdx.x == 0) {
    const float t_raw = sampled ? ldg(p.temperature + n) : 1.f;
    s_t = t_raw > 0.0f ? t_raw : 1.0f;
  }
  __syncthreads();
  const float t = s_t;
  const int64_t toff = p.target.offset(n, j, p.K, p.Vl);
  const TT* trow = toff >= 0 ? static_cast<const TT*>(p.target.row(toff)) : nullptr;
  const int64_t begin = c * w.chunk, end = begin + w.chunk < p.Vl ? begin + w.chunk : p.Vl;
  ShardScan sc;
  sc.init(t);
  if (sampled) {
    scan_shard<true>(trow, begin, end, sc);
  } else {
    scan_shard<false>(trow, begin, end, sc);
  }
  const ArgMax a = block_allreduce(sc.raw.argmax(), s_amax);
  const VStats ts = sampled ? block_allreduce(sc.stats(t), s_vs) : VStats::empty();
  VStats qs = VStats::empty();
  if (sampled && p.draft_logits != nullptr && j < p.K) {
    ShardScan sq;
    sq.init(t);
    scan_shard<true>(static_cast<const TD*>(p.draft_logits) + (n * p.K + j) * p.Vl, begin, end, sq);
    qs = block_allreduce(sq.stats(t), s_vs);
  }
  if (threadIdx.x == 0) {
    verify::st_part(w.amax + row_id * w.cs + c, a);
    verify::st_part(w.t + row_id * w.cs + c, ts);
    verify::st_part(w.q + row_id * w.cs + c, qs);
  }
  if (!verify::last_cta(w.tickets + row_id, static_cast<uint32_t>(w.chunks), &s_last)) return;
  if (threadIdx.x < 32) write_row(p, w, row_id, t);
}

}  // namespace dist_stats

inline SplitV dist_verify_stats_split(int64_t rows, int64_t Vl) {
  return split_v(Vl, rows, static_cast<int64_t>(device_sm_count()) * 2, dist_stats::kMinChunk);
}
size_t dist_verify_stats_workspace_bytes(int64_t rows, int64_t Vl) {
  const SplitV sv = dist_verify_stats_split(rows, Vl);
  return 3 * 16 * static_cast<size_t>(rows) * static_cast<size_t>((sv.chunks + 1) / 2 * 2);
}

cudaError_t launch_dist_verify_stats(const DistVerifyStatsParams& p, void* workspace, uint32_t* tickets,
                                     cudaStream_t s) {
  const int64_t rows = p.N * (p.K + 1);
  if (rows <= 0) return cudaSuccess;
  const SplitV sv = dist_verify_stats_split(rows, p.Vl);
  dist_stats::Work w;
  w.chunk = sv.chunk;
  w.chunks = sv.chunks;
  w.cs = (sv.chunks + 1) / 2 * 2;
  w.amax = static_cast<ArgMax*>(workspace);
  w.t = reinterpret_cast<verify::VStats*>(w.amax + rows * w.cs);
  w.q = w.t + rows * w.cs;
  w.tickets = tickets;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(rows * sv.chunks));
  cfg.block = dim3(dist_stats::kThreads);
  cfg.stream = s;
  cudaError_t err = cudaErrorInvalidValue;
  const DType dd = p.draft_logits != nullptr ? p.draft_dtype : p.target.dtype;
  DSPARK_DISPATCH_FLOAT(p.target.dtype, TT, return cudaErrorInvalidValue,
    DSPARK_DISPATCH_FLOAT(dd, TD, return cudaErrorInvalidValue,
      err = launch("dist_verify_stats", dist_stats::stats_kernel<TT, TD>, cfg, p, w);
    )
  )
  return err;
}

}  // namespace dspark
