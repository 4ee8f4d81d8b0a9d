// What every torch launcher shares: the dispatch key, the device guard and stream, argument checks that name the
// argument, and the dtype map. The same launcher source builds for the GPU (nvcc; dispatch key CUDA) and for the
// SIMT harness (g++ with DSPARK_SIMT; dispatch key CPU, kernels run on CPU tensors through csrc/simt).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dspark/platform.cuh"
#include "dspark/vec.cuh"

// The op library: torch.ops.dspark_C on the GPU, torch.ops.dspark_simt in the SIMT build (so both can load in one
// process). registration.cpp defines every schema; a launcher registers its op with
// DSPARK_LIBRARY_IMPL(m) { m.impl(name, fn); }.
#if defined(DSPARK_SIMT)
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

// `t` is on the kernels' device (and on `like`'s device when given), contiguous, of dtype `dtype`.
inline void check_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(on_kernel_device(t), op, ": ", name, " must be ", kDeviceWord, ", got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}
inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// float32 / bfloat16 / float16 -> dspark::DType (anything else is an error naming the argument).
inline dspark::DType float_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return dspark::DType::kFloat32;
    case at::kBFloat16: return dspark::DType::kBFloat16;
    case at::kHalf: return dspark::DType::kFloat16;
    default: TORCH_CHECK(false, op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

}  // namespace dspark_torch
