/* dspark.h: C ABI of dspark_kernels for engines without PyTorch (library dspark_capi, built by CMakeLists.txt).
 *
 * Every function returns DSPARK_OK (0) or a negative DSPARK_ERR_* code; dspark_last_error() then describes the
 * failure (naming the argument) for the calling thread. Kernels run asynchronously on the given stream: a
 * DSPARK_ERR_CUDA return reports a launch error only, as with any CUDA launch.
 *
 * Conventions of the op entries (dspark_accept_prefix_scan, dspark_schedule_verify_lens, dspark_draft_block,
 * dspark_verify_chain): every array is a contiguous device buffer; a parameter struct mirrors the op's arguments
 * (dspark_kernels.accept_prefix_scan / schedule_verify_lens / draft_block / verify_chain, whose documentation is
 * the spec); dtypes are DSPARK_DTYPE_* values; every array must be aligned to its element size
 * (DSPARK_ERR_BAD_VALUE naming it otherwise); the caller allocates the outputs and a workspace of at least
 * dspark_<op>_workspace_size() bytes (0 is possible: then workspace may be NULL; a non-NULL workspace must be
 * 16-byte aligned, as cudaMalloc's are) - nothing is allocated inside a call and nothing synchronises with the
 * host. accept_prefix_scan and schedule_verify_lens enqueue exactly one kernel on the given stream, verify_chain one
 * to three and draft_block K + 2 (2K + 2 with a gated or rnn head; 2 with top_k) in stream order. A workspace needs
 * no initialisation, may be larger than its call needs and may be reused by any later call once the call's kernels
 * have finished (stream order); verify_chain also takes a tickets buffer, zeroed once by the caller (see there).
 * Integer outputs equal the reference's exactly. Values that cannot be checked without reading device memory
 * (token ids, temperatures, offsets) are not checked: they get the reference's defined results, stated per entry.
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
  DSPARK_DTYPE_F8E4M3 = 3,  /* float8 e4m3 (fn): draft_block's w2 only, with w2_scale */
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
 * [N, K, V] device buffer. rng_key: device int64 [2] = (seed, offset), read by the kernel (graph-safe).
 * N, K, V >= 0, N <= 2^32, K < 2^24, V <= 2^34 (DSPARK_ERR_BAD_SHAPE naming the size otherwise),
 * 0 <= stream < 256. */
DSPARK_API int dspark_rng_uniform(float* out, int64_t N, int64_t K, int64_t V, const int64_t* rng_key,
                                  int stream, cudaStream_t s);

/* The generator on the host: the uint32 draw and its float32 uniform of one cell (either output may be NULL).
 * request < 2^32, position < 2^24, token < 2^34, 0 <= stream < 256 (DSPARK_ERR_BAD_VALUE naming the argument
 * otherwise). */
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
  const uint8_t* active;         /* [N] 0 / 1, or NULL (every request active): an inactive request verifies
                                    nothing (verify_lens 0, no rows in cu_seqlens) and counts in neither B nor
                                    tau; values other than 0 count as 1 */
  /* outputs */
  int32_t* verify_lens;          /* [N] */
  int32_t* cu_seqlens;           /* [N+1] */
  float* theta;                  /* [1] */
} dspark_schedule_verify_lens_args;

/* Bytes of workspace: 0 while N*K (and NB*KB with a budget in DSPARK_SCHEDULE_ARGMAX mode) is at most 2048, the
 * one tile the CTA holds in shared memory, whatever N; beyond, the sort's arrays: about 16 to 20 bytes per element
 * of the larger plus 4 per request. Limits (of the size query too): N*(K+1) < 2^31 (cu_seqlens is int32) and
 * NB*KB < 2^31, DSPARK_ERR_BAD_SHAPE otherwise. */
DSPARK_API int dspark_schedule_verify_lens_workspace_size(const dspark_schedule_verify_lens_args* args,
                                                          size_t* bytes);
DSPARK_API int dspark_schedule_verify_lens(const dspark_schedule_verify_lens_args* args, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * draft_block: the sequential Markov head over a parallel drafter's block of K positions, a launch per position for
 * all N requests (dspark_kernels.draft_block; reference: dspark_kernels/reference/draft_block.py). With x the
 * token before a position (the anchor, then the previous draft) and e = W1[x] (a zero row for x outside [0, V)):
 *   vanilla v = e;  gated v = sigmoid(Wg [h_k; e] + bg) * e;
 *   rnn [g, c, o] = Wj [s; e; h_k] + bj, s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c) (s starts at 0), v = tanh(o);
 *   logits_k = U_k + W2 v;  token = argmax(logits_k) (greedy; ties to the lowest index) or
 *   argmax(logits_k / T - log(-log u)) (T > 0; u = uniform(request, position, DSPARK_STREAM_DRAFT, token));
 *   logprob_k = log_softmax(logits_k / T)[token] (T = 1 for greedy requests);
 *   conf_k = w . [h_k; e] + b,  survival_k = prod_{i<=k} sigmoid(conf_i / T_sts_i).
 * All arithmetic is float32 whatever the input dtypes; every float input has its own DSPARK_DTYPE_F32 / BF16 /
 * F16 field. Defined results for unchecked values: a token outside W1's rows (an anchor, or a draft_to_target
 * entry) reads a zero embedding; NaN logits never yield a draft id outside [0, V); draft_to_target entries are not
 * read for distinctness or range (dspark_kernels.MarkovHead checks them); a NaN or negative temperature counts as
 * greedy; logprob is NaN for a row holding a NaN or +inf logit (or only -inf), as torch.log_softmax gives. */
enum { DSPARK_HEAD_VANILLA = 0, DSPARK_HEAD_GATED = 1, DSPARK_HEAD_RNN = 2 };

typedef struct dspark_draft_block_args {
  int64_t N, K, V;               /* requests, block positions (K < 2^24), vocabulary (V < 2^31); any may be 0
                                    (then the call does nothing and needs no pointers) */
  int64_t R;                     /* rank r of the Markov head (>= 0) */
  int64_t D;                     /* hidden size d (>= 0; ignored, taken as 0, when hidden is not used) */
  int64_t VT;                    /* rows of w1, the target vocabulary (>= 0) with draft_to_target; ignored, taken
                                    as V, without */
  const void* base_logits;       /* [N, K, V] float: the backbone's logits U of the K positions */
  int base_logits_dtype;
  const void* anchor_tokens;     /* [N] int32/int64: the last committed token of each request (x_0) */
  int anchor_tokens_dtype;
  int head_kind;                 /* DSPARK_HEAD_VANILLA, DSPARK_HEAD_GATED or DSPARK_HEAD_RNN */
  const void* w1;                /* [VT, R] float: the embedding of the previous token (a target id) */
  int w1_dtype;
  const void* w2;                /* [V, R] float: the correction W2 (an nn.Linear(r, V) weight); or
                                    DSPARK_DTYPE_F8E4M3 with w2_scale */
  int w2_dtype;
  const float* w2_scale;         /* [V] float32 per-row scales of a DSPARK_DTYPE_F8E4M3 w2 (bias_j = w2_scale[j] *
                                    (W2_j . v)); NULL for any other w2 dtype */
  const void* draft_to_target;   /* [V] int32/int64: the target id of each draft id, for a drafter over a reduced
                                    vocabulary of V ids (base_logits, w2 and logits cover them; tokens are
                                    draft_to_target[j] for the drafted id j, and the next position reads W1 at it),
                                    or NULL (V is the target vocabulary) */
  int draft_to_target_dtype;
  const void* wg;                /* [R, D + R] float: the gate (DSPARK_HEAD_GATED: required; ignored otherwise) */
  int wg_dtype;
  const void* bg;                /* [R] float: the gate's bias (DSPARK_HEAD_GATED: required; ignored otherwise) */
  int bg_dtype;
  const void* wj;                /* [3R, 2R + D] float: the joint map (DSPARK_HEAD_RNN: required; ignored
                                    otherwise) */
  int wj_dtype;
  const void* bj;                /* [3R] float: its bias (DSPARK_HEAD_RNN: required; ignored otherwise) */
  int bj_dtype;
  const void* hidden;            /* [N, K, D] float: the backbone's hidden states; required by the gated and rnn
                                    heads and by the confidence head, ignored (with D) otherwise */
  int hidden_dtype;
  const void* conf_weight;       /* [D + R] float: the confidence head's weight, or NULL (no confidence head) */
  int conf_weight_dtype;
  const void* conf_bias;         /* [1] float: its bias (required with conf_weight) */
  int conf_bias_dtype;
  const void* sts_temperatures;  /* [K] float STS temperatures T_sts, or NULL (all 1); only with conf_weight */
  int sts_temperatures_dtype;
  const float* temperature;      /* [N] float32 per-request sampling temperatures, or NULL (every request greedy:
                                    no random numbers are read); T <= 0 or NaN: greedy for that request */
  const int64_t* rng_key;        /* device int64 [2] = (seed, offset), read by the kernel (graph-safe); required
                                    with temperature, may be NULL without */
  int64_t top_k;                 /* 0: the full proposal; 1..min(V, 1024): top-k proposals. Per position only the
                                    top_k largest entries of U (by value, NaN lowest, ties to the lower id) get a
                                    bias, and the draft, logprob and logits are those of the softmax over them */
  /* outputs (float32) */
  int64_t* tokens;               /* [N, K] drafted tokens */
  float* draft_logprobs;         /* [N, K] log q(token) under softmax(logits / T) (T = 1 for greedy requests) */
  float* logits;                 /* [N, K, V] the corrected logits U + W2 v, or NULL (not written; verify_chain's
                                    lossless sampling needs them); [N, K, top_k] with top_k, over the candidates in
                                    increasing draft-id order */
  int64_t* candidates;           /* [N, K, top_k] the target ids of those columns (top_k with logits; ignored
                                    otherwise) */
  float* conf_logits;            /* [N, K] raw confidence logits z (required with conf_weight, ignored without) */
  float* survival;               /* [N, K] survival (required with conf_weight, ignored without) */
} dspark_draft_block_args;

/* Bytes of workspace (depends on N, K, R, the head and the device: the per-position partials of each CTA, about
 * 16 K x (2 x SMs) bytes a request): 0 when N, K or V is 0. DSPARK_ERR_BAD_SHAPE when no launch configuration fits
 * the device. */
DSPARK_API int dspark_draft_block_workspace_size(const dspark_draft_block_args* args, size_t* bytes);
/* Enqueues draft_setup, then per position (a draft_head for a gated / rnn head and) a sweep, then draft_finish; on
 * sm_90+ every launch after the first a programmatic dependent launch. The whole call can be captured in a CUDA
 * graph. */
DSPARK_API int dspark_draft_block(const dspark_draft_block_args* args, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------------------
 * verify_chain: verify each request's draft chain [anchor, d_1..d_L] against one target forward: greedy, lossless
 * token-level rejection sampling or block verification (Sun et al. 2024) (dspark_kernels.verify_chain;
 * reference: dspark_kernels/reference/verify_chain.py). Row j of a request scores draft d_{j+1}, row L the
 * bonus token. Random numbers: uniform(request, j, DSPARK_STREAM_ACCEPT, 0) for the accept tests,
 * uniform(request, row, DSPARK_STREAM_RESIDUAL, token) for the correction / bonus token. fp32 math.
 * Defined results for unchecked values: a draft outside [0, V) is rejected at its position; NaN logits never yield
 * a token outside [0, V); packed rows outside [0, total_rows) are never read and a request with no rows emits
 * nothing; verify_lens are clamped to [0, K]; a NaN or negative temperature counts as greedy. */
enum { DSPARK_VERIFY_TOKEN = 0, DSPARK_VERIFY_BLOCK = 1 };

typedef struct dspark_verify_chain_args {
  int64_t N;                     /* requests (>= 0; 0: the call does nothing) */
  int64_t K;                     /* drafts per request, 1 <= K <= 16 */
  int64_t V;                     /* vocabulary, 1 <= V < 2^34 (V < 2^31 with draft_logits) */
  const void* target_logits;     /* dense [N, K+1, V] (cu_seqlens NULL) or packed [total_rows, V] float */
  int target_logits_dtype;
  const void* cu_seqlens;        /* [N+1] int32/int64 row offsets of the packed layout (request r owns rows
                                    cu[r]..cu[r+1]-1, verify length cu[r+1] - cu[r] - 1), or NULL (dense) */
  int cu_seqlens_dtype;
  int64_t total_rows;            /* rows of the packed target_logits (>= 0; ignored when dense) */
  const void* draft_tokens;      /* [N, K] int32/int64 */
  int draft_tokens_dtype;
  const void* draft_logits;      /* [N, K, W] float: the logits the drafts were sampled from (draft_block's
                                    logits), or NULL (one-hot drafts: q(d_j) = 1). W = V (dense rows), Vd (reduced
                                    rows, with target_to_draft) or k (top-k rows, with draft_candidates): the rows
                                    are read as they are */
  int draft_logits_dtype;
  int64_t draft_width;           /* W (0: V; must be V for dense rows) */
  const int32_t* target_to_draft; /* [V] int32: the draft column of each target id (-1: none; an entry outside
                                    [0, W) counts as none), or NULL. Build it once per draft vocabulary with
                                    dspark.verify_chain's target_to_draft_map: column c of draft_to_target maps
                                    to id draft_to_target[c], the last column of an id wins */
  const void* draft_candidates;  /* [N, K, k] int32/int64: the target id of each column of top-k rows (k <= 1024;
                                    ids outside [0, V) map nowhere; of repeated ids the last column), or NULL */
  int draft_candidates_dtype;
  const float* draft_logprobs;   /* [N, K] float32 log q_j(d_j) at the request's temperature (draft_block's
                                    draft_logprobs), or NULL; needs draft_logits. The accept tests then use
                                    exp(draft_logprobs), and each draft row is normalised with it:
                                    q_j(x) = exp(l_j(x) - l_j(d_j) + draft_logprobs_j), l = draft_logits / T (the
                                    row's own softmax where that is not finite) */
  const void* verify_lens;       /* [N] int32/int64: verify at most this many drafts (clamped to [0, K]), or NULL */
  int verify_lens_dtype;
  const void* survival;          /* [N, K] float, or NULL ... */
  int survival_dtype;
  const void* thresholds;        /* ... [K] float (given together): verify the leading positions with
                                    survival[r, j] >= thresholds[j]. Combined lengths take the minimum */
  int thresholds_dtype;
  const float* temperature;      /* [N] float32, or NULL (every request greedy: no random numbers are read);
                                    T <= 0 or NaN: greedy for that request */
  const int64_t* rng_key;        /* device int64 [2] = (seed, offset) (graph-safe); required with temperature,
                                    may be NULL without */
  const void* stop_token_ids;    /* [num_stops] int32/int64, or NULL: an accepted stop token ends acceptance right
                                    after it, with no bonus token */
  int stop_token_ids_dtype;
  int64_t num_stops;             /* >= 0 */
  int method;                    /* DSPARK_VERIFY_TOKEN or DSPARK_VERIFY_BLOCK (both lossless; greedy requests
                                    ignore it) */
  /* outputs */
  int64_t* tokens;               /* [N, K+1]: accepted drafts, then the bonus/correction token, then -1 */
  int32_t* num_accepted;         /* [N] */
  uint8_t* accept_mask;          /* [N, K] bool (0/1) */
  /* the kernels' tickets (neither input nor output) */
  uint32_t* tickets;             /* at least dspark_verify_chain_tickets_size(N) bytes (3 N words, indexed by
                                    request): zeroed once by the caller (cudaMemsetAsync) before its first call and
                                    left zero by every call, so one buffer serves every later call of at most its
                                    capacity in requests, whatever its other shapes; calls that may overlap (on
                                    other streams) need a buffer each */
  size_t tickets_bytes;          /* the buffer's size */
} dspark_verify_chain_args;

/* Bytes of workspace (depends on N, K, V, W and the device's SM count; never 0 for N > 0): the kernels' partials,
 * no initialisation needed. Kernels: one for greedy calls (temperature NULL), two for token sampling, three for
 * block verification. */
DSPARK_API int dspark_verify_chain_workspace_size(const dspark_verify_chain_args* args, size_t* bytes);
/* Bytes of tickets (args.tickets) a call of N requests needs: 12 N (3 N uint32 words; N >= 0). */
DSPARK_API int dspark_verify_chain_tickets_size(int64_t N, size_t* bytes);
DSPARK_API int dspark_verify_chain(const dspark_verify_chain_args* args, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DSPARK_CAPI_H_ */
