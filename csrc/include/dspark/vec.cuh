// dspark/vec.cuh: element types and 16-byte vector access of rows of logits (no torch).
//
// Rows of fp32 / bf16 / fp16 logits are read with 16-byte loads (4 or 8 elements) wherever the row allows: a scalar
// head up to the first 16-byte boundary, whole vectors, then a scalar tail, so any V and any row start work (a
// packed [R, V] bf16 tensor with odd V has rows at every 2-byte offset). All arithmetic is float32.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "platform.cuh"

namespace dspark {

// Element types of the float inputs, numbered as the C ABI numbers them (dspark.h: DSPARK_DTYPE_*). kFloat8E4M3 is
// only a quantized W2 of draft_block (with per-row scales); DSPARK_DISPATCH_FLOAT and load_float do not take it.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3 };

// Run `...` with `T` bound to the C++ type of `dtype` (float, __nv_bfloat16, __half); `on_bad` otherwise.
#define DSPARK_DISPATCH_FLOAT(dtype, T, on_bad, ...)        \
  switch (dtype) {                                          \
    case ::dspark::DType::kFloat32: {                       \
      using T = float;                                      \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    case ::dspark::DType::kBFloat16: {                      \
      using T = __nv_bfloat16;                              \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    case ::dspark::DType::kFloat16: {                       \
      using T = __half;                                     \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    default:                                                \
      on_bad;                                               \
  }

DSPARK_HOST_DEVICE_FN float to_float(float v) { return v; }
DSPARK_HOST_DEVICE_FN float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
DSPARK_HOST_DEVICE_FN float to_float(__half v) { return __half2float(v); }
DSPARK_HOST_DEVICE_FN float to_float(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

// The two 16-bit values packed in `w` (the one at the lower address first) as float32. A bf16 is a float's high
// half, so its pair is a shift and a mask (one instruction each; the element-wise conversion spends two on the
// high one).
template <typename T>
DSPARK_HOST_DEVICE_FN void widen_pair(uint32_t w, float& lo, float& hi);
template <>
DSPARK_HOST_DEVICE_FN void widen_pair<__nv_bfloat16>(uint32_t w, float& lo, float& hi) {
  const uint32_t bits[2] = {w << 16, w & 0xffff0000u};
  memcpy(&lo, &bits[0], 4);
  memcpy(&hi, &bits[1], 4);
}
template <>
DSPARK_HOST_DEVICE_FN void widen_pair<__half>(uint32_t w, float& lo, float& hi) {
  __half h[2];
  memcpy(h, &w, 4);
  lo = to_float(h[0]);
  hi = to_float(h[1]);
}

template <typename T>
DSPARK_HOST_DEVICE_FN T from_float(float v);
template <>
DSPARK_HOST_DEVICE_FN float from_float<float>(float v) { return v; }
template <>
DSPARK_HOST_DEVICE_FN __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
DSPARK_HOST_DEVICE_FN __half from_float<__half>(float v) { return __float2half(v); }

DSPARK_HOST_DEVICE_FN bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16 bytes of elements.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = static_cast<int>(16 / sizeof(T));
  T v[kN];
};

// One 16-byte global load (p must be 16-byte aligned).
template <typename T>
DSPARK_DEVICE Vec16<T> load16(const T* p) {
  const uint4 raw = ldg(reinterpret_cast<const uint4*>(p));
  Vec16<T> out;
  memcpy(&out, &raw, 16);
  return out;
}

template <typename T>
DSPARK_DEVICE void store16(T* p, const Vec16<T>& v) {
  uint4 raw;
  memcpy(&raw, &v, 16);
  stg(reinterpret_cast<uint4*>(p), raw);
}

// How many elements of [begin, end) of `row` come before its first kAlign-byte boundary (all of them when the row
// is not even element-aligned): the scalar head of a vectorised sweep (kAlign 32: each warp's 16-byte loads then
// cover whole sectors).
template <typename T, int kAlign = 16>
DSPARK_HOST_DEVICE_FN int64_t scalar_head(const T* row, int64_t begin, int64_t end) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row + begin);
  int64_t head = addr % kAlign == 0 ? 0 : static_cast<int64_t>((kAlign - addr % kAlign) / sizeof(T));
  if (addr % sizeof(T) != 0) head = end - begin;
  return head < end - begin ? head : end - begin;
}

// The first index for_each_element / for_each_batch give thread t of nthreads over [begin, end) (INT64_MAX: none).
template <typename T>
DSPARK_HOST_DEVICE_FN int64_t first_visited(const T* row, int64_t begin, int64_t end, int t) {
  if (end <= begin) return INT64_MAX;
  constexpr int kN = Vec16<T>::kN;
  const int64_t head = scalar_head(row, begin, end);
  if (t < head) return begin + t;
  const int64_t body = begin + head, nvec = (end - body) / kN;
  if (t < nvec) return body + static_cast<int64_t>(t) * kN;
  const int64_t tail = body + nvec * kN;
  return tail + t < end ? tail + t : INT64_MAX;
}

// Visit elements [begin, end) of `row` (element 0 of a row): thread `t` of `nthreads` calls f(index, value) for its
// share, as float32. Whole 16-byte vectors go to threads round-robin (vector i to thread i % nthreads); the scalar
// head and tail go to threads 0, 1, ... Every element is read exactly once.
template <typename T, typename F>
DSPARK_DEVICE void for_each_element(const T* row, int64_t begin, int64_t end, int t, int nthreads, F&& f) {
  if (end <= begin) return;
  constexpr int kN = Vec16<T>::kN;
  const int64_t head = scalar_head(row, begin, end);
  for (int64_t i = t; i < head; i += nthreads) f(begin + i, to_float(ldg(row + begin + i)));
  const int64_t body = begin + head;
  const int64_t nvec = (end - body) / kN;
  for (int64_t i = t; i < nvec; i += nthreads) {
    const Vec16<T> v = load16(row + body + i * kN);
#pragma unroll
    for (int j = 0; j < kN; ++j) f(body + i * kN + j, to_float(v.v[j]));
  }
  const int64_t tail = body + nvec * kN;
  for (int64_t i = tail + t; i < end; i += nthreads) f(i, to_float(ldg(row + i)));
}

// The 32-bit word of two (bf16, fp16) or one (fp32) -inf: what a vector past the end of a row reads as.
template <typename T>
DSPARK_HOST_DEVICE_FN uint32_t neg_inf_word() {
  return sizeof(T) == 4 ? 0xff800000u : (std::is_same<T, __half>::value ? 0xfc00fc00u : 0xff80ff80u);
}

// Visit elements [begin, end) of `row` with kU independent 16-byte loads in flight per thread: vectors go to threads
// round-robin as in for_each_element (vector i to thread i % nthreads), and thread t loads its vectors i, i + n, ...,
// i + (kU-1) n of one step before using any of them. on_batch(x, at, stride, nv) gets x[kU][kN] as float32 (vectors
// k >= nv lie past the end and read as -inf), element (k, e) being index at + k * stride + e; the scalar head (up to
// the first kHeadAlign-byte boundary) and tail go to on_scalar(index, value). A thread sees its elements in
// increasing index order.
template <int kU, int kHeadAlign = 16, typename T, typename FB, typename FS>
DSPARK_DEVICE void for_each_batch(const T* row, int64_t begin, int64_t end, int t, int nthreads, FB&& on_batch,
                                  FS&& on_scalar) {
  if (end <= begin) return;
  constexpr int kN = Vec16<T>::kN;
  const int64_t head = scalar_head<T, kHeadAlign>(row, begin, end);
  for (int64_t i = t; i < head; i += nthreads) on_scalar(begin + i, to_float(ldg(row + begin + i)));
  const int64_t body = begin + head;
  const int64_t nvec = (end - body) / kN;
  const uint4* vecs = reinterpret_cast<const uint4*>(row + body);
  const uint32_t pad = neg_inf_word<T>();
  for (int64_t i = t; i < nvec; i += static_cast<int64_t>(kU) * nthreads) {
    uint4 raw[kU];
    int valid = 0;  // the batch's vectors inside the row: a prefix of the kU
#pragma unroll
    for (int k = 0; k < kU; ++k) {  // all kU loads issue before the first use
      const bool in = i + static_cast<int64_t>(k) * nthreads < nvec;
      raw[k] = in ? ldg(vecs + i + static_cast<int64_t>(k) * nthreads) : make_uint4(pad, pad, pad, pad);
      valid += in ? 1 : 0;
    }
    float x[kU][kN];
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      Vec16<T> v;
      memcpy(&v, &raw[k], 16);
#pragma unroll
      for (int e = 0; e < kN; ++e) x[k][e] = to_float(v.v[e]);
    }
    on_batch(x, body + i * kN, static_cast<int64_t>(nthreads) * kN, valid);
  }
  const int64_t tail = body + nvec * kN;
  for (int64_t i = tail + t; i < end; i += nthreads) on_scalar(i, to_float(ldg(row + i)));
}

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
// Element i of a float array whose dtype is known only at run time, as float32.
DSPARK_DEVICE float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBFloat16: return to_float(ldg(static_cast<const __nv_bfloat16*>(p) + i));
    case DType::kFloat16: return to_float(ldg(static_cast<const __half*>(p) + i));
    default: return ldg(static_cast<const float*>(p) + i);
  }
}

// Element i of an int32 (is64 false) or int64 array, as int64.
DSPARK_DEVICE int64_t load_int(const void* p, bool is64, int64_t i) {
  return is64 ? ldg(static_cast<const int64_t*>(p) + i) : static_cast<int64_t>(ldg(static_cast<const int32_t*>(p) + i));
}

// for_each_element over elements [begin, end) of a row whose dtype is known only at run time.
template <typename F>
DSPARK_DEVICE void for_each_element(const void* row, DType t, int64_t begin, int64_t end, int lane, int lanes, F&& f) {
  switch (t) {
    case DType::kBFloat16: for_each_element(static_cast<const __nv_bfloat16*>(row), begin, end, lane, lanes, f); break;
    case DType::kFloat16: for_each_element(static_cast<const __half*>(row), begin, end, lane, lanes, f); break;
    case DType::kFloat8E4M3:
      for_each_element(static_cast<const __nv_fp8_e4m3*>(row), begin, end, lane, lanes, f);
      break;
    default: for_each_element(static_cast<const float*>(row), begin, end, lane, lanes, f); break;
  }
}
#endif

}  // namespace dspark
