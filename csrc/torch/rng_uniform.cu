// Torch launcher of dspark_C::rng_uniform_ (the kernel lives in csrc/include/dspark/rng_uniform.cuh).
#include "common.h"
#include "dspark/rng_uniform.cuh"

namespace dspark_torch {
namespace {

void rng_uniform_(at::Tensor& out, const at::Tensor& rng_key, int64_t stream) {
  constexpr const char* op = "rng_uniform_";
  check_input(op, "out", out, out);
  check_dtype(op, "out", out, at::kFloat);
  TORCH_CHECK(out.dim() == 3, op, ": out must have 3 dimensions [N, K, V], got shape ", out.sizes());
  check_input(op, "rng_key", rng_key, out);
  check_dtype(op, "rng_key", rng_key, at::kLong);
  TORCH_CHECK(rng_key.numel() == 2, op, ": rng_key must be int64 [2] (seed, offset), got shape ", rng_key.sizes());
  TORCH_CHECK(stream >= 0 && stream < 256, op, ": stream must be in [0, 256), got ", stream);
  const int64_t N = out.size(0), K = out.size(1), V = out.size(2);
  TORCH_CHECK(K < (int64_t(1) << 24), op, ": out.size(1) (positions) must be < 2^24, got ", K);
  TORCH_CHECK(V <= (int64_t(1) << 34), op, ": out.size(2) (tokens) must be <= 2^34, got ", V);
  if (out.numel() == 0) return;
  const DeviceGuard guard(out);
  check_launch(dspark::launch_rng_uniform(out.data_ptr<float>(), N, K, V, rng_key.data_ptr<int64_t>(),
                                          static_cast<int>(stream), current_stream(out)),
               op);
}

}  // namespace

DSPARK_LIBRARY_IMPL(m) {
  m.impl("rng_uniform_", &rng_uniform_);
}

}  // namespace dspark_torch
