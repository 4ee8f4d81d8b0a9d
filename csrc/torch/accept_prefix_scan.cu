// Torch launcher of accept_prefix_scan (the kernel lives in csrc/include/dspark/accept_prefix_scan.cuh).
#include "common.h"
#include "dspark/accept_prefix_scan.cuh"

#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

namespace dspark_torch {
namespace {

constexpr const char* kScanOp = "accept_prefix_scan";

dspark::IntArray scan_int_array(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& like,
                           int64_t numel) {
  if (!t.has_value()) return dspark::IntArray{nullptr, true};
  check_input(kScanOp, name, *t, like);
  TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, kScanOp, ": ", name,
              " must be int32 or int64, got ", t->scalar_type());
  TORCH_CHECK(numel < 0 || t->numel() == numel, kScanOp, ": ", name, " must have ", numel, " elements, got shape ",
              t->sizes());
  return dspark::IntArray{t->data_ptr(), t->scalar_type() == at::kLong};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> accept_prefix_scan(
    const at::Tensor& tokens, const at::Tensor& seq_lens, const std::optional<at::Tensor>& num_accepted,
    const std::optional<at::Tensor>& accept_mask, const std::optional<at::Tensor>& verify_cu_seqlens,
    const std::optional<at::Tensor>& block_table, int64_t block_size, const std::optional<at::Tensor>& max_seq_lens,
    const std::optional<at::Tensor>& stop_token_ids) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1, kScanOp, ": tokens must have shape [N, K+1], got ",
              tokens.sizes());
  const int64_t N = tokens.size(0), kp1 = tokens.size(1), K = kp1 - 1;
  TORCH_CHECK(N * kp1 < (int64_t(1) << 31), kScanOp, ": N*(K+1) must be < 2^31 (cu_out is int32), got ", N * kp1);
  dspark::AcceptPrefixScanParams p;
  p.N = N;
  p.K = K;
  p.tokens = scan_int_array("tokens", tokens, tokens, N * kp1);
  TORCH_CHECK(seq_lens.dim() == 1, kScanOp, ": seq_lens must have shape [N], got ", seq_lens.sizes());
  p.seq_lens = scan_int_array("seq_lens", seq_lens, tokens, N);
  TORCH_CHECK(num_accepted.has_value() != accept_mask.has_value(), kScanOp,
              ": exactly one of num_accepted and accept_mask must be given");
  p.num_accepted = scan_int_array("num_accepted", num_accepted, tokens, N);
  if (accept_mask.has_value()) {
    check_input(kScanOp, "accept_mask", *accept_mask, tokens);
    check_dtype(kScanOp, "accept_mask", *accept_mask, at::kBool);
    TORCH_CHECK(accept_mask->dim() == 2 && accept_mask->size(0) == N && accept_mask->size(1) == K, kScanOp,
                ": accept_mask must have shape [", N, ", ", K, "], got ", accept_mask->sizes());
    p.accept_mask = reinterpret_cast<const uint8_t*>(accept_mask->data_ptr<bool>());
  }
  p.verify_cu_seqlens = scan_int_array("verify_cu_seqlens", verify_cu_seqlens, tokens, N + 1);
  if (block_table.has_value()) {
    TORCH_CHECK(block_table->dim() == 2 && block_table->size(0) == N, kScanOp,
                ": block_table must have shape [N, max_blocks], got ", block_table->sizes());
    TORCH_CHECK(block_size > 0, kScanOp, ": block_size must be > 0, got ", block_size);
    p.block_table = scan_int_array("block_table", block_table, tokens, -1);
    p.max_blocks = block_table->size(1);
    p.has_block_table = true;
    p.block_size = block_size;
  }
  p.max_seq_lens = scan_int_array("max_seq_lens", max_seq_lens, tokens, N);
  if (stop_token_ids.has_value()) {
    TORCH_CHECK(stop_token_ids->dim() == 1, kScanOp, ": stop_token_ids must have 1 dimension, got shape ",
                stop_token_ids->sizes());
    p.stop_token_ids = scan_int_array("stop_token_ids", stop_token_ids, tokens, -1);
    p.num_stops = stop_token_ids->numel();
  }
  const auto i32 = tokens.options().dtype(at::kInt), i64 = tokens.options().dtype(at::kLong);
  at::Tensor cu_out = at::empty({N + 1}, i32);
  at::Tensor out_tokens = at::empty({N * kp1}, i64);
  at::Tensor new_seq = at::empty({N}, i32);
  at::Tensor anchor = at::empty({N}, i64);
  at::Tensor rows = at::empty({N * kp1}, i32);
  at::Tensor slots = at::empty({block_table.has_value() ? N * kp1 : 0}, i64);
  at::Tensor finished = at::empty({N}, tokens.options().dtype(at::kBool));
  p.cu_out = cu_out.data_ptr<int32_t>();
  p.out_tokens = out_tokens.data_ptr<int64_t>();
  p.new_seq_lens = new_seq.data_ptr<int32_t>();
  p.next_anchor = anchor.data_ptr<int64_t>();
  p.hidden_rows = rows.data_ptr<int32_t>();
  p.kv_slots = block_table.has_value() ? slots.data_ptr<int64_t>() : nullptr;
  p.finished = reinterpret_cast<uint8_t*>(finished.data_ptr<bool>());
  const DeviceGuard guard(tokens);  // the plan reads the current device's SM count and occupancy
  const size_t ws_bytes = dspark::accept_prefix_scan_workspace_bytes(N);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, tokens.options().dtype(at::kByte));
  const cudaError_t err = dspark::launch_accept_prefix_scan(p, ws_bytes ? ws.data_ptr() : nullptr,
                                                            current_stream(tokens));
  TORCH_CHECK(err != cudaErrorInvalidValue, kScanOp, ": N = ", N, " requests exceed what one launch keeps resident");
  check_launch(err, kScanOp);
  return {cu_out, out_tokens, new_seq, anchor, rows, slots, finished};
}

}  // namespace

DSPARK_LIBRARY_FRAGMENT(m) {
  m.def("accept_prefix_scan(Tensor tokens, Tensor seq_lens, Tensor? num_accepted, Tensor? accept_mask, "
        "Tensor? verify_cu_seqlens, Tensor? block_table, int block_size, Tensor? max_seq_lens, "
        "Tensor? stop_token_ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}
DSPARK_LIBRARY_IMPL(m) {
  m.impl("accept_prefix_scan", &accept_prefix_scan);
}

}  // namespace dspark_torch
