// dspark/schedule_verify_lens.h: the host interface of schedule_verify_lens: its parameters, workspace and launch
// (plain C++ over the CUDA runtime's types; no torch, no device code). dspark/schedule_verify_lens.cuh holds the
// kernel and defines the functions declared here.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "platform.cuh"  // cudaError_t, cudaStream_t
#include "vec.cuh"

namespace dspark {

struct ScheduleVerifyLensParams {
  int64_t N = 0, K = 0;
  const void* survival = nullptr;          // [N, K] or null (then conf_logits)
  DType survival_dtype = DType::kFloat32;
  const void* conf_logits = nullptr;       // [N, K] or null
  DType conf_dtype = DType::kFloat32;
  const void* sts_temperatures = nullptr;  // [K] or null (only with conf_logits)
  DType sts_dtype = DType::kFloat32;
  const float* token_counts = nullptr;     // [P] strictly ascending
  const float* step_time_ms = nullptr;     // [P] positive
  int64_t P = 0;
  double fixed_overhead_ms = 0.0;
  int64_t min_len = 0, max_len = 0;        // 0 <= min_len <= max_len <= K
  bool exact = true;                       // "exact" or "argmax"
  const void* budget_survival = nullptr;   // [NB, KB] (argmax only; may be null when NB * KB == 0)
  bool has_budget = false;                 // argmax count from budget_survival
  DType budget_dtype = DType::kFloat32;
  int64_t NB = 0, KB = 0;
  double gain = 1.0;                       // 1 + min_gain (argmax only)
  const uint8_t* active = nullptr;         // [N] 0 / 1 (0: not scheduled, no rows) or null (all active)
  int32_t* verify_lens = nullptr;          // [N]
  int32_t* cu_seqlens = nullptr;           // [N+1]
  float* theta = nullptr;                  // []
};


// Workspace bytes (0 for a one-tile launch: N*K, and N'*K' of a budget, up to 2048).
size_t schedule_verify_lens_workspace_bytes(const ScheduleVerifyLensParams& p);

// Launch on `stream`; the caller has checked the arguments (see ScheduleVerifyLensParams; N*K and N'*K' below
// 2^31). One CTA.
cudaError_t launch_schedule_verify_lens(const ScheduleVerifyLensParams& p, void* workspace, cudaStream_t stream);

}  // namespace dspark
