// CPU kernel of accept_prefix_scan (the meaning: dspark_kernels/reference/accept_prefix_scan.py): one pass over the
// requests, in order, so the exclusive prefix sum of the emitted counts is a running total.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "common.h"
#include "dspark/scan_lengths.h"

namespace dspark_cpu {

namespace {

// floor(a / b) and the non-negative remainder, for b > 0 (Python's // and %).
int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && (a < 0)); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

// Accepted drafts n_r: num_accepted clamped to [0, K], or the leading run of True in accept_mask.
int64_t accepted(const at::Tensor& num_accepted, const at::Tensor& accept_mask, int64_t r, int64_t K) {
  if (num_accepted.defined()) return std::clamp<int64_t>(num_accepted.data_ptr<int64_t>()[r], 0, K);
  const bool* m = accept_mask.data_ptr<bool>() + r * K;
  int64_t n = 0;
  while (n < K && m[n]) ++n;
  return n;
}

using dspark::scan::exact_room;
using dspark::scan::wrapping_add;

// The paged-KV slot of position p (-1 where p < 0, outside the table, or at a negative block id).
int64_t kv_slot(const int64_t* table, int64_t max_blocks, int64_t block_size, int64_t p) {
  const int64_t blk = floor_div(p, block_size);
  if (p < 0 || blk < 0 || blk >= max_blocks) return -1;
  const int64_t id = table[blk];
  return id < 0 ? -1 : id * block_size + floor_mod(p, block_size);
}

// Whether one of row[0..e) is a stop token.
bool emits_stop(const int64_t* row, int64_t e, const at::Tensor& stops) {
  if (!stops.defined()) return false;
  const int64_t* ids = stops.data_ptr<int64_t>();
  for (int64_t i = 0; i < e; ++i) {
    if (std::find(ids, ids + stops.numel(), row[i]) != ids + stops.numel()) return true;
  }
  return false;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> accept_prefix_scan(
    const at::Tensor& tokens_in, const at::Tensor& seq_lens_in, const std::optional<at::Tensor>& num_accepted_in,
    const std::optional<at::Tensor>& accept_mask_in, const std::optional<at::Tensor>& verify_cu_seqlens,
    const std::optional<at::Tensor>& block_table_in, int64_t block_size, const std::optional<at::Tensor>& max_seq_lens,
    const std::optional<at::Tensor>& stop_token_ids) {
  const int64_t N = tokens_in.size(0), KP1 = tokens_in.size(1), K = KP1 - 1;
  const at::Tensor tokens = as_long(tokens_in), seq = as_long(seq_lens_in);
  const at::Tensor n_in = num_accepted_in ? as_long(*num_accepted_in) : at::Tensor();
  const at::Tensor mask = accept_mask_in ? accept_mask_in->contiguous() : at::Tensor();
  const at::Tensor vcu = verify_cu_seqlens ? as_long(*verify_cu_seqlens) : at::Tensor();
  const at::Tensor table = block_table_in ? as_long(*block_table_in) : at::Tensor();
  const at::Tensor limit = max_seq_lens ? as_long(*max_seq_lens) : at::Tensor();
  const at::Tensor stops = stop_token_ids ? as_long(*stop_token_ids) : at::Tensor();
  const auto opts = tokens_in.options();

  at::Tensor cu_out = at::zeros({N + 1}, opts.dtype(at::kInt));
  at::Tensor out_tokens = at::full({N * KP1}, -1, opts.dtype(at::kLong));
  at::Tensor new_seq_lens = at::empty({N}, opts.dtype(at::kInt));
  at::Tensor next_anchor = at::empty({N}, opts.dtype(at::kLong));
  at::Tensor hidden_rows = at::full({N * KP1}, -1, opts.dtype(at::kInt));
  at::Tensor kv_slots = at::full({table.defined() ? N * KP1 : 0}, -1, opts.dtype(at::kLong));
  at::Tensor finished = at::zeros({N}, opts.dtype(at::kBool));

  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* s = seq.data_ptr<int64_t>();
  const int64_t max_blocks = table.defined() ? table.size(1) : 0;
  int64_t total = 0;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t* row = tok + r * KP1;
    const int64_t n = accepted(n_in, mask, r, K);
    int64_t e = n + (row[n] >= 0 ? 1 : 0);
    const int64_t room = limit.defined() ? exact_room(limit.data_ptr<int64_t>()[r], s[r]) : INT64_MAX;
    e = std::min(e, room);
    const int64_t start = vcu.defined() ? vcu.data_ptr<int64_t>()[r] : r * KP1;
    const int64_t end = vcu.defined() ? vcu.data_ptr<int64_t>()[r + 1] : start + KP1;
    const uint64_t own = end > start ? static_cast<uint64_t>(end) - static_cast<uint64_t>(start) : 0;  // exact
    for (int64_t i = 0; i < e; ++i) {
      out_tokens.data_ptr<int64_t>()[total + i] = row[i];
      const bool mine = static_cast<uint64_t>(i) < own;
      hidden_rows.data_ptr<int32_t>()[total + i] = static_cast<int32_t>(mine ? start + i : -1);
      if (table.defined()) {
        kv_slots.data_ptr<int64_t>()[total + i] =
            kv_slot(table.data_ptr<int64_t>() + r * max_blocks, max_blocks, block_size, wrapping_add(s[r], i - 1));
      }
    }
    total += e;
    cu_out.data_ptr<int32_t>()[r + 1] = static_cast<int32_t>(total);
    new_seq_lens.data_ptr<int32_t>()[r] = static_cast<int32_t>(wrapping_add(s[r], e));
    next_anchor.data_ptr<int64_t>()[r] = e > 0 ? row[e - 1] : -1;
    const bool at_limit = limit.defined() && e >= room;  // S + e >= max_seq_lens[r], exactly
    finished.data_ptr<bool>()[r] = at_limit || emits_stop(row, e, stops);
  }
  return {cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows, kv_slots, finished};
}

}  // namespace dspark_cpu
