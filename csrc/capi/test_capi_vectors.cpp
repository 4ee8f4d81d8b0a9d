// ctest of the C ABI on the CPU: dspark_capi.cu built with DSPARK_SIMT (the kernels run on host buffers through
// the SIMT harness) must reproduce python_tests/data/capi_vectors.json, the reference's outputs of
// accept_prefix_scan, schedule_verify_lens, draft_block and verify_chain (written by
// python_tests/data/make_capi_vectors.py): integer outputs (tokens, counts, masks, lengths) exactly, theta to 1e-6
// relative, and draft_block's float32 outputs (logits, conf_logits, survival) to 1e-5 relative + 1e-6 absolute,
// draft_logprobs to 1e-5 relative + 2e-5 absolute (NaN must match NaN); plus argument errors that name the argument.
// Usage: test_capi_vectors <path/to/capi_vectors.json>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#if defined(DSPARK_SIMT)
#include "dspark_simt/runtime.h"  // the harness's schedule settings; must precede the CUDA headers
#endif
#include "dspark.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// ---- a tiny JSON reader: null, true/false, numbers (also NaN / Infinity / -Infinity, as Python writes them),
// strings without escapes, arrays, objects.
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  std::string text;  // the number's or string's text
  std::vector<Json> items;
  std::map<std::string, Json> fields;
  bool is_null() const { return kind == kNull; }
  const Json& operator[](const std::string& key) const {
    static const Json null_value;
    auto it = fields.find(key);
    return it == fields.end() ? null_value : it->second;
  }
  int64_t i() const { return strtoll(text.c_str(), nullptr, 10); }
  double d() const {
    if (text == "NaN") return NAN;
    if (text == "Infinity") return INFINITY;
    if (text == "-Infinity") return -INFINITY;
    return strtod(text.c_str(), nullptr);
  }
};

struct Parser {
  const std::string& s;
  size_t p = 0;
  void ws() {
    while (p < s.size() && (s[p] == ' ' || s[p] == '\n' || s[p] == '\t' || s[p] == '\r')) ++p;
  }
  bool eat(const char* word) {
    const size_t n = strlen(word);
    if (s.compare(p, n, word) == 0) {
      p += n;
      return true;
    }
    return false;
  }
  Json value() {
    ws();
    Json v;
    if (p >= s.size()) throw std::runtime_error("unexpected end of JSON");
    const char c = s[p];
    if (c == '{') {
      v.kind = Json::kObject;
      ++p;
      ws();
      if (s[p] == '}') {
        ++p;
        return v;
      }
      for (;;) {
        ws();
        Json key = value();
        ws();
        if (s[p++] != ':') throw std::runtime_error("expected ':' in JSON");
        v.fields[key.text] = value();
        ws();
        if (s[p] == ',') { ++p; continue; }
        if (s[p++] != '}') throw std::runtime_error("expected '}' in JSON");
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++p;
      ws();
      if (s[p] == ']') {
        ++p;
        return v;
      }
      for (;;) {
        v.items.push_back(value());
        ws();
        if (s[p] == ',') { ++p; continue; }
        if (s[p++] != ']') throw std::runtime_error("expected ']' in JSON");
        return v;
      }
    }
    if (c == '"') {
      const size_t e = s.find('"', p + 1);
      v.kind = Json::kString;
      v.text = s.substr(p + 1, e - p - 1);
      p = e + 1;
      return v;
    }
    if (eat("null")) return v;
    if (eat("true")) { v.kind = Json::kBool; v.text = "1"; return v; }
    if (eat("false")) { v.kind = Json::kBool; v.text = "0"; return v; }
    v.kind = Json::kNumber;
    const size_t b = p;
    if (eat("NaN") || eat("Infinity") || eat("-Infinity")) {
      v.text = s.substr(b, p - b);
      return v;
    }
    while (p < s.size() && strchr("+-0123456789.eE", s[p])) ++p;
    if (p == b) throw std::runtime_error("bad JSON value at offset " + std::to_string(p));
    v.text = s.substr(b, p - b);
    return v;
  }
};

// An input array in the vector file's form ({"dtype": ..., "data": [...]}) as bytes of its dtype.
struct Buf {
  std::vector<unsigned char> bytes;
  int dtype = -1;
  const void* ptr() const { return bytes.empty() ? nullptr : bytes.data(); }
};

Buf int_buf(const Json& j) {
  Buf b;
  if (j.is_null()) return b;
  const bool is64 = j["dtype"].text == "i64";
  b.dtype = is64 ? DSPARK_DTYPE_I64 : DSPARK_DTYPE_I32;
  for (const Json& x : j["data"].items) {
    const int64_t v = x.i();
    if (is64) {
      unsigned char c[8];
      memcpy(c, &v, 8);
      b.bytes.insert(b.bytes.end(), c, c + 8);
    } else {
      const int32_t w = static_cast<int32_t>(v);
      unsigned char c[4];
      memcpy(c, &w, 4);
      b.bytes.insert(b.bytes.end(), c, c + 4);
    }
  }
  if (b.bytes.empty()) b.bytes.resize(8);  // a present but empty array: a valid pointer
  return b;
}

Buf float_buf(const Json& j) {
  Buf b;
  if (j.is_null()) return b;
  const std::string& dt = j["dtype"].text;
  b.dtype = dt == "f32" ? DSPARK_DTYPE_F32
            : dt == "bf16" ? DSPARK_DTYPE_BF16
            : dt == "f8e4m3" ? DSPARK_DTYPE_F8E4M3 : DSPARK_DTYPE_F16;
  for (const Json& x : j["data"].items) {
    if (b.dtype == DSPARK_DTYPE_F8E4M3) {
      b.bytes.push_back(static_cast<unsigned char>(x.i()));
    } else if (b.dtype == DSPARK_DTYPE_F32) {
      const float f = static_cast<float>(x.d());
      unsigned char c[4];
      memcpy(c, &f, 4);
      b.bytes.insert(b.bytes.end(), c, c + 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(x.i());
      unsigned char c[2];
      memcpy(c, &h, 2);
      b.bytes.insert(b.bytes.end(), c, c + 2);
    }
  }
  if (b.bytes.empty()) b.bytes.resize(8);
  return b;
}

template <typename T>
void expect_equal(const std::vector<T>& got, const Json& want, const std::string& what) {
  if (want.items.size() != got.size()) {
    check(false, what + ": " + std::to_string(got.size()) + " values, want " + std::to_string(want.items.size()));
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<int64_t>(got[i]) != want.items[i].i()) {
      check(false, what + "[" + std::to_string(i) + "] = " + std::to_string(static_cast<int64_t>(got[i])) +
                       ", want " + want.items[i].text);
      return;
    }
  }
}

void run_scan(const Json& c, int index) {
  const std::string name = "scan case " + std::to_string(index);
  const int64_t N = c["N"].i(), K = c["K"].i(), W = N * (K + 1);
  const Buf tokens = int_buf(c["tokens"]), seq = int_buf(c["seq_lens"]), nacc = int_buf(c["num_accepted"]);
  const Buf vcu = int_buf(c["verify_cu_seqlens"]), table = int_buf(c["block_table"]);
  const Buf maxl = int_buf(c["max_seq_lens"]), stops = int_buf(c["stop_token_ids"]);
  std::vector<uint8_t> mask;
  for (const Json& x : c["accept_mask"].items) mask.push_back(static_cast<uint8_t>(x.i()));
  std::vector<int32_t> cu(N + 1, 12345), rows(W, 12345), new_seq(N, 12345);
  std::vector<int64_t> out(W, 12345), anchor(N, 12345), slots(W, 12345);
  std::vector<uint8_t> fin(N, 7);
  dspark_accept_prefix_scan_args a;
  memset(&a, 0, sizeof a);
  a.N = N;
  a.K = K;
  a.tokens = tokens.ptr();
  a.tokens_dtype = tokens.dtype;
  a.seq_lens = seq.ptr();
  a.seq_lens_dtype = seq.dtype;
  a.num_accepted = nacc.ptr();
  a.num_accepted_dtype = nacc.dtype;
  a.accept_mask = c["accept_mask"].is_null() ? nullptr : (mask.empty() ? fin.data() : mask.data());
  a.verify_cu_seqlens = vcu.ptr();
  a.verify_cu_seqlens_dtype = vcu.dtype;
  a.block_table = table.ptr();
  a.block_table_dtype = table.dtype;
  a.max_blocks = c["max_blocks"].i();
  a.block_size = c["block_size"].i();
  a.max_seq_lens = maxl.ptr();
  a.max_seq_lens_dtype = maxl.dtype;
  a.stop_token_ids = stops.ptr();
  a.stop_token_ids_dtype = stops.dtype;
  a.num_stops = c["stop_token_ids"].is_null() ? 0 : static_cast<int64_t>(c["stop_token_ids"]["data"].items.size());
  a.cu_out = cu.data();
  a.out_tokens = out.data();
  a.new_seq_lens = new_seq.data();
  a.next_anchor = anchor.data();
  a.hidden_rows = rows.data();
  a.kv_slots = slots.data();
  a.finished = fin.data();
  size_t bytes = 99;
  check(dspark_accept_prefix_scan_workspace_size(&a, &bytes) == DSPARK_OK, name + ": workspace size: " +
                                                                               dspark_last_error());
  std::vector<unsigned char> ws(bytes + 1);
  const int rc = dspark_accept_prefix_scan(&a, ws.data(), bytes, nullptr);
  check(rc == DSPARK_OK, name + ": dspark_accept_prefix_scan returned " + std::to_string(rc) + ": " +
                             dspark_last_error());
  if (rc != DSPARK_OK) return;
  const Json& e = c["expect"];
  expect_equal(cu, e["cu_out"], name + " cu_out");
  expect_equal(out, e["out_tokens"], name + " out_tokens");
  expect_equal(new_seq, e["new_seq_lens"], name + " new_seq_lens");
  expect_equal(anchor, e["next_anchor"], name + " next_anchor");
  expect_equal(rows, e["hidden_rows"], name + " hidden_rows");
  if (!e["kv_slots"].is_null()) expect_equal(slots, e["kv_slots"], name + " kv_slots");
  expect_equal(fin, e["finished"], name + " finished");
}

void run_schedule(const Json& c, int index) {
  const std::string name = "schedule case " + std::to_string(index);
  const int64_t N = c["N"].i();
  const Buf surv = float_buf(c["survival"]), conf = float_buf(c["conf_logits"]);
  const Buf sts = float_buf(c["sts_temperatures"]), budget = float_buf(c["budget_survival"]);
  std::vector<float> counts, times;
  for (const Json& x : c["token_counts"].items) counts.push_back(static_cast<float>(x.d()));
  for (const Json& x : c["step_time_ms"].items) times.push_back(static_cast<float>(x.d()));
  std::vector<int32_t> lens(N, 12345), cu(N + 1, 12345);
  float theta = -1.0f;
  dspark_schedule_verify_lens_args a;
  memset(&a, 0, sizeof a);
  a.N = N;
  a.K = c["K"].i();
  a.survival = surv.ptr();
  a.survival_dtype = surv.dtype;
  a.conf_logits = conf.ptr();
  a.conf_logits_dtype = conf.dtype;
  a.sts_temperatures = sts.ptr();
  a.sts_temperatures_dtype = sts.dtype;
  a.token_counts = counts.data();
  a.step_time_ms = times.data();
  a.P = static_cast<int64_t>(counts.size());
  a.fixed_overhead_ms = c["fixed_overhead_ms"].d();
  a.min_len = c["min_len"].i();
  a.max_len = c["max_len"].i();
  a.mode = c["mode"].text == "exact" ? DSPARK_SCHEDULE_EXACT : DSPARK_SCHEDULE_ARGMAX;
  a.budget_survival = budget.ptr();
  a.budget_survival_dtype = budget.dtype;
  a.NB = c["NB"].i();
  a.KB = c["KB"].i();
  a.min_gain = c["min_gain"].d();
  std::vector<uint8_t> active;
  for (const Json& x : c["active"].items) active.push_back(static_cast<uint8_t>(x.i()));
  a.active = c["active"].is_null() ? nullptr : active.data();
  a.verify_lens = lens.data();
  a.cu_seqlens = cu.data();
  a.theta = &theta;
  size_t bytes = 99;
  check(dspark_schedule_verify_lens_workspace_size(&a, &bytes) == DSPARK_OK, name + ": workspace size: " +
                                                                                 dspark_last_error());
  std::vector<unsigned char> ws(bytes + 16);
  const int rc = dspark_schedule_verify_lens(&a, bytes ? ws.data() : nullptr, bytes, nullptr);
  check(rc == DSPARK_OK, name + ": dspark_schedule_verify_lens returned " + std::to_string(rc) + ": " +
                             dspark_last_error());
  if (rc != DSPARK_OK) return;
  const Json& e = c["expect"];
  expect_equal(lens, e["verify_lens"], name + " verify_lens");
  expect_equal(cu, e["cu_seqlens"], name + " cu_seqlens");
  const double want = e["theta"].d();
  check(fabs(theta - want) <= 1e-6 * fabs(want), name + " theta " + std::to_string(theta) + ", want " +
                                                     e["theta"].text);
}

void argument_errors() {
  dspark_accept_prefix_scan_args a;
  memset(&a, 0, sizeof a);
  int32_t cu[3];
  int64_t tok[4] = {1, 2, 3, 4};
  a.N = 2;
  a.K = 1;
  a.tokens = tok;
  a.tokens_dtype = DSPARK_DTYPE_F32;  // not an integer dtype
  a.cu_out = cu;
  size_t bytes = 0;
  check(dspark_accept_prefix_scan_workspace_size(&a, &bytes) == DSPARK_ERR_BAD_DTYPE &&
            strstr(dspark_last_error(), "tokens_dtype") != nullptr,
        "a float tokens_dtype must be rejected, naming tokens_dtype");
  a.tokens_dtype = DSPARK_DTYPE_I64;
  check(dspark_accept_prefix_scan(&a, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "seq_lens") != nullptr,
        "a NULL seq_lens must be rejected, naming seq_lens");
  int64_t any64[1];  // never read: the checks below fail before any access
  int32_t any32[1];
  uint8_t any8[1];
  a.seq_lens = any64;
  a.seq_lens_dtype = DSPARK_DTYPE_I64;
  a.num_accepted = any32;
  a.num_accepted_dtype = DSPARK_DTYPE_I32;
  a.out_tokens = any64;
  a.new_seq_lens = any32;
  a.next_anchor = any64;
  a.hidden_rows = any32;
  a.finished = any8;
  a.N = int64_t(1) << 29;  // N*(K+1) fits int32, but not one launch's resident CTAs
  check(dspark_accept_prefix_scan_workspace_size(&a, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "resident") != nullptr,
        std::string("N beyond one launch's resident CTAs must be rejected; got: ") + dspark_last_error());
  a.N = -1;
  check(dspark_accept_prefix_scan(&a, nullptr, 0, nullptr) == DSPARK_ERR_BAD_SHAPE, "N < 0 must be rejected");
  check(dspark_accept_prefix_scan(nullptr, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER, "NULL args");

  dspark_schedule_verify_lens_args s;
  memset(&s, 0, sizeof s);
  float surv[2] = {0.5f, 0.4f}, c1 = 1.0f, t1 = 10.0f, theta = 0;
  int32_t lens[1], cus[2];
  s.N = 1;
  s.K = 2;
  s.survival = surv;
  s.token_counts = &c1;
  s.step_time_ms = &t1;
  s.P = 1;
  s.min_len = 0;
  s.max_len = 3;  // > K
  s.verify_lens = lens;
  s.cu_seqlens = cus;
  s.theta = &theta;
  check(dspark_schedule_verify_lens(&s, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "max_len") != nullptr,
        "max_len > K must be rejected, naming max_len");
  s.max_len = 2;
  s.survival_dtype = 9;
  check(dspark_schedule_verify_lens(&s, nullptr, 0, nullptr) == DSPARK_ERR_BAD_DTYPE &&
            strstr(dspark_last_error(), "survival_dtype") != nullptr,
        "a bad survival_dtype must be rejected");
  s.survival_dtype = DSPARK_DTYPE_F32;
  s.mode = DSPARK_SCHEDULE_EXACT;
  s.min_gain = 0.5;
  check(dspark_schedule_verify_lens(&s, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "min_gain") != nullptr,
        "min_gain in exact mode must be rejected");
  s.min_gain = 0.0;
  check(dspark_schedule_verify_lens(&s, nullptr, 0, nullptr) == DSPARK_OK, "a valid schedule call");
  check(lens[0] == 2 && cus[0] == 0 && cus[1] == 3, "flat cost table: both drafts verified");
}

// float32 outputs against the reference's: |got - want| <= kRtol |want| + atol, NaN where the reference has NaN.
// atol is kAtol, or kLogprobAtol for draft_logprobs: the kernel's log-sum-exp takes its exponentials as
// 2^(x log2 e - m log2 e), so the log of the sum carries the rounding of m log2 e (|m| 2^-24 for the row's maximum
// logit m, about 2e-6 at |m| = 30) on top of a different summation order; the Python tests of the same kernel
// (test_draft_block.py) use the same bound.
constexpr double kRtol = 1e-5, kAtol = 1e-6, kLogprobAtol = 2e-5;
void expect_close(const std::vector<float>& got, const Json& want_arr, const std::string& what,
                  double atol = kAtol) {
  const Json& want = want_arr["data"];
  if (want.items.size() != got.size()) {
    check(false, what + ": " + std::to_string(got.size()) + " values, want " + std::to_string(want.items.size()));
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want.items[i].d(), x = got[i];
    const bool ok = (w != w) ? (x != x) : (x == w || fabs(x - w) <= kRtol * fabs(w) + atol);
    if (!ok) {
      char buf[128];
      snprintf(buf, sizeof buf, "[%zu] = %.9g, want %.9g", i, x, w);
      check(false, what + buf);
      return;
    }
  }
}

std::vector<int64_t> rng_key_of(const Json& c) {
  std::vector<int64_t> key;
  for (const Json& x : c["rng_key"].items) key.push_back(x.i());
  return key;
}

int head_of(const std::string& s) {
  return s == "vanilla" ? DSPARK_HEAD_VANILLA : s == "gated" ? DSPARK_HEAD_GATED : DSPARK_HEAD_RNN;
}

void run_draft(const Json& c, int index) {
  const std::string name = "draft_block case " + std::to_string(index) + " (" + c["head"].text + ")";
  const int64_t N = c["N"].i(), K = c["K"].i(), V = c["V"].i();
  const Buf base = float_buf(c["base_logits"]), anchors = int_buf(c["anchor_tokens"]);
  const Buf w1 = float_buf(c["w1"]), w2 = float_buf(c["w2"]), wg = float_buf(c["wg"]), bg = float_buf(c["bg"]);
  const Buf w2_scale = float_buf(c["w2_scale"]);
  const Buf wj = float_buf(c["wj"]), bj = float_buf(c["bj"]), hidden = float_buf(c["hidden"]);
  const Buf cw = float_buf(c["conf_weight"]), cb = float_buf(c["conf_bias"]), sts = float_buf(c["sts_temperatures"]);
  const Buf temps = float_buf(c["temperature"]);
  const std::vector<int64_t> key = rng_key_of(c);
  const bool has_conf = !c["conf_weight"].is_null(), with_logits = c["return_logits"].text == "1";
  const int64_t top_k = c["top_k"].i(), width = top_k > 0 ? top_k : V;
  std::vector<int64_t> tokens(N * K, 12345), candidates(with_logits && top_k > 0 ? N * K * top_k : 0, 12345);
  std::vector<float> logprobs(N * K, -7.0f), logits(with_logits ? N * K * width : 0, -7.0f);
  std::vector<float> conf(has_conf ? N * K : 0, -7.0f), surv(has_conf ? N * K : 0, -7.0f);
  dspark_draft_block_args a;
  memset(&a, 0, sizeof a);
  a.N = N;
  a.K = K;
  a.V = V;
  a.R = c["R"].i();
  a.D = c["D"].i();
  a.base_logits = base.ptr();
  a.base_logits_dtype = base.dtype;
  a.anchor_tokens = anchors.ptr();
  a.anchor_tokens_dtype = anchors.dtype;
  a.head_kind = head_of(c["head"].text);
  a.w1 = w1.ptr();
  a.w1_dtype = w1.dtype;
  a.w2 = w2.ptr();
  a.w2_dtype = w2.dtype;
  a.w2_scale = static_cast<const float*>(w2_scale.ptr());
  a.wg = wg.ptr();
  a.wg_dtype = wg.dtype;
  a.bg = bg.ptr();
  a.bg_dtype = bg.dtype;
  a.wj = wj.ptr();
  a.wj_dtype = wj.dtype;
  a.bj = bj.ptr();
  a.bj_dtype = bj.dtype;
  a.hidden = hidden.ptr();
  a.hidden_dtype = hidden.dtype;
  a.conf_weight = cw.ptr();
  a.conf_weight_dtype = cw.dtype;
  a.conf_bias = cb.ptr();
  a.conf_bias_dtype = cb.dtype;
  a.sts_temperatures = sts.ptr();
  a.sts_temperatures_dtype = sts.dtype;
  a.temperature = static_cast<const float*>(temps.ptr());
  a.rng_key = key.data();
  a.top_k = top_k;
  a.tokens = tokens.data();
  a.draft_logprobs = logprobs.data();
  a.logits = with_logits ? logits.data() : nullptr;
  a.candidates = candidates.empty() ? nullptr : candidates.data();
  a.conf_logits = has_conf ? conf.data() : nullptr;
  a.survival = has_conf ? surv.data() : nullptr;
  size_t bytes = 0;
  check(dspark_draft_block_workspace_size(&a, &bytes) == DSPARK_OK && bytes > 0,
        name + ": workspace size: " + dspark_last_error());
  std::vector<double> ws(bytes / sizeof(double) + 2);  // 16-byte aligned storage
  const int rc = dspark_draft_block(&a, ws.data(), bytes, nullptr);
  check(rc == DSPARK_OK, name + ": dspark_draft_block returned " + std::to_string(rc) + ": " + dspark_last_error());
  if (rc != DSPARK_OK) return;
  const Json& e = c["expect"];
  expect_equal(tokens, e["tokens"], name + " tokens");
  expect_close(logprobs, e["draft_logprobs"], name + " draft_logprobs", kLogprobAtol);
  if (with_logits) expect_close(logits, e["logits"], name + " logits");
  if (!candidates.empty()) expect_equal(candidates, e["candidates"], name + " candidates");
  if (has_conf) {
    expect_close(conf, e["conf_logits"], name + " conf_logits");
    expect_close(surv, e["survival"], name + " survival");
  }
}

void run_verify(const Json& c, int index) {
  const std::string name = "verify_chain case " + std::to_string(index) + " (" + c["method"].text + ")";
  const int64_t N = c["N"].i(), K = c["K"].i();
  const Buf target = float_buf(c["target_logits"]), cu = int_buf(c["cu_seqlens"]);
  const Buf drafts = int_buf(c["draft_tokens"]), dlogits = float_buf(c["draft_logits"]);
  const Buf dlogprobs = float_buf(c["draft_logprobs"]), lens = int_buf(c["verify_lens"]);
  const Buf surv = float_buf(c["survival"]), thr = float_buf(c["thresholds"]), temps = float_buf(c["temperature"]);
  const Buf stops = int_buf(c["stop_token_ids"]);
  const Buf inv = int_buf(c["target_to_draft"]), cands = int_buf(c["draft_candidates"]);
  const std::vector<int64_t> key = rng_key_of(c);
  std::vector<int64_t> tokens(N * (K + 1), 12345);
  std::vector<int32_t> n_acc(N, 12345);
  std::vector<uint8_t> mask(N * K, 7);
  dspark_verify_chain_args a;
  memset(&a, 0, sizeof a);
  a.N = N;
  a.K = K;
  a.V = c["V"].i();
  a.target_logits = target.ptr();
  a.target_logits_dtype = target.dtype;
  a.cu_seqlens = cu.ptr();
  a.cu_seqlens_dtype = cu.dtype;
  a.total_rows = c["total_rows"].i();
  a.draft_tokens = drafts.ptr();
  a.draft_tokens_dtype = drafts.dtype;
  a.draft_logits = dlogits.ptr();
  a.draft_logits_dtype = dlogits.dtype;
  a.draft_width = c["draft_width"].i();
  a.target_to_draft = static_cast<const int32_t*>(inv.ptr());
  a.draft_candidates = cands.ptr();
  a.draft_candidates_dtype = cands.dtype;
  a.draft_logprobs = static_cast<const float*>(dlogprobs.ptr());
  a.verify_lens = lens.ptr();
  a.verify_lens_dtype = lens.dtype;
  a.survival = surv.ptr();
  a.survival_dtype = surv.dtype;
  a.thresholds = thr.ptr();
  a.thresholds_dtype = thr.dtype;
  a.temperature = static_cast<const float*>(temps.ptr());
  a.rng_key = c["temperature"].is_null() ? nullptr : key.data();  // greedy calls need no key
  a.stop_token_ids = stops.ptr();
  a.stop_token_ids_dtype = stops.dtype;
  a.num_stops = c["stop_token_ids"].is_null() ? 0 : static_cast<int64_t>(c["stop_token_ids"]["data"].items.size());
  a.method = c["method"].text == "block" ? DSPARK_VERIFY_BLOCK : DSPARK_VERIFY_TOKEN;
  a.tokens = tokens.data();
  a.num_accepted = n_acc.data();
  a.accept_mask = mask.data();
  size_t bytes = 0;
  check(dspark_verify_chain_workspace_size(&a, &bytes) == DSPARK_OK && bytes > 0,
        name + ": workspace size: " + dspark_last_error());
  std::vector<double> ws(bytes / sizeof(double) + 2);
  std::vector<uint32_t> tickets(3 * N, 0);  // zeroed once
  a.tickets = tickets.data();
  a.tickets_bytes = tickets.size() * sizeof(uint32_t);
  int rc = DSPARK_OK;
  for (int call = 0; call < 2 && rc == DSPARK_OK; ++call)  // a second call on the same buffers: tickets left at 0
    rc = dspark_verify_chain(&a, ws.data(), bytes, nullptr);
  check(rc == DSPARK_OK, name + ": dspark_verify_chain returned " + std::to_string(rc) + ": " + dspark_last_error());
  if (rc != DSPARK_OK) return;
  const Json& e = c["expect"];
  expect_equal(tokens, e["tokens"], name + " tokens");
  expect_equal(n_acc, e["num_accepted"], name + " num_accepted");
  expect_equal(mask, e["accept_mask"], name + " accept_mask");
}

void draft_verify_argument_errors() {
  // draft_block: a NULL required pointer names the field; a bad enum; a bad dtype; the hidden requirement
  float base[2 * 3] = {0}, w[3 * 2] = {0}, lp[2];
  int64_t anchor[1] = {0}, tok[2];
  dspark_draft_block_args d;
  memset(&d, 0, sizeof d);
  d.N = 1;
  d.K = 2;
  d.V = 3;
  d.R = 2;
  d.base_logits = base;
  d.anchor_tokens = anchor;
  d.anchor_tokens_dtype = DSPARK_DTYPE_I64;
  d.head_kind = DSPARK_HEAD_VANILLA;
  d.w1 = w;
  d.w2 = nullptr;  // missing
  d.tokens = tok;
  d.draft_logprobs = lp;
  size_t bytes = 0;
  check(dspark_draft_block_workspace_size(&d, &bytes) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "w2") != nullptr,
        std::string("a NULL w2 must be rejected, naming w2; got: ") + dspark_last_error());
  d.w2 = w;
  d.w2_dtype = DSPARK_DTYPE_F8E4M3;  // an fp8 W2 without its row scales
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "w2_scale") != nullptr,
        std::string("an fp8 w2 without w2_scale must be rejected, naming w2_scale; got: ") + dspark_last_error());
  const float scale[3] = {1.0f, 1.0f, 1.0f};
  d.w2_dtype = DSPARK_DTYPE_F32;  // row scales for a float W2
  d.w2_scale = scale;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "w2_scale") != nullptr,
        std::string("w2_scale with an f32 w2 must be rejected, naming w2_scale; got: ") + dspark_last_error());
  d.w2_scale = nullptr;
  d.head_kind = 7;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "head_kind") != nullptr,
        "a bad head_kind must be rejected, naming head_kind");
  d.head_kind = DSPARK_HEAD_GATED;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "hidden") != nullptr,
        "the gated head without hidden must be rejected, naming hidden");
  d.head_kind = DSPARK_HEAD_VANILLA;
  d.w1_dtype = DSPARK_DTYPE_I32;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_DTYPE &&
            strstr(dspark_last_error(), "w1_dtype") != nullptr,
        "an integer w1_dtype must be rejected, naming w1_dtype");
  d.w1_dtype = DSPARK_DTYPE_F32;
  int32_t d2t[3] = {2, 0, 1};  // a draft vocabulary of V = 3 ids over VT target ids
  d.draft_to_target = d2t;
  d.draft_to_target_dtype = DSPARK_DTYPE_F32;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_DTYPE &&
            strstr(dspark_last_error(), "draft_to_target") != nullptr,
        "a float draft_to_target must be rejected, naming draft_to_target");
  d.draft_to_target_dtype = DSPARK_DTYPE_I32;
  d.VT = -1;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "VT") != nullptr,
        "VT < 0 with draft_to_target must be rejected, naming VT");
  d.VT = 3;
  check(dspark_draft_block_workspace_size(&d, &bytes) == DSPARK_OK && bytes > 0, "a valid size query with a map");
  d.draft_to_target = nullptr;
  d.temperature = lp;  // sampling without a key
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "rng_key") != nullptr,
        "temperature without rng_key must be rejected, naming rng_key");
  d.temperature = nullptr;
  check(dspark_draft_block_workspace_size(&d, &bytes) == DSPARK_OK && bytes > 0, "a valid draft_block size query");
  check(dspark_draft_block(&d, nullptr, bytes, nullptr) == DSPARK_ERR_WORKSPACE &&
            strstr(dspark_last_error(), "workspace") != nullptr,
        "a NULL workspace must be rejected");
  d.K = 0;  // nothing to do: no pointers needed
  d.base_logits = nullptr;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_OK, "K = 0 is a no-op");
  d.K = -1;
  check(dspark_draft_block(&d, nullptr, 0, nullptr) == DSPARK_ERR_BAD_SHAPE, "K < 0 must be rejected");
  check(dspark_draft_block(nullptr, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER, "NULL draft_block args");

  // verify_chain
  float target[1 * 2 * 4] = {0};
  int64_t drafts[1] = {0}, out[2];
  int32_t nacc[1];
  uint8_t mask[1];
  dspark_verify_chain_args v;
  memset(&v, 0, sizeof v);
  v.N = 1;
  v.K = 1;
  v.V = 4;
  v.target_logits = target;
  v.draft_tokens = nullptr;  // missing
  v.draft_tokens_dtype = DSPARK_DTYPE_I64;
  v.tokens = out;
  v.num_accepted = nacc;
  v.accept_mask = mask;
  check(dspark_verify_chain_workspace_size(&v, &bytes) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "draft_tokens") != nullptr,
        std::string("a NULL draft_tokens must be rejected, naming draft_tokens; got: ") + dspark_last_error());
  v.draft_tokens = drafts;
  v.K = 17;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "K must be in [1, 16]") != nullptr,
        "K > 16 must be rejected");
  v.K = 1;
  v.method = 2;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "method") != nullptr,
        "a bad method must be rejected, naming method");
  v.method = DSPARK_VERIFY_TOKEN;
  v.draft_logprobs = target;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "draft_logprobs") != nullptr,
        "draft_logprobs without draft_logits must be rejected");
  v.draft_logprobs = nullptr;
  v.thresholds = target;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "survival") != nullptr,
        "thresholds without survival must be rejected");
  v.thresholds = nullptr;
  v.accept_mask = nullptr;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "accept_mask") != nullptr,
        "a NULL accept_mask must be rejected, naming accept_mask");
  v.accept_mask = mask;
  v.N = int64_t(1) << 30;  // (K + 1) x chunks CTAs a request: beyond gridDim.x
  check(dspark_verify_chain_workspace_size(&v, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "grid") != nullptr,
        std::string("N beyond one launch's grid must be rejected; got: ") + dspark_last_error());
  v.N = 1;
  v.V = int64_t(1) << 31;  // a draft's column is an int32
  v.draft_logits = target;
  check(dspark_verify_chain_workspace_size(&v, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "V < 2^31") != nullptr,
        std::string("draft_logits with V >= 2^31 must be rejected; got: ") + dspark_last_error());
  v.V = 4;
  v.draft_logits = nullptr;
  check(dspark_verify_chain_workspace_size(&v, &bytes) == DSPARK_OK && bytes > 0, "a valid verify_chain size query");
  std::vector<double> ws(bytes / sizeof(double) + 2);
  check(dspark_verify_chain(&v, reinterpret_cast<char*>(ws.data()) + 4, bytes, nullptr) == DSPARK_ERR_WORKSPACE &&
            strstr(dspark_last_error(), "aligned") != nullptr,
        "a misaligned workspace must be rejected");
  check(dspark_verify_chain(&v, ws.data(), bytes, nullptr) == DSPARK_ERR_NULL_POINTER &&
            strstr(dspark_last_error(), "tickets") != nullptr,
        std::string("NULL tickets must be rejected, naming tickets; got: ") + dspark_last_error());
  uint32_t tickets[3] = {0, 0, 0};
  size_t tickets_bytes = 0;
  check(dspark_verify_chain_tickets_size(1, &tickets_bytes) == DSPARK_OK && tickets_bytes == sizeof tickets,
        "verify_chain's tickets: 3 words a request");
  v.tickets = tickets;
  v.tickets_bytes = sizeof tickets - 1;
  check(dspark_verify_chain(&v, ws.data(), bytes, nullptr) == DSPARK_ERR_WORKSPACE &&
            strstr(dspark_last_error(), "tickets") != nullptr,
        std::string("too few tickets must be rejected, naming tickets; got: ") + dspark_last_error());
  v.tickets_bytes = sizeof tickets;
  v.target_logits = reinterpret_cast<const char*>(target) + 2;  // a float array at an address no float may have
  check(dspark_verify_chain(&v, ws.data(), bytes, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "target_logits must be aligned") != nullptr,
        std::string("a misaligned target_logits must be rejected, naming it; got: ") + dspark_last_error());
  v.target_logits = target;
  v.tokens = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(out) + 4);
  check(dspark_verify_chain(&v, ws.data(), bytes, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "tokens must be aligned") != nullptr,
        std::string("a misaligned tokens output must be rejected, naming it; got: ") + dspark_last_error());
  v.tokens = out;
  check(dspark_verify_chain(&v, ws.data(), bytes, nullptr) == DSPARK_OK, std::string("a valid greedy verify_chain "
                                                                                      "call without rng_key: ") +
                                                                              dspark_last_error());
  check(nacc[0] == 1 && out[0] == 0 && out[1] == 0 && mask[0] == 1, "all-zero logits: draft 0 accepted, bonus 0");
  check(tickets[0] == 0 && tickets[1] == 0 && tickets[2] == 0, "a call leaves its tickets at zero");
  v.N = 0;
  v.target_logits = nullptr;
  check(dspark_verify_chain(&v, nullptr, 0, nullptr) == DSPARK_OK, "N = 0 is a no-op");
}


// ---- verify_chain's buffers across calls of other shapes: one workspace never initialised (0xAB bytes) and one
// tickets buffer zeroed once, sized for the largest call, serve calls of any N, V and draft width, greedy and sampled:
// each call's outputs equal those of the same call on buffers of its own.
struct ReuseCase {
  int64_t N, V, W;  // W < V: reduced draft rows (target_to_draft); W == V: dense rows
  bool sampled;
  int method;
};

struct VerifyOut {
  int rc = DSPARK_OK;
  std::vector<int64_t> tokens;
  std::vector<int32_t> n_acc;
  std::vector<uint8_t> mask;
};

uint32_t lcg(uint32_t* state) {
  *state = *state * 1664525u + 1013904223u;
  return *state >> 8;
}

// One call of case `c` with inputs drawn from `seed`; with ws NULL the workspace size query only (into *need).
VerifyOut verify_call(const ReuseCase& c, uint32_t seed, void* ws, size_t ws_bytes, uint32_t* tickets,
                      size_t tickets_bytes, size_t* need) {
  constexpr int64_t K = 3;
  uint32_t st = seed;
  std::vector<float> target(c.N * (K + 1) * c.V), dlogits(c.sampled ? c.N * K * c.W : 0), temps(c.N);
  for (float& x : target) x = static_cast<float>(lcg(&st) % 1000) / 250.0f - 2.0f;
  for (float& x : dlogits) x = static_cast<float>(lcg(&st) % 1000) / 250.0f - 2.0f;
  std::vector<int64_t> drafts(c.N * K);
  for (int64_t r = 0; r < c.N; ++r) {
    temps[r] = r % 4 == 3 ? 0.0f : 0.5f + static_cast<float>(r % 3) * 0.5f;  // every fourth request greedy
    for (int64_t j = 0; j < K; ++j) {
      const float* row = &target[(r * (K + 1) + j) * c.V];
      int64_t best = 0;
      for (int64_t v = 1; v < c.V; ++v) best = row[v] > row[best] ? v : best;
      // the target's argmax (accepted by a greedy request) up to a per-request cut, then another id
      drafts[r * K + j] = j < r % (K + 1) ? best : static_cast<int64_t>(lcg(&st) % c.V);
    }
  }
  std::vector<int32_t> t2d(c.V);
  for (int64_t v = 0; v < c.V; ++v) t2d[v] = v < c.W ? static_cast<int32_t>(c.W - 1 - v) : -1;
  const int64_t key[2] = {1234, 5};
  VerifyOut o;
  o.tokens.assign(c.N * (K + 1), 12345);
  o.n_acc.assign(c.N, 12345);
  o.mask.assign(c.N * K, 7);
  dspark_verify_chain_args a;
  memset(&a, 0, sizeof a);
  a.N = c.N;
  a.K = K;
  a.V = c.V;
  a.target_logits = target.data();
  a.draft_tokens = drafts.data();
  a.draft_tokens_dtype = DSPARK_DTYPE_I64;
  if (c.sampled) {
    a.draft_logits = dlogits.data();
    a.draft_width = c.W;
    a.target_to_draft = c.W < c.V ? t2d.data() : nullptr;
    a.temperature = temps.data();
    a.rng_key = key;
  }
  a.method = c.method;
  a.tokens = o.tokens.data();
  a.num_accepted = o.n_acc.data();
  a.accept_mask = o.mask.data();
  a.tickets = tickets;
  a.tickets_bytes = tickets_bytes;
  o.rc = ws == nullptr ? dspark_verify_chain_workspace_size(&a, need) : dspark_verify_chain(&a, ws, ws_bytes, nullptr);
  return o;
}

void verify_reuse() {
  const ReuseCase cases[] = {
      {128, 64, 64, false, DSPARK_VERIFY_TOKEN}, {1, 64, 64, false, DSPARK_VERIFY_TOKEN},
      {24, 64, 64, true, DSPARK_VERIFY_TOKEN},   {1, 64, 64, true, DSPARK_VERIFY_TOKEN},
      {6, 200, 200, true, DSPARK_VERIFY_BLOCK},  {3, 200, 24, true, DSPARK_VERIFY_TOKEN},
      {2, 40, 40, false, DSPARK_VERIFY_BLOCK},   {24, 40, 8, true, DSPARK_VERIFY_BLOCK},
  };
  size_t ws_max = 0, tickets_max = 0;
  for (const ReuseCase& c : cases) {
    size_t need = 0, tickets = 0;
    check(verify_call(c, 0, nullptr, 0, nullptr, 0, &need).rc == DSPARK_OK &&
              dspark_verify_chain_tickets_size(c.N, &tickets) == DSPARK_OK,
          std::string("verify_chain reuse: size queries: ") + dspark_last_error());
    ws_max = need > ws_max ? need : ws_max;
    tickets_max = tickets > tickets_max ? tickets : tickets_max;
  }
  std::vector<double> ws(ws_max / sizeof(double) + 1);
  memset(ws.data(), 0xAB, ws.size() * sizeof(double));
  std::vector<uint32_t> tickets(tickets_max / sizeof(uint32_t), 0);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    const ReuseCase& c = cases[i];
    const std::string name = "verify_chain reuse call " + std::to_string(i) + " (N=" + std::to_string(c.N) +
                             " V=" + std::to_string(c.V) + " W=" + std::to_string(c.W) +
                             (c.sampled ? " sampled)" : " greedy)");
    const uint32_t seed = 100 + static_cast<uint32_t>(i);
    const VerifyOut got = verify_call(c, seed, ws.data(), ws.size() * sizeof(double), tickets.data(),
                                      tickets.size() * sizeof(uint32_t), nullptr);
    check(got.rc == DSPARK_OK, name + ": returned " + std::to_string(got.rc) + ": " + dspark_last_error());
    size_t need = 0;
    verify_call(c, seed, nullptr, 0, nullptr, 0, &need);
    std::vector<double> own_ws(need / sizeof(double) + 1);
    memset(own_ws.data(), 0x5C, own_ws.size() * sizeof(double));
    std::vector<uint32_t> own_tickets(3 * c.N, 0);
    const VerifyOut want = verify_call(c, seed, own_ws.data(), need, own_tickets.data(),
                                       own_tickets.size() * sizeof(uint32_t), nullptr);
    check(want.rc == DSPARK_OK, name + ": on its own buffers: " + dspark_last_error());
    bool written = true;
    for (int32_t n : want.n_acc) written = written && n >= 0 && n <= 3;
    check(written, name + ": on its own buffers: num_accepted not written");
    check(got.tokens == want.tokens && got.n_acc == want.n_acc && got.mask == want.mask,
          name + ": outputs differ from the same call on its own buffers");
  }
  bool zero = true;
  for (uint32_t t : tickets) zero = zero && t == 0;
  check(zero, "verify_chain reuse: the calls leave the tickets at zero");
}

// ---- limits: sizes whose products overflow int64 or int32, the generator's ranges, schedule_verify_lens without
// candidates for many requests
void limits() {
  size_t bytes = 0;
  int32_t cu[2];
  int64_t any64[2];
  int32_t any32[2];
  uint8_t any8[2];
  dspark_accept_prefix_scan_args a;
  memset(&a, 0, sizeof a);
  a.N = 1;
  a.K = INT64_MAX;  // K + 1 overflows int64
  a.tokens = any64;
  a.tokens_dtype = DSPARK_DTYPE_I64;
  a.seq_lens = any64;
  a.seq_lens_dtype = DSPARK_DTYPE_I64;
  a.num_accepted = any32;
  a.num_accepted_dtype = DSPARK_DTYPE_I32;
  a.cu_out = cu;
  a.out_tokens = any64;
  a.new_seq_lens = any32;
  a.next_anchor = any64;
  a.hidden_rows = any32;
  a.finished = any8;
  check(dspark_accept_prefix_scan_workspace_size(&a, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "N*(K+1)") != nullptr,
        std::string("accept_prefix_scan with K = INT64_MAX must be rejected; got: ") + dspark_last_error());
  a.K = 1;
  a.out_tokens = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(any64) + 4);
  check(dspark_accept_prefix_scan_workspace_size(&a, &bytes) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "out_tokens must be aligned") != nullptr,
        std::string("a misaligned out_tokens must be rejected, naming it; got: ") + dspark_last_error());

  dspark_schedule_verify_lens_args s;
  memset(&s, 0, sizeof s);
  float surv[2] = {0.5f, 0.4f}, c1 = 1.0f, t1 = 10.0f, theta = 0;
  s.N = 1;
  s.K = int64_t(1) << 32;  // uint32(K) == 0
  s.survival = surv;
  s.token_counts = &c1;
  s.step_time_ms = &t1;
  s.P = 1;
  s.max_len = 2;
  s.mode = DSPARK_SCHEDULE_ARGMAX;
  s.verify_lens = any32;
  s.cu_seqlens = cu;
  s.theta = &theta;
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "N*(K+1)") != nullptr,
        std::string("schedule_verify_lens with K = 2^32 must be rejected, naming N*(K+1); got: ") +
            dspark_last_error());
  check(dspark_schedule_verify_lens(&s, nullptr, 0, nullptr) == DSPARK_ERR_BAD_SHAPE,
        "schedule_verify_lens with K = 2^32 must be rejected by the call too");
  s.N = (int64_t(1) << 30) + 1;  // N*(K+1) = 2^31 + 2 with K = 1
  s.K = 1;
  s.max_len = 1;
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "N*(K+1)") != nullptr,
        std::string("schedule_verify_lens with N*(K+1) >= 2^31 must be rejected; got: ") + dspark_last_error());
  s.N = 1;
  s.K = 2;
  s.max_len = 2;
  s.budget_survival = surv;
  s.NB = s.KB = int64_t(1) << 31;  // NB*KB = 2^62
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "NB*KB") != nullptr,
        std::string("a budget of 2^62 elements must be rejected, naming NB*KB; got: ") + dspark_last_error());
  s.NB = INT64_MAX;
  s.KB = 2;
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "NB*KB") != nullptr,
        std::string("NB = INT64_MAX must be rejected, naming NB*KB; got: ") + dspark_last_error());
  s.NB = 1;
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_OK && bytes == 0,
        std::string("a one-tile schedule needs no workspace; got: ") + dspark_last_error());
  s.budget_survival = nullptr;
  s.NB = s.KB = 0;

  // no candidates (K = 0) for more requests than shared memory holds a word of each: every length 0
  const int64_t many = 70000;
  std::vector<int32_t> lens(many, 7), cus(many + 1, 7);
  s.N = many;
  s.K = 0;
  s.survival = nullptr;
  s.min_len = s.max_len = 0;
  s.verify_lens = lens.data();
  s.cu_seqlens = cus.data();
  theta = -1.0f;
  check(dspark_schedule_verify_lens_workspace_size(&s, &bytes) == DSPARK_OK && bytes == 0,
        std::string("K = 0: no workspace; got: ") + dspark_last_error());
  const int rc = dspark_schedule_verify_lens(&s, nullptr, 0, nullptr);
  check(rc == DSPARK_OK, std::string("schedule_verify_lens with K = 0 and N = 70000: ") + dspark_last_error());
  bool trivial = rc == DSPARK_OK;
  for (int64_t r = 0; r < many && trivial; ++r) trivial = lens[r] == 0 && cus[r] == r;
  check(trivial && cus[many] == many && theta > 0.0f, "K = 0: every length 0, cu_seqlens 0..N, a positive theta");

  // the generator's ranges: request < 2^32, position < 2^24, token < 2^34; rng_uniform's N <= 2^32
  uint32_t b = 0;
  check(dspark_philox_uniform_host(1, 2, (uint64_t(1) << 32) - 1, (uint64_t(1) << 24) - 1, 3,
                                   (uint64_t(1) << 34) - 1, &b, nullptr) == DSPARK_OK,
        "the generator's largest cell");
  check(dspark_philox_uniform_host(1, 2, uint64_t(1) << 32, 0, 3, 0, &b, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "request") != nullptr,
        std::string("request = 2^32 must be rejected, naming request; got: ") + dspark_last_error());
  check(dspark_philox_uniform_host(1, 2, 0, uint64_t(1) << 24, 3, 0, &b, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "position") != nullptr,
        std::string("position = 2^24 must be rejected, naming position; got: ") + dspark_last_error());
  check(dspark_philox_uniform_host(1, 2, 0, 0, 3, uint64_t(1) << 34, &b, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "token") != nullptr,
        std::string("token = 2^34 must be rejected, naming token; got: ") + dspark_last_error());
  float u[1];
  const int64_t key[2] = {1, 2};
  check(dspark_rng_uniform(u, (int64_t(1) << 32) + 1, 0, 1, key, 3, nullptr) == DSPARK_ERR_BAD_SHAPE &&
            strstr(dspark_last_error(), "N (requests)") != nullptr,
        std::string("rng_uniform with N = 2^32 + 1 must be rejected, naming N; got: ") + dspark_last_error());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s path/to/capi_vectors.json\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  if (!in) {
    fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  Json root;
  try {
    Parser parser{text};
    root = parser.value();
  } catch (const std::exception& e) {
    fprintf(stderr, "%s: %s\n", argv[1], e.what());
    return 2;
  }
  int n_scan = 0, n_sched = 0, n_draft = 0, n_verify = 0;
  // Every vector under three thread/block schedules with different shared-memory poison bytes (as simt_check
  // does for the torch ops): a missing barrier or an uninitialised shared read shows up as a mismatch.
  struct Schedule {
    dspark::simt::Order order;
    uint64_t seed;
    unsigned char poison;
  };
  const Schedule schedules[] = {{dspark::simt::Order::kForward, 0, 0xFF},
                                {dspark::simt::Order::kReverse, 0, 0x00},
                                {dspark::simt::Order::kRandom, 7, 0xA5}};
  for (const Schedule& sc : schedules) {
    dspark::simt::settings().order = sc.order;
    dspark::simt::settings().seed = sc.seed;
    dspark::simt::settings().poison = sc.poison;
    n_scan = n_sched = n_draft = n_verify = 0;
    for (const Json& c : root["scan"].items) run_scan(c, n_scan++);
    for (const Json& c : root["schedule"].items) run_schedule(c, n_sched++);
    for (const Json& c : root["draft"].items) run_draft(c, n_draft++);
    for (const Json& c : root["verify"].items) run_verify(c, n_verify++);
  }
  check(n_scan > 0 && n_sched > 0 && n_draft > 0 && n_verify > 0, "no vectors read");
  argument_errors();
  draft_verify_argument_errors();
  verify_reuse();
  limits();
  if (failures) {
    fprintf(stderr, "test_capi_vectors: %d failures\n", failures);
    return 1;
  }
  printf("test_capi_vectors: %d accept_prefix_scan, %d schedule_verify_lens, %d draft_block and %d verify_chain "
         "vectors ok under 3 schedules (C ABI on the SIMT harness)\n", n_scan, n_sched, n_draft, n_verify);
  return 0;
}
