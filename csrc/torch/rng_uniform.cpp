// Torch launcher of dspark_C::rng_uniform_ (the kernel lives in dspark/rng_uniform.cuh).
#include "common.h"
#include "dspark/rng_uniform.h"

namespace dspark_torch::rng_uniform {

constexpr const char* kOp = "rng_uniform_";

void launch(at::Tensor& out, const at::Tensor& rng_key, int64_t stream) {
  check_tensor(kOp, "out", out, out, at::kFloat, {kAnySize, kAnySize, kAnySize});
  const dspark::rng::Key key = check_rng_key(kOp, rng_key, out);
  TORCH_CHECK(stream >= 0 && stream < 256, kOp, ": stream must be in [0, 256), got ", stream);
  const int64_t N = out.size(0), K = out.size(1), V = out.size(2);
  TORCH_CHECK(N <= (int64_t(1) << 32), kOp, ": out.size(0) (requests) must be <= 2^32, got ", N);
  TORCH_CHECK(K < (int64_t(1) << 24), kOp, ": out.size(1) (positions) must be < 2^24, got ", K);
  TORCH_CHECK(V <= (int64_t(1) << 34), kOp, ": out.size(2) (tokens) must be <= 2^34, got ", V);
  if (out.numel() == 0) return;
  const DeviceGuard guard(out);
  check_launch(dspark::launch_rng_uniform(out.data_ptr<float>(), N, K, V, key,
                                          static_cast<int>(stream), current_stream(out)),
               kOp);
}

}  // namespace dspark_torch::rng_uniform

DSPARK_LIBRARY_IMPL(m) {
  m.impl("rng_uniform_", &dspark_torch::rng_uniform::launch);
}
