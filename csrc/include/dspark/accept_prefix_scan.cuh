// dspark/accept_prefix_scan.cuh: verification results -> the batch's bookkeeping, in ONE launch (no torch).
// Meaning: dspark_kernels/reference/accept_prefix_scan.py (the spec).
//
// Structure. The N requests are cut into G contiguous chunks of <= 1024 requests, one CTA each; the per-request
// values of a chunk (S, verify rows, e_r, its prefix, stop flag: 36 bytes each) stay in shared memory:
//   N <= 1024 (the launch-bound decode case): G = 1, one CTA of 1024 threads, a plain launch, no grid barrier;
//   N > 1024: G = min(resident CTAs, N / 256) CTAs of 256 threads in a cooperative launch (N up to ~800k on an
//            H200; 65536 -> 256 CTAs of 256 requests);
//   phase 1: each CTA computes e_r (accepted count from num_accepted or the leading run of accept_mask, the bonus
//            test, the length limit) for its chunk, and its chunk total; G > 1: the totals go to the workspace,
//            one grid barrier, and every CTA reads the G totals (its exclusive prefix and the batch total);
//   phase 2: a block scan of e over the chunk, then one thread per (request, emitted index i) of the chunk's dense
//            [rows, K+1] tile, 4 slots per thread with their token and block-table loads in flight together:
//            kept tokens (i < e_r) are written at cu_out[r] + i with their verify row and paged-KV slot; the dense
//            slots >= cu_out[N] that fall in the chunk's tile get -1 (so every slot of out_tokens / hidden_rows /
//            kv_slots is written exactly once, and tokens past e_r are never read); per request: cu_out[r+1],
//            new_seq_lens, next_anchor, finished (stop tokens from shared memory when there are <= 64).
// Integer inputs are int32 or int64 (a flag per array); all index arithmetic is 64-bit. Reads that could go out of
// bounds with inconsistent values (num_accepted, block-table columns) are clamped or skipped as the reference
// defines. The workspace holds the G chunk totals (int64), written before being read: no zeroing needed.
#pragma once

#include <stdint.h>

#include "block_scan.cuh"
#include "utils.cuh"

namespace dspark {

// A device array of int32 or int64 values.
struct IntArray {
  const void* ptr;
  bool is64;
  DSPARK_DEVICE int64_t at(int64_t i) const {
    return load_int(ptr, is64, i);
  }
  DSPARK_HOST_DEVICE_FN bool present() const { return ptr != nullptr; }
};

struct AcceptPrefixScanParams {
  int64_t N = 0, K = 0;                 // tokens is [N, K+1]
  IntArray tokens{nullptr, true};       // [N, K+1]
  IntArray seq_lens{nullptr, true};     // [N]
  IntArray num_accepted{nullptr, true}; // [N] or null (then accept_mask)
  const uint8_t* accept_mask = nullptr; // [N, K] bool or null
  IntArray verify_cu_seqlens{nullptr, true};  // [N+1] or null (dense r*(K+1))
  IntArray block_table{nullptr, true};  // [N, max_blocks] (may be null when max_blocks == 0)
  bool has_block_table = false;         // write kv_slots
  int64_t max_blocks = 0, block_size = 1;
  IntArray max_seq_lens{nullptr, true}; // [N] or null
  IntArray stop_token_ids{nullptr, true};  // [num_stops] or null
  int64_t num_stops = 0;
  // outputs
  int32_t* cu_out = nullptr;       // [N+1]
  int64_t* out_tokens = nullptr;   // [N*(K+1)]
  int32_t* new_seq_lens = nullptr; // [N]
  int64_t* next_anchor = nullptr;  // [N]
  int32_t* hidden_rows = nullptr;  // [N*(K+1)]
  int64_t* kv_slots = nullptr;     // [N*(K+1)], only with block_table
  uint8_t* finished = nullptr;     // [N] bool
};

namespace scan {
constexpr int kSmallThreads = 1024;        // the single-CTA launch (N <= 1024)
constexpr int kThreads = 256;              // the cooperative launch
constexpr int64_t kMaxChunk = 1024;        // requests per CTA (shared memory: 36 bytes each)
constexpr int64_t kSingleCtaMaxN = 1024;   // up to here: one CTA, no grid barrier
constexpr int kMaxSmemStops = 64;
constexpr int kUnroll = 4;                 // slots whose loads are in flight together
constexpr size_t kSmemPerRequest = 3 * sizeof(int64_t) + 3 * sizeof(int32_t);

struct Plan {
  int64_t grid, chunk;
  int threads;
  bool ok;
};
}  // namespace scan

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    accept_prefix_scan_kernel(AcceptPrefixScanParams p, int64_t chunk, int64_t* __restrict__ chunk_totals) {
  DSPARK_DYNAMIC_SMEM(int64_t, smem);
  int64_t* seq_s = smem;                     // [chunk] committed length S
  int64_t* rs_s = smem + chunk;              // [chunk] first verify row of the request
  int64_t* re_s = smem + 2 * chunk;          // [chunk] end of its verify rows
  int32_t* e_s = reinterpret_cast<int32_t*>(smem + 3 * chunk);  // [chunk] emitted count
  int32_t* cu_s = e_s + chunk;               // [chunk] exclusive prefix within the chunk
  int32_t* fl_s = e_s + 2 * chunk;           // [chunk] an emitted token is a stop token
  DSPARK_SHARED_ARRAY(int64_t, scratch, 32);
  DSPARK_SHARED_ARRAY(int64_t, stops_s, scan::kMaxSmemStops);
  constexpr int U = scan::kUnroll;

  const int tid = threadIdx.x;
  const int64_t N = p.N, K = p.K, kp1 = K + 1;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t left = N - r0;
  const int64_t cnt = left < chunk ? (left > 0 ? left : 0) : chunk;
  const bool smem_stops = p.num_stops <= scan::kMaxSmemStops;
  if (smem_stops)
    for (int64_t s = tid; s < p.num_stops; s += kThreads) stops_s[s] = p.stop_token_ids.at(s);

  // ---- phase 1: e_r (and what phase 2 needs per request) for the chunk
  int64_t local = 0;
  for (int64_t rr = tid; rr < cnt; rr += kThreads) {
    const int64_t r = r0 + rr;
    int64_t n_acc;
    if (p.num_accepted.present()) {
      n_acc = p.num_accepted.at(r);
      n_acc = n_acc < 0 ? 0 : (n_acc > K ? K : n_acc);
    } else {  // the leading run of True: all K flags are loaded (independent loads), the first False wins
      n_acc = K;
      for (int64_t j = 0; j < K; ++j)
        if (ldg(p.accept_mask + r * K + j) == 0 && n_acc == K) n_acc = j;
    }
    const int64_t seq = p.seq_lens.at(r);
    int64_t e = n_acc + (p.tokens.at(r * kp1 + n_acc) >= 0 ? 1 : 0);
    if (p.max_seq_lens.present()) {
      int64_t room = p.max_seq_lens.at(r) - seq;
      room = room < 0 ? 0 : room;
      e = e < room ? e : room;
    }
    int64_t rs = r * kp1, re = rs + kp1;
    if (p.verify_cu_seqlens.present()) {
      rs = p.verify_cu_seqlens.at(r);
      re = p.verify_cu_seqlens.at(r + 1);
    }
    seq_s[rr] = seq;
    rs_s[rr] = rs;
    re_s[rr] = re;
    e_s[rr] = static_cast<int32_t>(e);
    fl_s[rr] = 0;
    local += e;
  }
  int64_t prefix = 0, total = 0;
  if (gridDim.x == 1) {
    total = block_sum_int(local, scratch);
  } else {
    const int64_t mine = block_sum_int(local, scratch);
    if (tid == 0) stg(chunk_totals + blockIdx.x, mine);
    grid_sync();
    int64_t before = 0, all = 0;
    for (int64_t b = tid; b < gridDim.x; b += kThreads) {
      const int64_t v = ld_coherent(chunk_totals + b);
      all += v;
      if (b < blockIdx.x) before += v;
    }
    prefix = block_sum_int(before, scratch);
    total = block_sum_int(all, scratch);
  }

  // ---- block scan of e over the chunk: thread t owns a contiguous run of requests
  const int64_t per = (cnt + kThreads - 1) / kThreads;
  const int64_t lo = tid * per, hi = (lo + per < cnt ? lo + per : cnt);
  int64_t run = 0;
  for (int64_t rr = lo; rr < hi; ++rr) run += e_s[rr];
  int64_t off = block_exclusive_scan(run, scratch, static_cast<int64_t*>(nullptr));
  for (int64_t rr = lo; rr < hi; ++rr) {
    cu_s[rr] = static_cast<int32_t>(off);
    off += e_s[rr];
  }
  __syncthreads();

  // ---- phase 2a: the chunk's dense [cnt, K+1] tile, one thread per (request, emitted index); U slots per thread
  // have their token and block-table loads in flight together
  const int64_t tile = cnt * kp1;
  const int64_t dense0 = r0 * kp1;
  const bool has_table = p.has_block_table && p.kv_slots != nullptr;
  for (int64_t q0 = tid; q0 < tile; q0 += int64_t(U) * kThreads) {
    int64_t tok[U], bid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + int64_t(u) * kThreads;
      tok[u] = -1;
      bid[u] = -1;
      if (q >= tile) continue;
      const int64_t rr = q / kp1, i = q - rr * kp1, r = r0 + rr;
      if (i >= e_s[rr]) continue;
      tok[u] = p.tokens.at(r * kp1 + i);
      if (has_table) {
        const int64_t pos = seq_s[rr] - 1 + i;
        if (pos >= 0 && pos / p.block_size < p.max_blocks) bid[u] = p.block_table.at(r * p.max_blocks + pos / p.block_size);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + int64_t(u) * kThreads;
      if (q >= tile) continue;
      const int64_t rr = q / kp1, i = q - rr * kp1, r = r0 + rr;
      const int64_t e = e_s[rr];
      const int64_t d = dense0 + q;  // this thread's dense slot (for the -1 tail)
      if (d >= total) {
        stg(p.out_tokens + d, int64_t(-1));
        stg(p.hidden_rows + d, int32_t(-1));
        if (has_table) stg(p.kv_slots + d, int64_t(-1));
      }
      if (i >= e) continue;
      const int64_t o = prefix + cu_s[rr] + i;
      stg(p.out_tokens + o, tok[u]);
      if (i == e - 1) stg(p.next_anchor + r, tok[u]);
      const int64_t row = rs_s[rr] + i;
      stg(p.hidden_rows + o, static_cast<int32_t>(row < re_s[rr] ? row : -1));
      if (has_table) {
        const int64_t pos = seq_s[rr] - 1 + i;
        stg(p.kv_slots + o, bid[u] >= 0 ? bid[u] * p.block_size + pos % p.block_size : int64_t(-1));
      }
      bool stop = false;
      if (smem_stops) {
        for (int64_t s = 0; s < p.num_stops; ++s) stop |= stops_s[s] == tok[u];
      } else {
        for (int64_t s = 0; s < p.num_stops; ++s) stop |= p.stop_token_ids.at(s) == tok[u];
      }
      if (stop) fl_s[rr] = 1;  // benign: every writer stores 1
    }
  }
  __syncthreads();

  // ---- phase 2b: per request
  if (blockIdx.x == 0 && tid == 0) stg(p.cu_out, int32_t(0));
  for (int64_t rr = tid; rr < cnt; rr += kThreads) {
    const int64_t r = r0 + rr;
    const int64_t e = e_s[rr];
    stg(p.cu_out + r + 1, static_cast<int32_t>(prefix + cu_s[rr] + e));
    const int64_t new_len = seq_s[rr] + e;
    stg(p.new_seq_lens + r, static_cast<int32_t>(new_len));
    if (e == 0) stg(p.next_anchor + r, int64_t(-1));
    bool fin = fl_s[rr] != 0;
    if (p.max_seq_lens.present()) fin = fin || new_len >= p.max_seq_lens.at(r);
    stg(p.finished + r, static_cast<uint8_t>(fin ? 1 : 0));
  }
}
#endif

// How the launch splits N requests (the same on both sides of the workspace query).
inline scan::Plan accept_prefix_scan_plan(int64_t N) {
  using namespace scan;
  if (N <= kSingleCtaMaxN) return Plan{1, N > 0 ? N : 1, kSmallThreads, true};
  const size_t smem = size_t(kMaxChunk) * kSmemPerRequest;
  const int per_sm = max_active_blocks_per_sm(accept_prefix_scan_kernel<kThreads>, kThreads, smem);
  if (per_sm < 1) return Plan{1, N, kThreads, false};  // the occupancy query failed: refuse, never guess
  const int64_t resident = int64_t(device_sm_count()) * per_sm;
  int64_t grid = (N + kThreads - 1) / kThreads;  // at least 256 requests per CTA
  if (grid > resident) grid = resident;
  const int64_t chunk = (N + grid - 1) / grid;
  grid = (N + chunk - 1) / chunk;
  return Plan{grid, chunk, kThreads, chunk <= kMaxChunk};
}

// Workspace: the chunk totals (0 bytes for N <= 1024).
inline size_t accept_prefix_scan_workspace_bytes(int64_t N) {
  const scan::Plan plan = accept_prefix_scan_plan(N);
  return plan.grid > 1 ? size_t(plan.grid) * sizeof(int64_t) : 0;
}

// Launch on `stream`. The caller has checked shapes and dtypes (N >= 0, K >= 0, block_size > 0 with a table,
// N*(K+1) < 2^31 so cu_out fits int32). Returns cudaErrorInvalidValue when N exceeds what one launch keeps
// resident (1024 requests per resident CTA: about 800k on an H200), cudaSuccess for N == 0 after writing
// cu_out[0] = 0.
inline cudaError_t launch_accept_prefix_scan(const AcceptPrefixScanParams& p, void* workspace, cudaStream_t stream) {
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
  if (plan.grid == 1)
    return launch("accept_prefix_scan_kernel<1 CTA>", accept_prefix_scan_kernel<kSmallThreads>, cfg, p, plan.chunk,
                  static_cast<int64_t*>(workspace));
  return launch("accept_prefix_scan_kernel<cooperative>", accept_prefix_scan_kernel<kThreads>, cfg, p, plan.chunk,
                static_cast<int64_t*>(workspace));
}

}  // namespace dspark
