// dspark/draft_block.cuh: the whole draft block (all K positions of all N requests) in ONE cooperative launch.
//
// Meaning: dspark_kernels/reference/draft_block.py (the spec). Per request n and position k, with x the token
// before the position (the anchor, then the previous draft) and e = W1[x] (a zero row for x outside [0, V)):
//   vanilla v = e;  gated v = sigmoid(Wg [h_k; e] + bg) * e;  rnn [g, c, o] = Wj [s; e; h_k] + bj,
//   s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c), v = tanh(o);
//   logits = U_k + W2 v;  token = argmax(logits) (greedy) or argmax(logits / T - log(-log u)) (T > 0);
//   logprob = log_softmax(logits / T)[token] (T = 1 for greedy rows);  conf = w . [h_k; e] + b,
//   survival = prod sigmoid(conf / T_sts).
//
// Structure (a persistent kernel, G CTAs of 128 threads, every CTA resident; 2K grid barriers per block for the
// vanilla head, 3K for gated / rnn):
//   for k in 0..K-1:
//     phase 1a (one item per request, spread over the CTAs): merge request n's G partials of position k-1 (the
//        CTAs' vocabulary slices) into the token x and its log-probability and write them; gather e = W1[x] into a
//        float32 workspace row (for the vanilla head that row is v); the confidence logit and survival of k.
//     grid barrier
//     phase 1b (gated / rnn only): the gate / rnn matrix-vector products for the whole batch at once (items =
//        blocks of output rows x groups of 32 requests, weights staged in shared memory and read once per group):
//        v (and the rnn state, ping-ponged between two rows) into the workspace.  grid barrier
//     phase 2 (the vocabulary sweep): CTA b owns rows [b*chunk, (b+1)*chunk) of the vocabulary and streams its
//        W2 slice once per position and request group (up to 64 requests; fewer when r is large):
//        * bf16 / fp16 W2 (r <= 2048), on tensor cores (dspark/mma.cuh, m32n8k16): the group's float32 v rows
//          are split into hi + lo rows of W2's type after a per-request power-of-two scale (max |v| -> [2^13,
//          2^14): 16 significant bits of v with bf16, 22 with fp16), the group padded to a multiple of 8 with
//          zero rows. Per tile of 128 vocabulary rows, chunks of 64 columns of W2 are staged in shared memory in
//          their own type (16-byte copies); warp w loads the A fragment of rows 32w..32w+31 once per 16 columns
//          and issues two MMAs (hi, lo) per 8 requests into float32 accumulators (8 x 8 floats per lane for 64
//          requests). The accumulators go to a shared [NB, 128] bias tile, unscaled when folded.
//        * fp32 W2 (and 16-bit W2 with r > 2048): the FMA sweep: a tile of 128 rows x 32 columns is staged as
//          float32, thread t owns row t and accumulates W2[row] . v_n for every request of the group in
//          registers.
//        The fold: one warp per request adds U to the tile's biases, writes the logits when asked, and folds
//        (argmax or Gumbel race winner, softmax statistics of logits / T) into the CTA's running partial for
//        that request. The bias never reaches global memory. Partials go to a workspace [G, N].
//        CTAs: all resident, >= 128 vocabulary rows each, and the per-position broadcast of the v rows to every
//        CTA (N * r * 4 bytes each) at most 1/12 of the position's U + W2 bytes (N = 1: 132 CTAs; the headline
//        N = 64, r = 256, V = 151936 bf16: 123 CTAs).
//     grid barrier
//   final: the last position's partials are merged (one CTA per request) into its tokens and log-probabilities.
//
// Every random draw is keyed by (request, position, STREAM_DRAFT, token), so the race winner does not depend on
// the split. Ties go to the lowest index, NaN scores count as -inf (infinities stay), so tokens equal the
// reference's whenever the float32 logits agree. All arithmetic is float32 (the tensor cores form exact products of
// 16-bit operands and accumulate them in float32; the v split keeps 16 / 22 bits of v, so the biases sit within
// ~2^-17 / 2^-22 of sum |W2 v| of the float32 ones); offsets are 64-bit. The tensor-core path has run only in the
// SIMT harness's emulation of dspark/mma.cuh (and compiled for sm_80 / sm_90a), not yet on a GPU.
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "utils.cuh"

namespace dspark {
namespace draft {

// 128 threads and one CTA per SM (every CTA resident for the cooperative launch).
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRK = 32;                  // W2 columns per staged chunk
constexpr int kWtStride = kRK + 4;       // floats per staged row: the pad makes float4 reads conflict-free
constexpr int64_t kGroupFloats = 16384;  // shared floats for the v rows of one request group (64 KB)
constexpr int kMaxGroup = 64;            // requests per group (the register tile of the sweep)
constexpr int kMaxCtasPerSm = 1;
constexpr int64_t kMinRowsPerCta = 128;
constexpr int64_t kBroadcastShare = 12;  // v broadcast to the CTAs <= 1/12 of a position's U + W2 bytes
// The tensor-core sweep (16-bit W2): W2 tile columns per staged chunk, its row stride (elements; a multiple of 8
// that keeps every warp's 32-row block 32-byte aligned and spreads the rows over the banks), the bias tile's
// stride (floats), the widest rank it takes (a request's hi / lo rows must fit in the group area), and the
// exponent the split scales every request's largest |v| to (hi / lo stay normal numbers in fp16).
constexpr int kRKm = 64;
constexpr int kWtStrideM = kRKm + 8;
constexpr int kLtStrideM = kThreads + 4;
constexpr int64_t kMaxMmaRank = 2048;
constexpr int kSplitExp = 14;

enum Head : int { kVanilla = 0, kGated = 1, kRnn = 2 };

struct DraftBlockParams {
  const void* base;  // U [N, K, V]
  DType base_dtype;
  const void* anchors;  // [N] int32 or int64
  bool anchors_int64;
  int head;  // Head
  const void* w1;  // [V, R]
  DType w1_dtype;
  const void* w2;  // [V, R]
  DType w2_dtype;
  const void* wg;  // [R, D + R] (gated)
  DType wg_dtype;
  const void* bg;  // [R]
  DType bg_dtype;
  const void* wj;  // [3R, 2R + D] (rnn)
  DType wj_dtype;
  const void* bj;  // [3R]
  DType bj_dtype;
  const void* hidden;  // [N, K, D] or null (vanilla without confidence; D = 0)
  DType hidden_dtype;
  const void* conf_w;  // [D + R] or null (no confidence head)
  DType conf_w_dtype;
  const void* conf_b;  // [1]
  DType conf_b_dtype;
  const void* sts;  // [K] or null (all 1)
  DType sts_dtype;
  const float* temperature;  // [N] or null (every request greedy); T <= 0 or NaN: greedy
  const int64_t* rng_key;    // [2] (seed, offset)
  int64_t N, K, V, R, D;
  int64_t* tokens;    // [N, K]
  float* logprobs;    // [N, K]
  float* logits;      // [N, K, V] or null
  float* conf;        // [N, K] or null
  float* survival;    // [N, K] or null
};

// The launch shape, decided on the host from the shapes and the device (the same code in both builds).
struct Plan {
  bool mma;           // the tensor-core sweep (16-bit W2, R <= kMaxMmaRank)
  int grid;           // CTAs (all resident)
  int64_t chunk;      // vocabulary rows per CTA
  int group;          // requests per sweep group (NB)
  int64_t rows_item;  // phase-1b output rows per item
  int64_t rpad;       // R rounded up to kRK
  size_t smem;        // dynamic shared memory
  // dynamic shared memory layout (float offsets)
  int64_t off_wt, off_l, off_parts, off_temp, off_scale;
};

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
    return scaled - stats.log_sum_exp();
  }
};

DSPARK_HOST_DEVICE_FN size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// ------------------------------------------------------------------------------------------------ loads
DSPARK_DEVICE const void* offset_row(const void* p, DType t, int64_t elems) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(dtype_size(t));
}

// One warp: row . z over `len` elements (z in shared memory); every lane gets the sum.
DSPARK_DEVICE float warp_dot(const void* row, DType t, int64_t len, const float* z, int lane) {
  float acc = 0.0f;
  for_each_element(row, t, 0, len, lane, 32, [&](int64_t i, float w) { acc = fmaf(w, z[i], acc); });
  return warp_sum(acc);
}

// The phases are separate functions on the GPU, so that each gets the whole register file.
#if defined(DSPARK_SIMT)
#define DSPARK_DRAFT_PHASE DSPARK_DEVICE
#else
#define DSPARK_DRAFT_PHASE __device__ __noinline__
#endif

DSPARK_DEVICE float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

struct Workspace {
  float* v;      // [N, R]: the head's vector of the current position (vanilla: e itself)
  float* e;      // [N, R]: e = W1[x] of the current position (gated, rnn)
  float* state;  // [2, N, R]: the rnn state, ping-pong (rnn only)
  Part* parts;   // [G, N]
};

// Request n's partials of the last sweep, merged by the whole block (every thread gets the result).
DSPARK_DEVICE Part merge_parts(const Workspace& ws, int G, int64_t N, int64_t n, Part* scratch) {
  Part acc = Part::empty();
  for (int i = threadIdx.x; i < G; i += blockDim.x) acc.merge(ld_coherent(ws.parts + static_cast<int64_t>(i) * N + n));
  return block_allreduce(acc, scratch);
}

// ------------------------------------------------------------------------------------------------ phase 1a
// One item per request: the previous position's token and log-probability (k > 0), e = W1[x] into the workspace
// (it is v itself for the vanilla head), and the confidence logit and survival of position k.
DSPARK_DRAFT_PHASE void phase_request(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                 float* zs, Part* part_scratch, float* sum_scratch) {
  const int t = threadIdx.x;
  const int64_t N = p.N, K = p.K, V = p.V, R = p.R, D = p.D;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    int64_t x;
    if (k == 0) {
      x = p.anchors_int64 ? ldg(static_cast<const int64_t*>(p.anchors) + n)
                          : static_cast<int64_t>(ldg(static_cast<const int32_t*>(p.anchors) + n));
    } else {
      const Part pt = merge_parts(ws, plan.grid, N, n, part_scratch);
      x = pt.win.index;
      if (t == 0) {
        stg(p.tokens + n * K + (k - 1), x);
        stg(p.logprobs + n * K + (k - 1), pt.logprob());
      }
    }
    float* erow = (p.head == kVanilla ? ws.v : ws.e) + n * R;
    if (x >= 0 && x < V) {
      for_each_element(offset_row(p.w1, p.w1_dtype, x * R), p.w1_dtype, 0, R, t, blockDim.x, [&](int64_t i, float w) {
        zs[i] = w;
        stg(erow + i, w);
      });
    } else {
      for (int64_t i = t; i < R; i += blockDim.x) {
        zs[i] = 0.0f;
        stg(erow + i, 0.0f);
      }
    }
    if (p.conf_w != nullptr) {  // z = w . [h_k; e] + b, survival *= sigmoid(z / T_k)
      __syncthreads();
      const void* hrow = offset_row(p.hidden, p.hidden_dtype, (n * K + k) * D);
      float acc = 0.0f;
      for_each_element(p.conf_w, p.conf_w_dtype, 0, D + R, t, blockDim.x, [&](int64_t i, float w) {
        acc = fmaf(w, i < D ? load_float(hrow, p.hidden_dtype, i) : zs[i - D], acc);
      });
      const float z = block_sum(acc, sum_scratch) + load_float(p.conf_b, p.conf_b_dtype, 0);
      if (t == 0) {
        const float temp = p.sts != nullptr ? load_float(p.sts, p.sts_dtype, k) : 1.0f;
        const float prev = k == 0 ? 1.0f : ld_coherent(p.survival + n * K + (k - 1));
        stg(p.conf + n * K + k, z);
        stg(p.survival + n * K + k, prev * sigmoidf_(z / temp));
      }
    }
    __syncthreads();  // zs is reused by the next item
  }
}

// ------------------------------------------------------------------------------------------------ phase 1b
// The gate / rnn matrix-vector products for the whole batch: an item is a block of output rows j x a group of up
// to 32 requests (lane n <-> request n of the group). Column chunks of the weight rows and of the inputs
// z_n = [h_k; e] (gated) or [s; e; h_k] (rnn) are staged in shared memory, so each weight element is read from
// global memory once per request group and position; each warp accumulates its rows for its lane's request.
constexpr int kZGroup = 32;
constexpr int kCC = 64;         // columns per staged chunk
constexpr int kZStride = kCC + 1;
constexpr int kPerWarp = 16;    // gated: output rows per warp and item (rnn: 16 rows = a third of them each)

template <int M>  // 1: gated, 3: rnn (rows j, R + j, 2R + j)
DSPARK_DRAFT_PHASE void phase_matvec(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                float* smem) {
  constexpr int kOuts = kPerWarp / M;  // outputs per warp (rnn: 5, using 15 accumulators)
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, K = p.K, R = p.R, D = p.D;
  const int64_t width = M == 1 ? D + R : 2 * R + D;
  const int64_t rows_item = plan.rows_item;  // outputs per item (<= kWarps * kOuts)
  const int64_t blocks = (R + rows_item - 1) / rows_item, groups = (N + kZGroup - 1) / kZGroup;
  const void* w = M == 1 ? p.wg : p.wj;
  const DType wdt = M == 1 ? p.wg_dtype : p.wj_dtype;
  const float* s_old = ws.state + (k & 1) * N * R;
  float* s_new = ws.state + ((k + 1) & 1) * N * R;
  float* zt = smem;                          // [kZGroup, kZStride]
  float* wt = smem + kZGroup * kZStride;     // [M * rows_item, kCC]
  for (int64_t item = blockIdx.x; item < blocks * groups; item += gridDim.x) {
    const int64_t grp = item / blocks, jb = item - grp * blocks;
    const int64_t n0 = grp * kZGroup, j0 = jb * rows_item;
    const int nz = static_cast<int>(N - n0 < kZGroup ? N - n0 : kZGroup);
    const int nrows = static_cast<int>(R - j0 < rows_item ? R - j0 : rows_item);
    float acc[M][kOuts];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int q = 0; q < kOuts; ++q) acc[m][q] = 0.0f;
    for (int64_t c0 = 0; c0 < width; c0 += kCC) {
      __syncthreads();
      for (int i = t; i < kZGroup * kCC; i += blockDim.x) {
        const int nl = i / kCC, c = i - nl * kCC;
        const int64_t col = c0 + c, n = n0 + nl;
        float z = 0.0f;
        if (nl < nz && col < width) {
          const int64_t hrow = (n * K + k) * D;
          if (M == 1) {
            z = col < D ? load_float(p.hidden, p.hidden_dtype, hrow + col) : ld_coherent(ws.e + n * R + (col - D));
          } else if (col < R) {
            z = k == 0 ? 0.0f : ld_coherent(s_old + n * R + col);
          } else if (col < 2 * R) {
            z = ld_coherent(ws.e + n * R + (col - R));
          } else {
            z = load_float(p.hidden, p.hidden_dtype, hrow + (col - 2 * R));
          }
        }
        zt[nl * kZStride + c] = z;
      }
      for (int64_t i = t; i < int64_t(M) * rows_item * kCC; i += blockDim.x) {
        const int64_t rr = i / kCC, c = i - rr * kCC;
        const int64_t m = rr / rows_item, jl = rr - m * rows_item, col = c0 + c;
        wt[i] = jl < nrows && col < width ? load_float(w, wdt, (m * R + j0 + jl) * width + col) : 0.0f;
      }
      __syncthreads();
      const float* zrow = zt + lane * kZStride;
#pragma unroll
      for (int q = 0; q < kOuts; ++q) {
        const int jl = warp + q * kWarps;
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
    if (lane < nz) {
      const int64_t n = n0 + lane;
#pragma unroll
      for (int q = 0; q < kOuts; ++q) {
        const int jl = warp + q * kWarps;
        if (jl < nrows) {
          const int64_t j = j0 + jl;
          if (M == 1) {
            const float g = sigmoidf_(acc[0][q] + load_float(p.bg, p.bg_dtype, j));
            stg(ws.v + n * R + j, g * ld_coherent(ws.e + n * R + j));
          } else {
            const float sg = sigmoidf_(acc[0][q] + load_float(p.bj, p.bj_dtype, j));
            const float c = acc[1 % M][q] + load_float(p.bj, p.bj_dtype, R + j);
            const float o = acc[2 % M][q] + load_float(p.bj, p.bj_dtype, 2 * R + j);
            const float s = k == 0 ? 0.0f : ld_coherent(s_old + n * R + j);
            stg(s_new + n * R + j, sg * s + (1.0f - sg) * tanhf(c));
            stg(ws.v + n * R + j, tanhf(o));
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ phase 2
// One warp folds a tile's biases of request n (bias[i] * bscale for vocabulary row tile0 + i) into the request's
// running partial `run` (shared memory): adds U, writes the logits when asked, and takes the argmax (greedy,
// temp == 0) or the Gumbel race winner of logits / temp, with the softmax statistics of the scaled logits.
DSPARK_DEVICE void fold_tile(const DraftBlockParams& p, const rng::Philox& ph, int64_t n, int64_t k, int64_t tile0,
                             int rows, const float* bias, float bscale, float temp, int lane, Part* run) {
  const bool sampled = temp > 0.0f;
  const float tdiv = sampled ? temp : 1.0f;
  const int64_t row0 = (n * p.K + k) * p.V;
  Part pt = Part::empty();
  for (int i = lane; i < rows; i += 32) {
    const int64_t v = tile0 + i;
    const float l = load_float(p.base, p.base_dtype, row0 + v) + bias[i] * bscale;
    if (p.logits != nullptr) stg(p.logits + row0 + v, l);
    const float xs = l / tdiv;
    const float sc = sampled ? gumbel_score(xs, ph.uniform(n, k, rng::kStreamDraft, v)) : nan_to_neg_inf(l);
    pt.add(xs, sc, v);
  }
  pt = warp_allreduce(pt);
  if (lane == 0) run->merge(pt);
}

template <typename TW, int NBT>
DSPARK_DRAFT_PHASE void phase_sweep(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                               const rng::Philox& ph, float* smem) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, V = p.V, R = p.R, rpad = plan.rpad;
  float* vt = smem;                    // [NB, rpad]
  float* wt = smem + plan.off_wt;      // [kThreads, kWtStride]
  float* lt = smem + plan.off_l;       // [kWarps, kThreads]: the tile's biases of kWarps requests
  Part* run = reinterpret_cast<Part*>(smem + plan.off_parts);  // [NB]
  float* temps = smem + plan.off_temp;  // [NB]: T, or 0 for greedy
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * plan.chunk;
  const int64_t v1 = v0 + plan.chunk < V ? v0 + plan.chunk : V;
  constexpr int kEpv = static_cast<int>(16 / sizeof(TW));  // elements per 16-byte vector
  const TW* w2 = static_cast<const TW*>(p.w2);
  const bool vec = (R * static_cast<int64_t>(sizeof(TW))) % 16 == 0 && is_aligned16(w2);
  for (int64_t g0 = 0; g0 < N; g0 += plan.group) {
    const int nb = static_cast<int>(N - g0 < plan.group ? N - g0 : plan.group);
    __syncthreads();
    for (int64_t i = t; i < nb * rpad; i += kThreads) {
      const int64_t j = i / rpad, c = i - j * rpad;
      vt[i] = c < R ? ld_coherent(ws.v + (g0 + j) * R + c) : 0.0f;
    }
    for (int j = t; j < nb; j += kThreads) {
      run[j] = Part::empty();
      const float temp = p.temperature != nullptr ? ldg(p.temperature + g0 + j) : 0.0f;
      temps[j] = temp > 0.0f ? temp : 0.0f;
    }
    __syncthreads();
    for (int64_t tile0 = v0; tile0 < v1; tile0 += kThreads) {
      const int rows = static_cast<int>(v1 - tile0 < kThreads ? v1 - tile0 : kThreads);
      float acc[NBT];
#pragma unroll
      for (int j = 0; j < NBT; ++j) acc[j] = 0.0f;
      for (int64_t rc = 0; rc < R; rc += kRK) {
        __syncthreads();  // the previous chunk (or the group's setup) is done
        if (vec) {
          constexpr int kVpr = kRK / kEpv;  // vectors per staged row
          for (int i = t; i < kThreads * kVpr; i += kThreads) {
            const int row = i / kVpr, q = i - row * kVpr;
            const int64_t col = rc + q * kEpv;
            float* dst = wt + row * kWtStride + q * kEpv;
            if (row < rows && col < R) {
              const Vec16<TW> w = load16(w2 + (tile0 + row) * R + col);
#pragma unroll
              for (int e = 0; e < kEpv; ++e) dst[e] = to_float(w.v[e]);
            } else {
#pragma unroll
              for (int e = 0; e < kEpv; ++e) dst[e] = 0.0f;
            }
          }
        } else {
          for (int i = t; i < kThreads * kRK; i += kThreads) {
            const int row = i / kRK, c = i - row * kRK;
            const int64_t col = rc + c;
            wt[row * kWtStride + c] = row < rows && col < R ? to_float(ldg(w2 + (tile0 + row) * R + col)) : 0.0f;
          }
        }
        __syncthreads();
        const float* wrow = wt + t * kWtStride;
        const float* vcol = vt + rc;
#pragma unroll 1
        for (int c = 0; c < kRK; c += 4) {
          const float4 w = *reinterpret_cast<const float4*>(wrow + c);
#pragma unroll
          for (int j = 0; j < NBT; ++j) {
            if (j < nb) {
              const float4 x = *reinterpret_cast<const float4*>(vcol + j * rpad + c);
              acc[j] = fmaf(w.x, x.x, acc[j]);
              acc[j] = fmaf(w.y, x.y, acc[j]);
              acc[j] = fmaf(w.z, x.z, acc[j]);
              acc[j] = fmaf(w.w, x.w, acc[j]);
            }
          }
        }
      }
      // fold the tile into the running partials, kWarps requests at a time (warp w <-> request w of the chunk)
#pragma unroll
      for (int cc = 0; cc < NBT / kWarps; ++cc) {
        if (cc * kWarps < nb) {
#pragma unroll
          for (int j = 0; j < kWarps; ++j) lt[j * kThreads + t] = acc[cc * kWarps + j];
          __syncthreads();
          const int jl = cc * kWarps + warp;
          if (jl < nb) {
            fold_tile(p, ph, g0 + jl, k, tile0, rows, lt + warp * kThreads, 1.0f, temps[jl], lane, run + jl);
          }
          __syncthreads();
        }
      }
    }
    __syncthreads();
    for (int j = t; j < nb; j += kThreads) stg(ws.parts + static_cast<int64_t>(blockIdx.x) * N + g0 + j, run[j]);
  }
}

// x ~= hi + lo in a 16-bit type (an infinite or NaN hi carries no lo).
template <typename TW>
DSPARK_DEVICE void split_store(float x, TW* hi, TW* lo) {
  const TW h = from_float<TW>(x);
  const float hf = to_float(h);
  *hi = h;
  *lo = from_float<TW>(hf - hf == 0.0f ? x - hf : 0.0f);
}

// The tensor-core sweep for a 16-bit W2 (bf16 / fp16). Per request group (NBT a multiple of 8; the group pads to
// it with zero rows):
//   * the group's float32 v rows are split into two rows of W2's type, hi = T(v * s), lo = T(v * s - hi), with s
//     a power of two per request that brings max |v| to [2^13, 2^14) (fp16's range; exact, undone on the bias),
//     so hi + lo carries 16 (bf16) or 22 (fp16) significant bits of v; B operand layout [NB][hi row | lo row];
//   * per tile of 128 vocabulary rows (warp w owns rows 32w..32w+31), chunks of kRKm columns of W2 are staged in
//     shared memory in their own type (16-byte copies, no conversion); per 16 columns each warp loads its A
//     fragment once and issues two m32n8k16 MMAs (hi and lo) per 8 requests into float32 accumulators;
//   * the accumulators go to a shared [NB, 128] bias tile, and one warp per request folds it (fold_tile).
template <typename TW, int NBT>
DSPARK_DRAFT_PHASE void phase_sweep_mma(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                        const rng::Philox& ph, float* smem) {
  static_assert(NBT % mma::kN == 0, "the request group pads to the MMA's N");
  constexpr int kFrags = NBT / mma::kN;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t N = p.N, V = p.V, R = p.R, rpad = plan.rpad;
  TW* vt = reinterpret_cast<TW*>(smem);                     // [NB][2][rpad]: hi row, lo row
  TW* wt = reinterpret_cast<TW*>(smem + plan.off_wt);       // [kThreads][kWtStrideM]
  float* lt = smem + plan.off_l;                            // [NB][kLtStrideM]: the tile's biases
  Part* run = reinterpret_cast<Part*>(smem + plan.off_parts);  // [NB]
  float* temps = smem + plan.off_temp;                      // [NB]: T, or 0 for greedy
  float* unscale = smem + plan.off_scale;                   // [NB]: 1 / s
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * plan.chunk;
  const int64_t v1 = v0 + plan.chunk < V ? v0 + plan.chunk : V;
  constexpr int kEpv = static_cast<int>(16 / sizeof(TW));
  const TW* w2 = static_cast<const TW*>(p.w2);
  const bool vec = (R * static_cast<int64_t>(sizeof(TW))) % 16 == 0 && is_aligned16(w2);
  const int ldb = static_cast<int>(2 * rpad);
  for (int64_t g0 = 0; g0 < N; g0 += plan.group) {
    const int nb = static_cast<int>(N - g0 < plan.group ? N - g0 : plan.group);
    const int nbp = (nb + mma::kN - 1) / mma::kN * mma::kN;
    __syncthreads();
    // the split of v, one warp per request (rows nb..nbp-1 are zero)
    for (int j = warp; j < nbp; j += kWarps) {
      TW* hi = vt + static_cast<int64_t>(j) * ldb;
      TW* lo = hi + rpad;
      if (j < nb) {
        const float* vrow = ws.v + (g0 + j) * R;
        constexpr int kHold = 16;  // R <= 512: the row stays in registers between the max and the split
        float held[kHold];
        float amax = 0.0f;
        if (R <= 32 * kHold) {
#pragma unroll
          for (int q = 0; q < kHold; ++q) {
            const int64_t c = lane + 32 * q;
            held[q] = c < R ? ld_coherent(vrow + c) : 0.0f;
            amax = fmaxf(amax, fabsf(held[q]));
          }
        } else {
          for (int64_t c = lane; c < R; c += 32) amax = fmaxf(amax, fabsf(ld_coherent(vrow + c)));
        }
        amax = warp_max(amax);
        int e = 0;
        if (amax > 0.0f && amax < INFINITY) {
          frexpf(amax, &e);
          e = kSplitExp - e;
          e = e < -100 ? -100 : (e > 100 ? 100 : e);
        }
        const float sc = ldexpf(1.0f, e);
        if (lane == 0) unscale[j] = ldexpf(1.0f, -e);
        if (R <= 32 * kHold) {
#pragma unroll
          for (int q = 0; q < kHold; ++q) {
            const int64_t c = lane + 32 * q;
            if (c < rpad) split_store(held[q] * sc, hi + c, lo + c);
          }
        } else {
          for (int64_t c = lane; c < rpad; c += 32) split_store(c < R ? ld_coherent(vrow + c) * sc : 0.0f, hi + c, lo + c);
        }
      } else {
        for (int64_t c = lane; c < rpad; c += 32) {
          hi[c] = from_float<TW>(0.0f);
          lo[c] = from_float<TW>(0.0f);
        }
      }
    }
    for (int j = t; j < nb; j += kThreads) {
      run[j] = Part::empty();
      const float temp = p.temperature != nullptr ? ldg(p.temperature + g0 + j) : 0.0f;
      temps[j] = temp > 0.0f ? temp : 0.0f;
    }
    for (int64_t tile0 = v0; tile0 < v1; tile0 += kThreads) {
      const int rows = static_cast<int>(v1 - tile0 < kThreads ? v1 - tile0 : kThreads);
      mma::Acc acc[kFrags];
#pragma unroll
      for (int f = 0; f < kFrags; ++f) mma::zero(acc[f]);
      for (int64_t rc = 0; rc < rpad; rc += kRKm) {
        const int width = static_cast<int>(rpad - rc < kRKm ? rpad - rc : kRKm);  // a multiple of 32
        __syncthreads();  // the previous chunk (or the group's setup, or the last fold) is done
        if (vec) {
          const int vpr = width / kEpv;  // vectors per staged row
          for (int i = t; i < kThreads * vpr; i += kThreads) {
            const int row = i / vpr, q = i - row * vpr;
            const int64_t col = rc + q * kEpv;
            Vec16<TW> w;
            if (row < rows && col < R) {
              w = load16(w2 + (tile0 + row) * R + col);
            } else {
#pragma unroll
              for (int e = 0; e < kEpv; ++e) w.v[e] = from_float<TW>(0.0f);
            }
            *reinterpret_cast<Vec16<TW>*>(wt + row * kWtStrideM + q * kEpv) = w;
          }
        } else {
          for (int i = t; i < kThreads * width; i += kThreads) {
            const int row = i / width, c = i - row * width;
            const int64_t col = rc + c;
            wt[row * kWtStrideM + c] = row < rows && col < R ? ldg(w2 + (tile0 + row) * R + col) : from_float<TW>(0.0f);
          }
        }
        __syncthreads();
        const TW* aw = wt + warp * mma::kM * kWtStrideM;
        for (int kk = 0; kk < width; kk += mma::kK) {
          mma::FragA<TW> fa;
          mma::load_a(fa, aw + kk, kWtStrideM);
#pragma unroll
          for (int f = 0; f < kFrags; ++f) {
            if (f * mma::kN < nb) {  // warp-uniform
              mma::FragB<TW> fb;
              const TW* b = vt + static_cast<int64_t>(f * mma::kN) * ldb + rc + kk;
              mma::load_b(fb, b, ldb);
              mma::mma(acc[f], fa, fb);
              mma::load_b(fb, b + rpad, ldb);
              mma::mma(acc[f], fa, fb);
            }
          }
        }
      }
#pragma unroll
      for (int f = 0; f < kFrags; ++f)
        if (f * mma::kN < nb) mma::store(lt + f * mma::kN * kLtStrideM + warp * mma::kM, kLtStrideM, acc[f]);
      __syncthreads();
      for (int jl = warp; jl < nb; jl += kWarps)
        fold_tile(p, ph, g0 + jl, k, tile0, rows, lt + jl * kLtStrideM, unscale[jl], temps[jl], lane, run + jl);
    }
    __syncthreads();
    for (int j = t; j < nb; j += kThreads) stg(ws.parts + static_cast<int64_t>(blockIdx.x) * N + g0 + j, run[j]);
  }
}

template <typename TW, int NBT, bool kMma>
__global__ void __launch_bounds__(kThreads, 1) draft_block_kernel(DraftBlockParams p, Plan plan, Workspace ws) {
  DSPARK_DYNAMIC_SMEM(unsigned char, smem_raw);
  float* smem = reinterpret_cast<float*>(smem_raw + ((32u - (reinterpret_cast<uintptr_t>(smem_raw) & 31u)) & 31u));
  DSPARK_SHARED_ARRAY(Part, part_scratch, 32);
  DSPARK_SHARED_ARRAY(float, sum_scratch, 32);
  DSPARK_SHARED(rng::Philox, ph_s);
  if (threadIdx.x == 0) ph_s = p.temperature != nullptr ? rng::load_philox(p.rng_key) : rng::Philox::make(0, 0);
  __syncthreads();
  const rng::Philox ph = ph_s;
  for (int64_t k = 0; k < p.K; ++k) {
    phase_request(p, plan, ws, k, smem, part_scratch, sum_scratch);
    grid_sync();
    if (p.head != kVanilla) {
      if (p.head == kGated) {
        phase_matvec<1>(p, plan, ws, k, smem);
      } else {
        phase_matvec<3>(p, plan, ws, k, smem);
      }
      grid_sync();
    }
    if constexpr (kMma) {
      phase_sweep_mma<TW, NBT>(p, plan, ws, k, ph, smem);
    } else {
      phase_sweep<TW, NBT>(p, plan, ws, k, ph, smem);
    }
    grid_sync();
  }
  for (int64_t n = blockIdx.x; n < p.N; n += gridDim.x) {  // the last position's tokens
    const Part pt = merge_parts(ws, plan.grid, p.N, n, part_scratch);
    if (threadIdx.x == 0) {
      stg(p.tokens + n * p.K + (p.K - 1), pt.win.index);
      stg(p.logprobs + n * p.K + (p.K - 1), pt.logprob());
    }
  }
}
#endif  // __CUDACC__ || DSPARK_SIMT

// ------------------------------------------------------------------------------------------------ host side
inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// The launch shape for `sms` multiprocessors holding `per_sm` CTAs each (per_sm from the occupancy of `smem`).
inline Plan make_plan(const DraftBlockParams& p, int sms, int per_sm) {
  Plan pl{};
  const int64_t N = p.N, V = p.V, R = p.R;
  pl.rpad = round_up(R > 0 ? R : 1, kRK);
  pl.mma = p.w2_dtype != DType::kFloat32 && pl.rpad <= kMaxMmaRank;
  int64_t group = kGroupFloats / pl.rpad;
  if (group > kMaxGroup) group = kMaxGroup;
  if (pl.mma) group = group / 8 * 8;  // the tensor-core sweep pads its groups to multiples of 8 anyway
  if (group < 1) group = 1;
  pl.group = static_cast<int>(N < group ? (N > 0 ? N : 1) : group);
  const int m = p.head == kRnn ? 3 : 1;
  const int64_t max_rows = int64_t(kWarps) * (kPerWarp / m);
  // the v rows of a group: float32 (FMA sweep) or hi + lo 16-bit rows padded to 8 requests (same floats per row)
  const int64_t vrows = pl.mma ? round_up(pl.group, 8) : pl.group;
  const int64_t area = std::max<int64_t>({vrows * pl.rpad, R, int64_t(kZGroup) * kZStride + m * max_rows * kCC});
  pl.off_wt = round_up(area, 8);  // 32-byte aligned (the MMA operands)
  if (pl.mma) {
    pl.off_l = pl.off_wt + round_up(int64_t(kThreads) * kWtStrideM / 2, 8);
    pl.off_parts = pl.off_l + vrows * kLtStrideM;
  } else {
    pl.off_l = pl.off_wt + int64_t(kThreads) * kWtStride;
    pl.off_parts = pl.off_l + int64_t(kWarps) * kThreads;
  }
  pl.off_temp = pl.off_parts + int64_t(pl.group) * int64_t(sizeof(Part) / sizeof(float));
  pl.off_scale = pl.off_temp + round_up(pl.group, 4);
  // + 32 bytes: the kernel aligns the dynamic shared memory's start to 32 bytes (WMMA's operand alignment)
  pl.smem = static_cast<size_t>(pl.off_scale + round_up(pl.group, 4)) * sizeof(float) + 32;
  // CTAs: all resident, at least kMinRowsPerCta vocabulary rows each, and the per-position broadcast of the
  // group's v rows to every CTA (N * R * 4 bytes each) at most 1/kBroadcastShare of the position's U + W2 bytes.
  const int64_t resident = int64_t(sms) * (per_sm < kMaxCtasPerSm ? per_sm : kMaxCtasPerSm);
  const int64_t floor_k = N * V * int64_t(dtype_size(p.base_dtype)) + V * R * int64_t(dtype_size(p.w2_dtype));
  const int64_t bcast = std::max<int64_t>(N * R * 4, 1) * kBroadcastShare;
  int64_t want = std::min<int64_t>(resident, (V + kMinRowsPerCta - 1) / kMinRowsPerCta);
  want = std::min<int64_t>(want, floor_k / bcast);
  if (want < 1) want = 1;
  pl.chunk = (V + want - 1) / want;
  pl.grid = static_cast<int>((V + pl.chunk - 1) / pl.chunk);
  // phase-1b output rows per item: as many as the register tile holds (each item re-stages its requests' inputs,
  // so fewer rows cost bytes), but few enough to give every CTA an item when the batch is small
  const int64_t groups = (N + kZGroup - 1) / kZGroup;
  int64_t rows = (R * groups + pl.grid - 1) / pl.grid;
  const int64_t nz = N < kZGroup ? N : kZGroup;
  const int64_t byte_rows = (8 * nz + int64_t(dtype_size(p.head == kRnn ? p.wj_dtype : p.wg_dtype)) * m - 1) /
                            (int64_t(dtype_size(p.head == kRnn ? p.wj_dtype : p.wg_dtype)) * m);
  rows = std::max<int64_t>(rows, byte_rows);
  rows = std::min<int64_t>(std::max<int64_t>(rows, kWarps), max_rows);
  pl.rows_item = rows;
  return pl;
}

inline size_t workspace_floats_before_parts(const DraftBlockParams& p) {
  const size_t v = size_t(p.N) * size_t(p.R);
  return size_t(round_up(int64_t(v * (p.head == kVanilla ? 1 : p.head == kGated ? 2 : 4)), 4));
}
inline size_t workspace_bytes_for(const DraftBlockParams& p, const Plan& pl) {
  return workspace_floats_before_parts(p) * 4 + size_t(pl.grid) * size_t(p.N) * sizeof(Part);
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
template <typename TW, int NBT, bool kMma>
inline cudaError_t launch_typed(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  auto kernel = draft_block_kernel<TW, NBT, kMma>;
  // the plan's shared memory does not depend on the occupancy: size it first, then ask how many CTAs fit
  Plan pl = make_plan(p, device_sm_count(), 1);
#if !defined(DSPARK_SIMT)
  if (pl.smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(pl.smem));
    if (err != cudaSuccess) return err;
  }
#endif
  const int per_sm = max_active_blocks_per_sm(kernel, kThreads, pl.smem);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  pl = make_plan(p, device_sm_count(), per_sm);
  if (out_plan != nullptr) *out_plan = pl;
  if (workspace == nullptr) return cudaSuccess;  // a size query
  Workspace ws;
  float* base = static_cast<float*>(workspace);
  const int64_t v = p.N * p.R;
  ws.v = base;
  ws.e = base + v;
  ws.state = base + 2 * v;
  ws.parts = reinterpret_cast<Part*>(base + workspace_floats_before_parts(p));
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(pl.grid));
  cfg.block = dim3(kThreads);
  cfg.smem = pl.smem;
  cfg.stream = stream;
  cfg.cooperative = true;
  // the name says which sweep runs (the harness records it): tensor cores or the FP32 FMA loop
  return launch(kMma ? "draft_block_kernel[mma]" : "draft_block_kernel[fma]", kernel, cfg, p, pl, ws);
}

template <typename TW>
inline cudaError_t launch_w2(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  const Plan probe = make_plan(p, 1, 1);
  if constexpr (std::is_same<TW, float>::value) {  // float32 W2: the FMA sweep
    if (probe.group <= 8) return launch_typed<TW, 8, false>(p, workspace, stream, out_plan);
    return launch_typed<TW, kMaxGroup, false>(p, workspace, stream, out_plan);
  } else {
    if (!probe.mma) return launch_typed<TW, 8, false>(p, workspace, stream, out_plan);  // R > kMaxMmaRank
    if (probe.group <= 8) return launch_typed<TW, 8, true>(p, workspace, stream, out_plan);
    return launch_typed<TW, kMaxGroup, true>(p, workspace, stream, out_plan);
  }
}

inline cudaError_t dispatch(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  switch (p.w2_dtype) {
    case DType::kFloat32: return launch_w2<float>(p, workspace, stream, out_plan);
    case DType::kBFloat16: return launch_w2<__nv_bfloat16>(p, workspace, stream, out_plan);
    case DType::kFloat16: return launch_w2<__half>(p, workspace, stream, out_plan);
    default: return cudaErrorInvalidValue;
  }
}
#endif

}  // namespace draft

using draft::DraftBlockParams;

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Workspace the launch needs for `p` on the current device (bytes; 16-byte aligned start required).
inline size_t draft_block_workspace_bytes(const DraftBlockParams& p) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return 0;
  draft::Plan pl{};
  if (draft::dispatch(p, nullptr, nullptr, &pl) != cudaSuccess) return 0;
  return draft::workspace_bytes_for(p, pl);
}

// Launch on `stream`; the caller has checked the arguments (shapes, dtypes, K < 2^24, V <= 2^31 - 1).
inline cudaError_t launch_draft_block(const DraftBlockParams& p, void* workspace, cudaStream_t stream) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return cudaSuccess;
  return draft::dispatch(p, workspace, stream, nullptr);
}
#endif

}  // namespace dspark
