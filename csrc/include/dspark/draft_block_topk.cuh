// dspark/draft_block_topk.cuh: draft_block's top-k proposal mode (DraftBlockParams::top_k > 0) in two launches.
//
// Meaning: dspark_kernels/reference/draft_block.py with top_k (the spec). Per request n and position k only the
// candidates C = the top_k largest entries of U_k get a bias: logits_c = U_k[c] + B_c(v) for c in C, in increasing id
// order; the draft (argmax, or the Gumbel race keyed by the draft id), its log-probability and the sparse logits are
// those of the softmax over C alone. The ranking is reference.topk_candidates' total order: the float value (-0 equal
// to +0, NaN below -inf), ties to the lower id; so C is unique whatever U holds.
//
// U does not depend on the walk, so there are two launches of CTAs of 256 threads, in stream order (the second a
// programmatic dependent launch):
//   draft_topk_select (a CTA a row of U, N K of them; select_row): one read of the row. Every element gets a
//     distinct 64-bit rank key (the order key above the inverted id); the keys above a rising floor go to a shared
//     buffer, which is cut back to its top_k (a bitonic sort) whenever the next chunk might not fit; at the end the
//     top_k keys are sorted by id and C's ids and U's values at them (a rank key holds its float) written to the
//     workspace.
//   draft_topk_walk (a CTA a request; walk): request n's Markov walk, K positions in order: e = W1[x],
//     the confidence logit and survival, v (gated / rnn: a warp per output row, the inputs staged in shared
//     memory), then a warp per candidate for W2[c] . v (consecutive lanes, consecutive elements): top_k rows of W2 per
//     position instead of V, read once.
//     One block reduction of draft::Part over the candidates gives the winner and the softmax statistics.
// Everything is float32; ties, NaN and -inf rules are those of the dense kernel (draft::Part).
#pragma once

#include "draft_block.cuh"
#include "select_top.cuh"

namespace dspark {
namespace draft_topk {

using draft::DraftBlockParams;
using draft::Part;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kMaxTopK <= top_select::kMaxTop, "the candidates must fit the selection buffer");
static_assert(kThreads == top_select::kThreads, "select_top runs on the whole block");

struct Workspace {
  int32_t* ids;  // [N, K, top_k] the candidates' draft ids, increasing
  float* vals;   // [N, K, top_k] U at them (from their rank keys: the walk reads them side by side, not gathered)
};

// Shared memory of the dynamic part, in floats: e, v, the rnn state, the gate / rnn input [s; e; h_k], and the
// candidates' ids and logits.
DSPARK_HOST_DEVICE_FN int64_t smem_floats(const DraftBlockParams& p) {
  return 5 * p.R + p.D + 2 * p.top_k;
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
using top_select::rank_key;
using top_select::rank_key_id;
using top_select::SelectScratch;

// Phase 1 for row `row` of U: C's draft ids, increasing, into the workspace. One read of the row
// (top_select::select_top: the keys above a rising floor into the shared buffer, cut back to the top_k when the next
// chunk might not fit), then the top_k keys sorted by id. The whole block.
DSPARK_DEVICE void select_row(const DraftBlockParams& p, const Workspace& ws, int64_t row, SelectScratch& s) {
  const int64_t V = p.V, top = p.top_k;
  const void* urow = draft::offset_row(p.base, p.base_dtype, row * V);
  top_select::select_top(s, V, top, [&](int64_t c0, int64_t c1, uint64_t floor) {
    for_each_element(urow, p.base_dtype, c0, c1, threadIdx.x, kThreads, [&](int64_t i, float x) {
      const uint64_t key = rank_key(x, i);
      if (key > floor) top_select::push(s, key);
    });
  });
  top_select::sort_kept(s, top, true);  // keys[0, top) hold C, by increasing id
  for (int64_t i = threadIdx.x; i < top; i += kThreads) {
    stg(ws.ids + row * top + i, static_cast<int32_t>(rank_key_id(s.keys[i])));
    stg(ws.vals + row * top + i, top_select::rank_key_value(s.keys[i]));
  }
  __syncthreads();  // the keys are read before the next row's reset
}

// The head's vector v of request n at position k (e in zs, written before a barrier): zs itself for the vanilla
// head; else computed into vv (the rnn state st updated), a warp per output row over the staged inputs hz.
DSPARK_DEVICE const float* head_vector(const DraftBlockParams& p, int64_t n, int64_t k, const float* zs, float* vv,
                                       float* st, float* hz) {
  if (p.head == draft::kVanilla) return zs;
  const int64_t R = p.R, D = p.D;
  const void* hrow = draft::offset_row(p.hidden, p.hidden_dtype, (n * p.K + k) * D);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  if (p.head == draft::kGated) {  // v = sigmoid(Wg [h_k; e] + bg) * e
    for (int64_t i = t; i < D + R; i += kThreads) hz[i] = i < D ? load_float(hrow, p.hidden_dtype, i) : zs[i - D];
    __syncthreads();
    for (int64_t j = warp; j < R; j += kWarps) {
      const float z = draft::warp_dot(draft::offset_row(p.wg, p.wg_dtype, j * (D + R)), p.wg_dtype, D + R, hz, lane);
      if (lane == 0) vv[j] = draft::sigmoidf_(z + load_float(p.bg, p.bg_dtype, j)) * zs[j];
    }
  } else {  // [g, c, o] = Wj [s; e; h_k] + bj, s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c), v = tanh(o)
    const int64_t W = 2 * R + D;
    for (int64_t i = t; i < W; i += kThreads) {
      hz[i] = i < R ? st[i] : (i < 2 * R ? zs[i - R] : load_float(hrow, p.hidden_dtype, i - 2 * R));
    }
    __syncthreads();
    for (int64_t j = warp; j < R; j += kWarps) {
      float z[3];
#pragma unroll
      for (int m = 0; m < 3; ++m) {
        const int64_t r = m * R + j;
        z[m] = draft::warp_dot(draft::offset_row(p.wj, p.wj_dtype, r * W), p.wj_dtype, W, hz, lane) +
               load_float(p.bj, p.bj_dtype, r);
      }
      if (lane == 0) {
        const float sg = draft::sigmoidf_(z[0]);
        st[j] = sg * hz[j] + (1.0f - sg) * tanhf(z[1]);
        vv[j] = tanhf(z[2]);
      }
    }
  }
  __syncthreads();
  return vv;
}

// Phase 2: request n's walk over its K positions. The whole block; smem: smem_floats(p) floats.
DSPARK_DEVICE void walk(const DraftBlockParams& p, const Workspace& ws, int64_t n, float* smem,
                             Part* part_scratch, float* sum_scratch, const rng::Philox& ph) {
  const int64_t K = p.K, R = p.R, top = p.top_k;
  float* zs = smem;
  float* vv = zs + R;
  float* st = vv + R;
  float* hz = st + R;
  int32_t* cid = reinterpret_cast<int32_t*>(hz + 2 * R + p.D);
  float* lg = reinterpret_cast<float*>(cid + top);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  __syncthreads();  // the previous request's reads are done
  for (int64_t i = t; i < R; i += kThreads) st[i] = 0.0f;
  const float temp = p.temperature != nullptr ? ldg(p.temperature + n) : 0.0f;
  const bool sampled = temp > 0.0f;  // NaN: greedy
  const float tdiv = sampled ? temp : 1.0f;
  int64_t x = draft::anchor_of(p, n);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t row = n * K + k;
    __syncthreads();  // the previous position is done with zs, vv, cid and lg
    draft::gather_e(p, x, zs);
    for (int64_t i = t; i < top; i += kThreads) {  // draft_topk_select wrote them (the launch before)
      cid[i] = ld_coherent(ws.ids + row * top + i);
      lg[i] = ld_coherent(ws.vals + row * top + i);
    }
    __syncthreads();
    draft::confidence(p, n, k, zs, sum_scratch);
    const float* v = head_vector(p, n, k, zs, vv, st, hz);
    for (int64_t c = warp; c < top; c += kWarps) {  // U + B at the candidates, a warp per W2 row
      const int64_t j = cid[c];
      float b = draft::warp_dot(draft::offset_row(p.w2, p.w2_dtype, j * R), p.w2_dtype, R, v, lane);
      if (p.w2_scale != nullptr) b *= ldg(p.w2_scale + j);
      if (lane == 0) lg[c] += b;
    }
    __syncthreads();
    Part part = Part::empty();
    for (int64_t c = t; c < top; c += kThreads) {
      const int64_t j = cid[c];
      const float l = lg[c], xs = l / tdiv;
      part.add(xs, sampled ? gumbel_score(xs, ph.uniform(n, k, rng::kStreamDraft, j)) : nan_to_neg_inf(l), j);
      if (p.logits != nullptr) stg(p.logits + row * top + c, l);
      if (p.candidates != nullptr) stg(p.candidates + row * top + c, draft::target_id(p, j));
    }
    part = block_allreduce(part, part_scratch);
    x = draft::target_id(p, part.win.index);
    if (t == 0) {
      stg(p.tokens + row, x);
      stg(p.logprobs + row, part.logprob());
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) draft_topk_select_kernel(DraftBlockParams p, Workspace ws) {
  DSPARK_SHARED(SelectScratch, sel);
  for (int64_t row = blockIdx.x; row < p.N * p.K; row += gridDim.x) select_row(p, ws, row, sel);
  launch_dependents();
}

__global__ void __launch_bounds__(kThreads, 1) draft_topk_walk_kernel(DraftBlockParams p, Workspace ws) {
  DSPARK_DYNAMIC_SMEM(float, smem);
  DSPARK_SHARED_ARRAY(Part, part_scratch, 32);
  DSPARK_SHARED_ARRAY(float, sum_scratch, 32);
  DSPARK_SHARED(rng::Philox, ph_s);
  grid_dependency_wait();
  if (threadIdx.x == 0) ph_s = p.temperature != nullptr ? rng::load_philox(p.rng_key) : rng::Philox::make(0, 0);
  __syncthreads();
  const rng::Philox ph = ph_s;
  for (int64_t n = blockIdx.x; n < p.N; n += gridDim.x) walk(p, ws, n, smem, part_scratch, sum_scratch, ph);
}
#endif  // __CUDACC__ || DSPARK_SIMT

inline size_t workspace_bytes(const DraftBlockParams& p) {
  return size_t(p.N) * size_t(p.K) * size_t(p.top_k) * (sizeof(int32_t) + sizeof(float));
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// A size query when workspace is null (then only the configuration is checked).
inline cudaError_t dispatch(const DraftBlockParams& p, void* workspace, cudaStream_t stream) {
  const size_t smem = size_t(smem_floats(p)) * sizeof(float);
  cudaError_t err = set_max_dynamic_smem(draft_topk_walk_kernel, smem);
  if (err != cudaSuccess) return err;
  if (max_active_blocks_per_sm(draft_topk_walk_kernel, kThreads, smem) < 1) return cudaErrorInvalidConfiguration;
  if (workspace == nullptr) return cudaSuccess;
  Workspace ws;
  ws.ids = static_cast<int32_t*>(workspace);
  ws.vals = reinterpret_cast<float*>(ws.ids + p.N * p.K * p.top_k);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(std::min<int64_t>(p.N * p.K, int64_t(1) << 30)));
  cfg.block = dim3(kThreads);
  cfg.stream = stream;
  err = launch("draft_topk_select", draft_topk_select_kernel, cfg, p, ws);
  if (err != cudaSuccess) return err;
  cfg.grid = dim3(static_cast<unsigned>(std::min<int64_t>(p.N, int64_t(1) << 30)));
  cfg.smem = smem;
  cfg.pdl = true;
  return launch("draft_topk_walk", draft_topk_walk_kernel, cfg, p, ws);
}
#endif

}  // namespace draft_topk
}  // namespace dspark
