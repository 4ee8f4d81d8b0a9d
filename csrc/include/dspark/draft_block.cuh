// dspark/draft_block.cuh: the whole draft block (all K positions of all N requests) as K skinny matrix products, one
// launch per position, chained by programmatic dependent launch (no torch).
//
// Meaning: dspark_kernels/reference/draft_block.py (the spec). Per request n and position k, with x the token
// before the position (the anchor, then the previous draft) and e = W1[x] (a zero row for x outside W1's VT rows):
//   vanilla v = e;  gated v = sigmoid(Wg [h_k; e] + bg) * e;  rnn [g, c, o] = Wj [s; e; h_k] + bj,
//   s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c), v = tanh(o);
//   logits = U_k + W2 v;  token = argmax(logits) (greedy) or argmax(logits / T - log(-log u)) (T > 0);
//   logprob = log_softmax(logits / T)[token] (T = 1 for greedy rows);  conf = w . [h_k; e] + b,
//   survival = prod sigmoid(conf / T_sts).
// With a draft vocabulary (d2t: [V] target ids) U, W2 and the sweep cover its V ids and the drafted id j becomes the
// target id x = d2t[j] (the token written and the row of W1 the next position reads); without one, x = j, VT = V.
//
// The only dependency between positions is N tokens, so the launches are (stream order, each after the first a
// programmatic dependent launch whose blocks wait in grid_dependency_wait after the prologue that does not depend on
// the launch before):
//   draft_setup            zero keys [K][N] (the packed winners) and, with a confidence head, the hidden-state part
//                          of every position's confidence logit, hz[n][k] = w[:d] . h_k (hidden read once)
//   for k in 0..K-1:
//     draft_head[gated|rnn] (gated / rnn only) v_k for every request into the workspace: items of output rows x
//                          groups of 32 requests, the weight rows and the inputs [h_k; e] / [s; e; h_k] staged in
//                          shared memory (e = W1[x] with x from keys[k - 1] or the anchors); the rnn state in two
//                          ping-pong rows
//     draft_sweep[gemv|mma] position k (dspark/draft_sweep.cuh): U_k + W2 v over every (request, vocabulary row),
//                          folded per CTA and request; keys[k][n] gets the atomic max of the CTA winners' packed keys
//                          (so the next position reads one key a request, whatever the number of CTAs), and
//                          stats[k][slice][n] the CTA's softmax statistics and its winner's scaled logit
//   draft_finish           a CTA a group of up to 32 requests, a warp a position: the tokens (from keys), their
//                          log-probabilities (the slices' statistics merged, the scaled logit of the slice holding
//                          the winner), with a confidence head conf = hz + w[d:] . W1[x] + b; then a warp a request
//                          writes its row of each output (survival by a product scan across the lanes)
// So launches = K + 2 (vanilla) or 2K + 2 (gated, rnn); no cooperative launch, no grid barrier; the whole op can be
// captured in a CUDA graph. Why a 64-bit atomic max per (CTA, request) rather than each CTA merging the previous
// position's per-CTA winners at its start, or a last-CTA ticket: at N = 256 every CTA sweeps every request (W2 once
// per position), so a start-of-CTA merge reads slices x N x 8 bytes a CTA (540 KB at 264 CTAs: more than W2 over the
// grid), and a ticket leaves one CTA merging slices x N partials (2 MB) alone at every position; the atomics cost N
// x 8 bytes a CTA, and the next position's CTAs read N x 8 bytes.
//
// Every random draw is keyed by (request, position, STREAM_DRAFT, token), so the race winner does not depend on the
// split. Ties go to the lowest index, NaN scores count as -inf (infinities stay), so tokens equal the reference's
// whenever the float32 logits agree. All arithmetic is float32 (tensor cores form exact products of 16-bit operands
// and accumulate in float32; a float v is split into hi + lo 16-bit rows, 16 / 22 significant bits with bf16 / fp16,
// so the biases sit within ~2^-17 / 2^-22 of sum |W2 v| of the float32 ones); offsets are 64-bit.
//
// Defines what dspark/draft_block.h declares: a library includes this header in one translation unit
// (csrc/kernels/draft_block.cu, csrc/capi/dspark_capi.cu).
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "draft_block.h"
#include "draft_part.cuh"
#include "draft_sweep.cuh"
#include "utils.cuh"

namespace dspark {
namespace draft {

// The workspace of the full proposal (draft_block_workspace_bytes sizes it; its start 16-byte aligned, its pieces
// 128 bytes apart from it, so that rows of 32 bytes stay whole sectors when the start is).
struct Workspace {
  uint64_t* keys;   // [K][Np]: each position's packed winners (atomic max; zeroed by draft_setup; Np: padded N)
  float4* stats;    // [K][slices][Np]: each sweep CTA's (m, s, its winner's scaled logit, 0); s NaN: a NaN or +inf
  float* hz;        // [N][K]: w[:d] . h_k (with a confidence head)
  float* v;         // [N][R]: the head's vector of the current position (gated, rnn)
  float* state;     // [2][N][R]: the rnn state, ping-pong
};

// The gate / rnn products: output rows of an item (a block of rows x a group of kZGroup requests), their columns
// staged kCC at a time.
constexpr int kHeadThreads = 256;
constexpr int kHeadWarps = kHeadThreads / 32;
constexpr int kZGroup = 32;
constexpr int kCC = 64;
constexpr int kZStride = kCC + 1;
constexpr int kPerWarp = 16;  // gated: output rows a warp and item (rnn: a third of them each)

DSPARK_HOST_DEVICE_FN size_t align128(size_t b) { return (b + 127) / 128 * 128; }

// Byte offsets of the workspace's pieces for `slices` sweep CTAs a lane (the last is the total).
struct WorkspaceLayout {
  size_t keys, stats, hz, v, state, total;
};
inline WorkspaceLayout workspace_layout(const DraftBlockParams& p, int slices) {
  WorkspaceLayout l{};
  const size_t N = size_t(p.N), K = size_t(p.K), R = size_t(p.R), S = size_t(slices);
  const size_t Np = size_t(padded_requests(p.N));
  l.keys = 0;
  l.stats = align128(l.keys + K * Np * 8);
  l.hz = align128(l.stats + K * Np * S * 16);
  l.v = align128(l.hz + (p.conf_w != nullptr ? N * K * 4 : 0));
  l.state = align128(l.v + (p.head != kVanilla ? N * R * 4 : 0));
  l.total = align128(l.state + (p.head == kRnn ? 2 * N * R * 4 : 0));
  return l;
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// ------------------------------------------------------------------------------------------------ helpers
DSPARK_DEVICE const void* offset_row(const void* p, DType t, int64_t elems) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(dtype_size(t));
}

DSPARK_DEVICE float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

DSPARK_DEVICE int64_t anchor_of(const DraftBlockParams& p, int64_t n) {
  return load_int(p.anchors, p.anchors_int64, n);
}

// The token of drafted id j: d2t[j] with a draft vocabulary, else j (an index outside [0, V) is passed through).
DSPARK_DEVICE int64_t target_id(const DraftBlockParams& p, int64_t j) {
  if (p.d2t == nullptr || j < 0 || j >= p.V) return j;
  return load_int(p.d2t, p.d2t_int64, j);
}

// Whether a row of `len` elements of dtype t at p takes 16-byte loads of 8 elements (two for fp32).
DSPARK_DEVICE bool row_vector(const void* p, DType t, int64_t len) {
  return is_aligned16(p) && len % 8 == 0 && t != DType::kFloat8E4M3;
}

// Elements i..i+7 of a row_vector row as float32.
DSPARK_DEVICE void load_row8(const void* p, DType t, int64_t i, float (&f)[8]) {
  if (t == DType::kFloat32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = ldg(q), b = ldg(q + 1);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    return;
  }
  const uint4 raw = ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(p) + 2 * i));
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (t == DType::kBFloat16) {
      widen_pair<__nv_bfloat16>(w[q], f[2 * q], f[2 * q + 1]);
    } else {
      widen_pair<__half>(w[q], f[2 * q], f[2 * q + 1]);
    }
  }
}

// One warp: a . b over `len` elements of two rows of any float dtypes; every lane gets the sum. 16-byte loads of 8
// consecutive elements a lane where both rows allow, else element by element (consecutive lanes, consecutive
// elements).
DSPARK_DEVICE float row_dot(const void* a, DType ta, const void* b, DType tb, int64_t len, int lane) {
  float acc = 0.0f;
  if (row_vector(a, ta, len) && row_vector(b, tb, len)) {
    for (int64_t c = 8 * lane; c < len; c += 256) {
      float x[8], y[8];
      load_row8(a, ta, c, x);
      load_row8(b, tb, c, y);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(x[e], y[e], acc);
    }
  } else {
    for (int64_t c = lane; c < len; c += 32) acc = fmaf(load_float(a, ta, c), load_float(b, tb, c), acc);
  }
  return warp_sum(acc);
}

// One warp: row . z over `len` elements of a row of any dtype (an fp8 W2's too; z in shared memory), consecutive
// lanes on consecutive elements (whole sectors of the row, conflict-free reads of z); every lane gets the sum (the
// top-k walk).
DSPARK_DEVICE float warp_dot(const void* row, DType t, int64_t len, const float* z, int lane) {
  float acc = 0.0f;
  for (int64_t i = lane; i < len; i += 32) {
    const float w = t == DType::kFloat8E4M3 ? to_float(ldg(static_cast<const __nv_fp8_e4m3*>(row) + i))
                                            : load_float(row, t, i);
    acc = fmaf(w, z[i], acc);
  }
  return warp_sum(acc);
}

// e = W1[x] (a zero row for x outside W1's rows) into zs, the whole block (the top-k walk).
DSPARK_DEVICE void gather_e(const DraftBlockParams& p, int64_t x, float* zs) {
  const bool in = x >= 0 && x < p.VT;
  for (int64_t i = threadIdx.x; i < p.R; i += blockDim.x) zs[i] = in ? load_float(p.w1, p.w1_dtype, x * p.R + i) : 0.0f;
}

// The confidence logit and survival of request n at position k from e in zs (written before a barrier): z =
// w . [h_k; e] + b, survival *= sigmoid(z / T_k). The whole block; no-op without a confidence head (the top-k walk).
DSPARK_DEVICE void confidence(const DraftBlockParams& p, int64_t n, int64_t k, const float* zs, float* sum_scratch) {
  if (p.conf_w == nullptr) return;
  const int t = threadIdx.x;
  const int64_t K = p.K, D = p.D;
  const void* hrow = offset_row(p.hidden, p.hidden_dtype, (n * K + k) * D);
  float acc = 0.0f;
  for (int64_t i = t; i < D + p.R; i += blockDim.x)  // element by element: conflict-free reads of zs
    acc = fmaf(load_float(p.conf_w, p.conf_w_dtype, i), i < D ? load_float(hrow, p.hidden_dtype, i) : zs[i - D], acc);
  const float z = block_sum(acc, sum_scratch) + load_float(p.conf_b, p.conf_b_dtype, 0);
  if (t == 0) {
    const float temp = p.sts != nullptr ? load_float(p.sts, p.sts_dtype, k) : 1.0f;
    const float prev = k == 0 ? 1.0f : ld_coherent(p.survival + n * K + (k - 1));
    stg(p.conf + n * K + k, z);
    stg(p.survival + n * K + k, prev * sigmoidf_(z / temp));
  }
}

// ------------------------------------------------------------------------------------------------ draft_setup
// keys[:] = 0; hz[n][k] = w[:D] . h[n, k] (a warp a row of hidden).
__global__ void __launch_bounds__(kSweepThreads) draft_setup_kernel(DraftBlockParams p, Workspace ws) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t NK = p.N * p.K, keys = padded_requests(p.N) * p.K;
  for (int64_t i = int64_t(blockIdx.x) * kSweepThreads + t; i < keys; i += int64_t(gridDim.x) * kSweepThreads)
    stg(ws.keys + i, uint64_t(0));
  if (p.conf_w == nullptr) return;
  for (int64_t row = int64_t(blockIdx.x) * kSweepWarps + warp; row < NK; row += int64_t(gridDim.x) * kSweepWarps) {
    const float z = row_dot(offset_row(p.hidden, p.hidden_dtype, row * p.D), p.hidden_dtype, p.conf_w,
                            p.conf_w_dtype, p.D, lane);
    if (lane == 0) stg(ws.hz + row, z);
  }
}

// ------------------------------------------------------------------------------------------------ draft_head
// The gate / rnn matrix-vector products of position k for the whole batch: an item is a block of output rows j x a
// group of up to kZGroup requests (lane n <-> request n of the group). Column chunks of the weight rows and of the
// inputs z_n = [h_k; e] (gated) or [s; e; h_k] (rnn) are staged in shared memory (consecutive threads, consecutive
// columns of a row), so each weight element is read from global memory once per request group and position; each
// warp accumulates its rows for its lane's request.
// The column swizzle of draft_head's output table: row jl of rows_item (a power of two) keeps request nl at column
// nl ^ head_swizzle(jl), so that a warp writing one row (32 requests) and a warp reading consecutive rows of
// consecutive requests (32 / rows_item requests of rows_item rows) both touch 32 different banks.
DSPARK_DEVICE int head_swizzle(int jl, int64_t rows_item) {
  return static_cast<int>((jl * (rows_item < 32 ? 32 / rows_item : 1)) & 31);
}

template <int M>  // 1: gated, 3: rnn (rows j, R + j, 2R + j)
__global__ void __launch_bounds__(kHeadThreads) draft_head_kernel(DraftBlockParams p, Workspace ws, int64_t k,
                                                                   int64_t rows_item, const uint64_t* prev_keys) {
  constexpr int kOuts = kPerWarp / M;  // outputs a warp and item (rnn: 5, using 15 accumulators)
  DSPARK_DYNAMIC_SMEM(float, smem);
  DSPARK_SHARED_ARRAY(int64_t, xs, kZGroup);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, K = p.K, R = p.R, D = p.D;
  const int64_t width = M == 1 ? D + R : 2 * R + D;
  const int64_t blocks = (R + rows_item - 1) / rows_item, groups = (N + kZGroup - 1) / kZGroup;
  const void* w = M == 1 ? p.wg : p.wj;
  const DType wdt = M == 1 ? p.wg_dtype : p.wj_dtype;
  const float* s_old = ws.state + (k & 1) * N * R;
  float* s_new = ws.state + ((k + 1) & 1) * N * R;
  float* zt = smem;                       // [kZGroup, kZStride]
  float* wt = smem + kZGroup * kZStride;  // [M * rows_item, kCC]
  grid_dependency_wait();
  for (int64_t item = blockIdx.x; item < blocks * groups; item += gridDim.x) {
    const int64_t grp = item / blocks, jb = item - grp * blocks;
    const int64_t n0 = grp * kZGroup, j0 = jb * rows_item;
    const int nz = static_cast<int>(N - n0 < kZGroup ? N - n0 : kZGroup);
    const int nrows = static_cast<int>(R - j0 < rows_item ? R - j0 : rows_item);
    __syncthreads();  // the previous item is done with xs, zt and wt
    if (t < nz) {
      const int64_t x =
          prev_keys == nullptr ? anchor_of(p, n0 + t) : target_id(p, winner_index(ldg(prev_keys + n0 + t)));
      xs[t] = x >= 0 && x < p.VT ? x : -1;
    }
    __syncthreads();
    auto e_at = [&](int nl, int64_t c) { return xs[nl] >= 0 ? load_float(p.w1, p.w1_dtype, xs[nl] * R + c) : 0.0f; };
    float acc[M][kOuts];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int q = 0; q < kOuts; ++q) acc[m][q] = 0.0f;
    for (int64_t c0 = 0; c0 < width; c0 += kCC) {
      if (c0 > 0) __syncthreads();  // the previous chunk is used
      for (int i = t; i < kZGroup * kCC; i += kHeadThreads) {
        const int nl = i / kCC, c = i - nl * kCC;
        const int64_t col = c0 + c, n = n0 + nl;
        float z = 0.0f;
        if (nl < nz && col < width) {
          const int64_t hrow = (n * K + k) * D;
          if (M == 1) {
            z = col < D ? load_float(p.hidden, p.hidden_dtype, hrow + col) : e_at(nl, col - D);
          } else if (col < R) {
            z = k == 0 ? 0.0f : ldg(s_old + n * R + col);
          } else if (col < 2 * R) {
            z = e_at(nl, col - R);
          } else {
            z = load_float(p.hidden, p.hidden_dtype, hrow + (col - 2 * R));
          }
        }
        zt[nl * kZStride + c] = z;
      }
      for (int64_t i = t; i < int64_t(M) * rows_item * kCC; i += kHeadThreads) {
        const int64_t rr = i / kCC, c = i - rr * kCC;
        const int64_t m = rr / rows_item, jl = rr - m * rows_item, col = c0 + c;
        wt[i] = jl < nrows && col < width ? load_float(w, wdt, (m * R + j0 + jl) * width + col) : 0.0f;
      }
      __syncthreads();
      const float* zrow = zt + lane * kZStride;
#pragma unroll
      for (int q = 0; q < kOuts; ++q) {
        const int jl = warp + q * kHeadWarps;
        if (jl < nrows) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float* wrow = wt + (m * rows_item + jl) * kCC;
            float a = acc[m][q];
            for (int c = 0; c < kCC; ++c) a = fmaf(wrow[c], zrow[c], a);
            acc[m][q] = a;
          }
        }
      }
    }
    // the pre-activations into ot [M][rows_item][32] (request nl's at column nl ^ head_swizzle(jl)), then each
    // request's rows j0.. of v (and of the rnn state) with consecutive threads
    __syncthreads();  // the last chunk's zt and wt are read
    float* ot = smem;
#pragma unroll
    for (int q = 0; q < kOuts; ++q) {
      const int jl = warp + q * kHeadWarps;
      if (jl < nrows) {
#pragma unroll
        for (int m = 0; m < M; ++m)
          ot[(m * rows_item + jl) * kZGroup + (lane ^ head_swizzle(jl, rows_item))] = acc[m][q];
      }
    }
    __syncthreads();
    for (int64_t i = t; i < int64_t(nz) * rows_item; i += kHeadThreads) {
      const int nl = static_cast<int>(i / rows_item), jl = static_cast<int>(i - int64_t(nl) * rows_item);
      if (jl >= nrows) continue;
      const int64_t n = n0 + nl, j = j0 + jl;
      const int col = nl ^ head_swizzle(jl, rows_item);
      if (M == 1) {
        const float g = sigmoidf_(ot[jl * kZGroup + col] + load_float(p.bg, p.bg_dtype, j));
        stg(ws.v + n * R + j, g * e_at(nl, j));
      } else {
        const float sg = sigmoidf_(ot[jl * kZGroup + col] + load_float(p.bj, p.bj_dtype, j));
        const float c = ot[(rows_item + jl) * kZGroup + col] + load_float(p.bj, p.bj_dtype, R + j);
        const float o = ot[(2 * rows_item + jl) * kZGroup + col] + load_float(p.bj, p.bj_dtype, 2 * R + j);
        const float s = k == 0 ? 0.0f : ldg(s_old + n * R + j);
        stg(s_new + n * R + j, sg * s + (1.0f - sg) * tanhf(c));
        stg(ws.v + n * R + j, tanhf(o));
      }
    }
  }
  launch_dependents();
}

// ------------------------------------------------------------------------------------------------ draft_finish
// Softmax statistics and a NaN / +inf flag, merged over slices, and the scaled logit of the winner's slice.
struct SliceMerge {
  SoftmaxStats st;
  int32_t bad, has;
  float scaled;
  DSPARK_DEVICE void merge(const SliceMerge& o) {
    st.merge(o.st);
    bad |= o.bad;
    if (o.has) has = 1, scaled = o.scaled;
  }
};

constexpr int kFinishK = 64;  // positions a finishing CTA holds at a time

// A CTA the requests n0 .. n0 + NB - 1, kFinishK positions at a time: (A) a warp a position, lanes (request
// l % NB, slices l / NB + (32 / NB) i), each request's slices merged (its [slice][N] records side by side for the
// lanes) into its token and log-probability; (B) a warp a (position, request): the confidence logit; both into
// shared [position][NB | 1] tables; (C) a warp a request, a lane a position: its row of each output, the survival by
// a product scan across the lanes (carried from chunk to chunk).
__global__ void __launch_bounds__(kSweepThreads) draft_finish_kernel(DraftBlockParams p, Workspace ws, int slices,
                                                                     int NB) {
  DSPARK_SHARED_ARRAY(int64_t, tok, kFinishK * (kFinishGroup + 1));
  DSPARK_SHARED_ARRAY(float, lps, kFinishK * (kFinishGroup + 1));
  DSPARK_SHARED_ARRAY(float, cfs, kFinishK * (kFinishGroup + 1));
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, K = p.K, R = p.R, D = p.D, n0 = int64_t(blockIdx.x) * NB, Np = padded_requests(N);
  const int nb = static_cast<int>(N - n0 < NB ? N - n0 : NB);
  const int nread = static_cast<int>(Np - n0 < NB ? Np - n0 : NB);  // the requests' records with their padding
  const int ld = NB > 1 ? NB + 1 : 1;  // (odd: a lane a position reads a column conflict-free)
  const bool conf = p.conf_w != nullptr;
  const float bias = conf ? load_float(p.conf_b, p.conf_b_dtype, 0) : 0.0f;
  grid_dependency_wait();
  float carry[kFinishGroup / kSweepWarps];  // request warp + 8 i's survival so far
#pragma unroll
  for (int i = 0; i < kFinishGroup / kSweepWarps; ++i) carry[i] = 1.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kFinishK) {
    const int kc = static_cast<int>(K - k0 < kFinishK ? K - k0 : kFinishK);
    for (int kl = warp; kl < kc; kl += kSweepWarps) {  // (A)
      const int64_t k = k0 + kl;
      const int n = lane % NB;
      const bool in = n < nb;
      const int64_t j = n < nread ? winner_index(ldg(ws.keys + k * Np + n0 + n)) : 0;
      const int64_t sw = in ? slice_of(p.V, slices, j) : -1;
      SliceMerge sm{SoftmaxStats::empty(), 0, 0, 0.0f};
      for (int s = lane / NB; n < nread && s < slices; s += 32 / NB) {
        const float4 r = ldg(ws.stats + (k * slices + s) * Np + n0 + n);
        sm.merge(SliceMerge{SoftmaxStats{r.x, r.y}, r.y != r.y ? 1 : 0, s == sw ? 1 : 0, r.z});
      }
      for (int o = NB; o < 32; o <<= 1) sm.merge(shfl_xor(sm, o));
      if (lane < nb) {
        const float m = sm.st.m;
        tok[kl * ld + lane] = target_id(p, j);
        lps[kl * ld + lane] = sm.bad || !(m > neg_inf()) || !(m < INFINITY) ? NAN : sm.st.log_softmax_at(sm.scaled);
      }
    }
    for (int f = warp; conf && f < kc * nb; f += kSweepWarps) {  // (B)
      const int kl = f / nb, n = f - kl * nb;
      const int64_t k = k0 + kl;
      const int64_t x =
          k == 0 ? anchor_of(p, n0 + n) : target_id(p, winner_index(ldg(ws.keys + (k - 1) * Np + n0 + n)));
      const float e = x >= 0 && x < p.VT ? row_dot(offset_row(p.w1, p.w1_dtype, x * R), p.w1_dtype,
                                                   offset_row(p.conf_w, p.conf_w_dtype, D), p.conf_w_dtype, R, lane)
                                         : 0.0f;
      if (lane == 0) cfs[kl * ld + n] = ldg(ws.hz + (n0 + n) * K + k) + e + bias;
    }
    __syncthreads();
    for (int n = warp, i = 0; n < nb; n += kSweepWarps, ++i) {  // (C)
      for (int kb = 0; kb < kc; kb += 32) {
        const int kl = kb + lane;
        const bool in = kl < kc;
        const int64_t at = (n0 + n) * K + k0 + kl;
        if (in) {
          stg(p.tokens + at, tok[kl * ld + n]);
          stg(p.logprobs + at, lps[kl * ld + n]);
        }
        if (conf) {
          const float z = in ? cfs[kl * ld + n] : 0.0f;
          const float temp = in && p.sts != nullptr ? load_float(p.sts, p.sts_dtype, k0 + kl) : 1.0f;
          float c = in ? sigmoidf_(z / temp) : 1.0f;
          for (int o = 1; o < 32; o <<= 1) {  // inclusive product scan over the lanes
            const float prev = __shfl_up_sync(kFullMask, c, o);
            if (lane >= o) c *= prev;
          }
          c *= carry[i];
          if (in) {
            stg(p.conf + at, z);
            stg(p.survival + at, c);
          }
          carry[i] = __shfl_sync(kFullMask, c, 31);
        }
      }
    }
    __syncthreads();  // the tables are read before the next chunk's writes
  }
}
#endif  // __CUDACC__ || DSPARK_SIMT

// ------------------------------------------------------------------------------------------------ host side
// Position k's sweep inputs and outputs (the workspace's pointers may be null for a size query).
inline SweepParams sweep_params(const DraftBlockParams& p, const Workspace& ws, int slices, int64_t k) {
  SweepParams s{};
  s.u = static_cast<const char*>(p.base) + k * p.V * int64_t(dtype_size(p.base_dtype));
  s.u_dtype = p.base_dtype;
  s.u_stride = p.K * p.V;
  s.logits = p.logits != nullptr ? p.logits + k * p.V : nullptr;
  s.logits_stride = p.K * p.V;
  s.w2 = p.w2;
  s.w2_dtype = p.w2_dtype;
  s.w2_scale = p.w2_scale;
  s.N = p.N;
  s.V = p.V;
  s.R = p.R;
  s.v_w1 = p.head == kVanilla;
  s.vf = ws.v;
  s.w1 = p.w1;
  s.w1_dtype = p.w1_dtype;
  s.VT = p.VT;
  const int64_t np = padded_requests(p.N);
  s.prev_keys = k > 0 && ws.keys != nullptr ? ws.keys + (k - 1) * np : nullptr;
  s.anchors = p.anchors;
  s.anchors_int64 = p.anchors_int64;
  s.d2t = p.d2t;
  s.d2t_int64 = p.d2t_int64;
  s.temperature = p.temperature;
  s.rng_key = p.rng_key;
  s.position = k;
  s.id_offset = 0;
  s.slices = slices;
  s.np = np;
  s.keys = ws.keys != nullptr ? ws.keys + k * np : nullptr;
  s.stats = ws.stats != nullptr ? ws.stats + k * np * slices : nullptr;
  return s;
}

// draft_head's output rows an item (a power of two, at least 16): as many as its register tile holds (each item
// re-stages its requests' inputs), few enough to give every resident CTA an item when the batch is small.
inline int64_t head_rows_item(const DraftBlockParams& p, int64_t ctas) {
  const int m = p.head == kRnn ? 3 : 1;
  int64_t max_rows = kHeadWarps;
  while (2 * max_rows <= int64_t(kHeadWarps) * (kPerWarp / m)) max_rows *= 2;
  const int64_t groups = (p.N + kZGroup - 1) / kZGroup;
  const int64_t want = (p.R * groups + ctas - 1) / ctas;
  int64_t rows = 2 * kHeadWarps;  // (16 rows: whole sectors of a 16-bit W1 row and of v's rows)
  while (rows < want && rows < max_rows) rows *= 2;
  return rows;
}

inline size_t head_smem(const DraftBlockParams& p, int64_t rows_item) {  // (the output table fits in it)
  const int m = p.head == kRnn ? 3 : 1;
  return sizeof(float) * size_t(kZGroup * kZStride + m * rows_item * kCC);
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
inline Workspace workspace_at(void* base, const WorkspaceLayout& l, const DraftBlockParams& p) {
  char* b = static_cast<char*>(base);
  Workspace ws;
  ws.keys = reinterpret_cast<uint64_t*>(b + l.keys);
  ws.stats = reinterpret_cast<float4*>(b + l.stats);
  ws.hz = p.conf_w != nullptr ? reinterpret_cast<float*>(b + l.hz) : nullptr;
  ws.v = p.head != kVanilla ? reinterpret_cast<float*>(b + l.v) : nullptr;
  ws.state = p.head == kRnn ? reinterpret_cast<float*>(b + l.state) : nullptr;
  return ws;
}

// The sweep's plan for p (the same for every position).
inline cudaError_t plan(const DraftBlockParams& p, SweepPlan* pl) {
  const Workspace none{};
  return sweep(sweep_params(p, none, 1, 0), *pl, true, nullptr, false, "", "");
}

// Sizes (workspace null: *bytes only) or enqueues the launches of the full proposal.
inline cudaError_t run(const DraftBlockParams& p, void* workspace, cudaStream_t stream, size_t* bytes) {
  SweepPlan pl{};
  cudaError_t err = plan(p, &pl);
  if (err != cudaSuccess) return err;
  const WorkspaceLayout lay = workspace_layout(p, pl.slices);
  if (bytes != nullptr) *bytes = lay.total;
  if (workspace == nullptr) return cudaSuccess;
  const Workspace ws = workspace_at(workspace, lay, p);
  const int sms = device_sm_count();
  LaunchConfig cfg;
  cfg.block = dim3(kSweepThreads);
  cfg.stream = stream;
  const int64_t rows = std::max<int64_t>(p.N * p.K / kSweepWarps, 1);
  cfg.grid = dim3(static_cast<unsigned>(std::min<int64_t>(rows, int64_t(2) * sms)));
  err = launch("draft_setup", draft_setup_kernel, cfg, p, ws);
  if (err != cudaSuccess) return err;
  const int64_t rows_item = head_rows_item(p, int64_t(2) * sms);
  const size_t hsmem = head_smem(p, rows_item);
  if (p.head != kVanilla) {
    err = p.head == kGated ? set_max_dynamic_smem(draft_head_kernel<1>, hsmem)
                           : set_max_dynamic_smem(draft_head_kernel<3>, hsmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t items = (p.R + rows_item - 1) / rows_item * ((p.N + kZGroup - 1) / kZGroup);
  for (int64_t k = 0; k < p.K; ++k) {
    const uint64_t* prev = k > 0 ? ws.keys + (k - 1) * padded_requests(p.N) : nullptr;
    if (p.head != kVanilla && items > 0) {  // (R = 0: v is empty, nothing to launch)
      LaunchConfig hc;
      hc.grid = dim3(static_cast<unsigned>(std::min<int64_t>(items, int64_t(2) * sms)));
      hc.block = dim3(kHeadThreads);
      hc.smem = hsmem;
      hc.stream = stream;
      hc.pdl = true;
      err = p.head == kGated ? launch("draft_head[gated]", draft_head_kernel<1>, hc, p, ws, k, rows_item, prev)
                             : launch("draft_head[rnn]", draft_head_kernel<3>, hc, p, ws, k, rows_item, prev);
      if (err != cudaSuccess) return err;
    }
    err = sweep(sweep_params(p, ws, pl.slices, k), pl, false, stream, true, "draft_sweep[gemv]", "draft_sweep[mma]");
    if (err != cudaSuccess) return err;
  }
  const int nb = finish_group(p.N);
  cfg.grid = dim3(static_cast<unsigned>((p.N + nb - 1) / nb));
  cfg.pdl = true;
  return launch("draft_finish", draft_finish_kernel, cfg, p, ws, pl.slices, nb);
}
#endif

}  // namespace draft

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
namespace draft_topk {  // defined in dspark/draft_block_topk.cuh, included at the end
inline size_t workspace_bytes(const DraftBlockParams& p);
inline cudaError_t dispatch(const DraftBlockParams& p, void* workspace, cudaStream_t stream);
}  // namespace draft_topk

size_t draft_block_workspace_bytes(const DraftBlockParams& p) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return 0;
  if (p.top_k > 0) return draft_topk::dispatch(p, nullptr, nullptr) == cudaSuccess ? draft_topk::workspace_bytes(p) : 0;
  size_t bytes = 0;
  return draft::run(p, nullptr, nullptr, &bytes) == cudaSuccess ? bytes : 0;
}

cudaError_t launch_draft_block(const DraftBlockParams& p, void* workspace, cudaStream_t stream) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return cudaSuccess;
  if (p.top_k > 0) return draft_topk::dispatch(p, workspace, stream);
  return draft::run(p, workspace, stream, nullptr);
}
#endif

}  // namespace dspark

#include "draft_block_topk.cuh"
