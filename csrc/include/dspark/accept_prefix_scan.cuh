// dspark/accept_prefix_scan.cuh: verification results -> the batch's bookkeeping, in ONE launch (no torch).
// Meaning: dspark_kernels/reference/accept_prefix_scan.py (the spec).
//
// Structure. The N requests are cut into G contiguous chunks, one CTA of 512 threads each (chunk <= 2048
// requests, kept in shared memory):
//   phase 1: each CTA computes e_r (accepted count from num_accepted or the leading run of accept_mask, the bonus
//            test, the length limit) for its chunk into shared memory and its chunk total;
//   G == 1 (N <= 1024, the launch-bound decode case): a plain launch, no grid barrier;
//   G > 1: a cooperative launch; each CTA writes its chunk total to the workspace, one grid barrier, and every CTA
//            reads the G totals (its exclusive prefix and the batch total; G <= resident CTAs, a few hundred);
//   phase 2: a block scan of e over the chunk, then one thread per (request, emitted index i) of the chunk's dense
//            [rows, K+1] tile: tokens are read once, coalesced; kept tokens (i < e_r) are written at
//            cu_out[r] + i with their verify row and paged-KV slot; the dense slots >= cu_out[N] that fall in the
//            chunk's tile get -1 (so every slot of out_tokens / hidden_rows / kv_slots is written exactly once);
//            per request: cu_out[r+1], new_seq_lens, next_anchor, finished (stop tokens from shared memory when
//            there are <= 64 of them).
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
    return is64 ? ldg(static_cast<const int64_t*>(ptr) + i) : static_cast<int64_t>(ldg(static_cast<const int32_t*>(ptr) + i));
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
  IntArray block_table{nullptr, true};  // [N, max_blocks] or null
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

namespace scan_detail {
constexpr int kThreads = 512;
constexpr int64_t kMaxChunk = 2048;      // requests per CTA (shared memory: 12 bytes each)
constexpr int64_t kSingleCtaMaxN = 1024;  // up to here: one CTA, no grid barrier
constexpr int kMaxSmemStops = 64;

struct Plan {
  int64_t grid, chunk;
  bool ok;
};
}  // namespace scan_detail

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    accept_prefix_scan_kernel(AcceptPrefixScanParams p, int64_t chunk, int64_t* __restrict__ chunk_totals) {
  DSPARK_DYNAMIC_SMEM(int32_t, smem);
  int32_t* e_s = smem;               // [chunk] emitted count
  int32_t* cu_s = smem + chunk;      // [chunk] exclusive prefix within the chunk
  int32_t* fl_s = smem + 2 * chunk;  // [chunk] an emitted token is a stop token
  DSPARK_SHARED_ARRAY(int64_t, scratch, 32);
  DSPARK_SHARED_ARRAY(int64_t, stops_s, scan_detail::kMaxSmemStops);

  const int tid = threadIdx.x;
  const int64_t N = p.N, K = p.K, kp1 = K + 1;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t cnt = (N - r0 < chunk ? N - r0 : chunk) > 0 ? (N - r0 < chunk ? N - r0 : chunk) : 0;
  const bool smem_stops = p.num_stops <= scan_detail::kMaxSmemStops;
  if (smem_stops)
    for (int64_t s = tid; s < p.num_stops; s += kThreads) stops_s[s] = p.stop_token_ids.at(s);

  // ---- phase 1: e_r for the chunk
  int64_t local = 0;
  for (int64_t rr = tid; rr < cnt; rr += kThreads) {
    const int64_t r = r0 + rr;
    int64_t n_acc;
    if (p.num_accepted.present()) {
      n_acc = p.num_accepted.at(r);
      n_acc = n_acc < 0 ? 0 : (n_acc > K ? K : n_acc);
    } else {
      n_acc = 0;
      while (n_acc < K && ldg(p.accept_mask + r * K + n_acc) != 0) ++n_acc;
    }
    int64_t e = n_acc + (p.tokens.at(r * kp1 + n_acc) >= 0 ? 1 : 0);
    if (p.max_seq_lens.present()) {
      int64_t room = p.max_seq_lens.at(r) - p.seq_lens.at(r);
      room = room < 0 ? 0 : room;
      e = e < room ? e : room;
    }
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

  // ---- phase 2a: the chunk's dense [cnt, K+1] tile, one thread per (request, emitted index)
  const int64_t tile = cnt * kp1;
  const int64_t dense0 = r0 * kp1;
  const bool has_table = p.block_table.present() && p.kv_slots != nullptr;
  for (int64_t q = tid; q < tile; q += kThreads) {
    const int64_t rr = q / kp1, i = q - rr * kp1, r = r0 + rr;
    const int64_t e = e_s[rr];
    const int64_t d = dense0 + q;  // this thread's dense slot (for the -1 tail)
    if (d >= total) {
      stg(p.out_tokens + d, int64_t(-1));
      stg(p.hidden_rows + d, int32_t(-1));
      if (has_table) stg(p.kv_slots + d, int64_t(-1));
    }
    if (i >= e) continue;
    const int64_t tok = p.tokens.at(r * kp1 + i);
    const int64_t o = prefix + cu_s[rr] + i;
    stg(p.out_tokens + o, tok);
    if (i == e - 1) stg(p.next_anchor + r, tok);
    int64_t row_start, row_end;
    if (p.verify_cu_seqlens.present()) {
      row_start = p.verify_cu_seqlens.at(r);
      row_end = p.verify_cu_seqlens.at(r + 1);
    } else {
      row_start = r * kp1;
      row_end = row_start + kp1;
    }
    const int64_t row = row_start + i;
    stg(p.hidden_rows + o, static_cast<int32_t>(row < row_end ? row : -1));
    if (has_table) {
      const int64_t pos = p.seq_lens.at(r) - 1 + i;
      int64_t slot = -1;
      if (pos >= 0) {
        const int64_t blk = pos / p.block_size;
        if (blk < p.max_blocks) {
          const int64_t id = p.block_table.at(r * p.max_blocks + blk);
          if (id >= 0) slot = id * p.block_size + (pos - blk * p.block_size);
        }
      }
      stg(p.kv_slots + o, slot);
    }
    bool stop = false;
    if (smem_stops) {
      for (int64_t s = 0; s < p.num_stops; ++s) stop |= stops_s[s] == tok;
    } else {
      for (int64_t s = 0; s < p.num_stops; ++s) stop |= p.stop_token_ids.at(s) == tok;
    }
    if (stop) fl_s[rr] = 1;  // benign: every writer stores 1
  }
  __syncthreads();

  // ---- phase 2b: per request
  if (blockIdx.x == 0 && tid == 0) stg(p.cu_out, int32_t(0));
  for (int64_t rr = tid; rr < cnt; rr += kThreads) {
    const int64_t r = r0 + rr;
    const int64_t e = e_s[rr];
    stg(p.cu_out + r + 1, static_cast<int32_t>(prefix + cu_s[rr] + e));
    const int64_t new_len = p.seq_lens.at(r) + e;
    stg(p.new_seq_lens + r, static_cast<int32_t>(new_len));
    if (e == 0) stg(p.next_anchor + r, int64_t(-1));
    bool fin = fl_s[rr] != 0;
    if (p.max_seq_lens.present()) fin = fin || new_len >= p.max_seq_lens.at(r);
    stg(p.finished + r, static_cast<uint8_t>(fin ? 1 : 0));
  }
}
#endif

// How the launch splits N requests (the same on both sides of the workspace query).
inline scan_detail::Plan accept_prefix_scan_plan(int64_t N) {
  using namespace scan_detail;
  if (N <= kSingleCtaMaxN) return Plan{1, N > 0 ? N : 1, true};
  const int64_t smem = 3 * kMaxChunk * int64_t(sizeof(int32_t));
  int64_t resident = int64_t(device_sm_count()) *
                     max_active_blocks_per_sm(accept_prefix_scan_kernel<kThreads>, kThreads, size_t(smem));
  if (resident < 1) resident = 1;
  int64_t grid = (N + kThreads - 1) / kThreads;  // at least 512 requests per CTA
  if (grid > resident) grid = resident;
  const int64_t chunk = (N + grid - 1) / grid;
  grid = (N + chunk - 1) / chunk;
  return Plan{grid, chunk, chunk <= kMaxChunk};
}

// Workspace: the chunk totals (0 bytes for N <= 1024).
inline size_t accept_prefix_scan_workspace_bytes(int64_t N) {
  const scan_detail::Plan plan = accept_prefix_scan_plan(N);
  return plan.grid > 1 ? size_t(plan.grid) * sizeof(int64_t) : 0;
}

// Launch on `stream`. The caller has checked shapes and dtypes (N >= 0, K >= 0, block_size > 0 with a table,
// N*(K+1) < 2^31 so cu_out fits int32). Returns cudaErrorInvalidValue when N exceeds what one launch can keep
// resident (about 2048 requests per resident CTA: over a million on an H200), cudaSuccess for N == 0 after
// writing cu_out[0] = 0.
inline cudaError_t launch_accept_prefix_scan(const AcceptPrefixScanParams& p, void* workspace, cudaStream_t stream) {
  using namespace scan_detail;
  const Plan plan = accept_prefix_scan_plan(p.N);
  if (!plan.ok) return cudaErrorInvalidValue;
  if (plan.grid > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.grid));
  cfg.block = dim3(kThreads);
  cfg.smem = size_t(3 * plan.chunk) * sizeof(int32_t);
  cfg.stream = stream;
  cfg.cooperative = plan.grid > 1;
  return launch("accept_prefix_scan_kernel", accept_prefix_scan_kernel<kThreads>, cfg, p, plan.chunk,
                static_cast<int64_t*>(workspace));
}

}  // namespace dspark
