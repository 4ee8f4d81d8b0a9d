// What the launchers of the vocabulary-parallel shard passes (csrc/torch/dist_*.cu) check alike: the shard's target
// rows (dense [N, K+1, Vl] or packed [R, Vl] with cu_seqlens) and its place in the vocabulary.
#pragma once

#include "common.h"
#include "dspark/dist_rows.cuh"

namespace dspark_torch {

constexpr int64_t kMaxShardedVocab = int64_t(1) << 24;  // layout.MAX_VOCAB: ids travel as float32 slots

// The target rows of a shard for N requests with K drafts; Vl >= 1.
inline dspark::dist::TargetRows check_target_shard(const char* op, const at::Tensor& target_shard,
                                                   const std::optional<at::Tensor>& cu_seqlens,
                                                   const at::Tensor& like, int64_t N, int64_t K) {
  dspark::dist::TargetRows rows;
  rows.dtype = check_float(op, "target_shard", target_shard, like);
  if (cu_seqlens) {
    TORCH_CHECK(target_shard.dim() == 2, op, ": target_shard must be packed [R, Vl] with cu_seqlens, got shape ",
                target_shard.sizes());
    rows.cu_i64 = check_int(op, "cu_seqlens", *cu_seqlens, like, {N + 1});
    rows.cu_seqlens = cu_seqlens->data_ptr();
    rows.total_rows = target_shard.size(0);
  } else {
    check_shape(op, "target_shard", target_shard, {N, K + 1, kAnySize});
  }
  TORCH_CHECK(target_shard.size(-1) >= 1, op, ": target_shard must have at least one column (the shard's size)");
  rows.data = target_shard.data_ptr();
  return rows;
}

// The shard [vocab_start, vocab_start + Vl) lies in [0, vocab_size), vocab_size <= 2^24.
inline void check_shard_span(const char* op, int64_t vocab_start, int64_t Vl, int64_t vocab_size) {
  TORCH_CHECK(vocab_start >= 0 && vocab_start + Vl <= vocab_size && vocab_size <= kMaxShardedVocab, op,
              ": the shard [vocab_start, vocab_start + Vl) = [", vocab_start, ", ", vocab_start + Vl,
              ") must lie in [0, vocab_size = ", vocab_size, ") with vocab_size <= 2^24");
}

}  // namespace dspark_torch
