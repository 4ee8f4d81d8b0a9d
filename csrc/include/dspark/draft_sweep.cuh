// dspark/draft_sweep.cuh: one position of the Markov head over the vocabulary as a skinny matrix product at memory
// speed (no torch). Shared by draft_block (one launch per position: dspark/draft_block.cuh) and dist_draft_step (one
// position on one vocabulary shard: dspark/dist_draft_step.cuh).
//
// For each request n of the batch and each row j of [0, V) (a draft id, or a column of a shard whose global id is
// id_offset + j):
//   logit = U[n][j] + s_j (W2[j] . v_n)         (s_j: an fp8 W2's row scale, else 1; float32 throughout)
// folded per request into a draft::Part on the fly: the argmax (greedy, T <= 0 or NaN) or the Gumbel race of logit / T
// keyed by (n, position, STREAM_DRAFT, id), with the softmax statistics of logit / T (T = 1 for greedy requests), so
// the bias never reaches global memory. v_n is a float32 row (vf) or W1's row of the token before the position: the
// anchor, or the previous position's winner, read from its packed key (prev_keys).
//
// Grid (lanes, slices): CTA (l, s) takes the requests [l G, l G + G) (G: the group) and vocabulary slice s
// (slice_bounds: whole 16-row units). Lanes are the fastest grid dimension, so the lanes of a slice run side by side
// and share its W2 rows through L2 when N needs more than one group. 256 threads (8 warps) a CTA.
//   * sweep_gemv_kernel (N <= kGemvMaxN with a 16-bit or fp8 W2, any N with an fp32 W2 or r > kMaxMmaRank; G = 1, 2,
//     4, 8): CUDA cores. Lane l holds 8 columns of the group's v rows in registers (256 columns a pass: one pass up
//     to r = 256) and reads the same 8 columns of a W2 row with one 16-byte load (8 bytes fp8, 2 x 16 fp32); a warp
//     takes blocks of kRows consecutive rows, the block's loads in flight together (32-64 KB an SM: GemvShape). The
//     block's kRows x G dot products are reduce-scattered across the warp (warp_reduce_scatter), one (row, request)
//     pair on every 32 / (kRows G) lanes, which adds U and folds. U comes in chunks of kGemvChunk rows through
//     shared memory (16-byte cp.async copies, the next chunk's in flight while one is folded).
//   * sweep_mma_kernel (N > kGemvMaxN with a 16-bit or fp8 W2 and r <= kMaxMmaRank; G = 16 .. 256): tensor cores,
//     mma.sync m16n8k16 with the requests as M (A: the group's v rows in shared memory, split into hi + lo rows of
//     W2's 16-bit type unless they are W1's rows of that type) and the tile's W2 rows as N (B: 64-column chunks
//     through a kStages-deep cp.async ring; U's tile rides the ring with the tile's last chunk). Each warp folds its
//     accumulators from registers. A CTA takes up to 256 requests (128 with lo rows), so at N = 256 W2 streams once
//     per position.
// Both issue their first W2 (and U) copies before grid_dependency_wait (W2 and U do not depend on the launch before)
// and end with one Part per (request, CTA), kept as 16-byte records in [slices][N] arrays (a CTA's requests side by
// side): draft_block's sink atomically maxes the packed winner (pack_winner) into keys[n] and writes (m, s, the
// winner's scaled logit; s NaN when a NaN or +inf came); dist_draft_step's writes the whole Part, its statistics
// kept without NaN and +inf (add_column). Every global access of a warp instruction covers whole 32-byte sectors
// where the rows are 16-byte aligned, and every shared-memory access is free of bank conflicts (u_swizzle).
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

constexpr int kSweepThreads = 256;
constexpr int kSweepWarps = kSweepThreads / 32;
constexpr int kGemvMaxN = 4;         // the CUDA-core sweep's batch with a 16-bit or fp8 W2 (G <= 4 there, 8 else)
constexpr int kGemvChunk = 256;      // rows of U a CUDA-core CTA stages at a time
constexpr int64_t kMaxMmaRank = 2048;
constexpr int kMaxCtasPerSm = 2;
constexpr int64_t kMinSliceRows = 64;  // vocabulary rows a CTA at least (one tensor-core tile)
// The tensor-core sweep: vocabulary rows of a tile (64; 32 for 256 requests), W2 columns of a staged chunk, a staged
// 16-bit row's stride (elements: 144 bytes, an odd number of 16-byte units, so the 8 rows of an ldmatrix phase hit
// 8 different bank groups), the ring's depth, and the exponent the split scales each request's largest |v| to (hi and
// lo stay normal numbers in fp16).
constexpr int kTileV = 64;
constexpr int kChunkK = 64;
constexpr int kChunkStride = kChunkK + 8;
constexpr int kStages = 6;
constexpr int kSplitExp = 14;

// Everything one position's sweep reads and writes (the host fills it per launch).
struct SweepParams {
  const void* u;       // U of this position: request n's row at element n * u_stride
  DType u_dtype;
  int64_t u_stride;
  float* logits;       // request n's logits at element n * logits_stride, or null
  int64_t logits_stride;
  const void* w2;      // [V, R]
  DType w2_dtype;      // a float dtype, or kFloat8E4M3 with w2_scale
  const float* w2_scale;  // [V] or null
  int64_t N, V, R;
  bool v_w1;           // v rows are W1's rows of the tokens before the position (else vf's)
  const float* vf;     // [N, R] float32 v rows (v_w1 false)
  const void* w1;      // [VT, R]
  DType w1_dtype;
  int64_t VT;
  const uint64_t* prev_keys;  // [N] the previous position's packed winners, or null: the anchors
  const void* anchors;
  bool anchors_int64;
  const void* d2t;     // [V] target ids of the previous winners (draft ids), or null (the identity)
  bool d2t_int64;
  const float* temperature;  // [N] or null (every request greedy)
  rng::Key rng_key;
  int64_t position;    // the random draws' position
  int64_t id_offset;   // row j's token id (random draws, ties, winners): id_offset + j
  int slices;
  int64_t np;          // padded_requests(N): the records' row length
  // outputs, [slices][np] records: draft_block's (keys non-null) or dist_draft_step's
  uint64_t* keys;      // [N]: atomic max of pack_winner (zeroed before the first position)
  float4* stats;       // draft_block: (m, s, the winner's scaled logit, 0); dist: (winner value, scaled, m, s)
  int2* ids;           // dist: (winner id, bad)
};

// The requests a CTA merging the [slices][Np] records takes (draft_block's finish, dist_draft_step's merge): a power
// of two up to kFinishGroup, its lanes (request l % NB, slice l / NB), so that each load of a warp is contiguous. The
// rows of the records (and of draft_block's packed keys) have Np = padded_requests(N) entries (a multiple of 4 past
// N = 2: whole 32-byte sectors), so that every warp's loads and stores cover whole sectors; the merging lanes read
// the padding too.
constexpr int kFinishGroup = 32;
DSPARK_HOST_DEVICE_FN int64_t padded_requests(int64_t N) { return N <= 2 ? N : (N + 3) / 4 * 4; }
DSPARK_HOST_DEVICE_FN int finish_group(int64_t N) {
  int g = 1;
  while (g < kFinishGroup && g < N) g *= 2;
  return g;
}

// The tensor cores' operand type for a W2 stored as TS: TS itself (bf16 / fp16), bf16 for fp8 (widened per chunk).
template <typename TS>
using MmaType = std::conditional_t<std::is_same<TS, __nv_fp8_e4m3>::value, __nv_bfloat16, TS>;

// The DType of a tensor-core operand type (bf16 or fp16).
template <typename TW>
DSPARK_HOST_DEVICE_FN constexpr DType mma_dtype_of() {
  return std::is_same<TW, __half>::value ? DType::kFloat16 : DType::kBFloat16;
}

DSPARK_HOST_DEVICE_FN size_t dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kFloat8E4M3 ? 1 : 2);
}

// CTA b's vocabulary slice [v0, v1) of G slices: whole units of 16 rows (a sector of a 16-bit row of U), as even
// as that allows.
DSPARK_HOST_DEVICE_FN void slice_bounds(int64_t V, int64_t G, int64_t b, int64_t& v0, int64_t& v1) {
  const int64_t units = (V + 15) / 16;
  v0 = 16 * (b * units / G);
  v1 = 16 * ((b + 1) * units / G);
  if (v1 > V) v1 = V;
}

// The slice of G holding row j (slice_bounds' inverse).
DSPARK_HOST_DEVICE_FN int64_t slice_of(int64_t V, int64_t G, int64_t j) {
  const int64_t units = (V + 15) / 16;
  int64_t b = (j / 16) * G / units;
  int64_t v0, v1;
  for (slice_bounds(V, G, b, v0, v1); j >= v1; slice_bounds(V, G, ++b, v0, v1)) {
  }
  for (; j < v0; slice_bounds(V, G, --b, v0, v1)) {
  }
  return b;
}

// The tensor-core sweep's warp tiling for a group of G requests: kMW x kNW warps, warp (mw, nw) multiplying
// requests 16 kWM mw.. (kWM m16 blocks) by tile rows 8 kWN nw.. (kWN n8 blocks); a tile has kRows = 8 kNW kWN rows
// (64; 32 for 256 requests, whose warps each hold 32 requests x 32 rows of accumulators).
template <int G>
struct MmaShape {
  static constexpr int kWM = G >= 32 ? 2 : 1;
  static constexpr int kMW = G / (16 * kWM);
  static constexpr int kNW = kSweepWarps / kMW;
  static constexpr int kWN = kNW == 1 ? 4 : kTileV / (8 * kNW);
  static constexpr int kRows = 8 * kNW * kWN;
  static_assert(kMW * kNW == kSweepWarps && kRows <= kTileV, "8 warps cover the group and the tile");
};
DSPARK_HOST_DEVICE_FN constexpr int mma_tile_rows(int G) { return G == 256 ? 32 : kTileV; }

// Shared memory of the tensor-core sweep (byte offsets from a 128-byte aligned start; the host sizes it).
struct MmaLayout {
  int64_t rpad;     // R rounded up to the k-step (16)
  int64_t sv;       // elements from one v row to the next (rpad + 8: ldmatrix phases conflict-free)
  int64_t lo;       // bytes from the hi rows to the lo rows, 0: no lo rows
  int64_t ring, wide, u, temps, unscale, parts;
  int uslots;       // U tiles in flight (the fewest that no copy overwrites a tile still being folded)
  size_t bytes;     // dynamic shared memory, the alignment slack included
};

// Parts in shared memory, one array a field, so that consecutive threads touch consecutive words (a Part is 32
// bytes: 8 lanes storing Parts side by side would meet their 16-byte halves in the same banks).
struct PartSlots {
  static constexpr size_t kBytes = 8 + 5 * 4;  // a slot's bytes
  int64_t* index;
  float *value, *scaled, *m, *s;
  int32_t* bad;
  DSPARK_HOST_DEVICE_FN static PartSlots at(void* base, int n) {  // base 8-byte aligned
    PartSlots a;
    a.index = static_cast<int64_t*>(base);
    a.value = reinterpret_cast<float*>(a.index + n);
    a.scaled = a.value + n;
    a.m = a.scaled + n;
    a.s = a.m + n;
    a.bad = reinterpret_cast<int32_t*>(a.s + n);
    return a;
  }
#if defined(__CUDACC__) || defined(DSPARK_SIMT)
  DSPARK_DEVICE void put(int i, const Part& p) const {
    index[i] = p.win.index;
    value[i] = p.win.value;
    scaled[i] = p.scaled;
    m[i] = p.stats.m;
    s[i] = p.stats.s;
    bad[i] = p.bad;
  }
  DSPARK_DEVICE Part get(int i) const {
    return Part{SoftmaxStats{m[i], s[i]}, ArgMax{value[i], index[i]}, scaled[i], bad[i]};
  }
#endif
};

// U rows in shared memory: request j's `units` 16-byte units, unit u stored at u ^ u_swizzle(j), so that the copies
// (a quarter-warp: 8 consecutive units of a row, or 4 of each of two rows when rows have 4) and the folds' reads (the
// same unit of 8 consecutive requests, or 4 requests' 8-byte pairs a half-warp with fp32 U) hit 8 different bank
// groups. 4-unit rows (16-bit U, 32-row tiles): rows j, j + 1 sit 4 units apart, so the even requests' units cycle
// over one half and the odd ones' over the other.
DSPARK_HOST_DEVICE_FN int u_swizzle(int j, int units, bool f32) {
  return units == 4 ? (j >> 1) & 3 : (f32 ? ((j & 3) << 1) | ((j >> 2) & 1) : j & 7);
}
DSPARK_HOST_DEVICE_FN int u_offset(int j, int e, int units, int lg) {  // bytes of element e of row j (lg: log2 size)
  const int epu = 16 >> lg, u = e / epu;
  return (j * units + (u ^ u_swizzle(j, units, lg == 2))) * 16 + ((e - u * epu) << lg);
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// ------------------------------------------------------------------------------------------------ inputs
// The token before the position of request n: its anchor, or the target id of the previous position's winner.
DSPARK_DEVICE int64_t token_before(const SweepParams& p, int64_t n) {
  if (p.prev_keys == nullptr) return load_int(p.anchors, p.anchors_int64, n);
  const int64_t j = winner_index(ldg(p.prev_keys + n));
  return p.d2t == nullptr ? j : load_int(p.d2t, p.d2t_int64, j);
}

// Element c of request n's v row (token x: W1's row, a zero row outside [0, VT)).
DSPARK_DEVICE float v_at(const SweepParams& p, int64_t n, int64_t x, int64_t c) {
  if (!p.v_w1) return ldg(p.vf + n * p.R + c);
  return x >= 0 && x < p.VT ? load_float(p.w1, p.w1_dtype, x * p.R + c) : 0.0f;
}

// Whether U's rows of this position are 16-byte aligned at every 16-row unit (the staging copies are then 16-byte
// cp.async copies; else element copies).
DSPARK_DEVICE bool u_rows_aligned(const SweepParams& p) {
  const int64_t e = static_cast<int64_t>(dtype_size(p.u_dtype));
  return (p.u_stride * e) % 16 == 0 && is_aligned16(p.u);
}

// U's rows [r0, r0 + rows) of requests g0 .. g0 + G - 1 (zero past v1 or nb requests) into a shared tile of
// `units` units a row (u_offset's layout), by the CTA's kSweepThreads threads: 16-byte cp.async copies (consecutive
// threads, consecutive units of a row) where `aligned`, else element copies.
DSPARK_DEVICE void stage_u(const SweepParams& p, int64_t g0, int nb, int G, int64_t r0, int64_t v1, int units,
                           unsigned char* tile, bool aligned, int t) {
  const int lg = p.u_dtype == DType::kFloat32 ? 2 : 1, epu = 16 >> lg;
  const char* base = static_cast<const char*>(p.u);
  if (aligned) {
    for (int i = t; i < G * units; i += kSweepThreads) {
      const int j = i / units, u = i - j * units;
      const int64_t row = r0 + int64_t(u) * epu;
      const bool in = j < nb && row < v1;
      const char* src = in ? base + (((g0 + j) * p.u_stride + row) << lg) : base;
      cp_async_zfill<16>(tile + (j * units + (u ^ u_swizzle(j, units, lg == 2))) * 16, src, in ? 16 : 0);
    }
    return;
  }
  const int rows = units * epu;
  for (int i = t; i < G * rows; i += kSweepThreads) {
    const int j = i / rows, e = i - j * rows;
    const bool in = j < nb && r0 + e < v1;
    const float x = in ? load_float(p.u, p.u_dtype, (g0 + j) * p.u_stride + r0 + e) : 0.0f;
    unsigned char* d = tile + u_offset(j, e, units, lg);
    if (lg == 2) {
      *reinterpret_cast<float*>(d) = x;
    } else if (p.u_dtype == DType::kBFloat16) {
      *reinterpret_cast<__nv_bfloat16*>(d) = __float2bfloat16(x);  // (exact: x is a bf16)
    } else {
      *reinterpret_cast<__half*>(d) = __float2half(x);
    }
  }
}

// Element e of request j's row of a staged U tile as float32.
DSPARK_DEVICE float u_elem(const unsigned char* tile, int j, int e, int units, DType t) {
  const int lg = t == DType::kFloat32 ? 2 : 1;
  const unsigned char* a = tile + u_offset(j, e, units, lg);
  if (lg == 2) return *reinterpret_cast<const float*>(a);
  return t == DType::kBFloat16 ? to_float(*reinterpret_cast<const __nv_bfloat16*>(a))
                               : to_float(*reinterpret_cast<const __half*>(a));
}

// Elements e, e + 1 (e even) of request j's row of a staged U tile: one 4- or 8-byte read.
DSPARK_DEVICE float2 u_pair(const unsigned char* tile, int j, int e, int units, DType t) {
  const int lg = t == DType::kFloat32 ? 2 : 1;
  const unsigned char* a = tile + u_offset(j, e, units, lg);
  if (lg == 2) return *reinterpret_cast<const float2*>(a);
  const uint32_t w = *reinterpret_cast<const uint32_t*>(a);
  float2 f;
  if (t == DType::kBFloat16) {
    widen_pair<__nv_bfloat16>(w, f.x, f.y);
  } else {
    widen_pair<__half>(w, f.x, f.y);
  }
  return f;
}

// ------------------------------------------------------------------------------------------------ the fold
// A column with scaled logit x and NaN-free race key `key` of token id by dist_draft_step's rule: NaN and +inf carry
// no softmax mass and set bad (layout.local_softmax_stats), unlike Part::add (NaN sets bad, +inf is the maximum).
DSPARK_DEVICE void add_column(Part& pt, float x, float key, int64_t id) {
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

// One logit l of request n, token id, into pt: at temperature temp > 0 the race of l / temp (its uniform keyed by
// (n, position, DRAFT, id)), else the argmax of l (NaN as -inf); by dist_draft_step's rule where `dist`.
DSPARK_DEVICE void fold_logit(Part& pt, float l, float temp, const rng::Philox& ph, int64_t n, int64_t position,
                              int64_t id, bool dist) {
  float x = l, key;
  if (temp > 0.0f) {
    x = l / temp;
    key = gumbel_score(x, ph.uniform(n, position, rng::kStreamDraft, id));
  } else {
    key = nan_to_neg_inf(l);
  }
  if (dist) {
    add_column(pt, x, key, id);
  } else {
    pt.add(x, key, id);
  }
}

// Two logits of tokens id, id + 1 (cnt of them in the row) into pt, as fold_logit; the greedy draft_block case in
// one step (Part::add_greedy: a test, and the softmax terms by exp2).
DSPARK_DEVICE void fold_pair(Part& pt, float l0, float l1, int cnt, float temp, const rng::Philox& ph, int64_t n,
                             int64_t position, int64_t id, bool dist) {
  if (dist) {
    fold_logit(pt, l0, temp, ph, n, position, id, true);
    if (cnt > 1) fold_logit(pt, l1, temp, ph, n, position, id + 1, true);
    return;
  }
  float x[2] = {l0, cnt > 1 ? l1 : neg_inf()};
  if (temp > 0.0f) {
    float sc[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      x[e] = e < cnt ? x[e] / temp : neg_inf();
      sc[e] = e < cnt ? gumbel_score(x[e], ph.uniform(n, position, rng::kStreamDraft, id + e)) : neg_inf();
    }
    pt.add_n<2>(x, sc, id);
  } else {
    pt.add_greedy<2>(x, fmaxf(max_of(x), neg_inf()), id, 0);  // (NaN as -inf)
  }
}

// A CTA's Part of request n into the outputs (see the file's comment); the threads of a CTA's requests side by side.
DSPARK_DEVICE void sink(const SweepParams& p, int64_t n, int64_t slice, const Part& pt) {
  const int64_t at = slice * p.np + n;
  if (p.keys == nullptr) {
    stg(p.stats + at, make_float4(pt.win.value, pt.scaled, pt.stats.m, pt.stats.s));
    stg(p.ids + at, make_int2(static_cast<int>(pt.win.index), pt.bad));
    return;
  }
  atomicMax(reinterpret_cast<unsigned long long*>(p.keys + n), static_cast<unsigned long long>(pack_winner(pt.win)));
  stg(p.stats + at, make_float4(pt.stats.m, pt.bad ? NAN : pt.stats.s, pt.scaled, 0.0f));
}

// The temperature a request folds at: T > 0 (sampled), else 0 (greedy; also a negative or NaN T).
DSPARK_DEVICE float fold_temperature(const SweepParams& p, int64_t n) {
  const float t = p.temperature != nullptr ? ldg(p.temperature + n) : 0.0f;
  return t > 0.0f ? t : 0.0f;
}

// Reduce-scatter of kVals per-lane values across a full warp: on lane l, the sum over the 32 lanes of
// a[l kVals / 32] (a is clobbered). log2 kVals halving steps (reduce_halves: each lane keeps the half its partner
// sends; kHalf and its lane offset compile-time, so that a stays in registers), then the rest of a butterfly sum
// (the value's 32 / kVals lanes all end with it). The halves are picked with a bit mask (one LOP3 each), not
// `upper ? a[i] : a[i + half]`, which a compiler may turn into a select of addresses.
template <int kHalf, int kVals>
DSPARK_DEVICE void reduce_halves(float (&a)[kVals], int lane) {
  constexpr int kOff = kHalf * 32 / kVals;
  const uint32_t up = (lane & kOff) != 0 ? 0xffffffffu : 0u;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const uint32_t x = __float_as_uint(a[i]), y = __float_as_uint(a[i + kHalf]);
    const float send = __uint_as_float((x & up) | (y & ~up));
    const float keep = __uint_as_float((y & up) | (x & ~up));
    a[i] = keep + __shfl_xor_sync(kFullMask, send, kOff);
  }
  if constexpr (kHalf > 1) reduce_halves<kHalf / 2>(a, lane);
}

template <int kVals>
DSPARK_DEVICE float warp_reduce_scatter(float (&a)[kVals], int lane) {
  static_assert(kVals >= 1 && kVals <= 32 && (kVals & (kVals - 1)) == 0, "kVals is a power of two <= 32");
  if constexpr (kVals > 1) reduce_halves<kVals / 2>(a, lane);
#pragma unroll
  for (int off = 16 / kVals; off >= 1; off /= 2) a[0] += __shfl_xor_sync(kFullMask, a[0], off);
  return a[0];
}

// ------------------------------------------------------------------------------------------------ CUDA cores
// The columns lane l holds of a 256-column pass: two quads (4 columns each) at q0(l) and q0(l) + gap, so that each
// vector load of a warp covers a contiguous stretch of the row: 16-bit and fp8 W2 8 consecutive columns (one 16- or
// 8-byte load), fp32 W2 columns 4l.. and 128 + 4l.. (two 16-byte loads, each the warp's 512 contiguous bytes).
template <typename TS>
struct LaneCols {
  static constexpr bool kSplit = sizeof(TS) == 4;
  static constexpr int kGap = kSplit ? 128 : 4;
  DSPARK_DEVICE static int q0(int lane) { return kSplit ? 4 * lane : 8 * lane; }
  DSPARK_DEVICE static int col(int lane, int e) { return q0(lane) + (e < 4 ? e : kGap + e - 4); }
};

// Eight elements of a W2 row as stored (LaneCols' columns of lane `lane` from c0, zero past R): vector loads where
// the row allows (vec), else element by element.
template <typename TS>
struct Raw8 {
  static constexpr int kWords = static_cast<int>(sizeof(TS)) * 2;  // 32-bit words: 2 (fp8), 4 (16-bit), 8 (fp32)
  uint32_t w[kWords];
  DSPARK_DEVICE void load(const TS* row, int64_t c0, int lane, int64_t R, bool vec) {
    const int64_t c = c0 + LaneCols<TS>::q0(lane);
    if constexpr (kWords == 8) {  // two quads, 128 columns apart: each a 16-byte load (zero past R)
      if (vec) {
        const uint4 z = make_uint4(0, 0, 0, 0);
        const uint4 x = c + 4 <= R ? ldg(reinterpret_cast<const uint4*>(row + c)) : z;
        const uint4 y = c + 132 <= R ? ldg(reinterpret_cast<const uint4*>(row + c + 128)) : z;
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w, w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
        return;
      }
    } else if (vec && c + 8 <= R) {
      if constexpr (kWords == 2) {
        const uint2 x = ldg(reinterpret_cast<const uint2*>(row + c));
        w[0] = x.x, w[1] = x.y;
      } else {
        const uint4 x = ldg(reinterpret_cast<const uint4*>(row + c));
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
      }
      return;
    }
    TS e[8];
    memset(e, 0, sizeof(e));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t ci = c0 + LaneCols<TS>::col(lane, i);
      if (ci < R) e[i] = ldg(row + ci);
    }
    memcpy(w, e, sizeof(e));
  }
  DSPARK_DEVICE void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  DSPARK_DEVICE void widen(float (&f)[8]) const {
    if constexpr (std::is_same<TS, __nv_bfloat16>::value || std::is_same<TS, __half>::value) {
#pragma unroll
      for (int q = 0; q < 4; ++q) widen_pair<TS>(w[q], f[2 * q], f[2 * q + 1]);
    } else {
      TS e[8];
      memcpy(e, w, sizeof(e));
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
    }
  }
};

// Whether W2's rows of R elements allow 16-byte copies and Raw8's vector loads (8-byte ones for fp8).
DSPARK_HOST_DEVICE_FN bool w2_rows_vector(const void* w2, DType t, int64_t R) {
  return (R * static_cast<int64_t>(dtype_size(t))) % 16 == 0 && is_aligned16(w2);
}

// Quad q (elements 4q..4q+3, zero past R) of a float row of dtype t (fp32, bf16, fp16) as float32: one 16- or
// 8-byte load where `vec`, else element by element.
DSPARK_DEVICE float4 load_quad(const void* row, DType t, int64_t q, int64_t R, bool vec) {
  const int64_t c = 4 * q;
  if (vec && c + 4 <= R) {
    if (t == DType::kFloat32) return ldg(reinterpret_cast<const float4*>(static_cast<const float*>(row) + c));
    const uint2 w = ldg(reinterpret_cast<const uint2*>(static_cast<const char*>(row) + 2 * c));
    float4 f;
    if (t == DType::kBFloat16) {
      widen_pair<__nv_bfloat16>(w.x, f.x, f.y);
      widen_pair<__nv_bfloat16>(w.y, f.z, f.w);
    } else {
      widen_pair<__half>(w.x, f.x, f.y);
      widen_pair<__half>(w.y, f.z, f.w);
    }
    return f;
  }
  float e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = c + i < R ? load_float(row, t, c + i) : 0.0f;
  return make_float4(e[0], e[1], e[2], e[3]);
}

DSPARK_DEVICE float4 shfl_quad(float4 v, int src) {
  return make_float4(__shfl_sync(kFullMask, v.x, src), __shfl_sync(kFullMask, v.y, src),
                     __shfl_sync(kFullMask, v.z, src), __shfl_sync(kFullMask, v.w, src));
}

// Request n's v row at lane `lane`'s columns of the pass from c0 (LaneCols<TS>), by the whole warp: the warp reads
// quads l and 32 + l of the pass (each load the warp's contiguous bytes), then each lane takes its own quads from
// the lanes that read them.
template <typename TS>
DSPARK_DEVICE void load_v8(const SweepParams& p, int64_t n, int64_t x, int64_t c0, int lane, float (&v)[8]) {
  const bool in = !p.v_w1 || (x >= 0 && x < p.VT);
  const void* row = !p.v_w1 ? static_cast<const void*>(p.vf + n * p.R)
                            : static_cast<const char*>(p.w1) + (in ? x : 0) * p.R * int64_t(dtype_size(p.w1_dtype));
  const DType t = p.v_w1 ? p.w1_dtype : DType::kFloat32;
  const bool vec = (p.R % 4) == 0 && is_aligned16(!p.v_w1 ? static_cast<const void*>(p.vf) : p.w1);
  const int64_t qb = c0 / 4;
  float4 a = in ? load_quad(row, t, qb + lane, p.R, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 b = in ? load_quad(row, t, qb + 32 + lane, p.R, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (!LaneCols<TS>::kSplit) {  // this lane's quads are 2 lane and 2 lane + 1 of the pass
    const int s0 = (2 * lane) & 31, s1 = (2 * lane + 1) & 31;
    const float4 a0 = shfl_quad(a, s0), b0 = shfl_quad(b, s0), a1 = shfl_quad(a, s1), b1 = shfl_quad(b, s1);
    a = lane < 16 ? a0 : b0;
    b = lane < 16 ? a1 : b1;
  }
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The CUDA-core sweep's block: kRows rows a warp, their loads in flight together, and kRows G <= 32 dot products
// reduce-scattered. Registers decide: with one or two requests (G v rows of 8 columns, kRows G partial sums, the
// loads) two CTAs of 8 warps an SM fit 128 registers a thread, 4-8 rows x 512 bytes a warp in flight (32-64 KB an
// SM); four 16-bit or fp8 requests take one CTA an SM with 8 rows (32 KB), four fp32 ones two CTAs with 2 rows (32
// KB); eight (fp32 W2 or r > kMaxMmaRank) one CTA an SM.
template <typename TS, int G>
struct GemvShape {
  static constexpr bool kF32 = sizeof(TS) == 4, kHalf = std::is_same<TS, __half>::value;
  static constexpr int kRows = G == 1 ? (kF32 || kHalf ? 4 : 8) : (G == 2 ? 4 : (G == 4 ? (kF32 ? 2 : 8) : 4));
  static constexpr int kCtasPerSm = G == 8 || (G == 4 && !kF32) ? 1 : 2;
  static constexpr int kVals = kRows * G;
  static_assert(kVals <= 32, "one dot product a lane at most");
};

template <typename TS, int G>
__global__ void __launch_bounds__(kSweepThreads, GemvShape<TS, G>::kCtasPerSm) sweep_gemv_kernel(SweepParams p) {
  constexpr int kRows = GemvShape<TS, G>::kRows, kVals = GemvShape<TS, G>::kVals, kPerVal = 32 / kVals;
  // staged logits: a fold's G segments of kRows words in different banks, rows 16-byte aligned (float4 copies)
  constexpr int kLStride = kGemvChunk + (kRows > 4 ? kRows : 4);
  DSPARK_SHARED_ARRAY(uint4, ubuf, 2 * G * kGemvChunk * 4 / 16);  // two chunks of U (room for fp32)
  DSPARK_SHARED_ARRAY(float, lbuf, G * kLStride);                 // a chunk's logits (return_logits)
  DSPARK_SHARED_ARRAY(int64_t, part_mem, (kSweepWarps * G * PartSlots::kBytes + 7) / 8);
  const PartSlots warp_parts = PartSlots::at(part_mem, kSweepWarps * G);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t g0 = int64_t(blockIdx.x) * G, R = p.R;
  const int nb = static_cast<int>(p.N - g0 < G ? p.N - g0 : G);
  const int64_t slice = blockIdx.y;
  int64_t v0, v1;
  slice_bounds(p.V, p.slices, slice, v0, v1);
  const TS* w2 = static_cast<const TS*>(p.w2);
  const bool vec = w2_rows_vector(w2, p.w2_dtype, R);
  const int lg = p.u_dtype == DType::kFloat32 ? 2 : 1, units = (kGemvChunk << lg) / 16;
  const bool ualigned = u_rows_aligned(p);
  const int chunks = static_cast<int>((v1 - v0 + kGemvChunk - 1) / kGemvChunk);
  unsigned char* ub = reinterpret_cast<unsigned char*>(ubuf);
  const int ubytes = G * kGemvChunk * 4;
  // the (request, row) of the block this lane folds (one of the kPerVal lanes holding its dot product)
  const int val = lane / kPerVal, fi = val / kRows, fr = val % kRows;
  const bool folds = lane % kPerVal == 0 && fi < nb;
  Raw8<TS> raw[kRows];
  auto fetch = [&](int64_t r0, int64_t c0) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (r0 + q < v1) {
        raw[q].load(w2 + (r0 + q) * R, c0, lane, R, vec);
      } else {
        raw[q].zero();
      }
    }
  };
  // before the wait (W2 and U do not depend on the launch before): U's first chunk, this warp's first W2 rows
  stage_u(p, g0, nb, G, v0, v1, units, ub, ualigned, t);
  cp_async_commit();
  const int64_t first = v0 + warp * kRows;
  if (first < v1) fetch(first, 0);
  grid_dependency_wait();
  float vr[G][8];
  auto load_vr = [&](int64_t c0) {
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (i < nb) {
        load_v8<TS>(p, g0 + i, p.v_w1 ? token_before(p, g0 + i) : -1, c0, lane, vr[i]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) vr[i][e] = 0.0f;
      }
    }
  };
  const bool one_pass = R <= 256;
  if (one_pass) load_vr(0);
  const int64_t fn = g0 + fi;
  const float temp = folds ? fold_temperature(p, fn) : 0.0f;
  const rng::Philox ph = p.temperature != nullptr ? rng::load_philox(p.rng_key) : rng::Philox::make(0, 0);
  const bool dist = p.keys == nullptr;
  Part pt = Part::empty();
  for (int c = 0; c < chunks; ++c) {
    const int64_t c0 = v0 + int64_t(c) * kGemvChunk;
    const int rows_c = static_cast<int>(v1 - c0 < kGemvChunk ? v1 - c0 : kGemvChunk);
    cp_async_wait<0>();  // this chunk's U has landed (this thread's copies) ...
    __syncthreads();     // ... and everyone's; the chunk before is folded and its logits written
    if (c + 1 < chunks) stage_u(p, g0, nb, G, c0 + kGemvChunk, v1, units, ub + ((c + 1) & 1) * ubytes, ualigned, t);
    cp_async_commit();
    const unsigned char* us = ub + (c & 1) * ubytes;
    for (int b0 = warp * kRows; b0 < rows_c; b0 += kSweepWarps * kRows) {
      const int64_t row0 = c0 + b0;
      float acc[kVals];
#pragma unroll
      for (int i = 0; i < kVals; ++i) acc[i] = 0.0f;
      for (int64_t k0 = 0; k0 < R; k0 += 256) {
        if (k0 > 0 || row0 != first) fetch(row0, k0);
        if (!one_pass) load_vr(k0);
#pragma unroll
        for (int q = 0; q < kRows; ++q) {
          float w[8];
          raw[q].widen(w);
#pragma unroll
          for (int i = 0; i < G; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[i * kRows + q] = fmaf(w[e], vr[i][e], acc[i * kRows + q]);
        }
      }
      const float dot = warp_reduce_scatter<kVals>(acc, lane);
      const int64_t row = row0 + fr;
      if (folds && row < v1) {
        const float s = p.w2_scale != nullptr ? ldg(p.w2_scale + row) : 1.0f;
        const float l = u_elem(us, fi, b0 + fr, units, p.u_dtype) + dot * s;
        if (p.logits != nullptr) lbuf[fi * kLStride + b0 + fr] = l;
        fold_logit(pt, l, temp, ph, fn, p.position, p.id_offset + row, dist);
      }
    }
    if (p.logits != nullptr) {  // the chunk's logits, each request's row with consecutive threads
      __syncthreads();
      const bool lvec = p.logits_stride % 4 == 0 && is_aligned16(p.logits) && c0 % 4 == 0;
      constexpr int q4 = kGemvChunk / 4;  // (whole rows of 16-byte units: a quarter-warp stays in one row)
      for (int i = t; i < nb * q4; i += kSweepThreads) {
        const int j = i / q4, e = 4 * (i - j * q4);
        if (e >= rows_c) continue;
        float* out = p.logits + (g0 + j) * p.logits_stride + c0 + e;
        const float* in = lbuf + j * kLStride + e;
        if (lvec && e + 4 <= rows_c) {
          stg(reinterpret_cast<float4*>(out), *reinterpret_cast<const float4*>(in));
        } else {
          for (int x = 0; x < 4 && e + x < rows_c; ++x) stg(out + x, in[x]);
        }
      }
    }
  }
  launch_dependents();
  for (int o = 1; o < 32 / G; o <<= 1) pt.merge(shfl_xor(pt, o));  // a request's 32 / G consecutive lanes
  if (lane % (32 / G) == 0) warp_parts.put(warp * G + lane / (32 / G), pt);
  __syncthreads();
  if (t < nb) {
    Part m = warp_parts.get(t);
    for (int w = 1; w < kSweepWarps; ++w) m.merge(warp_parts.get(w * G + t));
    sink(p, g0 + t, slice, m);
  }
}

// ------------------------------------------------------------------------------------------------ tensor cores
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
#endif  // __CUDACC__ || DSPARK_SIMT

// Whether the sweep's v rows are W1's rows of W2's tensor-core type, copied as they are (no lo rows, scale 1).
DSPARK_HOST_DEVICE_FN bool v_rows_exact(const SweepParams& p, DType mma) {
  return p.v_w1 && p.w1_dtype == mma && p.R % 8 == 0 && is_aligned16(p.w1);
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// The group's v rows into the tile vt ([G][sv] elements of TW; lo rows `lo` bytes on), a warp a row: W1's rows of
// TW as they are (v_rows_exact: scale 1, no lo rows; 16-byte loads and stores); else hi = T(v s), lo = T(v s - hi)
// with s a power of two per request that brings max |v| to [2^13, 2^14) (exact; undone on the bias by unscale[j] =
// 1 / s). Rows nb..G-1 and columns R..rpad-1 are zero. Returns whether this thread stored a lo that is not zero.
template <typename TW>
DSPARK_DEVICE bool split_rows(const SweepParams& p, int64_t g0, int nb, int G, TW* vt, const MmaLayout& ml,
                              float* unscale, int lane, int warp) {
  const int64_t R = p.R, rpad = ml.rpad;
  const bool exact = v_rows_exact(p, mma_dtype_of<TW>());
  bool lo_live = false;
  for (int j = warp; j < G; j += kSweepWarps) {
    TW* hi = vt + j * ml.sv;
    TW* lo = ml.lo != 0 ? reinterpret_cast<TW*>(reinterpret_cast<char*>(hi) + ml.lo) : nullptr;
    const int64_t n = g0 + j;
    const int64_t x = j < nb && p.v_w1 ? token_before(p, n) : -1;
    if (exact || j >= nb) {  // W1's row (zero outside [0, VT)), or a zero row past the group
      const bool in = j < nb && x >= 0 && x < p.VT;
      const TW* src = static_cast<const TW*>(p.w1) + (in ? x * R : 0);
      for (int64_t c = 8 * lane; c < rpad; c += 256) {
        const uint4 w = in && c < R ? ldg(reinterpret_cast<const uint4*>(src + c)) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(hi + c) = w;
        if (lo != nullptr) *reinterpret_cast<uint4*>(lo + c) = make_uint4(0, 0, 0, 0);
      }
      if (lane == 0) unscale[j] = 1.0f;
      continue;
    }
    float amax = 0.0f;
    for (int64_t c = lane; c < R; c += 32) amax = fmaxf(amax, fabsf(v_at(p, n, x, c)));
    const int e = split_exponent(warp_max(amax));
    const float sc = ldexpf(1.0f, e);
    for (int64_t c = lane; c < rpad; c += 32)
      lo_live |= split_store(c < R ? v_at(p, n, x, c) * sc : 0.0f, hi + c, lo + c);
    if (lane == 0) unscale[j] = ldexpf(1.0f, -e);
  }
  return lo_live;
}

// A chunk of W2 (kRows rows from r0, `rows` of them in the slice; kChunkK columns from c0) into a ring slot
// ([kRows][kStride] elements of TS), zero past the slice or R: 16-byte cp.async copies where the rows allow
// (w2_rows_vector; a quarter-warp copies 128 contiguous bytes), else element by element.
template <typename TS, int kStride, int kRows>
DSPARK_DEVICE void stage_chunk(TS* slot, const TS* w2, int64_t R, int64_t r0, int rows, int64_t c0, bool vec,
                               int t) {
  constexpr int kEpu = static_cast<int>(16 / sizeof(TS)), kUpr = kChunkK / kEpu;
  if (vec) {
#pragma unroll
    for (int u = t; u < kRows * kUpr; u += kSweepThreads) {
      const int row = u / kUpr, cu = u % kUpr;
      const int64_t c = c0 + int64_t(cu) * kEpu;
      const bool in = row < rows && c < R;
      cp_async_zfill<16>(slot + row * kStride + cu * kEpu, in ? w2 + (r0 + row) * R + c : w2, in ? 16 : 0);
    }
    return;
  }
  for (int i = t; i < kRows * kChunkK; i += kSweepThreads) {
    const int row = i / kChunkK, c = i % kChunkK;
    TS v;
    memset(&v, 0, sizeof(v));
    if (row < rows && c0 + c < R) v = ldg(w2 + (r0 + row) * R + c0 + c);
    slot[row * kStride + c] = v;
  }
}

// A staged fp8 chunk of kRows rows (rows of kChunkK bytes) widened to bf16 rows of kChunkStride elements (exact:
// e4m3 is a subset of bf16): thread t one 16-byte unit (row t / 4, unit t % 4). A quarter-warp reads 128 contiguous
// bytes and writes each unit's two halves to units 9 row + 2 q (+ 1): 8 different bank groups.
template <int kRows>
DSPARK_DEVICE void widen_chunk(const __nv_fp8_e4m3* raw, __nv_bfloat16* out, int t) {
  if (t >= kRows * kChunkK / 16) return;
  const int row = t >> 2, q = 16 * (t & 3);
  const Vec16<__nv_fp8_e4m3> w = *reinterpret_cast<const Vec16<__nv_fp8_e4m3>*>(raw + row * kChunkK + q);
  Vec16<__nv_bfloat16> h[2];
#pragma unroll
  for (int e = 0; e < 16; ++e) h[e >> 3].v[e & 7] = __float2bfloat16(to_float(w.v[e]));
  *reinterpret_cast<Vec16<__nv_bfloat16>*>(out + row * kChunkStride + q) = h[0];
  *reinterpret_cast<Vec16<__nv_bfloat16>*>(out + row * kChunkStride + q + 8) = h[1];
}
static_assert(kTileV * kChunkK / 16 <= kSweepThreads, "widen_chunk: one 16-byte unit a thread");

// One staged chunk on tensor cores, `width` columns (a multiple of 16): the warp's kWM m16 blocks of requests (A by
// ldmatrix x4 from the v tile, this lane's row at `a`; the lo rows `lo` bytes on, with kLo) times its kWN n8 blocks
// of W2 rows (B by ldmatrix x4 of two blocks, x2 of one, this lane's row at `b`).
template <typename TW, int kWM, int kWN, bool kLo>
DSPARK_DEVICE void mma_chunk(float (&acc)[kWM][kWN][4], const TW* a, int64_t lo, int64_t sv, const TW* b, int width) {
#pragma unroll 1
  for (int kk = 0; kk < width; kk += 16) {
    uint32_t bf[kWN][2];
    if constexpr (kWN >= 2) {
#pragma unroll
      for (int q = 0; q < kWN; q += 2) {
        uint32_t r[4];
        warp::ldmatrix<4>(r, b + q * 8 * kChunkStride + kk);
        bf[q][0] = r[0], bf[q][1] = r[1], bf[q + 1][0] = r[2], bf[q + 1][1] = r[3];
      }
    } else {
      warp::ldmatrix<2>(bf[0], b + kk);
    }
#pragma unroll
    for (int h = 0; h < (kLo ? 2 : 1); ++h) {
      uint32_t af[kWM][4];
#pragma unroll
      for (int mb = 0; mb < kWM; ++mb) {
        const TW* ar = a + mb * 16 * sv + kk;
        warp::ldmatrix<4>(af[mb], h == 0 ? ar : reinterpret_cast<const TW*>(reinterpret_cast<const char*>(ar) + lo));
      }
#pragma unroll
      for (int mb = 0; mb < kWM; ++mb)
#pragma unroll
        for (int q = 0; q < kWN; ++q) warp::mma_m16n8k16<TW>(acc[mb][q], af[mb], bf[q]);
    }
  }
}

template <typename TS, int G>
__global__ void __launch_bounds__(kSweepThreads, 1) sweep_mma_kernel(SweepParams p, MmaLayout ml) {
  using TW = MmaType<TS>;
  using S = MmaShape<G>;
  constexpr int kWM = S::kWM, kWN = S::kWN, kMW = S::kMW, kNW = S::kNW, kRows = S::kRows;
  constexpr bool kWiden = !std::is_same<TS, TW>::value;          // an fp8 W2
  constexpr int kSlotStride = kWiden ? kChunkK : kChunkStride;   // a staged row (elements of TS)
  constexpr int kSlotElems = kRows * kSlotStride;
  DSPARK_DYNAMIC_SMEM(unsigned char, smem_raw);
  unsigned char* smem = smem_raw + ((128u - (reinterpret_cast<uintptr_t>(smem_raw) & 127u)) & 127u);
  TW* vt = reinterpret_cast<TW*>(smem);
  TS* ring = reinterpret_cast<TS*>(smem + ml.ring);
  TW* wide = reinterpret_cast<TW*>(smem + ml.wide);
  unsigned char* uring = smem + ml.u;
  float* temps = reinterpret_cast<float*>(smem + ml.temps);
  float* unscale = reinterpret_cast<float*>(smem + ml.unscale);
  const PartSlots parts = PartSlots::at(smem + ml.parts, kNW * G);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, mw = warp % kMW, nw = warp / kMW;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t g0 = int64_t(blockIdx.x) * G, R = p.R, sv = ml.sv;
  const int nb = static_cast<int>(p.N - g0 < G ? p.N - g0 : G);
  const int64_t slice = blockIdx.y;
  int64_t v0, v1;
  slice_bounds(p.V, p.slices, slice, v0, v1);
  const int64_t tiles = (v1 - v0 + kRows - 1) / kRows;
  const int nchunks = static_cast<int>((ml.rpad + kChunkK - 1) / kChunkK);
  const int64_t total = tiles * nchunks;
  const TS* w2 = static_cast<const TS*>(p.w2);
  const bool vec = w2_rows_vector(w2, p.w2_dtype, R);
  const int lg = p.u_dtype == DType::kFloat32 ? 2 : 1, units = (kRows << lg) / 16;
  const int uslot_bytes = G * kRows << lg;
  const bool ualigned = u_rows_aligned(p);
  auto stage = [&](int64_t q) {  // chunk q of the slice's stream (tile q / nchunks) into slot q % kStages, and
    if (q < total) {             // with a tile's last chunk the tile's U into U slot tile % uslots
      const int64_t tile = q / nchunks, r0 = v0 + tile * kRows;
      const int rows = static_cast<int>(v1 - r0 < kRows ? v1 - r0 : kRows);
      stage_chunk<TS, kSlotStride, kRows>(ring + (q % kStages) * kSlotElems, w2, R, r0, rows, (q % nchunks) * kChunkK,
                                          vec, t);
      if (q % nchunks == nchunks - 1)
        stage_u(p, g0, nb, G, r0, v1, units, uring + (tile % ml.uslots) * uslot_bytes, ualigned, t);
    }
    cp_async_commit();
  };
  for (int s = 0; s < kStages - 1; ++s) stage(s);  // W2 and U do not depend on the launch before
  grid_dependency_wait();
  const bool lo_mine = split_rows<TW>(p, g0, nb, G, vt, ml, unscale, lane, warp);
  for (int j = t; j < G; j += kSweepThreads) temps[j] = j < nb ? fold_temperature(p, g0 + j) : 0.0f;
  const bool lo_live = __syncthreads_or(lo_mine);
  const rng::Philox ph = p.temperature != nullptr ? rng::load_philox(p.rng_key) : rng::Philox::make(0, 0);
  const bool dist = p.keys == nullptr;
  // this lane's ldmatrix rows: A (requests m0 + (lane & 7) + 8 ((lane >> 3) & 1), column 8 (lane >> 4)), B (tile
  // rows n0 + 8 (lane >> 4) + (lane & 7), column 8 ((lane >> 3) & 1))
  const int m0 = mw * kWM * 16, n0 = nw * kWN * 8;
  const TW* arow = vt + (m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * sv + 8 * (lane >> 4);
  const int boff = (n0 + 8 * (lane >> 4) + (lane & 7)) * kChunkStride + 8 * ((lane >> 3) & 1);
  const bool lpaired = p.logits != nullptr && p.logits_stride % 2 == 0 && is_aligned16(p.logits);
  Part pt[kWM][2];
#pragma unroll
  for (int mb = 0; mb < kWM; ++mb) pt[mb][0] = pt[mb][1] = Part::empty();
  int64_t q = 0;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t tile0 = v0 + tile * kRows;
    float acc[kWM][kWN][4];
#pragma unroll
    for (int mb = 0; mb < kWM; ++mb)
#pragma unroll
      for (int f = 0; f < kWN; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mb][f][e] = 0.0f;
#pragma unroll 1
    for (int ci = 0; ci < nchunks; ++ci, ++q) {
      cp_async_wait<kStages - 2>();  // chunk q (and with a tile's last chunk its U) has landed (this thread's) ...
      __syncthreads();               // ... and everyone's; the slot before its slot is free again
      stage(q + kStages - 1);
      const TW* chunk;
      if constexpr (kWiden) {
        widen_chunk<kRows>(ring + (q % kStages) * kSlotElems, wide, t);
        __syncthreads();
        chunk = wide;
      } else {
        chunk = reinterpret_cast<const TW*>(ring + (q % kStages) * kSlotElems);
      }
      const int width = static_cast<int>(ml.rpad - ci * kChunkK < kChunkK ? ml.rpad - ci * kChunkK : kChunkK);
      if (G <= 128 && lo_live) {  // (256 requests a CTA only without lo rows)
        mma_chunk<TW, kWM, kWN, G <= 128>(acc, arow + ci * kChunkK, ml.lo, sv, chunk + boff, width);
      } else {
        mma_chunk<TW, kWM, kWN, false>(acc, arow + ci * kChunkK, ml.lo, sv, chunk + boff, width);
      }
    }
    // the fold: lane (g, tq) holds requests m0 + 16 mb + g + 8 h at rows n0 + 8 f + 2 tq, + 1 of the tile
    const unsigned char* us = uring + (tile % ml.uslots) * uslot_bytes;
#pragma unroll
    for (int mb = 0; mb < kWM; ++mb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = m0 + mb * 16 + g + 8 * h;
        if (j >= nb) continue;
        const int64_t n = g0 + j;
        const float temp = temps[j], bs = unscale[j];
#pragma unroll
        for (int f = 0; f < kWN; ++f) {
          const int e = n0 + f * 8 + 2 * tq;
          const int64_t row = tile0 + e;
          if (row >= v1) continue;
          const int cnt = row + 1 < v1 ? 2 : 1;
          float s0 = bs, s1 = bs;
          if constexpr (kWiden) {
            s0 *= ldg(p.w2_scale + row);
            s1 *= cnt > 1 ? ldg(p.w2_scale + row + 1) : 0.0f;
          }
          const float2 u = u_pair(us, j, e, units, p.u_dtype);
          const float l0 = u.x + acc[mb][f][2 * h] * s0, l1 = u.y + acc[mb][f][2 * h + 1] * s1;
          if (p.logits != nullptr) {
            float* out = p.logits + n * p.logits_stride + row;
            if (lpaired && cnt == 2) {
              stg(reinterpret_cast<float2*>(out), make_float2(l0, l1));
            } else {
              stg(out, l0);
              if (cnt == 2) stg(out + 1, l1);
            }
          }
          fold_pair(pt[mb][h], l0, l1, cnt, temp, ph, n, p.position, p.id_offset + row, dist);
        }
      }
  }
  cp_async_wait_all();
  launch_dependents();
  // a request's Part: over its 4 lanes (tq), then over the kNW warps of its rows
#pragma unroll
  for (int mb = 0; mb < kWM; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      Part& a = pt[mb][h];
      a.merge(shfl_xor(a, 1));
      a.merge(shfl_xor(a, 2));
      const int j = m0 + mb * 16 + g + 8 * h;
      if (tq != 0) continue;
      if (kNW == 1) {
        if (j < nb) sink(p, g0 + j, slice, a);
      } else {
        parts.put(nw * G + j, a);
      }
    }
  if (kNW > 1) {
    __syncthreads();
    for (int j = t; j < nb; j += kSweepThreads) {
      Part m = parts.get(j);
      for (int w = 1; w < kNW; ++w) m.merge(parts.get(w * G + j));
      sink(p, g0 + j, slice, m);
    }
  }
}
#endif  // __CUDACC__ || DSPARK_SIMT

// ------------------------------------------------------------------------------------------------ host side
// The launch shape of a position's sweep (the same for every position of a block).
struct SweepPlan {
  bool mma;
  int group;       // requests a CTA (G)
  int lanes, slices;
  MmaLayout layout;  // the tensor-core sweep's shared memory
};

DSPARK_HOST_DEVICE_FN int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// The tensor-core sweep's shared memory for a group of G requests (lo rows or not), W2 dtype w2, U dtype u.
inline MmaLayout mma_layout(int64_t R, int G, bool lo, DType w2, DType u) {
  MmaLayout l{};
  l.rpad = round_up(R > 0 ? R : 1, 16);
  l.sv = l.rpad + 8;
  const int64_t hi = round_up(int64_t(G) * l.sv * 2, 128);
  l.lo = lo ? hi : 0;
  l.ring = hi * (lo ? 2 : 1);
  const bool fp8 = w2 == DType::kFloat8E4M3;
  const int rows = mma_tile_rows(G);
  l.wide = l.ring + round_up(int64_t(kStages) * rows * (fp8 ? kChunkK : kChunkStride * 2), 128);
  l.u = l.wide + (fp8 ? round_up(int64_t(rows) * kChunkStride * 2, 128) : 0);
  const int64_t nchunks = (l.rpad + kChunkK - 1) / kChunkK;
  l.uslots = static_cast<int>((kStages + nchunks - 1) / nchunks);
  l.temps = l.u + round_up(int64_t(l.uslots) * G * rows * int64_t(dtype_size(u)), 128);
  l.unscale = l.temps + round_up(int64_t(G) * 4, 128);
  l.parts = l.unscale + round_up(int64_t(G) * 4, 128);
  const int nw = kSweepWarps / (G / (16 * (G >= 32 ? 2 : 1)));
  l.bytes = static_cast<size_t>(l.parts + (nw > 1 ? int64_t(nw) * G * int64_t(PartSlots::kBytes) : 0) + 128);
  return l;
}

inline int pow2_at_least(int64_t n) {
  int g = 1;
  while (g < n) g *= 2;
  return g;
}

// Which sweep and group (before the grid, which needs the occupancy): the CUDA-core sweep for small N, fp32 W2 and
// ranks past kMaxMmaRank, and where the smallest tensor-core group does not fit the device's shared memory.
inline SweepPlan choose_sweep(const SweepParams& p, size_t smem_cap) {
  SweepPlan pl{};
  const int64_t N = p.N > 0 ? p.N : 1;
  const DType mma = p.w2_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  pl.mma = p.w2_dtype != DType::kFloat32 && p.R <= kMaxMmaRank && N > kGemvMaxN;
  if (pl.mma) {
    const bool lo = !v_rows_exact(p, mma);
    int g = static_cast<int>(std::min<int64_t>(pow2_at_least(std::max<int64_t>(N, 16)), lo ? 128 : 256));
    while (g > 16 && mma_layout(p.R, g, lo, p.w2_dtype, p.u_dtype).bytes > smem_cap) g /= 2;
    pl.layout = mma_layout(p.R, g, lo, p.w2_dtype, p.u_dtype);
    pl.group = g;
    if (pl.layout.bytes > smem_cap) pl.mma = false;
  }
  if (!pl.mma) {
    const int cap = p.w2_dtype == DType::kFloat32 || p.R > kMaxMmaRank ? 8 : kGemvMaxN;
    pl.group = std::min(pow2_at_least(N), cap);
  }
  pl.lanes = static_cast<int>((N + pl.group - 1) / pl.group);
  return pl;
}

// The grid for `per_sm` resident CTAs an SM: every resident CTA (at most kMaxCtasPerSm an SM) as lanes x slices,
// each slice at least kMinSliceRows rows.
inline void size_grid(SweepPlan& pl, int64_t V, int sms, int per_sm) {
  const int64_t resident = int64_t(sms) * std::max(1, std::min(per_sm, kMaxCtasPerSm));
  const int64_t max_slices = std::max<int64_t>(1, (V + kMinSliceRows - 1) / kMinSliceRows);
  pl.slices = static_cast<int>(std::min<int64_t>(max_slices, std::max<int64_t>(1, resident / pl.lanes)));
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Plans (plan_only: the grid into pl from the occupancy of `kernel` with `smem` bytes of dynamic shared memory) or
// launches `kernel(p, extra...)` with plan pl.
template <typename Kernel, typename... Extra>
inline cudaError_t run_sweep(Kernel kernel, size_t smem, const SweepParams& p, SweepPlan& pl, bool plan_only,
                             cudaStream_t s, bool pdl, const char* name, const Extra&... extra) {
  if (smem > 0) {
    const cudaError_t err = set_max_dynamic_smem(kernel, smem);
    if (err != cudaSuccess) return err;
  }
  if (plan_only) {
    const int per_sm = max_active_blocks_per_sm(kernel, kSweepThreads, smem);
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    size_grid(pl, p.V, device_sm_count(), per_sm);
    return cudaSuccess;
  }
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(pl.lanes), static_cast<unsigned>(pl.slices));
  cfg.block = dim3(kSweepThreads);
  cfg.smem = smem;
  cfg.stream = s;
  cfg.pdl = pdl;
  return launch(name, kernel, cfg, p, extra...);
}

template <typename TS>
inline cudaError_t launch_gemv(const SweepParams& p, SweepPlan& pl, bool plan_only, cudaStream_t s, bool pdl,
                               const char* name) {
  switch (pl.group) {
    case 1: return run_sweep(sweep_gemv_kernel<TS, 1>, 0, p, pl, plan_only, s, pdl, name);
    case 2: return run_sweep(sweep_gemv_kernel<TS, 2>, 0, p, pl, plan_only, s, pdl, name);
    case 4: return run_sweep(sweep_gemv_kernel<TS, 4>, 0, p, pl, plan_only, s, pdl, name);
    default: return run_sweep(sweep_gemv_kernel<TS, 8>, 0, p, pl, plan_only, s, pdl, name);
  }
}

template <typename TS>
inline cudaError_t launch_mma(const SweepParams& p, SweepPlan& pl, bool plan_only, cudaStream_t s, bool pdl,
                              const char* name) {
  const size_t b = pl.layout.bytes;
  const MmaLayout l = pl.layout;
  switch (pl.group) {
    case 16: return run_sweep(sweep_mma_kernel<TS, 16>, b, p, pl, plan_only, s, pdl, name, l);
    case 32: return run_sweep(sweep_mma_kernel<TS, 32>, b, p, pl, plan_only, s, pdl, name, l);
    case 64: return run_sweep(sweep_mma_kernel<TS, 64>, b, p, pl, plan_only, s, pdl, name, l);
    case 128: return run_sweep(sweep_mma_kernel<TS, 128>, b, p, pl, plan_only, s, pdl, name, l);
    default: return run_sweep(sweep_mma_kernel<TS, 256>, b, p, pl, plan_only, s, pdl, name, l);
  }
}

// Plans (plan_only: the kernel, group and grid into pl, nothing launched) or launches one sweep with plan pl.
// Kernel names for the harness: `gemv_name` / `mma_name`.
inline cudaError_t sweep(const SweepParams& p, SweepPlan& pl, bool plan_only, cudaStream_t s, bool pdl,
                         const char* gemv_name, const char* mma_name) {
  if (plan_only) pl = choose_sweep(p, device_max_smem_per_block());
  if (pl.mma) {
    switch (p.w2_dtype) {
      case DType::kBFloat16: return launch_mma<__nv_bfloat16>(p, pl, plan_only, s, pdl, mma_name);
      case DType::kFloat16: return launch_mma<__half>(p, pl, plan_only, s, pdl, mma_name);
      case DType::kFloat8E4M3: return launch_mma<__nv_fp8_e4m3>(p, pl, plan_only, s, pdl, mma_name);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (p.w2_dtype) {
    case DType::kFloat32: return launch_gemv<float>(p, pl, plan_only, s, pdl, gemv_name);
    case DType::kBFloat16: return launch_gemv<__nv_bfloat16>(p, pl, plan_only, s, pdl, gemv_name);
    case DType::kFloat16: return launch_gemv<__half>(p, pl, plan_only, s, pdl, gemv_name);
    case DType::kFloat8E4M3: return launch_gemv<__nv_fp8_e4m3>(p, pl, plan_only, s, pdl, gemv_name);
    default: return cudaErrorInvalidValue;
  }
}
#endif

}  // namespace draft
}  // namespace dspark
