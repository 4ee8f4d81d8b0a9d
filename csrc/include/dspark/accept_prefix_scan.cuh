// dspark/accept_prefix_scan.cuh: verification results -> the batch's bookkeeping, in ONE launch (no torch).
// Meaning: dspark_kernels/reference/accept_prefix_scan.py (the spec).
//
// Structure. The N requests are cut into G contiguous chunks of <= 1024 requests (a multiple of 32), one CTA each,
// whose per-request values (S, last token, first verify row, verify rows, room, accepted drafts then the stop flag,
// e_r, its prefix: 40 bytes each) stay in shared memory:
//   N <= 1024 (the launch-bound decode case): G = 1, one CTA of 32 (N <= 32), 256 (N <= 256) or 1024 threads, a
//            plain launch, no grid barrier;
//   N > 1024: G = min(resident CTAs, N / 256) CTAs of 256 threads in a cooperative launch (N up to ~800k on an
//            H200), one grid barrier for the chunks' totals.
// Phases (one barrier after each; the decode case has 5):
//   A. per request, 32 consecutive requests a warp, every load coalesced: S, the length limit, the verify rows
//      (cu[r] loaded by lane r, cu[r+1] taken from lane r+1), the accepted drafts (num_accepted, or the leading
//      run of accept_mask: each lane reads 16 bytes of the warp's 32 rows and each row takes its bits of the
//      lanes holding it by two shuffles);
//   B. per verify slot (r, i) of the dense [rows, K+1] tile, 16 slots a thread (4 with 1024 threads) with their
//      token loads in flight together: the slot i = n_r decides the bonus, so e_r = min(n_r + (tokens[r, n_r] >= 0),
//      room);
//   C. the exclusive prefix sums of e over the chunk (one block scan per 1024 requests);
//   D. per verify slot again (the tokens still in registers when the tile fits one round of the block): kept
//      tokens (i < e_r) are written at cu_out[r] + i with their verify row and paged-KV slot, the dense slots
//      >= cu_out[N] that fall in the tile get -1 (every slot of out_tokens / hidden_rows / kv_slots is written
//      exactly once); the last kept token and the stop test go to shared memory;
//   E. per request, coalesced: cu_out (cu_out[r] by thread r; cu_out[N] by the last), new_seq_lens, next_anchor,
//      finished.
// Integer inputs are int32 or int64 (a flag per array); index arithmetic that can pass 2^31 is 64-bit. Reads that
// could go out of bounds with inconsistent values (num_accepted, block-table columns) are clamped or skipped as
// the reference defines. The workspace holds the G chunk totals (int64), written before being read.
//
// Defines what dspark/accept_prefix_scan.h declares: a library includes this header in one translation unit
// (csrc/kernels/accept_prefix_scan.cu, csrc/capi/dspark_capi.cu).
#pragma once

#include <stdint.h>

#include "accept_prefix_scan.h"
#include "block_scan.cuh"
#include "utils.cuh"

namespace dspark {

namespace scan {
constexpr int kThreads = 256;              // the cooperative launch
constexpr int64_t kMaxChunk = 1024;        // requests per CTA
constexpr int64_t kSingleCtaMaxN = 1024;   // up to here: one CTA, no grid barrier
constexpr int kMaxSmemStops = 64;
// Verify slots a thread handles per round (their loads in flight together): one round covers N (K+1) slots for
// K <= 15 at N <= the CTA's threads up to 256, and K <= 3 with 1024 threads (64 registers a thread there).
template <int kT>
constexpr int kSlots = kT <= 256 ? 16 : 4;
constexpr int64_t kMaxMaskK = 16;          // accept_mask rows up to this K: 16-byte loads and shuffles
constexpr size_t kSmemPerRequest = 2 * sizeof(int64_t) + 6 * sizeof(int32_t);

// Threads of the single-CTA launch for N requests.
DSPARK_HOST_DEVICE_FN int threads_for(int64_t n) { return n <= 32 ? 32 : (n <= 256 ? 256 : 1024); }

struct Plan {
  int64_t grid, chunk;
  int threads;
  bool ok;
};
}  // namespace scan

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
namespace scan {

// The per-request arrays of a chunk in dynamic shared memory. Values that only meet small counts are kept small:
// the first verify row's low 32 bits (hidden_rows is int32), the verify rows and the room clamped to K+1 and K+2
// (the emitted count is at most K+1, so comparisons with it are unchanged).
struct Chunk {
  int64_t *seq, *last;  // S, the last emitted token
  int32_t *row0, *rows, *room;  // first verify row, verify rows (<= K+1), length room (<= K+2)
  int32_t *acc;         // accepted drafts (phases A, B), then whether an emitted token is a stop token (C-E)
  int32_t *e, *cu;      // emitted count, its prefix in the chunk
  DSPARK_DEVICE Chunk(int64_t* smem, int64_t chunk) {
    seq = smem;
    last = smem + chunk;
    row0 = reinterpret_cast<int32_t*>(smem + 2 * chunk);
    rows = row0 + chunk;
    room = rows + chunk;
    acc = room + chunk;
    e = acc + chunk;
    cu = e + chunk;
  }
};

// Bit b of the result: byte b of the 16 is 0.
DSPARK_DEVICE uint32_t zero_bytes(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t z = 0;
DSPARK_UNROLL
  for (int i = 0; i < 16; ++i) z |= (((w[i >> 2] >> (8 * (i & 3))) & 0xffu) == 0 ? 1u : 0u) << i;
  return z;
}

// The leading run of True of row rw + lane of accept_mask [N, K], K <= kMaxMaskK, for the warp's rows rw ..
// rw + 31 (rw a multiple of 32, so their 32 K bytes start on a 32-byte boundary): lane l reads the l-th 16 bytes
// of them, and each row takes the zero bits of the (at most two) lanes holding its bytes.
DSPARK_DEVICE int64_t mask_run(const uint8_t* mask, int64_t N, int64_t K, int64_t rw) {
  const int lane = threadIdx.x & 31;
  const int64_t bytes = N * K, first = rw * K, at = first + 16 * lane;
  uint32_t zero = 0;
  if (lane < 2 * K && at < bytes) {
    if (at + 16 <= bytes && is_aligned16(mask)) {
      zero = zero_bytes(ldg(reinterpret_cast<const uint4*>(mask + at)));
    } else {
      for (int b = 0; b < 16 && at + b < bytes; ++b) zero |= (ldg(mask + at + b) == 0 ? 1u : 0u) << b;
    }
  }
  const int off = lane * static_cast<int>(K), a = off >> 4, sft = off & 15;
  const uint32_t z0 = __shfl_sync(0xffffffffu, zero, a);
  const uint32_t z1 = __shfl_sync(0xffffffffu, zero, a + 1 < 32 ? a + 1 : 31);
  const uint32_t bits = ((z0 | (z1 << 16)) >> sft) & ((1u << K) - 1u);
  return bits ? __ffs(static_cast<int>(bits)) - 1 : K;
}

// Phase A for the chunk's requests [b, b + kT): what the later phases need per request.
template <int kT>
DSPARK_DEVICE void load_requests(const AcceptPrefixScanParams& p, const Chunk& s, int64_t r0, int64_t cnt,
                                 int64_t b) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t rr = b + tid, r = r0 + rr, kp1 = p.K + 1;
  const bool in = rr < cnt;
  int64_t seq = 0, room = INT64_MAX, row0 = r * kp1, row1 = row0 + kp1;
  if (in) {
    seq = p.seq_lens.at(r);
    if (p.max_seq_lens.present()) {
      room = exact_room(p.max_seq_lens.at(r), seq);
    }
  }
  if (p.verify_cu_seqlens.present()) {  // cu[r] by lane r, cu[r+1] from lane r+1 (lane 31 loads its own)
    row0 = rr <= cnt && r <= p.N ? p.verify_cu_seqlens.at(r) : 0;
    row1 = __shfl_down_sync(0xffffffffu, row0, 1);
    if (lane == 31 && in) row1 = p.verify_cu_seqlens.at(r + 1);
  }
  int64_t acc = p.K;
  if (p.num_accepted.present()) {
    if (in) {
      acc = p.num_accepted.at(r);
      acc = acc < 0 ? 0 : (acc > p.K ? p.K : acc);
    }
  } else if (p.K <= kMaxMaskK) {
    acc = mask_run(p.accept_mask, p.N, p.K, r - lane);
  } else if (in) {  // long rows: every flag loaded (independent loads), the first False wins
    for (int64_t j = 0; j < p.K; ++j)
      if (ldg(p.accept_mask + r * p.K + j) == 0 && acc == p.K) acc = j;
  }
  if (in) {
    const uint64_t rows = row1 > row0 ? static_cast<uint64_t>(row1) - static_cast<uint64_t>(row0) : 0;  // exact
    s.seq[rr] = seq;
    s.row0[rr] = static_cast<int32_t>(row0);
    s.rows[rr] = static_cast<int32_t>(rows < static_cast<uint64_t>(kp1) ? rows : kp1);
    s.room[rr] = static_cast<int32_t>(room < kp1 + 1 ? room : kp1 + 1);
    s.acc[rr] = static_cast<int32_t>(acc);
  }
}

// Whether token t is a stop token.
DSPARK_DEVICE bool is_stop(const AcceptPrefixScanParams& p, const int64_t* stops_s, int64_t t) {
  bool stop = false;
  if (p.num_stops <= kMaxSmemStops) {
    for (int64_t s = 0; s < p.num_stops; ++s) stop |= stops_s[s] == t;
  } else {
    for (int64_t s = 0; s < p.num_stops; ++s) stop |= p.stop_token_ids.at(s) == t;
  }
  return stop;
}

// Phase D for one round of slots q0 + u kT of the chunk's dense tile (tok: their tokens).
template <int kT>
DSPARK_DEVICE void write_slots(const AcceptPrefixScanParams& p, const Chunk& s, const int64_t* stops_s, int64_t r0,
                               int64_t tile, int64_t q0, const int64_t (&tok)[kSlots<kT>], int64_t prefix,
                               int64_t total) {
  const uint32_t kp1 = static_cast<uint32_t>(p.K + 1);
  const int64_t dense0 = r0 * (p.K + 1);
  const bool has_table = p.has_block_table && p.kv_slots != nullptr;
  int64_t bid[kSlots<kT>];
DSPARK_UNROLL
  for (int u = 0; u < kSlots<kT>; ++u) {  // the block-table loads of the kept slots, in flight together
    const int64_t q = q0 + int64_t(u) * kT;
    bid[u] = -1;
    if (!has_table || q >= tile) continue;
    const uint32_t rr = static_cast<uint32_t>(q) / kp1, i = static_cast<uint32_t>(q) - rr * kp1;
    const int64_t pos = wrapping_add(s.seq[rr], int64_t(i) - 1);
    if (i < static_cast<uint32_t>(s.e[rr]) && pos >= 0 && pos / p.block_size < p.max_blocks)
      bid[u] = p.block_table.at((r0 + rr) * p.max_blocks + pos / p.block_size);
  }
DSPARK_UNROLL
  for (int u = 0; u < kSlots<kT>; ++u) {
    const int64_t q = q0 + int64_t(u) * kT;
    if (q >= tile) continue;
    const uint32_t rr = static_cast<uint32_t>(q) / kp1, i = static_cast<uint32_t>(q) - rr * kp1;
    const int64_t e = s.e[rr], d = dense0 + q, o = prefix + s.cu[rr] + i, pos = wrapping_add(s.seq[rr], int64_t(i) - 1);
    const int64_t row = i < static_cast<uint32_t>(s.rows[rr]) ? s.row0[rr] + int64_t(i) : -1;
    if (d >= total) {  // past the last emitted token: -1
      stg(p.out_tokens + d, int64_t(-1));
      stg(p.hidden_rows + d, int32_t(-1));
      if (has_table) stg(p.kv_slots + d, int64_t(-1));
    }
    if (i >= e) continue;
    stg(p.out_tokens + o, tok[u]);
    stg(p.hidden_rows + o, static_cast<int32_t>(row));
    if (has_table) stg(p.kv_slots + o, bid[u] >= 0 ? bid[u] * p.block_size + pos % p.block_size : int64_t(-1));
    if (i + 1 == e) s.last[rr] = tok[u];
    if (is_stop(p, stops_s, tok[u])) s.acc[rr] = 1;  // the stop flag (every writer stores 1)
  }
}

}  // namespace scan

template <int kT>
__global__ void __launch_bounds__(kT)
    accept_prefix_scan_kernel(AcceptPrefixScanParams p, int64_t chunk, int64_t* __restrict__ chunk_totals) {
  using namespace scan;
  DSPARK_DYNAMIC_SMEM(int64_t, smem);
  DSPARK_SHARED_ARRAY(int64_t, scratch, 64);  // two block-scan scratches
  DSPARK_SHARED_ARRAY(int64_t, stops_s, kMaxSmemStops);
  const Chunk s(smem, chunk);
  const int tid = threadIdx.x;
  const int64_t N = p.N, kp1 = p.K + 1;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t left = N - r0;
  const int64_t cnt = left < chunk ? (left > 0 ? left : 0) : chunk;
  const int64_t tile = cnt * kp1, dense0 = r0 * kp1;
  const bool one_round = tile <= int64_t(kSlots<kT>) * kT;
  if (p.num_stops <= kMaxSmemStops)
    for (int64_t i = tid; i < p.num_stops; i += kT) stops_s[i] = p.stop_token_ids.at(i);

  // A. per request
  for (int64_t b = 0; b < cnt; b += kT) load_requests<kT>(p, s, r0, cnt, b);
  __syncthreads();

  // B. per verify slot: the bonus test at slot i = n_r gives e_r
  int64_t tok[kSlots<kT>];
  for (int64_t q0 = tid; q0 < tile; q0 += int64_t(kSlots<kT>) * kT) {
DSPARK_UNROLL
    for (int u = 0; u < kSlots<kT>; ++u) {
      const int64_t q = q0 + int64_t(u) * kT;
      tok[u] = q < tile ? p.tokens.at(dense0 + q) : -1;
    }
DSPARK_UNROLL
    for (int u = 0; u < kSlots<kT>; ++u) {
      const int64_t q = q0 + int64_t(u) * kT;
      if (q >= tile) continue;
      const uint32_t rr = static_cast<uint32_t>(q) / static_cast<uint32_t>(kp1);
      const int64_t acc = s.acc[rr], room = s.room[rr];
      if (static_cast<int64_t>(q) - int64_t(rr) * kp1 != acc) continue;
      const int64_t e = acc + (tok[u] >= 0 ? 1 : 0);
      s.e[rr] = static_cast<int32_t>(e < room ? e : room);
    }
  }
  __syncthreads();

  // C. exclusive prefix sums of e over the chunk, then across chunks
  int64_t local = 0;
  for (int64_t b = 0, k = 0; b < cnt; b += kT, k ^= 1) {
    const int64_t rr = b + tid;
    int64_t sum;
    const int64_t excl = block_exclusive_scan<int64_t>(rr < cnt ? s.e[rr] : 0, scratch + 32 * k, &sum);
    if (rr < cnt) {
      s.cu[rr] = static_cast<int32_t>(local + excl);
      s.acc[rr] = 0;  // from here on: the stop flag
    }
    local += sum;
  }
  int64_t prefix = 0, total = local;
  if (gridDim.x > 1) {  // the chunks' totals: this chunk's prefix and the batch's total (the grid barrier frees
                        // both scratches)
    if (tid == 0) stg(chunk_totals + blockIdx.x, local);
    grid_sync();
    int64_t before = 0, all = 0;
    for (int64_t g = tid; g < gridDim.x; g += kT) {
      const int64_t v = ld_coherent(chunk_totals + g);
      all += v;
      before += g < blockIdx.x ? v : 0;
    }
    (void)block_exclusive_scan<int64_t>(before, scratch, &prefix);
    (void)block_exclusive_scan<int64_t>(all, scratch + 32, &total);
  }
  __syncthreads();

  // D. per verify slot: packed outputs, and -1 past the end
  for (int64_t q0 = tid; q0 < tile; q0 += int64_t(kSlots<kT>) * kT) {
    if (!one_round) {
DSPARK_UNROLL
      for (int u = 0; u < kSlots<kT>; ++u) {
        const int64_t q = q0 + int64_t(u) * kT;
        tok[u] = q < tile ? p.tokens.at(dense0 + q) : -1;
      }
    }
    write_slots<kT>(p, s, stops_s, r0, tile, q0, tok, prefix, total);
  }
  __syncthreads();

  // E. per request
  for (int64_t rr = tid; rr <= cnt; rr += kT) {
    const int64_t r = r0 + rr;
    if (rr == cnt) {  // cu_out[N], by the last chunk
      if (r == N) stg(p.cu_out + N, static_cast<int32_t>(total));
      continue;
    }
    const int64_t e = s.e[rr], new_len = wrapping_add(s.seq[rr], e);
    stg(p.cu_out + r, static_cast<int32_t>(prefix + s.cu[rr]));
    stg(p.new_seq_lens + r, static_cast<int32_t>(new_len));
    stg(p.next_anchor + r, e > 0 ? s.last[rr] : int64_t(-1));
    bool fin = s.acc[rr] != 0;
    if (p.max_seq_lens.present()) fin = fin || e >= s.room[rr];  // S + e >= max_seq_lens[r], exactly
    stg(p.finished + r, static_cast<uint8_t>(fin ? 1 : 0));
  }
}
// How the launch splits N requests (the same on both sides of the workspace query).
inline scan::Plan accept_prefix_scan_plan(int64_t N) {
  using namespace scan;
  if (N <= kSingleCtaMaxN) return Plan{1, N > 0 ? N : 1, threads_for(N), true};
  const size_t smem = size_t(kMaxChunk) * kSmemPerRequest;
  const int per_sm = max_active_blocks_per_sm(accept_prefix_scan_kernel<kThreads>, kThreads, smem);
  if (per_sm < 1) return Plan{1, N, kThreads, false};  // the occupancy query failed: refuse, never guess
  const int64_t resident = int64_t(device_sm_count()) * per_sm;
  int64_t grid = (N + kThreads - 1) / kThreads;  // at least 256 requests per CTA
  if (grid > resident) grid = resident;
  const int64_t chunk = ((N + grid - 1) / grid + 31) / 32 * 32;  // a multiple of 32: whole warps of requests
  grid = (N + chunk - 1) / chunk;
  return Plan{grid, chunk, kThreads, chunk <= kMaxChunk};
}

size_t accept_prefix_scan_workspace_bytes(int64_t N) {
  const scan::Plan plan = accept_prefix_scan_plan(N);
  return plan.grid > 1 ? size_t(plan.grid) * sizeof(int64_t) : 0;
}

bool accept_prefix_scan_fits(int64_t N) { return accept_prefix_scan_plan(N).ok; }

namespace scan {
template <int kT>
inline cudaError_t launch_with(const char* name, const AcceptPrefixScanParams& p, const LaunchConfig& cfg,
                               int64_t chunk, void* workspace) {
  const cudaError_t e = set_max_dynamic_smem(accept_prefix_scan_kernel<kT>, cfg.smem);  // above 48 KB at 1024
  if (e != cudaSuccess) return e;
  return launch(name, accept_prefix_scan_kernel<kT>, cfg, p, chunk, static_cast<int64_t*>(workspace));
}
}  // namespace scan

cudaError_t launch_accept_prefix_scan(const AcceptPrefixScanParams& p, void* workspace, cudaStream_t stream) {
  using namespace scan;
  const Plan plan = accept_prefix_scan_plan(p.N);
  if (!plan.ok) return cudaErrorInvalidValue;
  if (plan.grid > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.grid));
  cfg.block = dim3(plan.threads);
  cfg.smem = size_t(plan.chunk) * kSmemPerRequest;
  cfg.stream = stream;
  cfg.cooperative = plan.grid > 1;
  if (plan.grid > 1) return launch_with<kThreads>("accept_prefix_scan_kernel<cooperative>", p, cfg, plan.chunk, workspace);
  switch (plan.threads) {
    case 32: return launch_with<32>("accept_prefix_scan_kernel<32>", p, cfg, plan.chunk, workspace);
    case 256: return launch_with<256>("accept_prefix_scan_kernel<256>", p, cfg, plan.chunk, workspace);
    default: return launch_with<1024>("accept_prefix_scan_kernel<1024>", p, cfg, plan.chunk, workspace);
  }
}
#endif

}  // namespace dspark
