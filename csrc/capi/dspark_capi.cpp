// dspark_capi: the C ABI (csrc/capi/dspark.h): each entry checks its arguments and calls the op's launch function
// (csrc/include/dspark/<op>.h). Host C++ only: the kernels are the units of csrc/kernels, linked beside it.
//
// Built twice by CMakeLists.txt: with the kernel units compiled by nvcc into the library dspark_capi (the GPU), and
// with them compiled by the host compiler with DSPARK_SIMT against csrc/simt/runtime.cpp (no cudart), where the same
// entries run the kernels on the CPU through the SIMT harness on host buffers - that build is what ctest runs against
// the reference's vectors.
#if defined(DSPARK_SIMT)
#include "dspark_simt/runtime.h"  // its keyword macros must precede every CUDA header
#endif
#include "dspark.h"

#include <math.h>
#include <stdio.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "dspark/accept_prefix_scan.h"
#include "dspark/draft_block.h"
#include "dspark/rng.cuh"
#include "dspark/rng_uniform.h"
#include "dspark/schedule_verify_lens.h"
#include "dspark/verify_chain.h"

static_assert(DSPARK_HEAD_VANILLA == static_cast<int>(dspark::draft::kVanilla) &&
                  DSPARK_HEAD_GATED == static_cast<int>(dspark::draft::kGated) &&
                  DSPARK_HEAD_RNN == static_cast<int>(dspark::draft::kRnn),
              "DSPARK_HEAD_* must equal dspark::draft::Head");
static_assert(DSPARK_DTYPE_F32 == static_cast<int>(dspark::DType::kFloat32) &&
                  DSPARK_DTYPE_BF16 == static_cast<int>(dspark::DType::kBFloat16) &&
                  DSPARK_DTYPE_F16 == static_cast<int>(dspark::DType::kFloat16) &&
                  DSPARK_DTYPE_F8E4M3 == static_cast<int>(dspark::DType::kFloat8E4M3),
              "DSPARK_DTYPE_* must equal dspark::DType");

#define DSPARK_TRY(expr)      \
  do {                        \
    const int rc_ = (expr);   \
    if (rc_ != DSPARK_OK) return rc_; \
  } while (0)

namespace {

thread_local std::string g_last_error;

std::string cuda_message(cudaError_t err) {
#if defined(DSPARK_SIMT)
  return "CUDA error " + std::to_string(static_cast<int>(err));  // no cudart in the SIMT build
#else
  return cudaGetErrorString(err);
#endif
}

int fail(int code, const std::string& msg) {
  g_last_error = msg;
  return code;
}

int ok() {
  g_last_error.clear();
  return DSPARK_OK;
}

// A pointer argument and its element size: the kernels' loads and stores fault on a GPU unless every array is
// aligned to its element.
struct Array {
  const char* name;
  const void* ptr;
  size_t elem;
};
template <typename T>
Array typed(const char* name, const T* ptr) {
  return Array{name, ptr, sizeof(T)};
}

int check_aligned(const char* fn, std::initializer_list<Array> arrays) {
  for (const Array& a : arrays)
    if (reinterpret_cast<uintptr_t>(a.ptr) % a.elem != 0)
      return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": " + a.name + " must be aligned to its " +
                                            std::to_string(a.elem) + "-byte elements");
  return DSPARK_OK;
}

// a * b < limit for a, b >= 0, without a product that can overflow.
bool product_below(int64_t a, int64_t b, int64_t limit) { return a == 0 || b <= (limit - 1) / a; }
// n * (k + 1) < limit for n, k >= 0, likewise.
bool rows_below(int64_t n, int64_t k, int64_t limit) { return n == 0 || (k < limit && product_below(n, k + 1, limit)); }

constexpr int64_t kInt32Limit = int64_t(1) << 31;

// An integer array argument: DSPARK_DTYPE_I32 / I64 (NULL allowed when optional).
int int_array(const char* fn, const char* name, const void* ptr, int dtype, bool optional, dspark::IntArray* out) {
  if (ptr == nullptr) {
    if (!optional) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": " + name + " is NULL");
    *out = dspark::IntArray{nullptr, true};
    return DSPARK_OK;
  }
  if (dtype != DSPARK_DTYPE_I32 && dtype != DSPARK_DTYPE_I64)
    return fail(DSPARK_ERR_BAD_DTYPE, std::string(fn) + ": " + name +
                                          "_dtype must be DSPARK_DTYPE_I32 or DSPARK_DTYPE_I64, got " +
                                          std::to_string(dtype));
  DSPARK_TRY(check_aligned(fn, {Array{name, ptr, dtype == DSPARK_DTYPE_I64 ? 8u : 4u}}));
  *out = dspark::IntArray{ptr, dtype == DSPARK_DTYPE_I64};
  return DSPARK_OK;
}

int float_dtype(const char* fn, const char* name, int dtype, dspark::DType* out) {
  if (dtype != DSPARK_DTYPE_F32 && dtype != DSPARK_DTYPE_BF16 && dtype != DSPARK_DTYPE_F16)
    return fail(DSPARK_ERR_BAD_DTYPE, std::string(fn) + ": " + name +
                                          "_dtype must be DSPARK_DTYPE_F32, DSPARK_DTYPE_BF16 or DSPARK_DTYPE_F16, got " +
                                          std::to_string(dtype));
  *out = static_cast<dspark::DType>(dtype);
  return DSPARK_OK;
}

// A float array argument: NULL is an error naming it unless optional; else its dtype must be a float one.
int float_array(const char* fn, const char* name, const void* ptr, int dtype, bool optional, dspark::DType* out) {
  if (ptr == nullptr) {
    if (!optional) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": " + name + " is NULL");
    return DSPARK_OK;
  }
  DSPARK_TRY(float_dtype(fn, name, dtype, out));
  return check_aligned(fn, {Array{name, ptr, dtype == DSPARK_DTYPE_F32 ? 4u : 2u}});
}

int null_pointer(const char* fn, const char* name, const char* why = nullptr) {
  return fail(DSPARK_ERR_NULL_POINTER,
              std::string(fn) + ": " + name + " is NULL" + (why ? std::string(" (") + why + ")" : ""));
}

// The workspace a call got against what it needs (a non-NULL workspace must be 16-byte aligned).
int check_workspace(const char* fn, void* workspace, size_t workspace_bytes, size_t need) {
  if (workspace_bytes < need || (need > 0 && workspace == nullptr))
    return fail(DSPARK_ERR_WORKSPACE, std::string(fn) + ": workspace must hold " + std::to_string(need) +
                                          " bytes, got " + std::to_string(workspace_bytes) +
                                          (workspace == nullptr && need > 0 ? " (workspace is NULL)" : ""));
  if (workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return fail(DSPARK_ERR_WORKSPACE, std::string(fn) + ": workspace must be 16-byte aligned");
  return DSPARK_OK;
}

// Runs a launch function; the SIMT runtime reports a fault by throwing.
template <typename F>
int run_launch(const char* fn, F&& f) {
  cudaError_t err;
  try {
    err = f();
  } catch (const std::exception& e) {
    return fail(DSPARK_ERR_CUDA, std::string(fn) + ": kernel failed: " + e.what());
  }
  if (err != cudaSuccess) return fail(DSPARK_ERR_CUDA, std::string(fn) + ": launch failed: " + cuda_message(err));
  return ok();
}

// ---- accept_prefix_scan
int scan_params(const dspark_accept_prefix_scan_args* a, dspark::AcceptPrefixScanParams* p) {
  constexpr const char* fn = "dspark_accept_prefix_scan";
  if (a == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": args is NULL");
  if (a->N < 0 || a->K < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N and K must be >= 0, got N=" + std::to_string(a->N) +
                                          " K=" + std::to_string(a->K));
  if (!rows_below(a->N, a->K, kInt32Limit))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N*(K+1) must be < 2^31 (cu_out is int32), got N=" +
                                          std::to_string(a->N) + " K=" + std::to_string(a->K));
  p->N = a->N;
  p->K = a->K;
  const bool any = a->N > 0;
  DSPARK_TRY(int_array(fn, "tokens", a->tokens, a->tokens_dtype, !any, &p->tokens));
  DSPARK_TRY(int_array(fn, "seq_lens", a->seq_lens, a->seq_lens_dtype, !any, &p->seq_lens));
  if (any && (a->num_accepted == nullptr) == (a->accept_mask == nullptr))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": exactly one of num_accepted and accept_mask must be given");
  DSPARK_TRY(int_array(fn, "num_accepted", a->num_accepted, a->num_accepted_dtype, true, &p->num_accepted));
  p->accept_mask = a->accept_mask;
  DSPARK_TRY(int_array(fn, "verify_cu_seqlens", a->verify_cu_seqlens, a->verify_cu_seqlens_dtype, true,
                       &p->verify_cu_seqlens));
  DSPARK_TRY(int_array(fn, "block_table", a->block_table, a->block_table_dtype, true, &p->block_table));
  if (a->block_table != nullptr) {
    if (a->block_size <= 0)
      return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": block_size must be > 0 with block_table, got " +
                                            std::to_string(a->block_size));
    if (a->max_blocks < 0)
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": max_blocks must be >= 0, got " +
                                            std::to_string(a->max_blocks));
    if (any && a->kv_slots == nullptr)
      return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": kv_slots is NULL (required with block_table)");
    p->max_blocks = a->max_blocks;
    p->has_block_table = true;
    p->block_size = a->block_size;
  }
  DSPARK_TRY(int_array(fn, "max_seq_lens", a->max_seq_lens, a->max_seq_lens_dtype, true, &p->max_seq_lens));
  if (a->num_stops < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": num_stops must be >= 0, got " +
                                          std::to_string(a->num_stops));
  DSPARK_TRY(int_array(fn, "stop_token_ids", a->stop_token_ids, a->stop_token_ids_dtype, a->num_stops == 0,
                       &p->stop_token_ids));
  p->num_stops = a->stop_token_ids != nullptr ? a->num_stops : 0;
  if (a->cu_out == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": cu_out is NULL");
  if (any) {
    const char* missing = a->out_tokens == nullptr ? "out_tokens"
                          : a->new_seq_lens == nullptr ? "new_seq_lens"
                          : a->next_anchor == nullptr ? "next_anchor"
                          : a->hidden_rows == nullptr ? "hidden_rows"
                          : a->finished == nullptr ? "finished" : nullptr;
    if (missing) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": " + missing + " is NULL");
  }
  p->cu_out = a->cu_out;
  p->out_tokens = a->out_tokens;
  p->new_seq_lens = a->new_seq_lens;
  p->next_anchor = a->next_anchor;
  p->hidden_rows = a->hidden_rows;
  p->kv_slots = a->block_table != nullptr ? a->kv_slots : nullptr;
  p->finished = a->finished;
  DSPARK_TRY(check_aligned(fn, {typed("cu_out", p->cu_out), typed("out_tokens", p->out_tokens),
                                typed("new_seq_lens", p->new_seq_lens), typed("next_anchor", p->next_anchor),
                                typed("hidden_rows", p->hidden_rows), typed("kv_slots", p->kv_slots)}));
  if (!dspark::accept_prefix_scan_fits(a->N))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N = " + std::to_string(a->N) +
                                          " requests exceed what one launch keeps resident on this device");
  return DSPARK_OK;
}

// ---- schedule_verify_lens
int schedule_params(const dspark_schedule_verify_lens_args* a, dspark::ScheduleVerifyLensParams* p) {
  constexpr const char* fn = "dspark_schedule_verify_lens";
  if (a == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": args is NULL");
  if (a->N < 0 || a->K < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N and K must be >= 0, got N=" + std::to_string(a->N) +
                                          " K=" + std::to_string(a->K));
  if (!rows_below(a->N, a->K, kInt32Limit))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N*(K+1) must be < 2^31 (cu_seqlens is int32), got N=" +
                                          std::to_string(a->N) + " K=" + std::to_string(a->K));
  if (!(0 <= a->min_len && a->min_len <= a->max_len && a->max_len <= a->K))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": need 0 <= min_len <= max_len <= K=" +
                                          std::to_string(a->K) + ", got min_len=" + std::to_string(a->min_len) +
                                          ", max_len=" + std::to_string(a->max_len));
  if (a->mode != DSPARK_SCHEDULE_EXACT && a->mode != DSPARK_SCHEDULE_ARGMAX)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": mode must be DSPARK_SCHEDULE_EXACT or "
                                                        "DSPARK_SCHEDULE_ARGMAX, got " + std::to_string(a->mode));
  p->N = a->N;
  p->K = a->K;
  const bool any = a->N > 0 && a->K > 0;
  if ((a->survival == nullptr) == (a->conf_logits == nullptr) && any)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": exactly one of survival and conf_logits must be given");
  if (a->survival != nullptr) {
    DSPARK_TRY(float_array(fn, "survival", a->survival, a->survival_dtype, false, &p->survival_dtype));
    if (a->sts_temperatures != nullptr)
      return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": sts_temperatures is only used with conf_logits");
    p->survival = a->survival;
  } else if (a->conf_logits != nullptr) {
    DSPARK_TRY(float_array(fn, "conf_logits", a->conf_logits, a->conf_logits_dtype, false, &p->conf_dtype));
    p->conf_logits = a->conf_logits;
    if (a->sts_temperatures != nullptr) {
      DSPARK_TRY(float_array(fn, "sts_temperatures", a->sts_temperatures, a->sts_temperatures_dtype, false,
                             &p->sts_dtype));
      p->sts_temperatures = a->sts_temperatures;
    }
  } else {
    p->survival = a->survival;  // nothing to read (N == 0 or K == 0)
  }
  if (a->P < 1) return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": P (cost-table points) must be >= 1");
  if (a->token_counts == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": token_counts is NULL");
  if (a->step_time_ms == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": step_time_ms is NULL");
  if (!(a->fixed_overhead_ms >= 0.0 && a->fixed_overhead_ms < INFINITY))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": fixed_overhead_ms must be finite and >= 0");
  p->token_counts = a->token_counts;
  p->step_time_ms = a->step_time_ms;
  p->P = a->P;
  p->fixed_overhead_ms = a->fixed_overhead_ms;
  p->min_len = a->min_len;
  p->max_len = a->max_len;
  p->exact = a->mode == DSPARK_SCHEDULE_EXACT;
  if (!(a->min_gain >= 0.0 && a->min_gain < INFINITY))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": min_gain must be finite and >= 0");
  if (p->exact && (a->budget_survival != nullptr || a->min_gain != 0.0))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": budget_survival and min_gain apply to "
                                                        "DSPARK_SCHEDULE_ARGMAX only");
  if (a->budget_survival != nullptr) {
    if (a->NB < 0 || a->KB < 0)
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": NB and KB must be >= 0");
    if (!product_below(a->NB, a->KB, kInt32Limit))
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": NB*KB (budget_survival's elements) must be < 2^31, got "
                                            "NB=" + std::to_string(a->NB) + " KB=" + std::to_string(a->KB));
    DSPARK_TRY(float_array(fn, "budget_survival", a->budget_survival, a->budget_survival_dtype, false,
                           &p->budget_dtype));
    p->budget_survival = a->budget_survival;
    p->has_budget = true;
    p->NB = a->NB;
    p->KB = a->KB;
  }
  p->gain = 1.0 + a->min_gain;
  p->active = a->active;
  if (a->verify_lens == nullptr && a->N > 0)
    return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": verify_lens is NULL");
  if (a->cu_seqlens == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": cu_seqlens is NULL");
  if (a->theta == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": theta is NULL");
  p->verify_lens = a->verify_lens;
  p->cu_seqlens = a->cu_seqlens;
  p->theta = a->theta;
  return check_aligned(fn, {typed("token_counts", p->token_counts), typed("step_time_ms", p->step_time_ms),
                            typed("verify_lens", p->verify_lens), typed("cu_seqlens", p->cu_seqlens),
                            typed("theta", p->theta)});
}

// ---- draft_block
int draft_params(const dspark_draft_block_args* a, dspark::DraftBlockParams* p, bool* empty) {
  constexpr const char* fn = "dspark_draft_block";
  *p = dspark::DraftBlockParams{};
  if (a == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": args is NULL");
  if (a->N < 0 || a->K < 0 || a->V < 0 || a->R < 0 || a->D < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N, K, V, R, D must be >= 0, got N=" +
                                          std::to_string(a->N) + " K=" + std::to_string(a->K) + " V=" +
                                          std::to_string(a->V) + " R=" + std::to_string(a->R) + " D=" +
                                          std::to_string(a->D));
  if (a->K >= (int64_t(1) << 24))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": K (positions) must be < 2^24, got " + std::to_string(a->K));
  if (a->V >= (int64_t(1) << 31))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": V (vocabulary) must be < 2^31, got " + std::to_string(a->V));
  if (a->head_kind != DSPARK_HEAD_VANILLA && a->head_kind != DSPARK_HEAD_GATED && a->head_kind != DSPARK_HEAD_RNN)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": head_kind must be DSPARK_HEAD_VANILLA, DSPARK_HEAD_GATED "
                                                        "or DSPARK_HEAD_RNN, got " + std::to_string(a->head_kind));
  *empty = a->N == 0 || a->K == 0 || a->V == 0;
  if (*empty) return DSPARK_OK;  // nothing to read or write
  p->N = a->N;
  p->K = a->K;
  p->V = a->V;
  p->R = a->R;
  p->head = a->head_kind;
  DSPARK_TRY(float_array(fn, "base_logits", a->base_logits, a->base_logits_dtype, false, &p->base_dtype));
  p->base = a->base_logits;
  dspark::IntArray anchors;
  DSPARK_TRY(int_array(fn, "anchor_tokens", a->anchor_tokens, a->anchor_tokens_dtype, false, &anchors));
  p->anchors = anchors.ptr;
  p->anchors_int64 = anchors.is64;
  DSPARK_TRY(float_array(fn, "w1", a->w1, a->w1_dtype, false, &p->w1_dtype));
  p->w1 = a->w1;
  if (a->w2_dtype == DSPARK_DTYPE_F8E4M3) {
    if (a->w2 == nullptr) return null_pointer(fn, "w2");
    if (a->w2_scale == nullptr) return null_pointer(fn, "w2_scale", "a DSPARK_DTYPE_F8E4M3 w2 needs its row scales");
    p->w2_dtype = dspark::DType::kFloat8E4M3;
    p->w2_scale = a->w2_scale;
  } else {
    DSPARK_TRY(float_array(fn, "w2", a->w2, a->w2_dtype, false, &p->w2_dtype));
    if (a->w2_scale != nullptr)
      return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": w2_scale is only for a DSPARK_DTYPE_F8E4M3 w2");
  }
  p->w2 = a->w2;
  p->VT = a->V;
  if (a->draft_to_target != nullptr) {
    if (a->VT < 0)
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": VT (w1's rows) must be >= 0, got " +
                                            std::to_string(a->VT));
    dspark::IntArray d2t;
    DSPARK_TRY(int_array(fn, "draft_to_target", a->draft_to_target, a->draft_to_target_dtype, false, &d2t));
    p->d2t = d2t.ptr;
    p->d2t_int64 = d2t.is64;
    p->VT = a->VT;
  }
  const bool has_conf = a->conf_weight != nullptr;
  const bool needs_hidden = a->head_kind != DSPARK_HEAD_VANILLA || has_conf;
  if (needs_hidden) {
    if (a->hidden == nullptr)
      return null_pointer(fn, "hidden", a->head_kind != DSPARK_HEAD_VANILLA
                                            ? "required by the gated and rnn heads"
                                            : "required by the confidence head");
    DSPARK_TRY(float_array(fn, "hidden", a->hidden, a->hidden_dtype, false, &p->hidden_dtype));
    p->hidden = a->hidden;
    p->D = a->D;
  }
  if (a->head_kind == DSPARK_HEAD_GATED) {
    DSPARK_TRY(float_array(fn, "wg", a->wg, a->wg_dtype, false, &p->wg_dtype));
    DSPARK_TRY(float_array(fn, "bg", a->bg, a->bg_dtype, false, &p->bg_dtype));
    p->wg = a->wg;
    p->bg = a->bg;
  } else if (a->head_kind == DSPARK_HEAD_RNN) {
    DSPARK_TRY(float_array(fn, "wj", a->wj, a->wj_dtype, false, &p->wj_dtype));
    DSPARK_TRY(float_array(fn, "bj", a->bj, a->bj_dtype, false, &p->bj_dtype));
    p->wj = a->wj;
    p->bj = a->bj;
  }
  if (has_conf) {
    DSPARK_TRY(float_array(fn, "conf_weight", a->conf_weight, a->conf_weight_dtype, false, &p->conf_w_dtype));
    p->conf_w = a->conf_weight;
    if (a->conf_bias == nullptr) return null_pointer(fn, "conf_bias", "required with conf_weight");
    DSPARK_TRY(float_array(fn, "conf_bias", a->conf_bias, a->conf_bias_dtype, false, &p->conf_b_dtype));
    p->conf_b = a->conf_bias;
    DSPARK_TRY(float_array(fn, "sts_temperatures", a->sts_temperatures, a->sts_temperatures_dtype, true,
                           &p->sts_dtype));
    p->sts = a->sts_temperatures;
    if (a->conf_logits == nullptr) return null_pointer(fn, "conf_logits", "required with conf_weight");
    if (a->survival == nullptr) return null_pointer(fn, "survival", "required with conf_weight");
    p->conf = a->conf_logits;
    p->survival = a->survival;
  } else if (a->sts_temperatures != nullptr) {
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": sts_temperatures is only used with conf_weight");
  }
  p->temperature = a->temperature;
  if (a->temperature != nullptr && a->rng_key == nullptr)
    return null_pointer(fn, "rng_key", "required with temperature");
  p->rng_key = dspark::rng::Key::on_device(a->rng_key);
  if (a->top_k < 0 || a->top_k > std::min<int64_t>(a->V, dspark::draft_topk::kMaxTopK))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": top_k must be 0 or in [1, min(V, " +
                                          std::to_string(dspark::draft_topk::kMaxTopK) + ")], got " +
                                          std::to_string(a->top_k));
  p->top_k = a->top_k;
  if (a->top_k > 0 && a->logits != nullptr && a->candidates == nullptr)
    return null_pointer(fn, "candidates", "required with top_k and logits");
  p->candidates = a->top_k > 0 && a->logits != nullptr ? a->candidates : nullptr;
  if (a->tokens == nullptr) return null_pointer(fn, "tokens");
  if (a->draft_logprobs == nullptr) return null_pointer(fn, "draft_logprobs");
  p->tokens = a->tokens;
  p->logprobs = a->draft_logprobs;
  p->logits = a->logits;
  return check_aligned(fn, {typed("w2_scale", p->w2_scale), typed("temperature", p->temperature),
                            typed("rng_key", a->temperature != nullptr ? a->rng_key : nullptr),
                            typed("tokens", p->tokens), typed("draft_logprobs", p->logprobs),
                            typed("logits", p->logits), typed("candidates", p->candidates),
                            typed("conf_logits", p->conf), typed("survival", p->survival)});
}

// ---- verify_chain
// The draft rows' layout: dense [N, K, V], reduced [N, K, W] with target_to_draft, top-k [N, K, W] with
// draft_candidates.
int verify_draft_layout(const dspark_verify_chain_args* a, dspark::VerifyChainParams* p) {
  constexpr const char* fn = "dspark_verify_chain";
  p->draft_width = a->draft_width == 0 ? a->V : a->draft_width;
  if (a->target_to_draft != nullptr && a->draft_candidates != nullptr)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": target_to_draft and draft_candidates exclude each other");
  if ((a->target_to_draft != nullptr || a->draft_candidates != nullptr) && a->draft_logits == nullptr)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": " +
                                          (a->target_to_draft ? "target_to_draft" : "draft_candidates") +
                                          " needs draft_logits");
  if (a->draft_logits == nullptr) return DSPARK_OK;
  if (a->V >= (int64_t(1) << 31))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": draft_logits need V < 2^31, got " + std::to_string(a->V));
  if (a->target_to_draft != nullptr) {
    p->layout = dspark::DraftLayout::kReduced;
    p->target_to_draft = a->target_to_draft;
  } else if (a->draft_candidates != nullptr) {
    dspark::IntArray arr;
    DSPARK_TRY(int_array(fn, "draft_candidates", a->draft_candidates, a->draft_candidates_dtype, false, &arr));
    p->layout = dspark::DraftLayout::kTopK;
    p->draft_candidates = arr.ptr;
    p->cands_i64 = arr.is64;
    if (p->draft_width > dspark::verify::kMaxTopK)
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": top-k rows need draft_width <= " +
                                            std::to_string(dspark::verify::kMaxTopK) + ", got " +
                                            std::to_string(p->draft_width));
  } else if (p->draft_width != a->V) {
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": draft_width must be V (or 0) for dense draft rows, got " +
                                          std::to_string(a->draft_width));
  }
  if (p->draft_width < 1)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": draft_width must be >= 1, got " +
                                          std::to_string(a->draft_width));
  return DSPARK_OK;
}

int verify_params(const dspark_verify_chain_args* a, dspark::VerifyChainParams* p) {
  constexpr const char* fn = "dspark_verify_chain";
  *p = dspark::VerifyChainParams{};
  if (a == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": args is NULL");
  if (a->N < 0) return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N must be >= 0, got " + std::to_string(a->N));
  if (a->K < 1 || a->K > dspark::verify::kMaxK)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": K must be in [1, " + std::to_string(dspark::verify::kMaxK) +
                                          "], got " + std::to_string(a->K));
  if (a->V < 1 || a->V >= (int64_t(1) << 34))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": V must be in [1, 2^34), got " + std::to_string(a->V));
  if (a->method != DSPARK_VERIFY_TOKEN && a->method != DSPARK_VERIFY_BLOCK)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": method must be DSPARK_VERIFY_TOKEN or "
                                                        "DSPARK_VERIFY_BLOCK, got " + std::to_string(a->method));
  if (a->num_stops < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": num_stops must be >= 0, got " +
                                          std::to_string(a->num_stops));
  p->N = a->N;
  p->K = a->K;
  p->V = a->V;
  p->block_method = a->method == DSPARK_VERIFY_BLOCK;
  if (a->N == 0) return DSPARK_OK;  // nothing to read or write
  DSPARK_TRY(verify_draft_layout(a, p));
  if (!dspark::verify_chain_grid_fits(a->N, a->K, a->V, p->draft_width))
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N = " + std::to_string(a->N) +
                                          " requests exceed one launch's grid");
  DSPARK_TRY(float_array(fn, "target_logits", a->target_logits, a->target_logits_dtype, false, &p->target_dtype));
  p->target = a->target_logits;
  dspark::IntArray arr;
  if (a->cu_seqlens != nullptr) {
    if (a->total_rows < 0)
      return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": total_rows must be >= 0 with cu_seqlens, got " +
                                            std::to_string(a->total_rows));
    DSPARK_TRY(int_array(fn, "cu_seqlens", a->cu_seqlens, a->cu_seqlens_dtype, false, &arr));
    p->cu_seqlens = arr.ptr;
    p->cu_i64 = arr.is64;
    p->total_rows = a->total_rows;
  }
  DSPARK_TRY(int_array(fn, "draft_tokens", a->draft_tokens, a->draft_tokens_dtype, false, &arr));
  p->draft_tokens = arr.ptr;
  p->drafts_i64 = arr.is64;
  p->draft_dtype = p->target_dtype;
  if (a->draft_logits != nullptr) {
    DSPARK_TRY(float_array(fn, "draft_logits", a->draft_logits, a->draft_logits_dtype, false, &p->draft_dtype));
    p->draft_logits = a->draft_logits;
  }
  if (a->draft_logprobs != nullptr) {
    if (a->draft_logits == nullptr)
      return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": draft_logprobs needs draft_logits (the residual is "
                                                          "sampled from the draft rows)");
    p->draft_logprobs = a->draft_logprobs;
  }
  if (a->verify_lens != nullptr) {
    DSPARK_TRY(int_array(fn, "verify_lens", a->verify_lens, a->verify_lens_dtype, false, &arr));
    p->verify_lens = arr.ptr;
    p->lens_i64 = arr.is64;
  }
  if ((a->survival == nullptr) != (a->thresholds == nullptr))
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": survival and thresholds must be given together (" +
                                          (a->survival == nullptr ? "survival" : "thresholds") + " is NULL)");
  if (a->survival != nullptr) {
    DSPARK_TRY(float_array(fn, "survival", a->survival, a->survival_dtype, false, &p->survival_dtype));
    DSPARK_TRY(float_array(fn, "thresholds", a->thresholds, a->thresholds_dtype, false, &p->thresholds_dtype));
    p->survival = a->survival;
    p->thresholds = a->thresholds;
  }
  p->temperature = a->temperature;
  if (a->temperature != nullptr && a->rng_key == nullptr)
    return null_pointer(fn, "rng_key", "required with temperature");
  p->rng_key = dspark::rng::Key::on_device(a->rng_key);
  if (a->num_stops > 0) {
    DSPARK_TRY(int_array(fn, "stop_token_ids", a->stop_token_ids, a->stop_token_ids_dtype, false, &arr));
    p->stop_ids = arr.ptr;
    p->stops_i64 = arr.is64;
    p->num_stops = a->num_stops;
  }
  if (a->tokens == nullptr) return null_pointer(fn, "tokens");
  if (a->num_accepted == nullptr) return null_pointer(fn, "num_accepted");
  if (a->accept_mask == nullptr) return null_pointer(fn, "accept_mask");
  p->out_tokens = a->tokens;
  p->out_num_accepted = a->num_accepted;
  p->out_accept_mask = a->accept_mask;
  return check_aligned(fn, {typed("target_to_draft", p->target_to_draft), typed("draft_logprobs", p->draft_logprobs),
                            typed("temperature", p->temperature),
                            typed("rng_key", a->temperature != nullptr ? a->rng_key : nullptr),
                            typed("tokens", p->out_tokens), typed("num_accepted", p->out_num_accepted),
                            typed("tickets", a->tickets)});
}

size_t verify_workspace_bytes(const dspark::VerifyChainParams& p) {
  return dspark::verify_chain_workspace_bytes(p.N, p.K, p.V, p.draft_logits != nullptr ? p.draft_width : p.V);
}
size_t verify_tickets_bytes(int64_t N) {
  return sizeof(uint32_t) * static_cast<size_t>(dspark::verify_chain_ticket_count(N));
}

}  // namespace

extern "C" {

DSPARK_API const char* dspark_last_error(void) { return g_last_error.c_str(); }

DSPARK_API int dspark_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const int64_t* rng_key,
                                  int stream, cudaStream_t s) {
  if (N < 0 || K < 0 || V < 0)
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: N, K, V must be >= 0, got N=" + std::to_string(N) +
                                          " K=" + std::to_string(K) + " V=" + std::to_string(V));
  if (N > (int64_t(1) << 32))
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: N (requests) must be <= 2^32, got " + std::to_string(N));
  if (K >= (int64_t(1) << 24))
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: K (positions) must be < 2^24, got " + std::to_string(K));
  if (V > (int64_t(1) << 34))
    return fail(DSPARK_ERR_BAD_SHAPE, "dspark_rng_uniform: V (tokens) must be <= 2^34, got " + std::to_string(V));
  if (stream < 0 || stream >= 256)
    return fail(DSPARK_ERR_BAD_VALUE, "dspark_rng_uniform: stream must be in [0, 256), got " + std::to_string(stream));
  if (N == 0 || K == 0 || V == 0) return ok();
  if (out == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_rng_uniform: out is NULL");
  if (rng_key == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_rng_uniform: rng_key is NULL");
  DSPARK_TRY(check_aligned("dspark_rng_uniform", {typed("out", out), typed("rng_key", rng_key)}));
  const cudaError_t err = dspark::launch_rng_uniform(out, N, K, V, dspark::rng::Key::on_device(rng_key), stream, s);
  if (err != cudaSuccess)
    return fail(DSPARK_ERR_CUDA, std::string("dspark_rng_uniform: launch failed: ") + cuda_message(err));
  return ok();
}

DSPARK_API int dspark_philox_uniform_host(uint64_t seed, uint64_t offset, uint64_t request, uint64_t position,
                                          int stream, uint64_t token, uint32_t* bits, float* uniform) {
  constexpr const char* fn = "dspark_philox_uniform_host";
  if (stream < 0 || stream >= 256)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": stream must be in [0, 256), got " + std::to_string(stream));
  const char* out_of_range = request >= (uint64_t(1) << 32)    ? "request must be < 2^32"
                             : position >= (uint64_t(1) << 24) ? "position must be < 2^24"
                             : token >= (uint64_t(1) << 34)    ? "token must be < 2^34"
                                                               : nullptr;
  if (out_of_range)
    return fail(DSPARK_ERR_BAD_VALUE, std::string(fn) + ": " + out_of_range + " (the generator's counter)");
  const uint32_t x = dspark::rng::Philox::make(seed, offset).bits(request, position, uint32_t(stream), token);
  if (bits) *bits = x;
  if (uniform) *uniform = dspark::rng::bits_to_uniform(x);
  return ok();
}

DSPARK_API int dspark_philox4x32_10_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  if (!counter) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: counter is NULL");
  if (!key) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: key is NULL");
  if (!out) return fail(DSPARK_ERR_NULL_POINTER, "dspark_philox4x32_10_host: out is NULL");
  const dspark::rng::U32x4 r =
      dspark::rng::philox4x32_10(dspark::rng::U32x4{counter[0], counter[1], counter[2], counter[3]}, key[0], key[1]);
  out[0] = r.x;
  out[1] = r.y;
  out[2] = r.z;
  out[3] = r.w;
  return ok();
}

DSPARK_API int dspark_accept_prefix_scan_workspace_size(const dspark_accept_prefix_scan_args* args, size_t* bytes) {
  if (bytes == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_accept_prefix_scan_workspace_size: bytes is NULL");
  dspark::AcceptPrefixScanParams p;
  DSPARK_TRY(scan_params(args, &p));
  *bytes = dspark::accept_prefix_scan_workspace_bytes(p.N);
  return ok();
}

DSPARK_API int dspark_accept_prefix_scan(const dspark_accept_prefix_scan_args* args, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream) {
  dspark::AcceptPrefixScanParams p;
  DSPARK_TRY(scan_params(args, &p));
  const size_t need = dspark::accept_prefix_scan_workspace_bytes(p.N);
  DSPARK_TRY(check_workspace("dspark_accept_prefix_scan", workspace, workspace_bytes, need));
  return run_launch("dspark_accept_prefix_scan",
                    [&] { return dspark::launch_accept_prefix_scan(p, need ? workspace : nullptr, stream); });
}

DSPARK_API int dspark_schedule_verify_lens_workspace_size(const dspark_schedule_verify_lens_args* args,
                                                          size_t* bytes) {
  if (bytes == nullptr)
    return fail(DSPARK_ERR_NULL_POINTER, "dspark_schedule_verify_lens_workspace_size: bytes is NULL");
  dspark::ScheduleVerifyLensParams p;
  DSPARK_TRY(schedule_params(args, &p));
  *bytes = dspark::schedule_verify_lens_workspace_bytes(p);
  return ok();
}

DSPARK_API int dspark_schedule_verify_lens(const dspark_schedule_verify_lens_args* args, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  dspark::ScheduleVerifyLensParams p;
  DSPARK_TRY(schedule_params(args, &p));
  const size_t need = dspark::schedule_verify_lens_workspace_bytes(p);
  DSPARK_TRY(check_workspace("dspark_schedule_verify_lens", workspace, workspace_bytes, need));
  return run_launch("dspark_schedule_verify_lens",
                    [&] { return dspark::launch_schedule_verify_lens(p, need ? workspace : nullptr, stream); });
}

DSPARK_API int dspark_draft_block_workspace_size(const dspark_draft_block_args* args, size_t* bytes) {
  constexpr const char* fn = "dspark_draft_block_workspace_size";
  if (bytes == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": bytes is NULL");
  dspark::DraftBlockParams p;
  bool empty = false;
  DSPARK_TRY(draft_params(args, &p, &empty));
  if (empty) {
    *bytes = 0;
    return ok();
  }
  size_t need = 0;
  try {
    need = dspark::draft_block_workspace_bytes(p);
  } catch (const std::exception& e) {
    return fail(DSPARK_ERR_CUDA, std::string(fn) + ": " + e.what());
  }
  if (need == 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": no launch configuration fits this device (R = " +
                                          std::to_string(p.R) + ")");
  *bytes = need;
  return ok();
}

DSPARK_API int dspark_draft_block(const dspark_draft_block_args* args, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  constexpr const char* fn = "dspark_draft_block";
  dspark::DraftBlockParams p;
  bool empty = false;
  DSPARK_TRY(draft_params(args, &p, &empty));
  if (empty) return ok();
  size_t need = 0;
  try {
    need = dspark::draft_block_workspace_bytes(p);
  } catch (const std::exception& e) {
    return fail(DSPARK_ERR_CUDA, std::string(fn) + ": " + e.what());
  }
  if (need == 0)
    return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": no launch configuration fits this device (R = " +
                                          std::to_string(p.R) + ")");
  DSPARK_TRY(check_workspace(fn, workspace, workspace_bytes, need));
  return run_launch(fn, [&] { return dspark::launch_draft_block(p, workspace, stream); });
}

DSPARK_API int dspark_verify_chain_workspace_size(const dspark_verify_chain_args* args, size_t* bytes) {
  if (bytes == nullptr) return fail(DSPARK_ERR_NULL_POINTER, "dspark_verify_chain_workspace_size: bytes is NULL");
  dspark::VerifyChainParams p;
  DSPARK_TRY(verify_params(args, &p));
  *bytes = p.N > 0 ? verify_workspace_bytes(p) : 0;
  return ok();
}

DSPARK_API int dspark_verify_chain_tickets_size(int64_t N, size_t* bytes) {
  constexpr const char* fn = "dspark_verify_chain_tickets_size";
  if (bytes == nullptr) return fail(DSPARK_ERR_NULL_POINTER, std::string(fn) + ": bytes is NULL");
  if (N < 0) return fail(DSPARK_ERR_BAD_SHAPE, std::string(fn) + ": N must be >= 0, got " + std::to_string(N));
  *bytes = verify_tickets_bytes(N);
  return ok();
}

DSPARK_API int dspark_verify_chain(const dspark_verify_chain_args* args, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  constexpr const char* fn = "dspark_verify_chain";
  dspark::VerifyChainParams p;
  DSPARK_TRY(verify_params(args, &p));
  if (p.N == 0) return ok();
  const size_t need = verify_workspace_bytes(p);
  DSPARK_TRY(check_workspace(fn, workspace, workspace_bytes, need));
  if (args->tickets == nullptr) return null_pointer(fn, "tickets", "zeroed once, see dspark_verify_chain_tickets_size");
  const size_t need_tickets = verify_tickets_bytes(p.N);
  if (args->tickets_bytes < need_tickets)
    return fail(DSPARK_ERR_WORKSPACE, std::string(fn) + ": tickets must hold " + std::to_string(need_tickets) +
                                          " bytes (tickets_bytes), got " + std::to_string(args->tickets_bytes));
  return run_launch(fn, [&] { return dspark::launch_verify_chain(p, workspace, args->tickets, stream); });
}

}  // extern "C"
