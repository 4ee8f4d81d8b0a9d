/* dspark.h: C ABI of dspark_kernels for engines without PyTorch (library dspark_capi, built by CMakeLists.txt).
 *
 * Every function returns DSPARK_OK (0) or a negative DSPARK_ERR_* code; dspark_last_error() then describes the
 * failure (naming the argument) for the calling thread. Kernels run asynchronously on the given stream: a
 * DSPARK_ERR_CUDA return reports a launch error only, as with any CUDA launch.
 *
 * Conventions of the op entries (dspark_accept_prefix_scan, dspark_schedule_verify_lens): every array is a
 * contiguous device buffer; a parameter struct mirrors the op's arguments (dspark_kernels.accept_prefix_scan /
 * schedule_verify_lens, whose documentation is the spec); dtypes are DSPARK_DTYPE_* values; the caller allocates
 * the outputs and a workspace of at least dspark_<op>_workspace_size() bytes (0 is possible: then workspace may
 * be NULL) - nothing is allocated inside a call, nothing synchronises with the host, and a call enqueues exactly
 * one kernel on the given stream. The workspace needs no initialisation and may be reused once the call's kernel
 * has finished (stream order). Integer outputs equal the reference's exactly.
 *
 * draft_block and verify_chain have no entries here yet: their launch functions (launch_draft_block /
 * launch_verify_chain) are being written separately; their entries will follow the same conventions.
 *
 * Random numbers come from the package's generator (dspark_kernels/rng.py, csrc/include/dspark/rng.cuh):
 * Philox4x32-10, key = (seed_lo, seed_hi ^ offset_hi), counter = (token >> 2, position | stream << 24,
 * request, offset_lo), word token & 3, u = ((x >> 8) | 1) * 2^-24.
 */
#ifndef DSPARK_CAPI_H_
#define DSPARK_CAPI_H_

#include <stdint.h>

#include <cuda_runtime_api.h>

#if defined(_WIN32)
#define DSPARK_API __declspec(dllexport)
#else
#define DSPARK_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Element types (the float ones are dspark::DType's values). */
enum {
  DSPARK_DTYPE_F32 = 0,
  DSPARK_DTYPE_BF16 = 1,
  DSPARK_DTYPE_F16 = 2,
  DSPARK_DTYPE_I32 = 16,
  DSPARK_DTYPE_I64 = 17
};

enum {
  DSPARK_OK = 0,
  DSPARK_ERR_NULL_POINTER = -1,  /* a required pointer is NULL */
  DSPARK_ERR_BAD_SHAPE = -2,     /* a size is negative or out of the generator's range */
  DSPARK_ERR_BAD_VALUE = -3,     /* another argument is out of range (e.g. stream) */
  DSPARK_ERR_CUDA = -4,          /* the CUDA launch failed */
  DSPARK_ERR_BAD_DTYPE = -5,     /* a DSPARK_DTYPE_* the argument does not take */
  DSPARK_ERR_WORKSPACE = -6      /* workspace smaller than dspark_<op>_workspace_size() */
};

/* Streams of the generator (dspark_kernels.rng.STREAM_*). */
enum { DSPARK_STREAM_DRAFT = 0, DSPARK_STREAM_ACCEPT = 1, DSPARK_STREAM_RESIDUAL = 2, DSPARK_STREAM_USER = 16 };

/* The message of the calling thread's last failed call ("" if none). */
DSPARK_API const char* dspark_last_error(void);

/* out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v) for a contiguous float32
 * [N, K, V] device buffer. rng_key_device: device int64 [2] = (seed, offset), read by the kernel (graph-safe).
 * N, K, V >= 0, K < 2^24, V <= 2^34, 0 <= stream < 256. */
DSPARK_API int dspark_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const int64_t* rng_key_device,
                                  int stream, cudaStream_t s);

/* The generator on the host: the uint32 draw and its float32 uniform of one cell (either output may be NULL). */
DSPARK_API int dspark_philox_uniform_host(uint64_t seed, uint64_t offset, uint64_t request, uint64_t position,
                                          int stream, uint64_t token, uint32_t* bits, float* uniform);

/* Philox4x32-10 itself on the host: out = philox(counter, key). */
DSPARK_API int dspark_philox4x32_10_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

/* ---------------------------------------------------------------------------------------------------------
 * accept_prefix_scan: one decode step's verification results -> packed outputs, new lengths, next anchors, drafter
 * rows, paged-KV slots, finished flags (dspark_kernels.accept_prefix_scan). N requests, K drafts each.
 * Integer inputs are DSPARK_DTYPE_I32 or DSPARK_DTYPE_I64 (each its own dtype field). */
typedef struct dspark_accept_prefix_scan_args {
  int64_t N, K;
  const void* tokens;            /* [N, K+1]: accepted drafts, then the bonus/correction token, then -1 */
  int tokens_dtype;
  const void* seq_lens;          /* [N] committed lengths S */
  int seq_lens_dtype;
  const void* num_accepted;      /* [N] accepted drafts (clamped to [0, K]), or NULL ... */
  int num_accepted_dtype;
  const uint8_t* accept_mask;    /* ... [N, K] bool (0/1) accept flags (leading run counts): exactly one of them */
  const void* verify_cu_seqlens; /* [N+1] verify-batch row offsets, or NULL (dense r*(K+1)) */
  int verify_cu_seqlens_dtype;
  const void* block_table;       /* [N, max_blocks] paged-KV block ids (negative = unallocated), or NULL (non-NULL
                                    even when max_blocks == 0: then every kv slot is -1) */
  int block_table_dtype;
  int64_t max_blocks;
  int64_t block_size;            /* > 0 with block_table */
  const void* max_seq_lens;      /* [N] length limits, or NULL */
  int max_seq_lens_dtype;
  const void* stop_token_ids;    /* [num_stops] or NULL */
  int stop_token_ids_dtype;
  int64_t num_stops;
  /* outputs */
  int32_t* cu_out;               /* [N+1] exclusive prefix sum of the emitted counts e */
  int64_t* out_tokens;           /* [N*(K+1)] emitted tokens packed, -1 from cu_out[N] on */
  int32_t* new_seq_lens;         /* [N] S + e */
  int64_t* next_anchor;          /* [N] last emitted token, -1 if none */
  int32_t* hidden_rows;          /* [N*(K+1)] verify row of each emitted token, -1 after the end */
  int64_t* kv_slots;             /* [N*(K+1)] paged-KV slot of each emitted position (required with block_table,
                                    ignored without) */
  uint8_t* finished;             /* [N] bool */
} dspark_accept_prefix_scan_args;

/* Bytes of workspace dspark_accept_prefix_scan needs for these arguments (depends on N and the device). */
DSPARK_API int dspark_accept_prefix_scan_workspace_size(const dspark_accept_prefix_scan_args* args, size_t* bytes);
/* One launch; N*(K+1) < 2^31; N up to about 800k requests on an H200 (DSPARK_ERR_BAD_SHAPE above what one
 * cooperative launch keeps resident). */
DSPARK_API int dspark_accept_prefix_scan(const dspark_accept_prefix_scan_args* args, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * schedule_verify_lens: the confidence scheduler (dspark_kernels.schedule_verify_lens): verify_lens [N],
 * cu_seqlens [N+1] (prefix sums of 1 + verify_lens), theta (predicted expected tokens per second). One CTA. */
enum { DSPARK_SCHEDULE_EXACT = 0, DSPARK_SCHEDULE_ARGMAX = 1 };

typedef struct dspark_schedule_verify_lens_args {
  int64_t N, K;
  const void* survival;          /* [N, K] float, or NULL ... */
  int survival_dtype;
  const void* conf_logits;       /* ... [N, K] float confidence logits: exactly one of the two. Survival is then
                                    cumprod(sigmoid(z / T)) in float32 (product in float64, as torch on the CPU;
                                    the sigmoid may differ from torch's in the last bit) */
  int conf_logits_dtype;
  const void* sts_temperatures;  /* [K] float or NULL (only with conf_logits) */
  int sts_temperatures_dtype;
  const float* token_counts;     /* [P] cost table: strictly ascending token counts (float32) */
  const float* step_time_ms;     /* [P] positive step times (float32) */
  int64_t P;                     /* >= 1 */
  double fixed_overhead_ms;      /* >= 0 */
  int64_t min_len, max_len;      /* 0 <= min_len <= max_len <= K */
  int mode;                      /* DSPARK_SCHEDULE_EXACT or DSPARK_SCHEDULE_ARGMAX */
  const void* budget_survival;   /* [NB, KB] float or NULL (argmax only; non-NULL even when NB*KB == 0) */
  int budget_survival_dtype;
  int64_t NB, KB;
  double min_gain;               /* >= 0 (argmax only) */
  /* outputs */
  int32_t* verify_lens;          /* [N] */
  int32_t* cu_seqlens;           /* [N+1] */
  float* theta;                  /* [1] */
} dspark_schedule_verify_lens_args;

/* Bytes of workspace (0 while N*K fits the CTA's shared memory: about 8000 candidates). */
DSPARK_API int dspark_schedule_verify_lens_workspace_size(const dspark_schedule_verify_lens_args* args,
                                                          size_t* bytes);
DSPARK_API int dspark_schedule_verify_lens(const dspark_schedule_verify_lens_args* args, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DSPARK_CAPI_H_ */
