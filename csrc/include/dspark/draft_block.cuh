// dspark/draft_block.cuh: the whole draft block (all K positions of all N requests) in ONE cooperative launch.
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
// Structure (a persistent kernel, G CTAs of 128 threads, 256 for the tensor-core sweep's 64-request tile, every CTA
// resident; K grid barriers per block for the vanilla head, 3K for gated / rnn):
//   for k in 0..K-1:
//     phase 1a (gated / rnn; one item per request, spread over the CTAs): merge request n's partials of position
//        k-1 (one per vocabulary slice) into the token x and its log-probability and write them; gather e = W1[x]
//        into a float32 workspace row; the confidence logit and survival of k.  grid barrier
//        The vanilla head has no phase 1a: at the start of each request group's sweep, every CTA of the group's
//        lane takes x for the group itself (the max of the slices' packed winners, pack_winner) and reads v = W1[x]
//        directly; the CTA whose slice is n % slices writes request n's token, log-probability, confidence and
//        survival (vanilla_prologue). Partials are double-buffered by position, so no barrier separates them.
//     phase 1b (gated / rnn only): the gate / rnn matrix-vector products for the whole batch at once (items =
//        blocks of output rows x groups of 32 requests, weights staged in shared memory and read once per group):
//        v (and the rnn state, ping-ponged between two rows) into the workspace.  grid barrier
//     phase 2 (the vocabulary sweep): the grid is slices x lanes (make_plan). CTA b owns vocabulary slice b % slices
//        (whole groups of 16 rows, slices as even as that allows: slice_bounds) and streams its W2 slice once per
//        position for each request group of its lane (groups of up to 64 requests, fewer when r is large; lane
//        b / slices takes groups b / slices, + lanes, ...). One lane while N fits one group; at larger N the lanes
//        of a slice stream the same W2 rows side by side, so DRAM serves W2 once per position and L2 the rest.
//        * bf16 / fp16 W2 (r <= 2048), on tensor cores (dspark/mma_sync.cuh: ldmatrix + mma.sync m16n8k16; an fp8
//          e4m3 W2 the same way, each staged chunk widened to bf16 in shared memory first: widen_chunk): the
//          group's float32 v rows are split into hi + lo rows of W2's type after a per-request power-of-two scale
//          (max |v| -> [2^13, 2^14): 16 significant bits of v with bf16, 22 with fp16), the group padded to a
//          multiple of 8 with zero rows (VTile's k-block layout); when every lo row is zero the lo products are
//          skipped (the vanilla head with W1 of W2's type copies its v rows as they are, scale 1 and no lo rows).
//          The slice streams as chunks of 128 rows x 64 columns through a 3-stage cp.async ring (two 16 KB chunks
//          in flight while one is multiplied; padded strides, so every ldmatrix phase is conflict-free); warp w
//          multiplies rows 32w'..32w'+31 (w' = w mod 4; two m16 blocks, A by ldmatrix x4) by all 8-request blocks
//          of its register tile, or with 8 warps of its half of it (B by one ldmatrix x2 of the hi fragments, x4
//          with the lo ones; two MMAs per block, four with lo) into float32 accumulators (32 floats per lane for 32
//          requests a warp, 64 with kWideWarps = 4; a group's blocks past its requests are multiplied too and never
//          stored: no test in the k-step). After a tile's last chunk they go to a shared
//          [NB, 128] bias tile, unscaled when folded.
//        * fp32 W2 (and 16-bit W2 with r > 2048): the FMA sweep: a tile of 128 rows x 32 columns is staged as
//          float32, thread t owns row t and accumulates W2[row] . v_n for every request of the group in
//          registers, then writes the bias tile.
//        U's tile (the group's 128 rows of U) rides the ring too: it is copied with the tile's last W2 chunk into
//        one of plan.uslots slots (UStage; units swizzled so the fold's reads are conflict-free: u_swizzle)
//        when U's rows allow 16-byte copies (V a multiple of 8 16-bit or 4 fp32 elements, U 16-byte aligned) and
//        the slots fit the device's shared memory (make_plan; else the fold loads U from global memory).
//        The fold: tpr threads per request (tpr * group <= 128) take the tile's 16-byte pieces of U round-robin
//        (4 or 8 rows; when U is read from global memory, one 16-byte load each when aligned, so a request's tpr
//        threads read whole sectors; their lanes and piece order chosen so that every quarter-warp's bias reads
//        are conflict-free: fold_lane), write
//        the logits when asked, and fold the argmax or the Gumbel race winner (one Philox evaluation per quad: its
//        four words are the quad's uniforms) and the softmax statistics of logits / T into a running partial kept
//        in registers across the whole slice; one shuffle reduction per request and slice. The bias never reaches
//        global memory. Greedy rows of a staged 16-bit U with no logits or row scales take fold_pieces_greedy, a
//        loop with none of the other paths' tests (the sweep's time at large N is its instruction count). Partials
//        go to a workspace [2 positions, slices, N] with their packed winners.
//        CTAs: every resident one (up to kMaxCtasPerSm an SM) while slices x lanes can fill the GPU and each slice
//        keeps >= 128 vocabulary rows (on a 132-SM GPU at r = 256: 264 CTAs at N = 1, 132 up to 4 groups of 64,
//        128 = 8 x 16 at 16 groups); each
//        reads the v rows of its groups per position (gated / rnn: r * 4 bytes a request, written by the phase
//        before, so from L2; vanilla: W1's rows of the group's tokens).
//     grid barrier
//   final: the last position's partials are merged (one CTA per request) into its tokens and log-probabilities.
//
// Every random draw is keyed by (request, position, STREAM_DRAFT, token), so the race winner does not depend on
// the split. Ties go to the lowest index, NaN scores count as -inf (infinities stay), so tokens equal the
// reference's whenever the float32 logits agree. All arithmetic is float32 (the tensor cores form exact products of
// 16-bit operands and accumulate them in float32; the v split keeps 16 / 22 bits of v, so the biases sit within
// ~2^-17 / 2^-22 of sum |W2 v| of the float32 ones); offsets are 64-bit. The tensor-core path runs in the SIMT
// harness's emulation of dspark/mma_sync.cuh and, on sm_90a, passed the GPU tests on an H200.
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "draft_part.cuh"
#include "mma_sync.cuh"
#include "utils.cuh"

namespace dspark {
namespace draft {

// 128 threads a CTA (256 for the tensor-core sweep's 64-request tile: cta_threads), every CTA resident (the
// cooperative launch), up to kMaxCtasPerSm of them an SM where shared memory and registers allow (the occupancy
// query decides) and the slices stay long (kExtraShare): one CTA of 4 warps leaves each warp scheduler a single warp,
// which waits out every latency alone (measured on an H200: a warp issued once every 4.4-6.9 clocks); a second CTA,
// or a second set of 4 warps in the same CTA, gives the scheduler another warp to issue from. Two 128-thread CTAs
// are what <= 255 registers a thread allow; small groups fit twice in shared memory (up to 25 requests at r = 256),
// a 64-request group once, so there the CTA has 8 warps (the same shared memory: the warps split the requests, not
// the rows); kExtraShare bounds the extra slices' traffic (N <= 25 at V = 151936, r = 256).
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Vocabulary rows of a sweep tile and of a ring slot: 32 for each of 4 row warps.
constexpr int kTileRows = 128;
constexpr int kRK = 32;                  // W2 columns per staged chunk
constexpr int kWtStride = kRK + 4;       // floats per staged row: the pad makes float4 reads conflict-free
constexpr int64_t kGroupFloats = 16384;  // shared floats for the v rows of one request group (64 KB)
constexpr int kMaxGroup = 64;            // requests per group (the register tile of the sweep)
constexpr int kMaxCtasPerSm = 2;
constexpr int64_t kMinRowsPerCta = 128;
// More CTAs an SM mean more slices, and besides its W2 slice every CTA reads, each position, its group's v rows and
// every slice's packed winner for each request of its group (L2 hits, but bytes): stacked CTAs are taken only
// while those stay within 1 / kExtraShare of the CTA's W2 slice. 1: on the H200 a second CTA an SM never cost time
// where this admits it and 1 / 16 did not (N = 8..32 at V = 151936, r = 256: 3-5% less with a bf16 W2, 15-21% fp8).
constexpr int64_t kExtraShare = 1;
// The tensor-core sweep (16-bit W2): W2 columns per staged chunk and a staged row's stride (elements: 144 bytes,
// an odd number of 16-byte units, so the 8 rows of every ldmatrix phase hit distinct banks), the cp.async ring's
// depth (kStages - 1 chunks of 16 KB in flight while one is multiplied), the bias tile's stride (floats: 33 units,
// so the accumulator stores are conflict-free), the widest rank it takes, and the exponent the split scales every
// request's largest |v| to (hi / lo stay normal numbers in fp16).
constexpr int kRKm = 64;
constexpr int kWtStrideM = kRKm + 8;
// An fp8 W2 (e4m3) lands in its own ring of raw chunks, kRKm bytes a row (unpadded: a quarter-warp copies or reads
// the 4 units of two rows, 8 different bank groups), and each chunk is widened to bf16 (exactly: e4m3 is a subset of
// bf16) into one [kTileRows][kWtStrideM] buffer the MMAs read (widen_chunk).
constexpr int kRawStride8 = kRKm;
constexpr int kStages = 3;
// The vanilla prologue's dependent reads, in batches a lane issues before it uses the first, so that a warp waits
// one round trip per batch, not one per read: kMergeLoads of the slices' keys, kRowBatch of W1's rows.
constexpr int kMergeLoads = 10;
constexpr int kRowBatch = 4;
static_assert(kMaxGroup <= 32 * kWarps, "the merge gives each of a warp's requests at least one lane");
constexpr int kLtStrideM = kTileRows + 4;
// Threads a CTA of the kernel for register tile NBT: 32 kWideWarps for the tensor-core sweep's 64-request tile (8:
// two sets of 4 row warps, each multiplying half of the group's requests; 4: one set, the whole tile a warp), else
// 128. The plan's group decides the tile (launch_w2): NBT = 64 exactly when the group has more than 32 requests.
constexpr int kWideWarps = 8;
static_assert(kWideWarps == 4 || kWideWarps == 8, "one or two sets of row warps");
DSPARK_HOST_DEVICE_FN constexpr int cta_threads(int nbt, bool mma) {
  return mma && nbt > 32 ? 32 * kWideWarps : kThreads;
}
constexpr int64_t kMaxMmaRank = 2048;
constexpr int kSplitExp = 14;
// Shared memory the plan leaves below the device's per-block maximum for the kernel's static arrays (under 2 KB).
constexpr size_t kStaticSmemReserve = 4096;

enum Head : int { kVanilla = 0, kGated = 1, kRnn = 2 };

struct DraftBlockParams {
  const void* base;  // U [N, K, V]
  DType base_dtype;
  const void* anchors;  // [N] int32 or int64
  bool anchors_int64;
  int head;  // Head
  const void* w1;  // [VT, R]
  DType w1_dtype;
  const void* w2;  // [V, R]
  DType w2_dtype;  // a float dtype, or kFloat8E4M3 with w2_scale
  const float* w2_scale;  // [V]: per-row scales of an fp8 W2 (bias_j = w2_scale[j] * (W2_j . v)), else null
  const void* d2t;  // [V] int32 or int64 target ids of the draft ids, or null (the identity; VT = V)
  bool d2t_int64;
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
  rng::Key rng_key;
  int64_t N, K, V, R, D;
  int64_t VT;         // W1's rows (the target vocabulary)
  int64_t* tokens;    // [N, K]
  float* logprobs;    // [N, K]
  float* logits;      // [N, K, V] or null
  float* conf;        // [N, K] or null
  float* survival;    // [N, K] or null
  int64_t top_k;          // 0: the full proposal; else top-k proposals (draft_block_topk.cuh)
  int64_t* candidates;    // [N, K, top_k] the target ids of the sparse logits' columns, or null
};

// The launch shape, decided on the host from the shapes and the device (the same code in both builds).
struct Plan {
  bool mma;           // the tensor-core sweep (16-bit W2, R <= kMaxMmaRank)
  int grid;           // CTAs (all resident): slices x lanes
  int slices;         // vocabulary slices of the sweep (CTA b sweeps slice b % slices)
  int lanes;          // request lanes: CTA b sweeps request groups b / slices, + lanes, ... of its slice
  int group;          // requests per sweep group (NB)
  int64_t vrows;      // the group's rows in the v and bias tiles (the tensor-core sweep pads it to 8)
  int threads;        // a CTA's (cta_threads of the group)
  int tpr;            // threads folding each request of a group (a power of two, tpr * group <= threads)
  int64_t rows_item;  // phase-1b output rows per item
  int64_t rpad;       // R rounded up to kRK
  bool stage_u;       // the tensor-core sweep stages U's tiles through its cp.async ring (UStage)
  int uslots;         // U tiles the ring holds (the fewest that no copy overwrites a tile still being folded)
  size_t smem;        // dynamic shared memory
  // dynamic shared memory layout (float offsets)
  int64_t off_wt, off_l, off_temp, off_scale, off_u;
};


// A request group's v rows in shared memory as the tensor-core sweep's B operand (split_group writes them,
// mma_chunk reads them): the hi rows, then the lo rows lo_off elements on, each stored as k-blocks of 16 columns,
// kbs = 16 vrows + 16 elements apart. Row n's 16 columns of a block are 32 contiguous bytes, their 16-byte halves
// swapped when n & 4, so the 8 rows of an ldmatrix matrix (32 bytes apart) hit 8 different 16-byte bank groups; the
// blocks start 32 bytes apart mod 128, so do a warp's 16-byte stores of one row's consecutive units. The 8 requests
// of MMA block f sit at a constant offset (128 f elements) from block 0's, and a k-step moves on by kbs: the k-step
// loop's addresses are immediates. vt_elements leaves room for a block read past vrows (up to kMaxGroup rows: the
// sweep multiplies all of its register tile's blocks and keeps the first vrows / 8).
struct VTile {
  int kbs;         // elements per k-block
  int64_t lo_off;  // elements from the hi rows to the lo rows
  DSPARK_HOST_DEVICE_FN int64_t at(int n, int64_t c) const {
    return (c >> 4) * kbs + 16 * n + ((((c >> 3) ^ (n >> 2)) & 1) << 3) + (c & 7);
  }
};
DSPARK_HOST_DEVICE_FN VTile vtile(int64_t vrows, int64_t rpad) {
  const int kbs = static_cast<int>(16 * vrows + 16);
  return VTile{kbs, rpad / 16 * kbs};
}
DSPARK_HOST_DEVICE_FN int64_t vt_elements(int64_t vrows, int64_t rpad) {
  return 2 * vtile(vrows, rpad).lo_off + 16 * (vrows < kMaxGroup ? kMaxGroup - vrows : 0);
}

DSPARK_HOST_DEVICE_FN size_t dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kFloat8E4M3 ? 1 : 2);
}

// The DType of a tensor-core operand type (bf16 or fp16).
template <typename TW>
DSPARK_HOST_DEVICE_FN constexpr DType mma_dtype() {
  return std::is_same<TW, __half>::value ? DType::kFloat16 : DType::kBFloat16;
}

// CTA b's vocabulary slice [v0, v1) of G slices: whole groups of 16 tokens (four Philox calls' words; one 32-byte
// sector of a 16-bit row of U, two of an fp32 row), spread as evenly as that allows, so the slices start at
// multiples of 16 (on sector boundaries when U's rows are) and differ by at most 16 rows.
DSPARK_HOST_DEVICE_FN void slice_bounds(int64_t V, int64_t G, int64_t b, int64_t& v0, int64_t& v1) {
  const int64_t units = (V + 15) / 16;
  v0 = 16 * (b * units / G);
  v1 = 16 * ((b + 1) * units / G);
  if (v1 > V) v1 = V;
}

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
  float* v;         // [N, R]: the head's vector of the current position (gated, rnn)
  float* e;         // [N, R]: e = W1[x] of the current position (gated, rnn)
  float* state;     // [2, N, R]: the rnn state, ping-pong (rnn only)
  Part* parts;      // [2, slices, N]: the split-V partials of position k in buffer k & 1
  uint64_t* keys;   // [2, slices, N]: their winners, packed (pack_winner)
};

DSPARK_DEVICE int64_t part_at(int64_t k, int slices, int64_t N, int64_t slice, int64_t n) {
  return ((k & 1) * slices + slice) * N + n;
}


DSPARK_DEVICE int64_t anchor_of(const DraftBlockParams& p, int64_t n) {
  return p.anchors_int64 ? ldg(static_cast<const int64_t*>(p.anchors) + n)
                         : static_cast<int64_t>(ldg(static_cast<const int32_t*>(p.anchors) + n));
}

// The token of drafted id j: d2t[j] with a draft vocabulary, else j (an index outside [0, V), which no merge
// gives, is passed through unread).
DSPARK_DEVICE int64_t target_id(const DraftBlockParams& p, int64_t j) {
  if (p.d2t == nullptr || j < 0 || j >= p.V) return j;
  return p.d2t_int64 ? ldg(static_cast<const int64_t*>(p.d2t) + j)
                     : static_cast<int64_t>(ldg(static_cast<const int32_t*>(p.d2t) + j));
}

// Request n's partials of position k over the G slices, merged by the whole block (every thread gets the result).
// A thread's two partials a round are both loaded before the first merge (one round trip for up to 2 x blockDim
// slices), and merged in slice order.
DSPARK_DEVICE Part merge_parts(const Workspace& ws, int G, int64_t N, int64_t n, int64_t k, Part* scratch) {
  Part acc = Part::empty();
  const int step = static_cast<int>(blockDim.x);
  for (int i = threadIdx.x; i < G; i += 2 * step) {
    const Part a = ld_coherent(ws.parts + part_at(k, G, N, i, n));
    const Part b = i + step < G ? ld_coherent(ws.parts + part_at(k, G, N, i + step, n)) : Part::empty();
    acc.merge(a);
    if (i + step < G) acc.merge(b);
  }
  return block_allreduce_by_lead(acc, scratch);
}

// e = W1[x] (a zero row for x outside W1's rows) into zs, and into erow when it is not null; the whole block,
// element i by thread i % blockDim (consecutive lanes, consecutive words of zs: no bank conflict).
DSPARK_DEVICE void gather_e(const DraftBlockParams& p, int64_t x, float* zs, float* erow) {
  const bool in = x >= 0 && x < p.VT;
  for (int64_t i = threadIdx.x; i < p.R; i += blockDim.x) {
    const float w = in ? load_float(p.w1, p.w1_dtype, x * p.R + i) : 0.0f;
    zs[i] = w;
    if (erow != nullptr) stg(erow + i, w);
  }
}

// The confidence logit and survival of request n at position k from e in zs (written before a barrier): z =
// w . [h_k; e] + b, survival *= sigmoid(z / T_k). The whole block; no-op without a confidence head.
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

// ------------------------------------------------------------------------------------------------ phase 1a
// Gated / rnn heads, one item per request: the previous position's token and log-probability (k > 0), e = W1[x]
// into the workspace, and the confidence logit and survival of position k.
DSPARK_DRAFT_PHASE void phase_request(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                      float* zs, Part* part_scratch, float* sum_scratch) {
  const int64_t N = p.N, K = p.K;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    int64_t x;
    if (k == 0) {
      x = anchor_of(p, n);
    } else {
      const Part pt = merge_parts(ws, plan.slices, N, n, k - 1, part_scratch);
      x = target_id(p, pt.win.index);
      if (threadIdx.x == 0) {
        stg(p.tokens + n * K + (k - 1), x);
        stg(p.logprobs + n * K + (k - 1), pt.logprob());
      }
    }
    gather_e(p, x, zs, ws.e + n * p.R);
    __syncthreads();
    confidence(p, n, k, zs, sum_scratch);
    __syncthreads();  // zs is reused by the next item
  }
}

// Lanes a request gets when a warp merges nw requests' keys: the largest power of two <= 32 / nw (nw <= 32).
DSPARK_DEVICE int merge_lanes(int nw) {
  int kl = 32;
  while (kl > 1 && kl * nw > 32) kl >>= 1;
  return kl;
}

// The vanilla head's per-position work, done by the CTAs of each lane for its request group [g0, g0 + nb) at the
// start of the group's sweep instead of in a phase of its own (one grid barrier per position instead of two):
// xs[j] = the token before position k of request g0 + j (the anchor, or the winner of position k - 1 over all
// slices: a warp's max of the packed keys), which the sweep reads W1's row of as v; and, for the requests this CTA
// reports (those with n % slices == its slice), the token and log-probability of k - 1 (the merged partial) and the
// confidence logit and survival of k. zs: R floats of scratch.
DSPARK_DEVICE void vanilla_prologue(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                    int64_t g0, int nb, int slice, int64_t* xs, float* zs, Part* part_scratch,
                                    float* sum_scratch) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = static_cast<int>(blockDim.x >> 5);
  const int64_t N = p.N, K = p.K;
  // the warp's requests j = jw + r (r < nw: consecutive requests, so a load instruction reads whole sectors of a
  // slice's keys), kl = 32 / nw lanes each (a power of two): lane sub of request r reads slices sub, sub + kl, ...,
  // kMergeLoads of them a round, all issued before the first is used
  const int per = (nb + nwarps - 1) / nwarps, jw = warp * per;
  const int nw = nb - jw < per ? (nb > jw ? nb - jw : 0) : per;
  const int kl = nw > 0 ? merge_lanes(nw) : 32;
  const int r = lane / kl, sub = lane % kl, j = jw + r;
  const bool mine = r < nw;  // (lanes past the warp's requests read nothing)
  uint64_t key = 0;
  if (k > 0 && nw > 0) {
    const uint64_t* keys = ws.keys + part_at(k - 1, plan.slices, N, 0, g0 + (mine ? j : 0));  // slice s: keys[s N]
#pragma unroll 1
    for (int s0 = sub; s0 < plan.slices; s0 += kl * kMergeLoads) {
      uint64_t o[kMergeLoads];
#pragma unroll
      for (int u = 0; u < kMergeLoads; ++u) {
        const int s = s0 + kl * u;
        o[u] = mine && s < plan.slices ? ld_coherent(keys + s * N) : uint64_t(0);
      }
#pragma unroll
      for (int u = 0; u < kMergeLoads; ++u) key = o[u] > key ? o[u] : key;
    }
    for (int o = 1; o < kl; o <<= 1) {  // over the request's kl lanes (aligned groups of kl)
      const uint64_t other = shfl_xor(key, o);
      key = other > key ? other : key;
    }
  }
  if (mine && sub == 0) xs[j] = k == 0 ? anchor_of(p, g0 + j) : target_id(p, winner_index(key));
  __syncthreads();
  const int first = static_cast<int>((slice - g0 % plan.slices + plan.slices) % plan.slices);
  for (int j = first; j < nb; j += plan.slices) {
    const int64_t n = g0 + j;
    if (k > 0) {
      const Part pt = merge_parts(ws, plan.slices, N, n, k - 1, part_scratch);
      if (t == 0) {
        stg(p.tokens + n * K + (k - 1), xs[j]);
        stg(p.logprobs + n * K + (k - 1), pt.logprob());
      }
    }
    if (p.conf_w != nullptr) {
      gather_e(p, xs[j], zs, nullptr);
      __syncthreads();
      confidence(p, n, k, zs, sum_scratch);
      __syncthreads();  // zs is reused by the next request
    }
  }
}

// Where the sweep reads the v rows of its group: the workspace (phase 1b wrote them: gated, rnn), or W1's rows of
// the group's tokens xs (the vanilla head: v = e), read directly.
struct VRows {
  const float* v;  // [N, R] (gated, rnn) or null (vanilla)
  const void* w1;
  DType w1_dtype;
  int64_t VT, R;
  const int64_t* xs;  // [group] (shared memory)
  DSPARK_DEVICE float at(int64_t g0, int j, int64_t c) const {
    if (v != nullptr) return ld_coherent(v + (g0 + j) * R + c);
    const int64_t x = xs[j];
    return x >= 0 && x < VT ? load_float(w1, w1_dtype, x * R + c) : 0.0f;
  }
};

// The kernel's static shared scratch the sweeps use (the vanilla head's prologue runs in them).
struct SweepScratch {
  int64_t* xs;  // [kMaxGroup]
  Part* parts;  // [32]
  float* sums;  // [32]
};

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
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = static_cast<int>(blockDim.x >> 5);
  const int64_t N = p.N, K = p.K, R = p.R, D = p.D;
  const int64_t width = M == 1 ? D + R : 2 * R + D;
  const int64_t rows_item = plan.rows_item;  // outputs per item (<= kWarps * kOuts <= nwarps * kOuts)
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
        const int jl = warp + q * nwarps;
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
        const int jl = warp + q * nwarps;
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
// Elements i..i+E-1 of a row of U as float32, E = 16 bytes of U's type (4 or 8; n < E of them at the row's end):
// one 16-byte load when `vec` (the element 16-byte aligned), else element loads.
// 16 bytes of U's type as float32 (4 or 8 elements).
DSPARK_DEVICE void unpack_piece(uint4 raw, DType t, float (&out)[8]) {
  if (t == DType::kFloat32) {
    memcpy(out, &raw, 16);
  } else if (t == DType::kBFloat16) {
    __nv_bfloat16 h[8];
    memcpy(h, &raw, 16);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_float(h[e]);
  } else {
    __half h[8];
    memcpy(h, &raw, 16);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_float(h[e]);
  }
}

DSPARK_DEVICE void load_piece(const void* base, DType t, int64_t i, int n, bool vec, float (&out)[8]) {
  if (vec && n == (t == DType::kFloat32 ? 4 : 8)) {
    unpack_piece(ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(base) + int64_t(dtype_size(t)) * i)), t,
                 out);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = e < n ? load_float(base, t, i + e) : 0.0f;
}

// Where thread t of the CTA folds, with `tpr` threads per request (a power of two <= 32) and U pieces of E = 16 bytes
// of U (E = 4 fp32 or 8 16-bit elements): lane l of warp w folds request jf = w (32 / tpr) + l % (32 / tpr) as its
// thread hf = l / (32 / tpr) (a request's threads are lanes 32 / tpr apart: reduce_lanes), taking the tile's
// pieces rank, rank + tpr, ... (the tpr threads of a request together read tpr adjacent 16-byte pieces of U's row
// per step: whole sectors) and reading a 16-bit piece's two float4 halves of its bias row in the order flip,
// 1 - flip. rank and flip are what makes the bias reads conflict-free: the 8 lanes of a quarter-warp read 8
// different 16-byte bank groups (bias rows are kLtStrideM = 132 floats apart, 1 group mod 8; for 16-bit U a piece
// is 2 groups): with tpr <= 4 a quarter-warp holds 8 requests of one hf (jf + const); tpr = 8 pairs hf 2m, 2m + 1
// (4 requests each) on ranks 4 groups apart; tpr = 16 holds 4 hf of 2 requests (16-bit: 2 groups apart as they
// stand; fp32: ranks rotated 2 apart); tpr = 32 holds 8 hf of one request (fp32: 8 ranks; 16-bit: hf 4..7 of the
// quarter read their odd halves first).
struct FoldLane {
  int jf, hf, rank, flip;
};
DSPARK_DEVICE FoldLane fold_lane(int t, int tpr, int E) {
  const int rw = 32 / tpr, lane = t & 31, hf = lane / rw;
  FoldLane f{(t >> 5) * rw + lane % rw, hf, hf, 0};
  if (tpr == 8) f.rank = E == 8 ? (hf & 4) | ((hf & 1) << 1) | ((hf >> 1) & 1) : (hf >> 1) | ((hf & 1) << 2);
  if (tpr == 16 && E == 4) f.rank = ((hf << 1) & 15) | (hf >> 3);
  if (tpr == 32 && E == 8) f.flip = (hf >> 2) & 1;
  return f;
}

// A tile of U in shared memory (the tensor-core sweep's ring, UStage): request j's 128 elements are a row of
// 16-byte units whose unit u is stored at u ^ u_swizzle(j, E), so that the fold's reads of a quarter-warp (the
// lanes and pieces of fold_lane) hit 8 different 16-byte bank groups at every tpr: with tpr <= 4 a quarter-warp
// reads one unit of 8 requests j..j+7 (the swizzle is a permutation of j & 7); with fp32 U (E = 4) tpr = 8 pairs
// ranks 4 apart over requests j & 3 and tpr = 16 ranks of one parity over j & 1; with 16-bit U (E = 8) tpr = 8
// pairs ranks 2 apart over j & 3 (the swizzle keeps bit 1 fixed there) and tpr = 16 four adjacent ranks over j & 1
// (bit 2 flips); tpr = 32 reads 8 units of one request. The copies (consecutive threads, consecutive units of a
// row) are conflict-free too.
DSPARK_HOST_DEVICE_FN int u_swizzle(int j, int E) { return E == 4 ? (j & 7) : ((j & 1) << 2) | ((j >> 1) & 3); }

// The Gumbel race of a quad of logits l of tokens v..v+3 (cnt of them in the row) at temperature temp > 0: the
// scaled logits x = l / temp and their race scores, from one Philox evaluation (its four words are the quad's
// uniforms); -inf past the row's end.
DSPARK_DEVICE void race_quad(const rng::Philox& ph, int64_t n, int64_t k, int64_t v, const float* l, float temp,
                             int cnt, float (&x)[4], float (&sc)[4]) {
  const rng::F32x4 u4 = ph.uniform4(n, k, rng::kStreamDraft, v >> 2);
  const float u[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[e] = e < cnt ? l[e] / temp : neg_inf();
    sc[e] = e < cnt ? gumbel_score(x[e], u[e]) : neg_inf();
  }
}

// Thread `fl` of the tpr threads of request n folds its pieces of a tile into its running partial (fold_lane):
// bias[i] * bscale is the bias of vocabulary row tile0 + i (tile0 a multiple of 16; times w2_scale[row] for an fp8
// W2). It adds U (from the staged
// tile `us` when not null: request fl.jf's row of UStage's tile; else from global memory), writes the logits when
// asked, and folds each quad of 4 rows (Part::add_n) into the argmax (greedy, temp == 0) or the Gumbel race
// winner of logits / temp (race_quad), with the softmax statistics.
DSPARK_DEVICE void fold_pieces(const DraftBlockParams& p, const rng::Philox& ph, int64_t n, int64_t k, int64_t tile0,
                               int rows, const float* bias, float bscale, float temp, const FoldLane& fl, int tpr,
                               const uint4* us, Part& pt) {
  const bool sampled = temp > 0.0f;
  const int64_t row0 = (n * p.K + k) * p.V;
  const int E = p.base_dtype == DType::kFloat32 ? 4 : 8;
  const bool vec = (row0 + tile0) % E == 0 && is_aligned16(p.base);
  const bool vec_out = p.logits != nullptr && row0 % 4 == 0 && is_aligned16(p.logits);
  const int swz = u_swizzle(fl.jf, E);
  for (int i = E * fl.rank; i < rows; i += E * tpr) {
    float l[8];
    if (us != nullptr) {
      const uint4 raw = us[(i >> (E == 4 ? 2 : 3)) ^ swz];  // piece i / E
      unpack_piece(raw, p.base_dtype, l);
    } else {
      load_piece(p.base, p.base_dtype, row0 + tile0 + i, rows - i < E ? rows - i : E, vec, l);
    }
    if (fl.flip) {  // l + 4 q then holds the elements of half q ^ flip
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = l[e];
        l[e] = l[e + 4];
        l[e + 4] = x;
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int qs = q ^ fl.flip, i4 = i + 4 * qs;
      if (4 * qs >= E || i4 >= rows) continue;
      const int64_t v = tile0 + i4;
      const int cnt = rows - i4 < 4 ? rows - i4 : 4;
      float* lq = l + 4 * q;
      const float4 b = *reinterpret_cast<const float4*>(bias + i4);
      if (p.w2_scale == nullptr) {
        lq[0] += b.x * bscale, lq[1] += b.y * bscale, lq[2] += b.z * bscale, lq[3] += b.w * bscale;
      } else {  // an fp8 W2: each row's product times its scale (rows past the tile's end are never folded)
        const float bs[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) lq[e] += e < cnt ? bs[e] * bscale * ldg(p.w2_scale + v + e) : 0.0f;
      }
      if (vec_out && cnt == 4) {
        store_f32x4(p.logits + row0 + v, rng::F32x4{lq[0], lq[1], lq[2], lq[3]});
      } else if (p.logits != nullptr) {
        for (int e = 0; e < cnt; ++e) stg(p.logits + row0 + v + e, lq[e]);
      }
      float x[4], sc[4];  // the scaled logits and scores; -inf past the row's end
      if (sampled) {
        race_quad(ph, n, k, v, lq, temp, cnt, x, sc);
      } else {  // greedy: the scaled logit is the logit (x / 1 = x), its score the logit with NaN as -inf
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[e] = e < cnt ? lq[e] : neg_inf();
          sc[e] = fmaxf(x[e], neg_inf());
        }
      }
      pt.add_n<4>(x, sc, v);
    }
  }
}

// A piece of the greedy fold: x = U + bias * bscale of its 8 logits from unit `unit` of staged 16-bit U (us) and
// the piece's bias row, in fold_lane's half order (f4 = 4: the odd half first, only where kFlip).
template <typename TU, bool kFlip>
DSPARK_DEVICE void greedy_piece(const uint4* us, int unit, const float* bias, int f4, float bscale, float (&x)[8]) {
  const uint4 raw = us[unit];
  const float4 b0 = *reinterpret_cast<const float4*>(bias + (kFlip ? f4 : 0));
  const float4 b1 = *reinterpret_cast<const float4*>(bias + (kFlip ? f4 ^ 4 : 4));
  const bool flip = kFlip && f4 != 0;
  const uint32_t w[4] = {flip ? raw.z : raw.x, flip ? raw.w : raw.y, flip ? raw.x : raw.z,
                         flip ? raw.y : raw.w};  // U's elements in the same half order
  float u[8];
#pragma unroll
  for (int q = 0; q < 4; ++q) widen_pair<TU>(w[q], u[2 * q], u[2 * q + 1]);
  const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = u[e] + b[e] * bscale;
}

// fold_pieces for the common case: greedy, U of 16-bit type TU staged in shared memory (us), a 16-bit W2 (no row
// scales), no logits written. A staged 16-bit U has V % 8 == 0 (make_plan) and slices start at multiples of 16, so
// `rows` is a multiple of 8: whole pieces, nothing masked. A piece of 8 logits at a time (greedy_piece: its halves
// in fold_lane's order where kFlip, else as they stand: the same logits, only the bias reads' banks differ), through
// Part::add_greedy until the partial's maximum is above -inf (its first such piece of the group sweep), then
// through Part::add_greedy_seeded: the piece's maximum (a tree), one test, one FFMA and one MUFU.EX2 a logit.
template <typename TU, bool kFlip>
DSPARK_DEVICE void fold_pieces_greedy(int64_t tile0, int rows, const float* bias, float bscale, const FoldLane& fl,
                                      int tpr, const uint4* us, Part& pt) {
  const int swz = u_swizzle(fl.jf, 8), f4 = kFlip ? 4 * fl.flip : 0, step = 8 * tpr;
  int i = 8 * fl.rank;
  float x[8];
  for (bias += i; i < rows && !(pt.stats.m > neg_inf()); i += step, bias += step) {
    greedy_piece<TU, kFlip>(us, (i >> 3) ^ swz, bias, f4, bscale, x);
    pt.add_greedy<8>(x, fmaxf(max_of(x), neg_inf()), tile0 + i, f4);  // NaN as -inf
  }
  float ml = pt.stats.m * Part::kLog2e;
  for (; i < rows; i += step, bias += step) {
    greedy_piece<TU, kFlip>(us, (i >> 3) ^ swz, bias, f4, bscale, x);
    pt.add_greedy_seeded<8>(x, max_of(x), tile0 + i, f4, ml);  // (NaN only where every x is: never above m)
  }
}

// The merge of the running partials of the `tpr` lanes of each request (lanes 32 / tpr apart: fold_lane); every
// lane of the request gets it.
DSPARK_DEVICE Part reduce_lanes(Part pt, int tpr) {
  for (int o = 32 / tpr; o < 32; o <<= 1) pt.merge(shfl_xor(pt, o));
  return pt;
}

template <typename TW, int NBT>
DSPARK_DRAFT_PHASE void phase_sweep(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                    const rng::Philox& ph, float* smem, const SweepScratch& sc) {
  const int t = threadIdx.x;
  const int64_t N = p.N, V = p.V, R = p.R, rpad = plan.rpad;
  float* vt = smem;                    // [NB, rpad]
  float* wt = smem + plan.off_wt;      // [kThreads, kWtStride]
  float* lt = smem + plan.off_l;       // [NB, kLtStrideM]: the tile's biases
  float* temps = smem + plan.off_temp;  // [NB]: T, or 0 for greedy
  const int slice = static_cast<int>(blockIdx.x) % plan.slices, lane_id = static_cast<int>(blockIdx.x) / plan.slices;
  int64_t v0, v1;
  slice_bounds(V, plan.slices, slice, v0, v1);
  constexpr int kEpv = static_cast<int>(16 / sizeof(TW));  // elements per 16-byte vector
  const TW* w2 = static_cast<const TW*>(p.w2);
  const bool vec = (R * static_cast<int64_t>(sizeof(TW))) % 16 == 0 && is_aligned16(w2);
  const int tpr = plan.tpr;
  const FoldLane fl = fold_lane(t, tpr, p.base_dtype == DType::kFloat32 ? 4 : 8);
  const int jf = fl.jf;  // the request this thread folds
  const bool fused = p.head == kVanilla;  // (the workspace then has no v rows: ws.v is null)
  const VRows vr{ws.v, p.w1, p.w1_dtype, p.VT, R, sc.xs};
  for (int64_t g0 = int64_t(lane_id) * plan.group; g0 < N; g0 += int64_t(plan.lanes) * plan.group) {
    const int nb = static_cast<int>(N - g0 < plan.group ? N - g0 : plan.group);
    __syncthreads();
    if (fused) {
      vanilla_prologue(p, plan, ws, k, g0, nb, slice, sc.xs, vt, sc.parts, sc.sums);
      __syncthreads();
    }
    for (int64_t i = t; i < nb * rpad; i += kThreads) {
      const int64_t j = i / rpad, c = i - j * rpad;
      vt[i] = c < R ? vr.at(g0, static_cast<int>(j), c) : 0.0f;
    }
    for (int j = t; j < nb; j += kThreads) {
      const float temp = p.temperature != nullptr ? ldg(p.temperature + g0 + j) : 0.0f;
      temps[j] = temp > 0.0f ? temp : 0.0f;
    }
    __syncthreads();
    Part pt = Part::empty();
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
            float4* dst = reinterpret_cast<float4*>(wt + row * kWtStride + q * kEpv);  // 16-byte stores: a
            float f[kEpv] = {};                                                       // quarter-warp fills
            if (row < rows && col < R) {                                              // 128 bytes of a row
              const Vec16<TW> w = load16(w2 + (tile0 + row) * R + col);
#pragma unroll
              for (int e = 0; e < kEpv; ++e) f[e] = to_float(w.v[e]);
            }
#pragma unroll
            for (int e = 0; e < kEpv; e += 4) dst[e / 4] = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
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
      // the tile's biases of every request to lt; each thread folds its request's share into its running partial
#pragma unroll
      for (int j = 0; j < NBT; ++j)
        if (j < nb) lt[j * kLtStrideM + t] = acc[j];
      __syncthreads();
      if (jf < nb)
        fold_pieces(p, ph, g0 + jf, k, tile0, rows, lt + jf * kLtStrideM, 1.0f, temps[jf], fl, tpr, nullptr, pt);
    }
    pt = reduce_lanes(pt, tpr);
    if (fl.hf == 0 && jf < nb) {
      stg(ws.parts + part_at(k, plan.slices, N, slice, g0 + jf), pt);
      stg(ws.keys + part_at(k, plan.slices, N, slice, g0 + jf), pack_winner(pt.win));
    }
  }
}

// x ~= hi + lo in a 16-bit type (an infinite or NaN hi carries no lo); true when lo is not zero.
template <typename TW>
DSPARK_DEVICE bool split_store(float x, TW* hi, TW* lo) {
  const TW h = from_float<TW>(x);
  const float hf = to_float(h);
  const TW l = from_float<TW>(hf - hf == 0.0f ? x - hf : 0.0f);
  *hi = h;
  *lo = l;
  return to_float(l) != 0.0f;
}

// The power of two 2^e that brings max |v| = amax to [2^13, 2^14) (e = 0 for 0, inf or NaN), e within [-100, 100].
DSPARK_DEVICE int split_exponent(float amax) {
  int e = 0;
  if (amax > 0.0f && amax < INFINITY) {
    frexpf(amax, &e);
    e = kSplitExp - e;
    e = e < -100 ? -100 : (e > 100 ? 100 : e);
  }
  return e;
}

// split_group's rows j0 + kNW q (q < kRowBatch, rows below nbp; kNW: the CTA's warps) for the vanilla head with W1
// of W2's type (v = W1[xs[j]], a zero row for j >= nb or a token outside [0, VT)) and 16-byte rows: v is already of
// W2's type, so its hi row is W1's row itself (scale 1) and it has no lo row. Lane l copies units l, l + 32, ... of
// each row with one 16-byte load and store each (consecutive lanes, consecutive units: VTile); the batch's loads
// are all issued before its first store, so the warp waits one round trip for the batch, not one for each row.
template <typename TW, int kNW>
DSPARK_DEVICE void copy_rows_w1(const TW* w1, const int64_t* xs, int nb, int nbp, int j0, int64_t VT, int64_t R,
                                int64_t rpad, TW* vt, const VTile& vl, int lane) {
  for (int64_t c = 8 * lane; c < rpad; c += 8 * 32) {
    uint4 raw[kRowBatch];
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) {
      const int j = j0 + kNW * q;
      const int64_t x = j < nb ? xs[j] : -1;
      raw[q] = x >= 0 && x < VT && c < R ? ldg(reinterpret_cast<const uint4*>(w1 + x * R + c))
                                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) {
      const int j = j0 + kNW * q;
      if (j < nbp) *reinterpret_cast<uint4*>(vt + vl.at(j, c)) = raw[q];
    }
  }
}

// split_group's row j of any v (the workspace's float32 rows, or W1's rows of any type), element by element: lane l
// takes elements l + 32 q (held in registers for R <= 512).
template <typename TW>
DSPARK_DEVICE bool split_row_elements(const VRows& vr, int64_t R, int64_t rpad, int64_t g0, int j, TW* vt,
                                      const VTile& vl, float* unscale_j, int lane) {
  bool lo_live = false;
  constexpr int kHold = 16;  // R <= 512: the row stays in registers between the max and the split
  float held[kHold];
  float amax = 0.0f;
  if (R <= 32 * kHold) {
#pragma unroll
    for (int q = 0; q < kHold; ++q) {
      const int64_t c = lane + 32 * q;
      held[q] = c < R ? vr.at(g0, j, c) : 0.0f;
      amax = fmaxf(amax, fabsf(held[q]));
    }
  } else {
    for (int64_t c = lane; c < R; c += 32) amax = fmaxf(amax, fabsf(vr.at(g0, j, c)));
  }
  amax = warp_max(amax);
  const int e = split_exponent(amax);
  const float sc = ldexpf(1.0f, e);
  if (lane == 0) *unscale_j = ldexpf(1.0f, -e);
  if (R <= 32 * kHold) {
#pragma unroll
    for (int q = 0; q < kHold; ++q) {
      const int64_t c = lane + 32 * q;
      if (c < rpad) lo_live |= split_store(held[q] * sc, vt + vl.at(j, c), vt + vl.lo_off + vl.at(j, c));
    }
  } else {
    for (int64_t c = lane; c < rpad; c += 32) {
      const float x = c < R ? vr.at(g0, j, c) * sc : 0.0f;
      lo_live |= split_store(x, vt + vl.at(j, c), vt + vl.lo_off + vl.at(j, c));
    }
  }
  return lo_live;
}

// The group's v rows as hi + lo rows of W2's type in vt (VTile's layout; one warp per request; rows nb..nbp-1 are
// zero): hi = T(v s), lo = T(v s - hi), with s a power of two per request that brings max |v| to [2^13, 2^14)
// (fp16's range; exact, undone on the bias through unscale[j] = 1 / s). Returns whether this thread stored a lo that
// is not zero. The vanilla head's W1 rows of W2's type are v exactly: they are copied as hi rows with s = 1 and no lo
// rows (copy_rows_w1), and the sweep skips the lo products.
template <typename TW, int kNW>
DSPARK_DEVICE bool split_group(const VRows& vr, int64_t R, int64_t rpad, int64_t g0, int nb, int nbp, TW* vt,
                               const VTile& vl, float* unscale, int lane, int warp) {
  if (vr.v == nullptr && vr.w1_dtype == mma_dtype<TW>() && R % 8 == 0 && is_aligned16(vr.w1)) {
    for (int j0 = warp; j0 < nbp; j0 += kNW * kRowBatch) {  // W1's rows as they are
      copy_rows_w1<TW, kNW>(static_cast<const TW*>(vr.w1), vr.xs, nb, nbp, j0, vr.VT, R, rpad, vt, vl, lane);
      if (lane < kRowBatch && j0 + kNW * lane < nb) unscale[j0 + kNW * lane] = 1.0f;
    }
    return false;
  }
  bool lo_live = false;
  for (int j = warp; j < nbp; j += kNW) {  // split rows
    if (j >= nb) {
      for (int64_t c = lane; c < rpad; c += 32) vt[vl.at(j, c)] = vt[vl.lo_off + vl.at(j, c)] = from_float<TW>(0.0f);
      continue;
    }
    lo_live |= split_row_elements(vr, R, rpad, g0, j, vt, vl, unscale + j, lane);
  }
  return lo_live;
}

// The rows of the tile whose first row leaves `left` rows of the slice.
DSPARK_DEVICE int tile_rows(int left) { return left < kTileRows ? left : kTileRows; }

// The staging side's place in a CTA's chunk stream (kStages - 1 chunks ahead of the multiplying side): chunk ci of
// the tile `rows_left` rows before the slice's end (none left: the stream is done), in ring slot `slot`, its tile's
// U in slot `uslot`; moved on by counters (ints: a slice has fewer than 2^31 rows), so it multiplies and divides
// nothing.
struct ChunkCursor {
  int ci, slot, uslot, rows_left;
  DSPARK_DEVICE int rows() const { return tile_rows(rows_left); }
  DSPARK_DEVICE void next(int nchunks, int uslots) {
    if (++slot == kStages) slot = 0;
    if (++ci == nchunks) {
      ci = 0;
      rows_left -= kTileRows;
      if (++uslot == uslots) uslot = 0;
    }
  }
};

// This thread's share of the 16-byte cp.async copies of W2's chunks into the ring (W2's rows 16-byte aligned):
// vector t % kVpr of rows t / kVpr + j * kStep of each chunk of kTileRows x kRKm, zero-filled past the slice or the
// rank (a zero-size copy reads nothing; `any` is a valid address to name). Set up once a group sweep; its source
// moves on by kRKm columns a chunk and to the next tile's rows after a tile's last chunk, so a chunk's copies cost an
// address each and no multiplication (and a predicate each in a slice's last tile and at the rank's end).
template <int kT, typename TW, int kStride>
struct W2Copies {
  static constexpr int kEpv = static_cast<int>(16 / sizeof(TW)), kVpr = kRKm / kEpv, kStep = kT / kVpr;
  static_assert(kTileRows % kStep == 0, "whole passes over a tile's rows");
  const TW* src;       // this thread's first vector of the next chunk
  int64_t row_step;    // kStep rows of W2, in elements
  int64_t tile_jump;   // from a tile's last chunk to the next tile's first, in elements
  int row0, col0;      // this thread's first row and column of a chunk
  DSPARK_DEVICE W2Copies(const TW* w2, int64_t R, int64_t v0, int nchunks, int t)
      : row0(t / kVpr), col0((t % kVpr) * kEpv) {
    src = w2 + (v0 + row0) * R + col0;
    row_step = kStep * R;
    tile_jump = kTileRows * R - int64_t(nchunks - 1) * kRKm;
  }
  // The next chunk into `slot`: `rows` of its tile's rows in the slice, `cols` of W2's columns from its first on.
  DSPARK_DEVICE void issue(TW* slot, int rows, int cols, const TW* any) const {
    TW* d = slot + row0 * kStride + col0;
    if (rows == kTileRows && cols >= kRKm) {  // (every chunk but those of a slice's last tile or the rank's end)
      issue_whole(d);
    } else {
      issue_edge(d, rows, cols, any);
    }
  }
  // A whole chunk: every copy in, no predicate.
  DSPARK_DEVICE void issue_whole(TW* d) const {
    const TW* s = src;
#pragma unroll
    for (int j = 0; j < kTileRows / kStep; ++j, s += row_step, d += kStep * kStride) cp_async<16>(d, s);
  }
  DSPARK_DEVICE void issue_edge(TW* d, int rows, int cols, const TW* any) const {
    const bool col_in = col0 < cols;  // R is a multiple of kEpv here
    const TW* s = src;
#pragma unroll
    for (int j = 0; j < kTileRows / kStep; ++j, s += row_step, d += kStep * kStride) {
      const bool in = col_in && row0 + j * kStep < rows;
      cp_async_zfill<16>(d, in ? s : any, in ? 16 : 0);
    }
  }
  DSPARK_DEVICE void next(bool tile_end) { src += tile_end ? tile_jump : kRKm; }
};

// Chunk ci of W2's tile from row tile0 (`rows` of its kTileRows rows in the slice; columns kRKm * ci on) into a ring
// slot [kTileRows][kStride] by the kT threads, element by element (W2's rows not 16-byte aligned; W2Copies
// otherwise), zero past the slice or the rank.
template <int kT, typename TW, int kStride>
DSPARK_DEVICE void stage_w2_elements(const TW* w2, int64_t R, int64_t rpad, int64_t tile0, int rows, int ci,
                                     TW* slot, int t) {
  const int64_t rc = int64_t(ci) * kRKm;
  const int width = static_cast<int>(rpad - rc < kRKm ? rpad - rc : kRKm);  // a multiple of 32
  for (int i = t; i < kTileRows * width; i += kT) {
    const int row = i / width, q = i - row * width;
    const int64_t col = rc + q;
    if (row < rows && col < R) {
      slot[row * kStride + q] = ldg(w2 + (tile0 + row) * R + col);
    } else {
      memset(slot + row * kStride + q, 0, sizeof(TW));
    }
  }
}

// U's tiles for the nb requests of the group from g0 at position k, into ring slots [nb][128 elements]
// (u_swizzle's unit order; units past a tile's `rows` zero-filled): 16-byte cp.async copies, the plan has checked
// that U's rows allow them (V a multiple of 16 bytes of U, U 16-byte aligned). Thread t of kT copies unit t % upr of
// the rows of requests t / upr, + kT / upr, ...: set up once a group sweep (UStage), so a tile's copies cost no
// division and a predicate, an address and a cp.async each.
template <int kT, int kRows>
struct UStage {
  const char* src;  // this thread's first copy at the slice's first row v0
  int64_t step;     // bytes between this thread's requests' rows of U
  int lg;           // log2 of U's element size (1: 16-bit, 2: fp32); a row of a tile is 1 << (lg + 3) units
  DSPARK_DEVICE UStage(const DraftBlockParams& p, int64_t g0, int64_t k, int64_t v0, int t) {
    lg = p.base_dtype == DType::kFloat32 ? 2 : 1;
    const int log_upr = lg + 3, E = 16 >> lg;
    const int u = t & ((1 << log_upr) - 1), j0 = t >> log_upr;
    src = static_cast<const char*>(p.base) + ((((g0 + j0) * p.K + k) * p.V + v0 + int64_t(u) * E) << lg);
    step = (int64_t(kT >> log_upr) * p.K * p.V) << lg;
  }
  // The tile `rows` rows from v0 + off into `slot` (`any`: a valid address to name in a zero-size copy). Request j's
  // unit u lands at unit u ^ u_swizzle(j, E) of its row: the same for all of a thread's requests (j + 8) with
  // 16-bit U, so its copies then move on by constant strides.
  DSPARK_DEVICE void tile(int64_t off, int rows, int nb, uint4* slot, const void* any, int t) const {
    const int log_upr = lg + 3, E = 16 >> lg, jstep = kT >> log_upr;
    const int u = t & ((1 << log_upr) - 1), j0 = t >> log_upr;
    const bool in = u * E < rows;
    const char* s = in ? src + (off << lg) : static_cast<const char*>(any);
    const int64_t st = in ? step : 0;
    if (lg == 1) {  // unrolled over the most requests a tile holds (kRows), a predicate each
      constexpr int kJStep = kT >> 4;
      uint4* d = slot + (j0 << 4) + (u ^ u_swizzle(j0, E));
#pragma unroll
      for (int q = 0; q < (kRows + kJStep - 1) / kJStep; ++q, s += st, d += kJStep << 4) {
        if (j0 + q * kJStep < nb) cp_async_zfill<16>(d, s, in ? 16 : 0);
      }
    } else {
      for (int j = j0; j < nb; j += jstep, s += st) {
        cp_async_zfill<16>(slot + (j << log_upr) + (u ^ u_swizzle(j, E)), s, in ? 16 : 0);
      }
    }
  }
};

// A staged fp8 chunk (rows of kRawStride8 bytes, `width` of them used) widened to bf16 rows of kWtStrideM elements:
// 16-byte unit idx = t + kT j (row idx / upr, unit idx % upr) by thread t of kT. With full 64-byte rows a
// quarter-warp reads the 4 units of two rows (8 bank groups) and writes each unit's two bf16 halves to units 9 r +
// 2 q (+1) of rows 144 bytes apart, distinct mod 8: conflict-free (a 32-byte tail chunk, r = 32 mod 64, is 2-way).
template <int kT>
DSPARK_DEVICE void widen_chunk(const __nv_fp8_e4m3* raw, __nv_bfloat16* out, int width, int t) {
  const int upr = width / 16;
  for (int idx = t; idx < kTileRows * upr; idx += kT) {
    const int row = idx / upr, q = 16 * (idx - row * upr);
    const Vec16<__nv_fp8_e4m3> w = *reinterpret_cast<const Vec16<__nv_fp8_e4m3>*>(raw + row * kRawStride8 + q);
    Vec16<__nv_bfloat16> h[2];
#pragma unroll
    for (int e = 0; e < 16; ++e) h[e >> 3].v[e & 7] = __float2bfloat16(to_float(w.v[e]));
    *reinterpret_cast<Vec16<__nv_bfloat16>*>(out + row * kWtStrideM + q) = h[0];
    *reinterpret_cast<Vec16<__nv_bfloat16>*>(out + row * kWtStrideM + q + 8) = h[1];
  }
}

// A warp's tensor-core accumulators (mma_chunk's) to zero.
template <int kFrags>
DSPARK_DEVICE void zero(float (&acc)[2][kFrags][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int f = 0; f < kFrags; ++f)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][f][q] = 0.0f;
}

// This lane's ldmatrix rows for mma_chunk (lane l supplies row l % 8 of matrix l / 8 of an x4 load), as offsets set
// once a group sweep: `a` in a ring slot (row warp w owns rows 32 w.. of the tile, two m16 blocks), `b` and `b_lo` in
// the v tile from the warp's first 8-request block, at the chunk's first k-block (VTile: a chunk kRKm / 16 k-blocks
// on moves by that many kbs). B's matrices: columns 0-7 and 8-15 of the k-step's hi rows (m = 0, 1), then (m = 2,
// 3) of the next block's hi rows (`b`, kPairs) or of the lo rows (`b_lo`).
struct MmaLane {
  int a;
  int64_t b, b_lo;
};
DSPARK_DEVICE MmaLane mma_lane(const VTile& vl, int lane, int row_warp, bool pairs) {
  const int j = lane & 7, m = lane >> 3;
  return MmaLane{(row_warp * 32 + (m & 1) * 8 + j) * kWtStrideM + (m >> 1) * 8,
                 vl.at(pairs ? j + 8 * (m >> 1) : j, (m & 1) * 8), vl.at(j, (m & 1) * 8) + (m >> 1) * vl.lo_off};
}

// One staged chunk on tensor cores: the warp's two m16 blocks of rows (A from the ring slot through ldmatrix x4,
// this lane's row at `arow`) times every 8-request block of its register tile (kFrags blocks; B in VTile's layout
// from `brow`, each block at an immediate offset: one ldmatrix x4 gives the hi fragments of two blocks, or with kLo
// the hi and lo fragments of one), over the chunk's `width` columns. The blocks past the group's are multiplied too
// (by whatever vt holds there) and never stored: no test in the loop.
template <typename TW, int kFrags, bool kLo>
DSPARK_DEVICE void mma_chunk(float (&acc)[2][kFrags][4], const TW* arow, const TW* brow, int kbs, int width) {
  constexpr bool kPairs = !kLo && kFrags % 2 == 0;  // x4 loads of two blocks' hi fragments
  constexpr int kB = kPairs ? 2 : 1;                // blocks per B load
  auto k_step = [&](int kk, const TW* bs) {         // columns kk..kk+15 of the chunk (B's k-block at bs)
    uint32_t a[2][4];
    warp::ldmatrix<4>(a[0], arow + kk);
    warp::ldmatrix<4>(a[1], arow + 16 * kWtStrideM + kk);
#pragma unroll
    for (int f = 0; f < kFrags; f += kB) {
      uint32_t b[kLo || kPairs ? 4 : 2];
      warp::ldmatrix<kLo || kPairs ? 4 : 2>(b, bs + 128 * f);
#pragma unroll
      for (int h = 0; h < (kLo || kPairs ? 2 : 1); ++h) {
        const uint32_t bh[2] = {b[2 * h], b[2 * h + 1]};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) warp::mma_m16n8k16<TW>(acc[mt][kPairs ? f + h : f], a[mt], bh);
      }
    }
  };
  // k-steps a SASS iteration (bench/sass_draft.py counts them): a whole 64-column chunk's four where a warp has at
  // most 4 blocks and no lo products (the common case; a 32-column last chunk skips the second two by a uniform
  // branch), else two for up to 4 blocks a warp, one for 8 (two spill at 255 registers). One call site of k_step,
  // so that the line info of its inlined copies names the loop they sit in.
  constexpr int kSteps = !kLo && kFrags <= 4 ? kRKm / 16 : (kFrags > 4 ? 1 : 2);
#pragma unroll 1
  for (int kk = 0; kk < width; kk += 16 * kSteps, brow += kSteps * kbs) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      if (ks < 2 || kk + 16 * ks < width) k_step(kk + 16 * ks, brow + ks * kbs);  // (width: a multiple of 32)
    }
  }
}

// The tensor-core sweep for a 16-bit W2 (bf16 / fp16; TS = TW) or an fp8 one (TS = e4m3 staged raw and widened to
// TW = bf16 per chunk: widen_chunk), per request group (NBT a multiple of 8; the group pads to it with zero rows):
// the group's v rows split into hi + lo rows (split_group); the CTA's W2 slice streams through
// a kStages-deep cp.async ring of [kTileRows x kRKm columns] chunks, kStages - 1 chunks in flight while one is
// multiplied (mma_chunk); after a tile's last chunk the accumulators go to a shared [NB][kLtStrideM] bias tile and
// every thread folds its request's share (fold_pieces) into its running partial, kept in registers across the
// slice: one reduction per request (over its plan.tpr threads) and slice. With 8 warps (cta_threads) warp w
// multiplies the tile's rows of row warp w % 4 by the requests of half w / 4 of the register tile: every W2 chunk
// still comes on chip once, and each scheduler has two warps to issue from.
template <typename TW, int NBT, typename TS>
DSPARK_DRAFT_PHASE void phase_sweep_mma(const DraftBlockParams& p, const Plan& plan, const Workspace& ws, int64_t k,
                                        const rng::Philox& ph, float* smem, const SweepScratch& sc) {
  static_assert(NBT % 8 == 0, "the request group pads to the MMA's N");
  constexpr int kT = cta_threads(NBT, true), kHalves = kT / kThreads;
  static_assert(NBT % (8 * kHalves) == 0, "each half of the register tile is whole MMA blocks");
  constexpr int kFrags = NBT / 8 / kHalves;  // a warp's blocks of 8 requests
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, row_warp = warp % kWarps;
  const int block0 = (warp / kWarps) * kFrags;  // the warp's first block
  const int64_t N = p.N, V = p.V, R = p.R, rpad = plan.rpad;
  const VTile vl = vtile(plan.vrows, rpad);
  TW* vt = reinterpret_cast<TW*>(smem);                // hi rows, then lo rows (VTile)
  constexpr bool kWiden = !std::is_same<TS, TW>::value;  // an fp8 W2
  constexpr int kSlotStride = kWiden ? kRawStride8 : kWtStrideM;
  TS* ring = reinterpret_cast<TS*>(smem + plan.off_wt);  // [kStages][kTileRows][kSlotStride]
  TW* wide = reinterpret_cast<TW*>(ring + kStages * kTileRows * kSlotStride);  // [kTileRows][kWtStrideM] (kWiden)
  float* lt = smem + plan.off_l;                       // [vrows][kLtStrideM]: the tile's biases
  float* temps = smem + plan.off_temp;                 // [NB]: T, or 0 for greedy
  float* unscale = smem + plan.off_scale;              // [NB]: 1 / s
  const int slice = static_cast<int>(blockIdx.x) % plan.slices, lane_id = static_cast<int>(blockIdx.x) / plan.slices;
  int64_t v0, v1;
  slice_bounds(V, plan.slices, slice, v0, v1);
  const int nchunks = static_cast<int>((rpad + kRKm - 1) / kRKm);
  const int slice_rows = static_cast<int>(v1 - v0), rpad_i = static_cast<int>(rpad), r_i = static_cast<int>(R);
  const TS* w2 = static_cast<const TS*>(p.w2);
  const bool vec = (R * static_cast<int64_t>(sizeof(TS))) % 16 == 0 && is_aligned16(w2);
  const int tpr = plan.tpr, uslots = plan.uslots, group = plan.group;
  const bool stage_u = plan.stage_u;
  const FoldLane fl = fold_lane(t, tpr, p.base_dtype == DType::kFloat32 ? 4 : 8);
  const int jf = fl.jf;  // the request this thread folds
  const int slot_elems = kTileRows * kSlotStride;
  uint4* uring = reinterpret_cast<uint4*>(smem + plan.off_u);  // [uslots][group][128 elements of U] (stage_u)
  const int urow_units = kTileRows * static_cast<int>(dtype_size(p.base_dtype)) / 16;  // a request's row of a U tile
  const int uslot_units = group * urow_units;
  const uint4* umine = uring + jf * urow_units;  // this thread's request's row of U slot 0
  const bool fused = p.head == kVanilla;  // (the workspace then has no v rows: ws.v is null)
  const VRows vr{ws.v, p.w1, p.w1_dtype, p.VT, R, sc.xs};
  // fold_pieces_greedy's case, but for the temperature: U staged and of W2's 16-bit type, no row scales, no logits
  const bool fast_fold = stage_u && p.base_dtype == mma_dtype<TW>() && p.w2_scale == nullptr && p.logits == nullptr;
  constexpr bool kPairs = kFrags % 2 == 0;  // (mma_chunk's, without lo products)
  const MmaLane ml = mma_lane(vl, lane, row_warp, kPairs);
  const TW* vb = vt + 128 * block0;  // the warp's first block of the v tile
  const int kblocks_chunk = kRKm / 16 * vl.kbs;  // a chunk's k-blocks of the v tile
  for (int64_t g0 = int64_t(lane_id) * group; g0 < N; g0 += int64_t(plan.lanes) * group) {
    const int nb = static_cast<int>(N - g0 < group ? N - g0 : group);
    const int nbp = (nb + 7) / 8 * 8;
    // the chunk at `at` into its ring slot, and with a tile's last chunk the tile's U (stage_u), in one commit
    // group; then `at` moves on
    ChunkCursor at{0, 0, 0, slice_rows};
    W2Copies<kT, TS, kSlotStride> w2c(w2, R, v0, nchunks, t);
    const UStage<kT, NBT> ust(p, g0, k, v0, t);
    auto stage = [&]() {
      if (at.rows_left > 0) {
        const bool tile_end = at.ci == nchunks - 1;
        TS* slot = ring + at.slot * slot_elems;
        if (vec) {
          w2c.issue(slot, at.rows(), r_i - at.ci * kRKm, w2);
        } else {
          stage_w2_elements<kT, TS, kSlotStride>(w2, R, rpad, v1 - at.rows_left, at.rows(), at.ci, slot, t);
        }
        if (stage_u && tile_end) ust.tile(slice_rows - at.rows_left, at.rows(), nb, uring + at.uslot * uslot_units,
                                          p.base, t);
        w2c.next(tile_end);
      }
      cp_async_commit();
      at.next(nchunks, uslots);
    };
    __syncthreads();  // the previous group is done with vt, the ring, the U slots and lt
    for (int s = 0; s < kStages - 1; ++s) stage();  // the ring's first chunks fly while v is split
    if (fused) {  // (the vt area is its scratch until the split)
      vanilla_prologue(p, plan, ws, k, g0, nb, slice, sc.xs, smem, sc.parts, sc.sums);
      __syncthreads();
    }
    const bool lo_mine = split_group<TW, kT / 32>(vr, R, rpad, g0, nb, nbp, vt, vl, unscale, lane, warp);
    for (int j = t; j < nb; j += kT) {
      const float temp = p.temperature != nullptr ? ldg(p.temperature + g0 + j) : 0.0f;
      temps[j] = temp > 0.0f ? temp : 0.0f;
    }
    // the split is done (and whether any lo row is not zero), the temperatures and scales are in place
    const bool lo_live = __syncthreads_or(lo_mine);
    const float temp = jf < nb ? temps[jf] : 0.0f, bscale = jf < nb ? unscale[jf] : 0.0f;
    const bool greedy = fast_fold && temp == 0.0f;
    Part pt = Part::empty();
    int slot = 0;  // the ring slot of the chunk being multiplied
    for (int left = slice_rows, uslot = 0; left > 0; left -= kTileRows, uslot = uslot + 1 < uslots ? uslot + 1 : 0) {
      float acc[2][kFrags][4];
      zero(acc);
      const TW* b = vb;
#pragma unroll 1
      for (int ci = 0; ci < nchunks; ++ci, b += kblocks_chunk, slot = slot + 1 == kStages ? 0 : slot + 1) {
        cp_async_wait<kStages - 2>();  // chunk ci has landed (this thread's copies) ...
        __syncthreads();               // ... and everyone's; the slot before its slot is free again
        stage();                       // the chunk kStages - 1 on
        const int width = rpad_i - ci * kRKm < kRKm ? rpad_i - ci * kRKm : kRKm;
        const TW* chunk;
        if constexpr (kWiden) {
          widen_chunk<kT>(ring + slot * slot_elems, wide, width, t);
          __syncthreads();
          chunk = wide;
        } else {
          chunk = ring + slot * slot_elems;
        }
        if (lo_live) {  // block-uniform: a loop without the lo products' predicates when every lo row is zero
          mma_chunk<TW, kFrags, true>(acc, chunk + ml.a, b + ml.b_lo, vl.kbs, width);
        } else {
          mma_chunk<TW, kFrags, false>(acc, chunk + ml.a, b + ml.b, vl.kbs, width);
        }
      }
      const int64_t tile0 = v1 - left;
      const int rows = tile_rows(left);
      const int g = lane >> 2, tq = lane & 3;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int f = 0; f < kFrags; ++f)
          if ((block0 + f) * 8 < nb)
#pragma unroll
            for (int q = 0; q < 4; ++q)
              lt[((block0 + f) * 8 + 2 * tq + (q & 1)) * kLtStrideM + row_warp * 32 + mt * 16 + g + 8 * (q >> 1)] =
                  acc[mt][f][q];
      __syncthreads();
      if (jf < nb) {
        const uint4* us = stage_u ? umine + uslot * uslot_units : nullptr;
        if (greedy) {
          // (the halves swapped only at tpr = 32, a group of at most 4: the 8-request tile's)
          fold_pieces_greedy<TW, NBT == 8>(tile0, rows, lt + jf * kLtStrideM, bscale, fl, tpr, us, pt);
        } else {
          fold_pieces(p, ph, g0 + jf, k, tile0, rows, lt + jf * kLtStrideM, bscale, temp, fl, tpr, us, pt);
        }
      }
    }
    pt = reduce_lanes(pt, tpr);
    if (fl.hf == 0 && jf < nb) {
      stg(ws.parts + part_at(k, plan.slices, N, slice, g0 + jf), pt);
      stg(ws.keys + part_at(k, plan.slices, N, slice, g0 + jf), pack_winner(pt.win));
    }
  }
  cp_async_wait_all();
}

// The tensor cores' operand type for a W2 stored as TS: TS itself (bf16 / fp16), bf16 for fp8 (widened per chunk).
template <typename TS>
using MmaType = std::conditional_t<std::is_same<TS, __nv_fp8_e4m3>::value, __nv_bfloat16, TS>;

template <typename TS, int NBT, bool kMma>
__global__ void __launch_bounds__(cta_threads(NBT, kMma), 1)
    draft_block_kernel(DraftBlockParams p, Plan plan, Workspace ws) {
  DSPARK_DYNAMIC_SMEM(unsigned char, smem_raw);
  float* smem = reinterpret_cast<float*>(smem_raw + ((32u - (reinterpret_cast<uintptr_t>(smem_raw) & 31u)) & 31u));
  DSPARK_SHARED_ARRAY(Part, part_scratch, 32);
  DSPARK_SHARED_ARRAY(float, sum_scratch, 32);
  DSPARK_SHARED_ARRAY(int64_t, xs, kMaxGroup);
  DSPARK_SHARED(rng::Philox, ph_s);
  if (threadIdx.x == 0) ph_s = p.temperature != nullptr ? rng::load_philox(p.rng_key) : rng::Philox::make(0, 0);
  __syncthreads();
  const rng::Philox ph = ph_s;
  const SweepScratch sc{xs, part_scratch, sum_scratch};
  for (int64_t k = 0; k < p.K; ++k) {
    if (p.head != kVanilla) {  // (the vanilla head's per-request work runs at the start of the sweep)
      phase_request(p, plan, ws, k, smem, part_scratch, sum_scratch);
      grid_sync();
      if (p.head == kGated) {
        phase_matvec<1>(p, plan, ws, k, smem);
      } else {
        phase_matvec<3>(p, plan, ws, k, smem);
      }
      grid_sync();
    }
    if constexpr (kMma) {
      phase_sweep_mma<MmaType<TS>, NBT, TS>(p, plan, ws, k, ph, smem, sc);
    } else {
      phase_sweep<TS, NBT>(p, plan, ws, k, ph, smem, sc);
    }
    grid_sync();
  }
  for (int64_t n = blockIdx.x; n < p.N; n += gridDim.x) {  // the last position's tokens
    const Part pt = merge_parts(ws, plan.slices, p.N, n, p.K - 1, part_scratch);
    if (threadIdx.x == 0) {
      stg(p.tokens + n * p.K + (p.K - 1), target_id(p, pt.win.index));
      stg(p.logprobs + n * p.K + (p.K - 1), pt.logprob());
    }
  }
}
#endif  // __CUDACC__ || DSPARK_SIMT

// ------------------------------------------------------------------------------------------------ host side
inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// The launch shape for `sms` multiprocessors holding `per_sm` CTAs each (per_sm from the occupancy of `smem`), a
// block allowed `smem_cap` bytes of shared memory (0: size only what does not depend on it).
inline Plan make_plan(const DraftBlockParams& p, int sms, int per_sm, size_t smem_cap) {
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
  // the v rows of a group: float32 (FMA sweep) or hi + lo 16-bit rows padded to 8 requests (VTile)
  pl.vrows = pl.mma ? round_up(pl.group, 8) : pl.group;
  pl.threads = cta_threads(pl.group, pl.mma);
  int tpr = 32;
  while (tpr > 1 && int64_t(tpr) * pl.group > pl.threads) tpr >>= 1;
  pl.tpr = tpr;
  const int64_t vfloats = pl.mma ? vt_elements(pl.vrows, pl.rpad) / 2 : pl.vrows * pl.rpad;
  const int64_t area = std::max<int64_t>({vfloats, R, int64_t(kZGroup) * kZStride + m * max_rows * kCC});
  pl.off_wt = round_up(area, 8);  // 32-byte aligned
  // the tensor-core ring: kStages 16-bit slots, or (fp8) kStages raw slots and the widened chunk
  const int64_t ring_bytes = p.w2_dtype == DType::kFloat8E4M3
                                 ? int64_t(kStages) * kTileRows * kRawStride8 + int64_t(kTileRows) * kWtStrideM * 2
                                 : int64_t(kStages) * kTileRows * kWtStrideM * 2;
  pl.off_l = pl.off_wt + (pl.mma ? round_up(ring_bytes / 4, 8) : int64_t(kThreads) * kWtStride);
  pl.off_temp = pl.off_l + pl.vrows * kLtStrideM;
  pl.off_scale = pl.off_temp + round_up(pl.group, 4);
  pl.off_u = pl.off_scale + round_up(pl.group, 4);
  // + 32 bytes: the kernel aligns the dynamic shared memory's start to 32 bytes
  pl.smem = static_cast<size_t>(pl.off_u) * sizeof(float) + 32;
  // U's tiles through the ring when its rows allow 16-byte copies and the slots fit: a tile is copied with the W2
  // chunk kStages - 1 chunks before the tile's fold, so the slot of tile t is free once tile t - uslots is folded
  const int64_t nchunks = (pl.rpad + kRKm - 1) / kRKm;
  const int64_t u_elems = 16 / int64_t(dtype_size(p.base_dtype));
  pl.uslots = static_cast<int>((kStages - 1) / nchunks + 1);
  const size_t u_bytes = size_t(pl.uslots) * size_t(pl.group) * kTileRows * dtype_size(p.base_dtype);
  pl.stage_u = pl.mma && p.V % u_elems == 0 && is_aligned16(p.base) &&
               pl.smem + u_bytes + kStaticSmemReserve <= smem_cap;
  if (pl.stage_u) pl.smem += u_bytes;
  // CTAs: the resident ones as slices x lanes. Each request group has a lane of CTAs, one per vocabulary slice (at
  // least kMinRowsPerCta rows each); the lanes of a slice stream the same W2 rows side by side, so W2 comes from
  // DRAM once per position and is re-read from L2 by the other lanes. One lane (every resident CTA a slice) while
  // N fits one group; at N = 256 (r = 256: 4 groups of 64) 33 slices x 4 lanes on 132 SMs; past `resident` groups
  // a lane takes several. The v rows a CTA reads per position (its groups', r * 4 bytes each) come from L2: the
  // phase before wrote them.
  const int64_t sweep_groups = (std::max<int64_t>(N, 1) + pl.group - 1) / pl.group;
  const int64_t max_slices = std::max<int64_t>(1, V / kMinRowsPerCta);
  int64_t lanes = 1, slices = 1;
  auto grid_of = [&](int64_t resident) {
    lanes = std::min(sweep_groups, resident);
    slices = std::min(max_slices, std::max<int64_t>(1, resident / lanes));
    lanes = std::min(sweep_groups, std::max<int64_t>(1, resident / slices));
  };
  const int64_t per = std::max(1, per_sm < kMaxCtasPerSm ? per_sm : kMaxCtasPerSm);
  grid_of(int64_t(sms) * per);
  if (per > 1) {  // stacked: the reads besides the W2 slice, against it
    const int64_t w2_row = R * int64_t(dtype_size(p.w2_dtype)) + (p.w2_scale != nullptr ? 4 : 0);
    const int64_t v_row = R * (p.head == kVanilla ? int64_t(dtype_size(p.w1_dtype)) : 4);
    if (kExtraShare * pl.group * (v_row + 8 * slices) * slices > V * w2_row) grid_of(sms);
  }
  pl.slices = static_cast<int>(slices);
  pl.lanes = static_cast<int>(lanes);
  pl.grid = static_cast<int>(slices * lanes);
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
  return size_t(round_up(int64_t(v * (p.head == kVanilla ? 0 : p.head == kGated ? 2 : 4)), 8));
}
inline size_t workspace_bytes_for(const DraftBlockParams& p, const Plan& pl) {
  return workspace_floats_before_parts(p) * 4 + 2 * size_t(pl.slices) * size_t(p.N) * (sizeof(Part) + 8);
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
template <typename TW, int NBT, bool kMma>
inline cudaError_t launch_typed(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  auto kernel = draft_block_kernel<TW, NBT, kMma>;
  // the plan's shared memory does not depend on the occupancy: size it first, then ask how many CTAs fit
  const size_t cap = device_max_smem_per_block();
  Plan pl = make_plan(p, device_sm_count(), 1, cap);
  // always, not only above 48 KB: the default limit counts the static shared memory too
  const cudaError_t err = set_max_dynamic_smem(kernel, pl.smem);
  if (err != cudaSuccess) return err;
  if (pl.threads != cta_threads(NBT, kMma)) return cudaErrorInvalidConfiguration;  // (launch_w2 picks NBT so)
  const int per_sm = max_active_blocks_per_sm(kernel, pl.threads, pl.smem);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  pl = make_plan(p, device_sm_count(), per_sm, cap);
  if (out_plan != nullptr) *out_plan = pl;
  if (workspace == nullptr) return cudaSuccess;  // a size query
  Workspace ws;
  float* base = static_cast<float*>(workspace);
  const int64_t v = p.N * p.R;
  const bool rows = p.head != kVanilla;  // the vanilla head keeps no rows in the workspace
  ws.v = rows ? base : nullptr;
  ws.e = rows ? base + v : nullptr;
  ws.state = rows ? base + 2 * v : nullptr;
  ws.parts = reinterpret_cast<Part*>(base + workspace_floats_before_parts(p));
  ws.keys = reinterpret_cast<uint64_t*>(ws.parts + 2 * int64_t(pl.slices) * p.N);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(pl.grid));
  cfg.block = dim3(static_cast<unsigned>(pl.threads));
  cfg.smem = pl.smem;
  cfg.stream = stream;
  cfg.cooperative = true;
  // the name says which sweep runs (the harness records it): tensor cores or the FP32 FMA loop
  return launch(kMma ? "draft_block_kernel[mma]" : "draft_block_kernel[fma]", kernel, cfg, p, pl, ws);
}

template <typename TW>
inline cudaError_t launch_w2(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  const Plan probe = make_plan(p, 1, 1, 0);
  if constexpr (std::is_same<TW, float>::value) {  // float32 W2: the FMA sweep
    if (probe.group <= 8) return launch_typed<TW, 8, false>(p, workspace, stream, out_plan);
    return launch_typed<TW, kMaxGroup, false>(p, workspace, stream, out_plan);
  } else {
    if (!probe.mma) return launch_typed<TW, 8, false>(p, workspace, stream, out_plan);  // R > kMaxMmaRank
    // the register tile: the group rounded up to 8, 16, 32 or 64 requests, so that a small group does not pay a
    // 64-request tile's MMAs and registers (on the H200, N = 16 at a 24-request tile took 10% less than at 64)
    if (probe.group <= 8) return launch_typed<TW, 8, true>(p, workspace, stream, out_plan);
    if (probe.group <= 16) return launch_typed<TW, 16, true>(p, workspace, stream, out_plan);
    if (probe.group <= 32) return launch_typed<TW, 32, true>(p, workspace, stream, out_plan);
    return launch_typed<TW, kMaxGroup, true>(p, workspace, stream, out_plan);
  }
}

inline cudaError_t dispatch(const DraftBlockParams& p, void* workspace, cudaStream_t stream, Plan* out_plan) {
  switch (p.w2_dtype) {
    case DType::kFloat32: return launch_w2<float>(p, workspace, stream, out_plan);
    case DType::kBFloat16: return launch_w2<__nv_bfloat16>(p, workspace, stream, out_plan);
    case DType::kFloat16: return launch_w2<__half>(p, workspace, stream, out_plan);
    case DType::kFloat8E4M3: return launch_w2<__nv_fp8_e4m3>(p, workspace, stream, out_plan);
    default: return cudaErrorInvalidValue;
  }
}
#endif

}  // namespace draft

using draft::DraftBlockParams;

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
namespace draft_topk {  // defined in dspark/draft_block_topk.cuh, included at the end
inline size_t workspace_bytes(const DraftBlockParams& p);
inline cudaError_t dispatch(const DraftBlockParams& p, void* workspace, cudaStream_t stream);
}  // namespace draft_topk

// Workspace the launch needs for `p` on the current device (bytes; 16-byte aligned start required); 0 when no
// launch configuration fits. With top_k > 0 the top-k kernel (dspark/draft_block_topk.cuh) runs instead.
inline size_t draft_block_workspace_bytes(const DraftBlockParams& p) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return 0;
  if (p.top_k > 0) return draft_topk::dispatch(p, nullptr, nullptr) == cudaSuccess ? draft_topk::workspace_bytes(p) : 0;
  draft::Plan pl{};
  if (draft::dispatch(p, nullptr, nullptr, &pl) != cudaSuccess) return 0;
  return draft::workspace_bytes_for(p, pl);
}

// Launch on `stream`; the caller has checked the arguments (shapes, dtypes, K < 2^24, V <= 2^31 - 1).
inline cudaError_t launch_draft_block(const DraftBlockParams& p, void* workspace, cudaStream_t stream) {
  if (p.N <= 0 || p.K <= 0 || p.V <= 0) return cudaSuccess;
  if (p.top_k > 0) return draft_topk::dispatch(p, workspace, stream);
  return draft::dispatch(p, workspace, stream, nullptr);
}
#endif

}  // namespace dspark

#include "draft_block_topk.cuh"
