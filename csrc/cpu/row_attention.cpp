// Batch-invariant causal attention over a paged KV cache for the decode loop's CPU target. Row t (request r at
// position p) attends to exactly the keys at positions 0..p of request r, in position order: a float32 dot product
// per key (8 lanes, a fixed tree, as row_linear), the softmax maximum, exp and sum in key order, and the weighted
// sum of values in key order. Nothing depends on the other rows of the batch, the padded key length or the thread
// split, so a token's attention output is the same in a 1-row decode forward and in an 8-row verify forward
// (PyTorch's CPU scaled_dot_product_attention blocks its online softmax by the padded shapes, so it is not).
//
// q: [T, H, D]; k_cache, v_cache: [S, KV, D] (one layer, q's dtype); kv_slots: int64 [N, L] (slot of position i of
// request r); row_req, row_pos: int64 [T]. Positions past L - 1 read keys 0..L-1 only; a request index outside
// [0, N) gives a zero row. Returns [T, H * D] in q's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DSPARK_ATTN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSPARK_ATTN_CLONES
#endif

// One (row, head): q float32 [d]; keys / values of `keys` positions at element offsets kv_off[j] (into k and v);
// scores in w[0..keys); the output row in o. Every loop runs in a fixed order (8 lanes and a fixed tree for the dot
// products, keys in position order), so the instruction set may vectorize but never reorder across keys.
template <typename T>
void attend_row(const float* q, const T* k, const T* v, const int64_t* kv_off, int64_t keys, int64_t d, float scale,
                float* w, float* acc, float* o) {
  float mx = -INFINITY;
  const int64_t dv = d / 8 * 8;
  for (int64_t j = 0; j < keys; ++j) {
    const T* kr = k + kv_off[j];
    float lanes[8] = {};
    for (int64_t i = 0; i < dv; i += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += q[i + l] * static_cast<float>(kr[i + l]);
    float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (int64_t i = dv; i < d; ++i) s += q[i] * static_cast<float>(kr[i]);
    w[j] = s * scale;
    mx = std::max(mx, w[j]);
  }
  float sum = 0.0f;
  for (int64_t c = 0; c < d; ++c) acc[c] = 0.0f;
  for (int64_t j = 0; j < keys; ++j) {
    const float e = std::exp(w[j] - mx);
    sum += e;
    const T* vr = v + kv_off[j];
    for (int64_t c = 0; c < d; ++c) acc[c] += e * static_cast<float>(vr[c]);
  }
  for (int64_t c = 0; c < d; ++c) o[c] = acc[c] / sum;
}

DSPARK_ATTN_CLONES void attend_row_bf16(const float* q, const at::BFloat16* k, const at::BFloat16* v,
                                        const int64_t* kv_off, int64_t keys, int64_t d, float scale, float* w,
                                        float* acc, float* o) {
  attend_row(q, k, v, kv_off, keys, d, scale, w, acc, o);
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& kv_slots,
            const at::Tensor& row_req, const at::Tensor& row_pos, double scale, at::Tensor& out) {
  const int64_t t_rows = q.size(0), h = q.size(1), d = q.size(2), kvh = kc.size(1), group = h / kvh;
  const int64_t n = kv_slots.size(0), len = kv_slots.size(1), slots = kc.size(0);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* sl = kv_slots.data_ptr<int64_t>();
  const int64_t* req = row_req.data_ptr<int64_t>();
  const int64_t* pos = row_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t_rows * h, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> w(len), acc(d);
    std::vector<int64_t> off(len);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / h, head = i % h, kv = head / group, r = req[t];
      float* o = op + t * h * d + head * d;
      if (r < 0 || r >= n || len == 0) {
        std::fill(o, o + d, 0.0f);
        continue;
      }
      const int64_t keys = std::min<int64_t>(std::max<int64_t>(pos[t], 0), len - 1) + 1;
      for (int64_t j = 0; j < keys; ++j)
        off[j] = (std::min<int64_t>(std::max<int64_t>(sl[r * len + j], 0), slots - 1) * kvh + kv) * d;
      const float* qv = qp + (t * h + head) * d;
      if constexpr (std::is_same_v<T, at::BFloat16>)
        attend_row_bf16(qv, kp, vp, off.data(), keys, d, static_cast<float>(scale), w.data(), acc.data(), o);
      else
        attend_row(qv, kp, vp, off.data(), keys, d, static_cast<float>(scale), w.data(), acc.data(), o);
    }
  });
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& kv_slots, const at::Tensor& row_req, const at::Tensor& row_pos,
                         double scale) {
  TORCH_CHECK(q.dim() == 3, "row_attention: q must be [T, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2),
              "row_attention: k_cache and v_cache must be [S, KV, D = ", q.size(2), "], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "row_attention: the query heads must be a multiple of the KV heads");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "row_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(kv_slots.dim() == 2 && kv_slots.scalar_type() == at::kLong,
              "row_attention: kv_slots must be int64 [N, L]");
  TORCH_CHECK(row_req.dim() == 1 && row_pos.dim() == 1 && row_req.size(0) == q.size(0) &&
                  row_pos.size(0) == q.size(0) && row_req.scalar_type() == at::kLong &&
                  row_pos.scalar_type() == at::kLong,
              "row_attention: row_req and row_pos must be int64 [T = ", q.size(0), "]");
  const at::Tensor qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor sl = kv_slots.contiguous(), rq = row_req.contiguous(), rp = row_pos.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() > 0) {
    switch (q.scalar_type()) {
      case at::kFloat: attend<float>(qc, kc, vc, sl, rq, rp, scale, out); break;
      case at::kBFloat16: attend<at::BFloat16>(qc, kc, vc, sl, rq, rp, scale, out); break;
      case at::kHalf: attend<at::Half>(qc, kc, vc, sl, rq, rp, scale, out); break;
      default: TORCH_CHECK(false, "row_attention: q must be float32, bfloat16 or float16, got ", q.scalar_type());
    }
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_decode, m) {
  m.def("row_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_slots, Tensor row_req, Tensor row_pos, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark_decode, CPU, m) { m.impl("row_attention", &row_attention); }
