// Torch launcher of accept_prefix_scan (the kernel lives in dspark/accept_prefix_scan.cuh).
#include "common.h"
#include "dspark/accept_prefix_scan.h"

#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

namespace dspark_torch::accept_prefix_scan {

constexpr const char* kOp = "accept_prefix_scan";

// An optional int32 / int64 input of this shape as the kernel's IntArray (null when absent).
dspark::IntArray int_array(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& like,
                           std::initializer_list<int64_t> shape) {
  if (!t.has_value()) return dspark::IntArray{nullptr, true};
  const bool is_int64 = check_int(kOp, name, *t, like, shape);
  return dspark::IntArray{t->data_ptr(), is_int64};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> launch(
    const at::Tensor& tokens, const at::Tensor& seq_lens, const std::optional<at::Tensor>& num_accepted,
    const std::optional<at::Tensor>& accept_mask, const std::optional<at::Tensor>& verify_cu_seqlens,
    const std::optional<at::Tensor>& block_table, int64_t block_size, const std::optional<at::Tensor>& max_seq_lens,
    const std::optional<at::Tensor>& stop_token_ids) {
  check_shape(kOp, "tokens", tokens, {kAnySize, kAnySize});
  TORCH_CHECK(tokens.size(1) >= 1, kOp, ": tokens must have shape [N, K+1], got ", tokens.sizes());
  const int64_t N = tokens.size(0), kp1 = tokens.size(1), K = kp1 - 1;
  TORCH_CHECK(N * kp1 < (int64_t(1) << 31), kOp, ": N*(K+1) must be < 2^31 (cu_out is int32), got ", N * kp1);
  dspark::AcceptPrefixScanParams p;
  p.N = N;
  p.K = K;
  p.tokens = int_array("tokens", tokens, tokens, {N, kp1});
  p.seq_lens = int_array("seq_lens", seq_lens, tokens, {N});
  TORCH_CHECK(num_accepted.has_value() != accept_mask.has_value(), kOp,
              ": exactly one of num_accepted and accept_mask must be given");
  p.num_accepted = int_array("num_accepted", num_accepted, tokens, {N});
  if (accept_mask.has_value()) {
    check_tensor(kOp, "accept_mask", *accept_mask, tokens, at::kBool, {N, K});
    p.accept_mask = reinterpret_cast<const uint8_t*>(accept_mask->data_ptr<bool>());
  }
  p.verify_cu_seqlens = int_array("verify_cu_seqlens", verify_cu_seqlens, tokens, {N + 1});
  if (block_table.has_value()) {
    p.block_table = int_array("block_table", block_table, tokens, {N, kAnySize});
    TORCH_CHECK(block_size > 0, kOp, ": block_size must be > 0, got ", block_size);
    p.max_blocks = block_table->size(1);
    p.has_block_table = true;
    p.block_size = block_size;
  }
  p.max_seq_lens = int_array("max_seq_lens", max_seq_lens, tokens, {N});
  if (stop_token_ids.has_value()) {
    p.stop_token_ids = int_array("stop_token_ids", stop_token_ids, tokens, {kAnySize});
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
  TORCH_CHECK(err != cudaErrorInvalidValue, kOp, ": N = ", N, " requests exceed what one launch keeps resident");
  check_launch(err, kOp);
  return {cu_out, out_tokens, new_seq, anchor, rows, slots, finished};
}

}  // namespace dspark_torch::accept_prefix_scan

DSPARK_LIBRARY_IMPL(m) {
  m.impl("accept_prefix_scan", &dspark_torch::accept_prefix_scan::launch);
}
