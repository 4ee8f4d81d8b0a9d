// The "last CTA" tickets of the kernels that merge their CTAs' partials in the CTA that finishes (verify_chain and
// the vocabulary-parallel shard passes): 32-bit words zeroed once per (device, stream) and left zeroed by every
// launch, so a call allocates no zeroed memory and launches no memset (a CUDA graph replays the op as captured).
// One buffer per stream: calls on one stream run in order, calls on two streams never share a ticket.
#pragma once

#include <ATen/ops/zeros.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace dspark_torch {

// At least `count` zeroed tickets for kernels on `like`'s device and current stream.
inline uint32_t* zeroed_tickets(const at::Tensor& like, int64_t count) {
  static std::mutex mu;
  static std::map<std::pair<std::string, cudaStream_t>, at::Tensor> pool;
  static std::vector<at::Tensor> outgrown;  // kept: a launch of another thread may still use one
  const std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = pool[{like.device().str(), current_stream(like)}];
  if (!buf.defined() || buf.numel() < count) {
    if (buf.defined()) outgrown.push_back(buf);
    buf = at::zeros({count * 2}, like.options().dtype(at::kInt));
  }
  return reinterpret_cast<uint32_t*>(buf.data_ptr<int32_t>());
}

}  // namespace dspark_torch
