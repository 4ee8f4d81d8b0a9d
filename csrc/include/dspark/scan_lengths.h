// dspark/scan_lengths.h: accept_prefix_scan's length arithmetic, shared by its kernel (dspark/accept_prefix_scan.cuh)
// and its CPU kernel (csrc/cpu/accept_prefix_scan.cpp). Plain C++: it includes no CUDA header, so a host compiler
// without the CUDA toolkit on its include path builds the CPU kernel.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DSPARK_SCAN_LENGTH_FN __host__ __device__ __forceinline__
#else
#define DSPARK_SCAN_LENGTH_FN inline
#endif

namespace dspark {
namespace scan {
// Length arithmetic shared by the kernel and the CPU kernel (the reference's meaning, with no int64 overflow).
// a + b in int64 as torch computes it: wrapping, never the undefined signed overflow.
DSPARK_SCAN_LENGTH_FN int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
// max(limit - seq, 0) exactly, capped at INT64_MAX (the room before a length limit): a true difference past
// int64's range wraps negative, and is then the cap.
DSPARK_SCAN_LENGTH_FN int64_t exact_room(int64_t limit, int64_t seq) {
  if (limit <= seq) return 0;
  const int64_t gap = static_cast<int64_t>(static_cast<uint64_t>(limit) - static_cast<uint64_t>(seq));
  return gap < 0 ? INT64_MAX : gap;
}
}  // namespace scan
}  // namespace dspark
