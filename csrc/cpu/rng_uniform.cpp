// CPU kernel of rng_uniform_: out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v), the
// generator of dspark/rng.cuh, rows spread over the threads.
#include "common.h"

namespace dspark_cpu {

namespace {

// Tokens lo..hi-1 of row (n, k); lo is a multiple of kBlock.
DSPARK_CPU_CLONES void fill_row(const dspark::rng::Philox& ph, int64_t n, int64_t k, uint32_t stream, float* row,
                                int64_t lo, int64_t hi) {
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t len = std::min(kBlock, hi - b);
    if (len == kBlock) {
      uniforms(ph, n, k, stream, b, len, row + b);
    } else {
      float tail[kBlock];
      uniforms(ph, n, k, stream, b, len, tail);
      std::copy(tail, tail + len, row + b);
    }
  }
}

}  // namespace

void rng_uniform(at::Tensor& out, const at::Tensor& rng_key, int64_t stream) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 3 && out.is_contiguous(),
              "rng_uniform_: out must be a contiguous float32 [N, K, V] tensor");
  TORCH_CHECK(stream >= 0 && stream < 256, "rng_uniform_: stream must be in [0, 256), got ", stream);
  const int64_t N = out.size(0), K = out.size(1), V = out.size(2);
  if (out.numel() == 0) return;
  const dspark::rng::Philox ph = philox_of(rng_key);
  float* base = out.data_ptr<float>();
  const int64_t chunks = chunks_per_row(N * K, V);
  for_each_chunk(N * K, V, chunks, [&](int64_t row, int64_t, int64_t lo, int64_t hi) {
    fill_row(ph, row / K, row % K, static_cast<uint32_t>(stream), base + row * V, lo, hi);
  });
}

}  // namespace dspark_cpu
