// dspark/dist_rows.cuh: what the vocabulary-parallel pieces share (no torch): the exchanged layouts' slots
// (dspark_kernels/distributed/layout.py) and where a request's target row lies in a dense or packed shard tensor.
#pragma once

#include <stdint.h>

#include "packed_rows.cuh"
#include "platform.cuh"
#include "vec.cuh"

namespace dspark {
namespace dist {

constexpr float kEmptyId = 16777216.0f;  // layout.EMPTY_ID (2^24): above every token id

// StatsLayout: the first exchange's slots per (request, row, shard)
constexpr int kAmaxVal = 0, kAmaxId = 1, kTMax = 2, kTSum = 3, kTBad = 4, kTAt = 5, kQMax = 6, kQSum = 7, kQBad = 8,
              kQAt = 9;
DSPARK_HOST_DEVICE_FN int64_t stats_width(bool sampled, bool draft) {
  return sampled ? (draft ? kQAt + 1 : kTAt + 1) : kAmaxId + 1;
}
// PLAN_* (the decide step -> the residual pass) and RES_* (the second exchange)
constexpr int kPlanRow = 0, kPlanNeed = 1, kPlanRho = 2, kPlanTMax = 3, kPlanTSum = 4, kPlanTBad = 5, kPlanQMax = 6,
              kPlanQSum = 7, kPlanQBad = 8, kPlanWidth = 9;
constexpr int kResMass = 0, kResScore = 1, kResId = 2, kResGScore = 3, kResGId = 4, kResWidth = 5;
// The residual plan's slots per request: 0 greedy, 1 token (the emitting row), K+1 block (every row)
DSPARK_HOST_DEVICE_FN int64_t plan_slots(bool sampled, bool block, int64_t K) {
  return sampled ? (block ? K + 1 : 1) : 0;
}

// The target logits of one shard: dense [N, K+1, Vl], or packed [total_rows, Vl] with cu_seqlens [N+1].
struct TargetRows {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  const void* cu_seqlens = nullptr;
  bool cu_i64 = false;
  int64_t total_rows = 0;

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
  // The element offset of request n's row j (a packed row clamped into the tensor, as the reference's
  // gather_target_rows reads it); -1 when the packed tensor has no rows (the reference reads zeros).
  DSPARK_DEVICE int64_t offset(int64_t n, int64_t j, int64_t K, int64_t Vl) const {
    if (cu_seqlens == nullptr) return (n * (K + 1) + j) * Vl;
    if (total_rows == 0) return -1;
    return clamped_row(load_int(cu_seqlens, cu_i64, n), j, total_rows) * Vl;
  }

  DSPARK_DEVICE const void* row(int64_t offset) const {
    return static_cast<const char*>(data) + static_cast<size_t>(offset) * (dtype == DType::kFloat32 ? 4 : 2);
  }
#endif
};

}  // namespace dist
}  // namespace dspark
