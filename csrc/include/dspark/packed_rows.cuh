// dspark/packed_rows.cuh: which packed target rows a request owns (reference.verify_chain.packed_last_row).
#pragma once

#include <stdint.h>

#include "platform.cuh"

namespace dspark {

// The last of request r's packed rows, -1 for none: it owns [start, min(end, total_rows)) when
// 0 <= start < total_rows and end > start (start = cu_seqlens[r], end = cu_seqlens[r + 1]), at most K + 1 rows.
// The offsets are compared before anything is subtracted, so no int64 pair overflows.
DSPARK_HOST_DEVICE_FN int64_t packed_last_row(int64_t start, int64_t end, int64_t total_rows, int64_t K) {
  if (start < 0 || start >= total_rows || end <= start) return -1;
  const int64_t rows = (end < total_rows ? end : total_rows) - start;
  return (rows < K + 1 ? rows : K + 1) - 1;
}

// Row start + j clamped into [0, total_rows) (total_rows > 0, 0 <= j), without forming an overflowing sum.
DSPARK_HOST_DEVICE_FN int64_t clamped_row(int64_t start, int64_t j, int64_t total_rows) {
  if (start >= total_rows - j) return total_rows - 1;
  return start < -j ? 0 : start + j;
}

}  // namespace dspark
