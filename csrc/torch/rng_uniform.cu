// Torch launcher of dspark_C::rng_uniform_ (the kernel lives in csrc/include/dspark/rng_uniform.cuh).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dspark/rng_uniform.cuh"

namespace dspark_torch {

void rng_uniform_(at::Tensor& out, const at::Tensor& rng_key, int64_t stream) {
  TORCH_CHECK(out.is_cuda(), "rng_uniform_: out must be a CUDA tensor, got ", out.device());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "rng_uniform_: out must be float32, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 3, "rng_uniform_: out must have 3 dimensions [N, K, V], got shape ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), "rng_uniform_: out must be contiguous");
  TORCH_CHECK(rng_key.device() == out.device(), "rng_uniform_: rng_key must be on ", out.device(),
              " (the device of out), got ", rng_key.device());
  TORCH_CHECK(rng_key.scalar_type() == at::kLong, "rng_uniform_: rng_key must be int64, got ",
              rng_key.scalar_type());
  TORCH_CHECK(rng_key.numel() == 2 && rng_key.is_contiguous(),
              "rng_uniform_: rng_key must be a contiguous int64 [2] (seed, offset), got shape ", rng_key.sizes());
  TORCH_CHECK(stream >= 0 && stream < 256, "rng_uniform_: stream must be in [0, 256), got ", stream);
  const int64_t N = out.size(0), K = out.size(1), V = out.size(2);
  TORCH_CHECK(K < (int64_t(1) << 24), "rng_uniform_: out.size(1) (positions) must be < 2^24, got ", K);
  TORCH_CHECK(V <= (int64_t(1) << 34), "rng_uniform_: out.size(2) (tokens) must be <= 2^34, got ", V);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  C10_CUDA_CHECK(dspark::launch_rng_uniform(out.data_ptr<float>(), N, K, V, rng_key.data_ptr<int64_t>(),
                                            static_cast<int>(stream), s));
}

}  // namespace dspark_torch
