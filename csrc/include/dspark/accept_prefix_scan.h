// dspark/accept_prefix_scan.h: the host interface of accept_prefix_scan: its parameters, workspace and launch (plain
// C++ over the CUDA runtime's types; no torch, no device code). dspark/accept_prefix_scan.cuh holds the kernel and
// defines the functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "scan_lengths.h"  // scan::wrapping_add, scan::exact_room
#include "vec.cuh"  // load_int (device side)

namespace dspark {

// A device array of int32 or int64 values.
struct IntArray {
  const void* ptr;
  bool is64;
#if defined(__CUDACC__) || defined(DSPARK_SIMT)
  DSPARK_DEVICE int64_t at(int64_t i) const { return load_int(ptr, is64, i); }
#endif
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


// Workspace: the chunk totals (0 bytes for N <= 1024).
size_t accept_prefix_scan_workspace_bytes(int64_t N);

// Whether one launch keeps N requests resident on the current device (launch_accept_prefix_scan returns
// cudaErrorInvalidValue when it does not).
bool accept_prefix_scan_fits(int64_t N);

// Launch on `stream`. The caller has checked shapes and dtypes (N >= 0, K >= 0, block_size > 0 with a table,
// N*(K+1) < 2^31 so cu_out fits int32). Returns cudaErrorInvalidValue when N exceeds what one launch keeps
// resident (1024 requests per resident CTA: about 800k on an H200), cudaSuccess for N == 0 after writing
// cu_out[0] = 0.
cudaError_t launch_accept_prefix_scan(const AcceptPrefixScanParams& p, void* workspace, cudaStream_t stream);

}  // namespace dspark
