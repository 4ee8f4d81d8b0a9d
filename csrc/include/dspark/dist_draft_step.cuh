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
//   sweep  grid (request tiles of kTile, vocabulary chunks): CTA (t, b) stages its tile's v rows in shared memory;
//          warp w takes columns w, w + kWarps, ... of chunk b and reads each W2 row once, coalesced, accumulating the
//          dot products with all kTile v rows in registers; one reduce-scatter across the warp (log2 kTile halving
//          shuffles, then the rest of a warp sum) leaves request i's dot product on lane i * 32 / kTile, which adds
//          U, forms the key and updates request i's running Part. The warps' Parts merge through shared memory into
//          one Part per (request, chunk) in the workspace. The tiles of a chunk are adjacent in launch order, so at
//          N > kTile DRAM serves the chunk's W2 rows once and L2 the other tiles.
//   merge  a warp per request merges its chunks' Parts and writes the packed winner and the statistics.
// kTile is 8 for N <= 8 (the FMAs per loaded W2 element stay below an H100's FMA-to-byte ratio) and 32 above.
#pragma once

#include <math.h>
#include <stdint.h>

#include "draft_part.cuh"
#include "platform.cuh"
#include "reduce.cuh"
#include "rng.cuh"
#include "vec.cuh"

namespace dspark {

struct DistDraftStepParams {
  const void* base = nullptr;  // U at this position, rows of Vl elements `base_stride` apart
  DType base_dtype = DType::kFloat32;
  int64_t base_stride = 0;
  const float* v = nullptr;    // [N, R]
  const void* w2 = nullptr;    // [Vl, R] rows of the shard
  DType w2_dtype = DType::kFloat32;
  const float* temperature = nullptr;  // [N] or null (every request greedy)
  rng::Key rng_key;
  int64_t N = 0, Vl = 0, R = 0, position = 0, vocab_start = 0;
  float* logits = nullptr;     // [N, Vl] float32, or null
  int64_t* packed = nullptr;   // [N]
  float* stats = nullptr;      // [N, 5]: max, sum, bad, the winner's scaled logit, its id (as float32)
};

namespace dist_draft {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStatsWidth = 5;
constexpr int64_t kMinChunk = 128;  // columns per CTA at least (16 per warp)
// Resident sweep CTAs per SM its register allocation must allow (0: no bound, ptxas's choice). On sm_100 ptxas holds
// the float kTile = 8 sweep to 64 registers (four CTAs) and spills 8 bytes; three CTAs leave that tile 85. The
// kTile = 32 sweeps keep ptxas's choice (104 there; a bound of three spills them), as does every sweep elsewhere.
template <int kTile>
constexpr int sweep_min_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  return kTile <= 8 ? 3 : 0;
#else
  return 0;
#endif
}

// A column with scaled logit `x` and (NaN-free) key `key` of global id `id`: NaN and +inf carry no softmax mass and
// set `bad` (layout.local_softmax_stats), unlike draft::Part::add.
DSPARK_DEVICE void add_column(draft::Part& pt, float x, float key, int64_t id) {
  if (pt.win.beaten_by(key, id)) {
    pt.win = ArgMax{key, id};
    pt.scaled = x;
  }
  if (x != x || x == INFINITY) {
    pt.bad = 1;
  } else {
    pt.stats.update(x);
  }
}

// Reduce-scatter of kTile per-lane values across a full warp: returns, on lane l, the sum over the 32 lanes of
// a[l * kTile / 32] (a is clobbered). log2(kTile) halving steps, each lane keeping the half its partner sends, then
// the rest of a butterfly sum.
template <int kTile>
DSPARK_DEVICE float warp_reduce_scatter(float (&a)[kTile], int lane) {
  static_assert(kTile >= 1 && kTile <= 32 && (kTile & (kTile - 1)) == 0, "kTile is a power of two <= 32");
  int off = 16;
#pragma unroll
  for (int half = kTile / 2; half >= 1; half /= 2, off /= 2) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? a[i] : a[i + half];
      const float keep = upper ? a[i + half] : a[i];
      a[i] = keep + __shfl_xor_sync(kFullMask, send, off);
    }
  }
  for (; off >= 1; off /= 2) a[0] += __shfl_xor_sync(kFullMask, a[0], off);
  return a[0];
}

DSPARK_HOST_DEVICE_FN int64_t num_tiles(int64_t N, int tile) { return (N + tile - 1) / tile; }

template <typename TW, int kTile>
__global__ void __launch_bounds__(kThreads, sweep_min_ctas<kTile>())
    sweep_kernel(DistDraftStepParams p, int64_t chunk, int64_t chunks, draft::Part* __restrict__ parts) {
  DSPARK_DYNAMIC_SMEM(float, vs);  // [kTile, R]
  DSPARK_SHARED_ARRAY(draft::Part, warp_parts, kWarps * kTile);
  DSPARK_SHARED_ARRAY(float, temps, kTile);
  DSPARK_SHARED(rng::Philox, philox);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int nb = static_cast<int>(p.N - n0 < kTile ? p.N - n0 : kTile);
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t c1 = c0 + chunk < p.Vl ? c0 + chunk : p.Vl;
  for (int64_t i = threadIdx.x; i < kTile * p.R; i += kThreads) {  // rows past the batch are zero
    const int64_t j = i / p.R;
    vs[i] = j < nb ? ldg(p.v + (n0 + j) * p.R + (i - j * p.R)) : 0.0f;
  }
  if (threadIdx.x < nb) temps[threadIdx.x] = p.temperature != nullptr ? ldg(p.temperature + n0 + threadIdx.x) : 0.0f;
  if (threadIdx.x == kThreads - 1 && p.temperature != nullptr) philox = rng::load_philox(p.rng_key);
  __syncthreads();

  constexpr int kLanesPer = 32 / kTile;
  const int mine = lane / kLanesPer;  // the request whose dot product this lane ends with
  const bool owner = lane % kLanesPer == 0 && mine < nb;
  const int64_t n = n0 + mine;
  const bool sampled = owner && temps[mine] > 0.0f;
  const float scale = sampled ? temps[mine] : 1.0f;
  const rng::Philox ph = sampled ? philox : rng::Philox{};
  draft::Part pt = draft::Part::empty();
  const TW* w2 = static_cast<const TW*>(p.w2);
  for (int64_t c = c0 + warp; c < c1; c += kWarps) {
    float acc[kTile];
#pragma unroll
    for (int i = 0; i < kTile; ++i) acc[i] = 0.0f;
    for_each_element(w2 + c * p.R, 0, p.R, lane, 32, [&](int64_t e, float w) {
#pragma unroll
      for (int i = 0; i < kTile; ++i) acc[i] = fmaf(w, vs[i * p.R + e], acc[i]);
    });
    const float dot = warp_reduce_scatter<kTile>(acc, lane);
    if (!owner) continue;
    const float logit = load_float(p.base, p.base_dtype, n * p.base_stride + c) + dot;
    if (p.logits != nullptr) stg(p.logits + n * p.Vl + c, logit);
    const float x = logit / scale;
    const int64_t id = p.vocab_start + c;
    const float key = sampled ? gumbel_score(x, ph.uniform(n, p.position, rng::kStreamDraft, id))
                              : nan_to_neg_inf(logit);
    add_column(pt, x, key, id);
  }
  if (owner) warp_parts[warp * kTile + mine] = pt;
  __syncthreads();
  if (threadIdx.x < nb) {
    draft::Part merged = warp_parts[threadIdx.x];
    for (int w = 1; w < kWarps; ++w) merged.merge(warp_parts[w * kTile + threadIdx.x]);
    stg(parts + (n0 + threadIdx.x) * chunks + blockIdx.y, merged);
  }
}

__global__ void __launch_bounds__(kThreads) merge_kernel(DistDraftStepParams p, int64_t chunks,
                                                        const draft::Part* __restrict__ parts) {
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (n >= p.N) return;  // a whole warp leaves together
  draft::Part pt = draft::Part::empty();
  for (int64_t b = lane; b < chunks; b += 32) pt.merge(ldg(parts + n * chunks + b));
  pt = warp_allreduce(pt);
  if (lane != 0) return;
  // pack_key: pack_winner's unsigned order made signed (the top bit flipped)
  stg(p.packed + n, static_cast<int64_t>(draft::pack_winner(pt.win) ^ (uint64_t(1) << 63)));
  float* out = p.stats + n * kStatsWidth;
  stg(out + 0, pt.stats.m);
  stg(out + 1, pt.stats.s);
  stg(out + 2, pt.bad ? 1.0f : 0.0f);
  stg(out + 3, pt.scaled);
  stg(out + 4, static_cast<float>(pt.win.index));
}

// Chunks of the vocabulary: enough CTAs (times the request tiles) for two waves of resident CTAs.
inline SplitV split(int64_t Vl, int64_t tiles) {
  return split_v(Vl, tiles, static_cast<int64_t>(device_sm_count()) * 2 * (2048 / kThreads), kMinChunk);
}

inline int tile_for(int64_t N) { return N <= 8 ? 8 : 32; }

template <typename TW, int kTile>
inline cudaError_t launch_sweep(const DistDraftStepParams& p, SplitV sv, draft::Part* parts, cudaStream_t s) {
  const size_t smem = sizeof(float) * kTile * static_cast<size_t>(p.R);
  auto kernel = sweep_kernel<TW, kTile>;
  if (smem > kDefaultSmemPerBlock) {
    const cudaError_t err = set_max_dynamic_smem(kernel, smem);
    if (err != cudaSuccess) return err;
  }
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(num_tiles(p.N, kTile)), static_cast<unsigned>(sv.chunks));
  cfg.block = dim3(kThreads);
  cfg.smem = smem;
  cfg.stream = s;
  return launch("dist_draft_step_sweep", kernel, cfg, p, sv.chunk, sv.chunks, parts);
}

}  // namespace dist_draft

// The largest R the sweep's shared v tile allows for N requests on the current device.
inline int64_t dist_draft_step_max_rank(int64_t N) {
  const size_t tile = static_cast<size_t>(dist_draft::tile_for(N));
  // the sweep's static shared memory: the warps' Parts, the tile's temperatures, the key (and alignment slack)
  const size_t fixed =
      sizeof(draft::Part) * dist_draft::kWarps * tile + sizeof(float) * tile + sizeof(rng::Philox) + 64;
  const size_t smem = device_max_smem_per_block();
  return smem > fixed ? static_cast<int64_t>((smem - fixed) / (sizeof(float) * tile)) : 0;
}

// Workspace bytes for these sizes (the per-(request, chunk) partials).
inline size_t dist_draft_step_workspace_bytes(int64_t N, int64_t Vl) {
  const SplitV sv = dist_draft::split(Vl, dist_draft::num_tiles(N, dist_draft::tile_for(N)));
  return sizeof(draft::Part) * static_cast<size_t>(N) * static_cast<size_t>(sv.chunks);
}

// Launch on `s`; the caller checked the arguments (N, Vl, R >= 1, R <= dist_draft_step_max_rank(N), Vl < 2^24,
// vocab_start + Vl <= 2^24, position < 2^24) and gives dist_draft_step_workspace_bytes(N, Vl) bytes of workspace.
inline cudaError_t launch_dist_draft_step(const DistDraftStepParams& p, void* workspace, cudaStream_t s) {
  if (p.N <= 0) return cudaSuccess;
  const int tile = dist_draft::tile_for(p.N);
  const SplitV sv = dist_draft::split(p.Vl, dist_draft::num_tiles(p.N, tile));
  auto* parts = static_cast<draft::Part*>(workspace);
  cudaError_t err = cudaErrorInvalidValue;
  DSPARK_DISPATCH_FLOAT(p.w2_dtype, TW, return cudaErrorInvalidValue, {
    err = tile == 8 ? dist_draft::launch_sweep<TW, 8>(p, sv, parts, s)
                    : dist_draft::launch_sweep<TW, 32>(p, sv, parts, s);
  });
  if (err != cudaSuccess) return err;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.N + dist_draft::kWarps - 1) / dist_draft::kWarps));
  cfg.block = dim3(dist_draft::kThreads);
  cfg.stream = s;
  return launch("dist_draft_step_merge", dist_draft::merge_kernel, cfg, p, sv.chunks, parts);
}

}  // namespace dspark
