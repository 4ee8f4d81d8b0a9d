// dspark/dist_rows.cuh: what the vocabulary-parallel shard passes share (no torch): where a request's target row
// lies in a dense or packed shard tensor, and the id of an empty candidate slot.
#pragma once

#include <stdint.h>

#include "platform.cuh"
#include "vec.cuh"

namespace dspark {
namespace dist {

constexpr float kEmptyId = 16777216.0f;  // layout.EMPTY_ID (2^24): above every token id

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
    int64_t r = load_int(cu_seqlens, cu_i64, n) + j;
    r = r < 0 ? 0 : (r >= total_rows ? total_rows - 1 : r);
    return r * Vl;
  }

  DSPARK_DEVICE const void* row(int64_t offset) const {
    return static_cast<const char*>(data) + static_cast<size_t>(offset) * (dtype == DType::kFloat32 ? 4 : 2);
  }
#endif
};

}  // namespace dist
}  // namespace dspark
