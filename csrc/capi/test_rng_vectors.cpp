// Host test of the generator (no GPU): csrc/include/dspark/rng.cuh compiled by the host compiler, and the C ABI
// of dspark_capi, must reproduce the Random123 known answers and every vector of
// python_tests/data/rng_vectors.json bit for bit.  Usage: test_rng_vectors <path/to/rng_vectors.json>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fstream>
#include <sstream>
#include <string>

#include "dspark.h"
#include "dspark/rng.cuh"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

std::string hex(uint32_t x) {
  char b[16];
  snprintf(b, sizeof b, "%08x", x);
  return b;
}

void known_answer(const uint32_t c[4], const uint32_t k[2], const uint32_t want[4], const char* name) {
  const dspark::rng::U32x4 r = dspark::rng::philox4x32_10(dspark::rng::U32x4{c[0], c[1], c[2], c[3]}, k[0], k[1]);
  const uint32_t got[4] = {r.x, r.y, r.z, r.w};
  uint32_t via_c[4] = {0, 0, 0, 0};
  check(dspark_philox4x32_10_host(c, k, via_c) == DSPARK_OK, std::string("dspark_philox4x32_10_host ") + name);
  for (int i = 0; i < 4; ++i) {
    check(got[i] == want[i], std::string("philox4x32_10 ") + name + " word " + std::to_string(i) + ": got " +
                                 hex(got[i]) + " want " + hex(want[i]));
    check(via_c[i] == want[i], std::string("C ABI philox ") + name + " word " + std::to_string(i));
  }
}

// The value after "key": in one JSON object (numbers, or the string for "uniform").
std::string field(const std::string& obj, const char* key) {
  const std::string pat = std::string("\"") + key + "\"";
  size_t p = obj.find(pat);
  if (p == std::string::npos) return "";
  p = obj.find(':', p + pat.size());
  if (p == std::string::npos) return "";
  ++p;
  while (p < obj.size() && (obj[p] == ' ' || obj[p] == '\n' || obj[p] == '\t' || obj[p] == '\r')) ++p;
  if (p < obj.size() && obj[p] == '"') {
    const size_t e = obj.find('"', p + 1);
    return obj.substr(p + 1, e - p - 1);
  }
  size_t e = p;
  while (e < obj.size() && obj[e] != ',' && obj[e] != '}' && obj[e] != '\n') ++e;
  return obj.substr(p, e - p);
}

}  // namespace

int main(int argc, char** argv) {
  // Random123 known-answer vectors of philox4x32-10.
  {
    const uint32_t c0[4] = {0, 0, 0, 0}, k0[2] = {0, 0};
    const uint32_t w0[4] = {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u};
    known_answer(c0, k0, w0, "zeros");
    const uint32_t c1[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, k1[2] = {0xffffffffu, 0xffffffffu};
    const uint32_t w1[4] = {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu};
    known_answer(c1, k1, w1, "ones");
    const uint32_t c2[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, k2[2] = {0xa4093822u, 0x299f31d0u};
    const uint32_t w2[4] = {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u};
    known_answer(c2, k2, w2, "pi");
  }
  if (argc < 2) {
    fprintf(stderr, "usage: %s path/to/rng_vectors.json\n", argv[0]);
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
  size_t pos = text.find("\"vectors\"");
  if (pos == std::string::npos) {
    fprintf(stderr, "no \"vectors\" in %s\n", argv[1]);
    return 2;
  }
  int count = 0;
  while ((pos = text.find('{', pos)) != std::string::npos) {
    const size_t end = text.find('}', pos);
    if (end == std::string::npos) break;
    const std::string obj = text.substr(pos, end - pos + 1);
    pos = end + 1;
    const uint64_t seed = strtoull(field(obj, "seed").c_str(), nullptr, 10);
    const uint64_t offset = strtoull(field(obj, "offset").c_str(), nullptr, 10);
    const uint64_t request = strtoull(field(obj, "request").c_str(), nullptr, 10);
    const uint64_t position = strtoull(field(obj, "position").c_str(), nullptr, 10);
    const uint32_t stream = static_cast<uint32_t>(strtoul(field(obj, "stream").c_str(), nullptr, 10));
    const uint64_t token = strtoull(field(obj, "token").c_str(), nullptr, 10);
    const uint32_t bits = static_cast<uint32_t>(strtoull(field(obj, "bits").c_str(), nullptr, 10));
    const float uniform = static_cast<float>(strtod(field(obj, "uniform").c_str(), nullptr));
    const std::string name = "vector " + std::to_string(count) + " (seed " + std::to_string(seed) + ", offset " +
                             std::to_string(offset) + ", token " + std::to_string(token) + ")";

    const dspark::rng::Philox ph = dspark::rng::Philox::make(seed, offset);
    const uint32_t got = ph.bits(request, position, stream, token);
    check(got == bits, name + ": bits " + std::to_string(got) + " want " + std::to_string(bits));
    const float u = ph.uniform(request, position, stream, token);
    check(memcmp(&u, &uniform, sizeof u) == 0, name + ": uniform differs");
    const dspark::rng::F32x4 u4 = ph.uniform4(request, position, stream, token >> 2);
    const float lanes[4] = {u4.x, u4.y, u4.z, u4.w};
    check(memcmp(&lanes[token & 3], &uniform, sizeof u) == 0, name + ": uniform4 lane differs");
    uint32_t cbits = 0;
    float cu = 0.0f;
    check(dspark_philox_uniform_host(seed, offset, request, position, int(stream), token, &cbits, &cu) == DSPARK_OK,
          name + ": dspark_philox_uniform_host failed");
    check(cbits == bits && memcmp(&cu, &uniform, sizeof cu) == 0, name + ": C ABI differs");
    ++count;
  }
  check(count > 0, "no vectors read");
  check(dspark_philox_uniform_host(0, 0, 0, 0, 256, 0, nullptr, nullptr) == DSPARK_ERR_BAD_VALUE &&
            strstr(dspark_last_error(), "stream") != nullptr,
        "bad stream must be rejected, naming the argument");
  if (failures) {
    fprintf(stderr, "test_rng_vectors: %d failures\n", failures);
    return 1;
  }
  printf("test_rng_vectors: 3 known answers and %d vectors ok\n", count);
  return 0;
}
