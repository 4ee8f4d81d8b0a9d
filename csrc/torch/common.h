// What every torch launcher shares: the dispatch key, the device guard and stream, and the argument checks (each
// naming the op and the argument; float dtypes map to dspark::DType). A launcher csrc/torch/<op>.cpp is host C++: it
// includes its op's host interface (dspark/<op>.h: parameters, workspace, launch functions), while
// csrc/kernels/<op>.cu compiles the kernels (dspark/<op>.cuh) without torch's headers. The same launcher source
// builds for the GPU (dispatch key CUDA) and for the SIMT harness (g++ with DSPARK_SIMT; dispatch key CPU, kernels
// run on CPU tensors through csrc/simt).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>

#include "dspark/platform.cuh"
#include "dspark/rng.cuh"
#include "dspark/vec.cuh"

// The op library: torch.ops.dspark_C on the GPU, torch.ops.dspark_simt in the SIMT build and
// torch.ops.dspark_simt_counting in its counting build (the access model's hooks), so all of them can load in one
// process. registration.cpp defines every schema; a launcher registers its op with
// DSPARK_LIBRARY_IMPL(m) { m.impl(name, fn); }.
#if defined(DSPARK_SIMT) && defined(DSPARK_SIMT_MODEL)
#define DSPARK_TORCH_LIBRARY dspark_simt_counting
#define DSPARK_TORCH_DISPATCH CPU
#elif defined(DSPARK_SIMT)
#define DSPARK_TORCH_LIBRARY dspark_simt
#define DSPARK_TORCH_DISPATCH CPU
#else
#define DSPARK_TORCH_LIBRARY dspark_C
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define DSPARK_TORCH_DISPATCH CUDA
#endif
#define DSPARK_LIBRARY_IMPL_(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define DSPARK_LIBRARY_IMPL(m) DSPARK_LIBRARY_IMPL_(DSPARK_TORCH_LIBRARY, DSPARK_TORCH_DISPATCH, m)

namespace dspark_torch {

#if defined(DSPARK_SIMT)
constexpr const char* kDeviceWord = "a CPU tensor (the SIMT build runs CUDA kernels on the CPU)";
inline bool on_kernel_device(const at::Tensor& t) { return t.device().is_cpu(); }
struct DeviceGuard {
  explicit DeviceGuard(const at::Tensor&) {}
};
inline cudaStream_t current_stream(const at::Tensor&) { return nullptr; }
inline void check_launch(cudaError_t, const char*) {}  // the SIMT runtime throws on a fault
#else
constexpr const char* kDeviceWord = "a CUDA tensor";
inline bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
struct DeviceGuard {
  explicit DeviceGuard(const at::Tensor& t) : guard(t.device()) {}
  c10::cuda::CUDAGuard guard;
};
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}
#endif

// The checks every launcher uses; each error names the op and the argument. Contiguity is decided by the Python
// registry (dspark_kernels/ops/_registry.py makes every kernel input contiguous); here it is only checked, for direct
// callers of torch.ops.dspark_C / dspark_simt: a launcher never copies an input.
constexpr int64_t kAnySize = -1;  // a check_shape entry that matches any size

// `t` is on the kernels' device and on `like`'s device, and contiguous.
inline void check_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(on_kernel_device(t), op, ": ", name, " must be ", kDeviceWord, ", got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// `t` has `shape.size()` dimensions of these sizes (kAnySize matches any).
inline void check_shape(const char* op, const char* name, const at::Tensor& t, std::initializer_list<int64_t> shape) {
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  int64_t i = 0;
  for (const int64_t s : shape) {
    same = same && (s == kAnySize || t.size(i) == s);
    ++i;
  }
  if (same) return;
  std::string want = "[";
  i = 0;
  for (const int64_t s : shape) want += (i++ ? ", " : "") + (s == kAnySize ? std::string("*") : std::to_string(s));
  TORCH_CHECK(false, op, ": ", name, " must have shape ", want, "], got ", t.sizes());
}

// An input of dtype `dtype` and this shape.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                         at::ScalarType dtype, std::initializer_list<int64_t> shape) {
  check_input(op, name, t, like);
  check_dtype(op, name, t, dtype);
  check_shape(op, name, t, shape);
}

// An int32 / int64 input; returns whether it is int64.
inline bool check_int(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  check_input(op, name, t, like);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong;
}
inline bool check_int(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                      std::initializer_list<int64_t> shape) {
  const bool is_int64 = check_int(op, name, t, like);
  check_shape(op, name, t, shape);
  return is_int64;
}

// The dspark::DType of a float32 / bfloat16 / float16 tensor.
inline dspark::DType float_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return dspark::DType::kFloat32;
    case at::kBFloat16: return dspark::DType::kBFloat16;
    case at::kHalf: return dspark::DType::kFloat16;
    default: TORCH_CHECK(false, op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// A float32 / bfloat16 / float16 input; returns its dspark::DType.
inline dspark::DType check_float(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  check_input(op, name, t, like);
  return float_dtype(op, name, t);
}

// A float32 / bfloat16 / float16 matrix whose rows are contiguous and any stride apart (a slice of a larger
// tensor); returns its dspark::DType.
inline dspark::DType check_float_rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(on_kernel_device(t), op, ": ", name, " must be ", kDeviceWord, ", got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ", t.device());
  check_shape(op, name, t, {kAnySize, kAnySize});
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name, "'s rows must be contiguous (last stride 1), got "
              "strides ", t.strides());
  TORCH_CHECK(t.stride(0) >= t.size(1) || t.size(0) <= 1, op, ": ", name, "'s rows must not overlap, got strides ",
              t.strides());
  return float_dtype(op, name, t);
}
inline dspark::DType check_float(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                                 std::initializer_list<int64_t> shape) {
  const dspark::DType dtype = check_float(op, name, t, like);
  check_shape(op, name, t, shape);
  return dtype;
}

// verify_chain's survival float [N, K] and thresholds float [K], given together or not at all.
struct SurvivalInputs {
  const void* survival = nullptr;
  const void* thresholds = nullptr;
  dspark::DType survival_dtype = dspark::DType::kFloat32, thresholds_dtype = dspark::DType::kFloat32;
};
inline SurvivalInputs check_survival(const char* op, const std::optional<at::Tensor>& survival,
                                     const std::optional<at::Tensor>& thresholds, const at::Tensor& like, int64_t N,
                                     int64_t K) {
  TORCH_CHECK(survival.has_value() == thresholds.has_value(), op, ": survival and thresholds must be given together");
  SurvivalInputs s;
  if (!survival) return s;
  s.survival_dtype = check_float(op, "survival", *survival, like, {N, K});
  s.thresholds_dtype = check_float(op, "thresholds", *thresholds, like, {K});
  s.survival = survival->data_ptr();
  s.thresholds = thresholds->data_ptr();
  return s;
}

// The random key: int64 [2] = (seed, offset). On the op's device the kernels read it (a CUDA graph replays with
// what it holds then); a CPU key beside device tensors is read here and passed by value (no launch, no sync).
inline dspark::rng::Key check_rng_key(const char* op, const at::Tensor& rng_key, const at::Tensor& like) {
  check_dtype(op, "rng_key", rng_key, at::kLong);
  TORCH_CHECK(rng_key.numel() == 2, op, ": rng_key must be int64 [2] (seed, offset), got shape ", rng_key.sizes());
  TORCH_CHECK(rng_key.device() == like.device() || rng_key.is_cpu(), op, ": rng_key must be on ", like.device(),
              " or on the CPU, got ", rng_key.device());
  TORCH_CHECK(rng_key.is_contiguous(), op, ": rng_key must be contiguous");
  const int64_t* k = rng_key.data_ptr<int64_t>();
  if (rng_key.device() == like.device()) return dspark::rng::Key::on_device(k);
  return dspark::rng::Key::by_value(static_cast<uint64_t>(k[0]), static_cast<uint64_t>(k[1]));
}

}  // namespace dspark_torch
