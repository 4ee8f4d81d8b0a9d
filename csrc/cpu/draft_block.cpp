// CPU kernel of draft_block (the meaning: dspark_kernels/reference/draft_block.py), full-vocabulary proposals
// (top_k = 0; the ops layer sends top-k proposals to the reference).
//
// Position by position: each request's head step (e = W1[x], v from the vanilla / gated / rnn head, the confidence
// logit) on one thread; then one sweep over the draft vocabulary, cut into chunks spread over the threads. A chunk
// reads each W2 row once (converted to float32 once), takes its dot product with every request's v, adds U, and
// folds the logits of a 32-row tile into each request's partial (argmax, or the Gumbel race keyed by the draft id;
// the softmax statistics of logits / T for draft_logprobs) while they are in L1; the bias never reaches memory
// (the logits do only when asked for). The chunks' partials merge per request into the drafted token.
#include <ATen/ops/empty.h>

#include <vector>

#include "common.h"

namespace dspark_cpu {

namespace {

constexpr int64_t kRows = 16;  // W2 rows per tile (a multiple of 4: whole Philox quads)

// A chunk's result for one request: the race winner (key, draft id), the winner's logit, the softmax statistics.
struct Part {
  Best best;
  float logit = kNaN;
  Stats stats;
};

Part merge(const Part& a, const Part& b) {
  const bool b_wins = b.best.value > a.best.value || (b.best.value == a.best.value && b.best.index < a.best.index);
  return Part{b_wins ? b.best : a.best, b_wins ? b.logit : a.logit, merge(a.stats, b.stats)};
}

// Per request: its temperature (1 for greedy requests) and whether it samples.
struct Temp {
  float t = 1.f;
  bool sampled = false;
};

// The sweep's inputs at one position.
struct Sweep {
  const void* u;         // base_logits [N, K, Vd]
  at::ScalarType udtype;
  const void* w2;        // [Vd, r]
  at::ScalarType wdtype;
  const float* scale;    // [Vd] or null
  const float* v;        // [N, r]
  int64_t N, K, Vd, r, k;
  const Temp* temps;
  dspark::rng::Philox ph;
  float* logits;         // [N, K, Vd] or null
};

// Folds request n's logits of tokens b..b+len-1 into its partial.
DSPARK_CPU_INLINE void fold_request(const Sweep& sw, int64_t n, const float* lg, int64_t b, int64_t len, Part& part,
                                    float* y, float* u) {
  const Temp& tp = sw.temps[n];
  fold_stats(lg, len, tp.t, part.stats);
  if (!tp.sampled) {
    fold_best(lg, len, b, part.best);
  } else {
    float m = -kInf;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < len; ++i) {
      y[i] = lg[i] / tp.t;
      m = y[i] > m ? y[i] : m;
    }
    if (m + kGumbelBound < part.best.value) return;  // no key of this tile can reach the leader
    uniforms(sw.ph, n, sw.k, dspark::rng::kStreamDraft, b, len, u);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) u[i] = y[i] - log_pos(-log_pos(u[i]));
    fold_best(u, len, b, part.best);
  }
  if (part.best.index >= b && part.best.index < b + len) part.logit = lg[part.best.index - b];
}

// tile[n * kRows + j] = scale_j * (w_j . v_n) for the tile's len rows w [len, r] and the N requests' v [N, r].
// Four requests at a time (their v rows stay in L1 while the tile's rows pass) keep four sums in flight and share
// each load of w.
DSPARK_CPU_INLINE void biases(const float* w, int64_t len, const float* v, int64_t N, int64_t r, const float* scale,
                              float* tile) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const float *v0 = v + n * r, *v1 = v0 + r, *v2 = v1 + r, *v3 = v2 + r;
    for (int64_t j = 0; j < len; ++j) {
      const float* wj = w + j * r;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t i = 0; i < r; ++i) {
        s0 += wj[i] * v0[i];
        s1 += wj[i] * v1[i];
        s2 += wj[i] * v2[i];
        s3 += wj[i] * v3[i];
      }
      tile[n * kRows + j] = s0 * scale[j];
      tile[(n + 1) * kRows + j] = s1 * scale[j];
      tile[(n + 2) * kRows + j] = s2 * scale[j];
      tile[(n + 3) * kRows + j] = s3 * scale[j];
    }
  }
  for (; n < N; ++n) {
    const float* vn = v + n * r;
    for (int64_t j = 0; j < len; ++j) {
      const float* wj = w + j * r;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < r; ++i) s += wj[i] * vn[i];
      tile[n * kRows + j] = s * scale[j];
    }
  }
}

// Draft ids lo..hi-1 for every request: parts[n] = the chunk's partial of request n.
template <typename TU, typename TW>
DSPARK_CPU_CLONES void sweep_chunk(const Sweep& sw, int64_t lo, int64_t hi, Part* parts) {
  const TU* U = static_cast<const TU*>(sw.u);
  const TW* W2 = static_cast<const TW*>(sw.w2);
  const int64_t r = sw.r;
  std::vector<float> wbuf(kRows * r), tile(sw.N * kRows);
  float ubuf[kRows], y[kRows], u[kRows], scale[kRows];
  for (int64_t n = 0; n < sw.N; ++n) parts[n].best.index = lo;
  for (int64_t b = lo; b < hi; b += kRows) {
    const int64_t len = std::min(kRows, hi - b);
    for (int64_t i = (b + kRows) * r; i < std::min(hi, b + 2 * kRows) * r; i += 64 / sizeof(TW)) {
      __builtin_prefetch(W2 + i);  // the next tile's rows
    }
    const float* w = as_float(W2 + b * r, len * r, wbuf.data());
    for (int64_t j = 0; j < len; ++j) scale[j] = sw.scale != nullptr ? sw.scale[b + j] : 1.f;
    biases(w, len, sw.v, sw.N, r, scale, tile.data());
    for (int64_t n = 0; n < sw.N; ++n) {
      const int64_t row = (n * sw.K + sw.k) * sw.Vd;
      const float* ub = as_float(U + row + b, len, ubuf);
      float* lg = &tile[n * kRows];
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) lg[i] = ub[i] + lg[i];
      if (sw.logits != nullptr) std::copy(lg, lg + len, sw.logits + row + b);
      fold_request(sw, n, lg, b, len, parts[n], y, u);
    }
  }
}

// The per-request head step: v (the vector W2 multiplies) and the confidence logit from e = W1[x] and h_k.
struct Head {
  std::string kind;
  at::Tensor w1, wg, bg, wj, bj, hidden, conf_w, conf_b;  // w1 in its dtype, the rest float32
  int64_t r = 0, d = 0, K = 0;

  std::vector<float> embed(int64_t x) const {
    std::vector<float> e(r, 0.f);
    if (x < 0 || x >= w1.size(0)) return e;
    with_float_type(w1.scalar_type(), [&](auto tag) {
      to_float(static_cast<const decltype(tag)*>(w1.data_ptr()) + x * r, r, e.data());
    });
    return e;
  }

  // Row i of a float32 matrix times the concatenation of `parts` (each a pointer and a length), plus bias[i].
  static float affine(const float* row, std::initializer_list<std::pair<const float*, int64_t>> parts, float bias) {
    float s = 0.f;
    for (const auto& [x, len] : parts) {
      for (int64_t i = 0; i < len; ++i) s += row[i] * x[i];
      row += len;
    }
    return s + bias;
  }

  static float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

  // v of request n at position k into v[0..r); state: the rnn head's s (updated).
  void step(int64_t n, int64_t k, const std::vector<float>& e, float* state, float* v) const {
    const float* h = hidden.defined() ? hidden.data_ptr<float>() + (n * K + k) * d : nullptr;
    if (kind == "vanilla") {
      std::copy(e.begin(), e.end(), v);
    } else if (kind == "gated") {
      for (int64_t i = 0; i < r; ++i) {
        const float g = affine(wg.data_ptr<float>() + i * (d + r), {{h, d}, {e.data(), r}}, bg.data_ptr<float>()[i]);
        v[i] = sigmoid(g) * e[i];
      }
    } else {
      std::vector<float> z(3 * r);
      for (int64_t i = 0; i < 3 * r; ++i) {
        z[i] = affine(wj.data_ptr<float>() + i * (2 * r + d), {{state, r}, {e.data(), r}, {h, d}},
                      bj.data_ptr<float>()[i]);
      }
      for (int64_t i = 0; i < r; ++i) {
        const float g = sigmoid(z[i]);
        state[i] = g * state[i] + (1.f - g) * std::tanh(z[r + i]);
        v[i] = std::tanh(z[2 * r + i]);
      }
    }
  }

  float confidence(int64_t n, int64_t k, const std::vector<float>& e) const {
    const float* h = hidden.data_ptr<float>() + (n * K + k) * d;
    return affine(conf_w.data_ptr<float>(), {{h, d}, {e.data(), r}}, conf_b.data_ptr<float>()[0]);
  }
};

at::Tensor float_or_undefined(const std::optional<at::Tensor>& t) { return t ? as_float(*t) : at::Tensor(); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_block(
    const at::Tensor& base_logits, const at::Tensor& anchor_tokens, c10::string_view head_kind, const at::Tensor& w1,
    const at::Tensor& w2, const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& draft_to_target,
    const std::optional<at::Tensor>& wg, const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& wj,
    const std::optional<at::Tensor>& bj, const std::optional<at::Tensor>& hidden,
    const std::optional<at::Tensor>& conf_weight, const std::optional<at::Tensor>& conf_bias,
    const std::optional<at::Tensor>& sts_temperatures, const std::optional<at::Tensor>& temperature,
    const at::Tensor& rng_key, bool return_logits, int64_t top_k) {
  TORCH_CHECK(top_k == 0, "draft_block (cpu): top-k proposals run on the reference");
  TORCH_CHECK(base_logits.is_contiguous() && w2.is_contiguous() && w1.is_contiguous(),
              "draft_block: inputs must be contiguous");
  const int64_t N = base_logits.size(0), K = base_logits.size(1), Vd = base_logits.size(2), r = w2.size(1);
  const auto opts = base_logits.options().dtype(at::kFloat);
  at::Tensor tokens = at::empty({N, K}, opts.dtype(at::kLong));
  at::Tensor logprobs = at::empty({N, K}, opts);
  at::Tensor logits = at::empty({return_logits ? N * K * Vd : 0}, opts);
  if (return_logits) logits = logits.view({N, K, Vd});
  const bool with_conf = conf_weight.has_value();
  at::Tensor conf = at::empty({with_conf ? N * K : 0}, opts), survival = at::empty({with_conf ? N * K : 0}, opts);
  if (with_conf) conf = conf.view({N, K}), survival = survival.view({N, K});
  const at::Tensor candidates = at::empty({0}, opts.dtype(at::kLong));

  Head head{std::string(head_kind), w1, float_or_undefined(wg), float_or_undefined(bg), float_or_undefined(wj),
            float_or_undefined(bj), float_or_undefined(hidden), float_or_undefined(conf_weight),
            float_or_undefined(conf_bias), r, hidden ? hidden->size(2) : 0, K};
  std::vector<Temp> temps(N);
  if (temperature) {
    const at::Tensor t = as_float(*temperature);
    for (int64_t n = 0; n < N; ++n) {
      temps[n].sampled = t.data_ptr<float>()[n] > 0.f;
      temps[n].t = temps[n].sampled ? t.data_ptr<float>()[n] : 1.f;
    }
  }
  const at::Tensor anchors = as_long(anchor_tokens);
  const at::Tensor d2t = draft_to_target ? as_long(*draft_to_target) : at::Tensor();
  const at::Tensor scale = w2_scale ? as_float(*w2_scale) : at::Tensor();
  std::vector<int64_t> prev(anchors.data_ptr<int64_t>(), anchors.data_ptr<int64_t>() + N);
  std::vector<float> v(N * r), state(N * r, 0.f);
  Sweep sw{base_logits.data_ptr(), base_logits.scalar_type(), w2.data_ptr(), w2.scalar_type(),
           scale.defined() ? scale.data_ptr<float>() : nullptr, v.data(), N, K, Vd, r, 0, temps.data(),
           philox_of(rng_key), return_logits ? logits.data_ptr<float>() : nullptr};
  const int64_t chunks = chunks_per_row(1, Vd);
  std::vector<Part> parts(chunks * N);

  for (int64_t k = 0; k < K && N > 0; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      const std::vector<float> e = head.embed(prev[n]);
      head.step(n, k, e, &state[n * r], &v[n * r]);
      if (with_conf) conf.data_ptr<float>()[n * K + k] = head.confidence(n, k, e);
    }
    sw.k = k;
    std::fill(parts.begin(), parts.end(), Part{});
    for_each_chunk(1, Vd, chunks, [&](int64_t, int64_t c, int64_t lo, int64_t hi) {
      with_float_type(sw.udtype, [&](auto ut) {
        with_float_type(sw.wdtype, [&](auto wt) {
          sweep_chunk<decltype(ut), decltype(wt)>(sw, lo, hi, &parts[c * N]);
        }, /*fp8=*/true);
      });
    }, r * N);
    for (int64_t n = 0; n < N; ++n) {
      Part p = parts[n];
      for (int64_t c = 1; c < chunks; ++c) p = merge(p, parts[c * N + n]);
      const int64_t id = p.best.index;
      prev[n] = d2t.defined() ? d2t.data_ptr<int64_t>()[id] : id;
      tokens.data_ptr<int64_t>()[n * K + k] = prev[n];
      logprobs.data_ptr<float>()[n * K + k] = log_prob(p.stats, p.logit / temps[n].t);
    }
  }
  if (with_conf) {
    const at::Tensor sts = sts_temperatures ? as_float(*sts_temperatures) : at::Tensor();
    for (int64_t n = 0; n < N; ++n) {
      float run = 1.f;
      for (int64_t k = 0; k < K; ++k) {
        const float z = conf.data_ptr<float>()[n * K + k] / (sts.defined() ? sts.data_ptr<float>()[k] : 1.f);
        run *= Head::sigmoid(z);
        survival.data_ptr<float>()[n * K + k] = run;
      }
    }
  }
  return {tokens, logits, conf, survival, logprobs, candidates};
}

}  // namespace dspark_cpu
