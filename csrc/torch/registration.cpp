// The dspark_C operator library (dspark_simt in the SIMT build): every op's schema, mutation declared, in one
// place. Each schema equals the one dspark_kernels/ops/<op>.py gives define_op, or for a local piece of the
// vocabulary-parallel ops the one of dspark_kernels/distributed/ops.py (python_tests/test_signatures.py compares
// them); each launcher (csrc/torch/<op>.cu) registers its implementation with DSPARK_LIBRARY_IMPL. In the
// ahead-of-time GPU build this file also creates the Python module `dspark_kernels._C`.
#include "common.h"

#define DSPARK_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
DSPARK_LIBRARY_(DSPARK_TORCH_LIBRARY, m) {
  m.def("rng_uniform_(Tensor(a!) out, Tensor rng_key, int stream) -> ()");
  m.def("draft_block(Tensor base_logits, Tensor anchor_tokens, str head_kind, Tensor w1, Tensor w2, "
        "Tensor? w2_scale, Tensor? draft_to_target, Tensor? wg, Tensor? bg, Tensor? wj, Tensor? bj, Tensor? hidden, "
        "Tensor? conf_weight, Tensor? conf_bias, Tensor? sts_temperatures, Tensor? temperature, Tensor rng_key, "
        "bool return_logits, int top_k) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("verify_chain(Tensor target_logits, Tensor? cu_seqlens, Tensor draft_tokens, Tensor? draft_logits, "
        "Tensor? target_to_draft, Tensor? draft_candidates, Tensor? draft_logprobs, Tensor? verify_lens, "
        "Tensor? survival, Tensor? thresholds, Tensor? temperature, Tensor rng_key, Tensor? stop_token_ids, "
        "str method) -> (Tensor, Tensor, Tensor)");
  m.def("accept_prefix_scan(Tensor tokens, Tensor seq_lens, Tensor? num_accepted, Tensor? accept_mask, "
        "Tensor? verify_cu_seqlens, Tensor? block_table, int block_size, Tensor? max_seq_lens, "
        "Tensor? stop_token_ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("schedule_verify_lens(Tensor? survival, Tensor? conf_logits, Tensor? sts_temperatures, Tensor token_counts, "
        "Tensor step_time_ms, float fixed_overhead_ms, int min_len, int max_len, str mode, Tensor? budget_survival, "
        "float min_gain, Tensor? active) -> (Tensor, Tensor, Tensor)");
  // The CUDA backends of dspark_dist's local pieces (dspark_kernels/distributed/ops.py: the same schemas there)
  m.def("draft_step(Tensor base_logits_k, Tensor v, Tensor w2_shard, Tensor? temperature, Tensor rng_key, "
        "int position, int vocab_start, bool return_logits) -> (Tensor, Tensor, Tensor)");
  m.def("verify_stats(Tensor target_shard, Tensor? cu_seqlens, Tensor draft_tokens, Tensor? draft_logits_shard, "
        "Tensor? temperature, int vocab_start, int vocab_size) -> Tensor");
  m.def("verify_decide(Tensor stats, Tensor shards, Tensor? residual, Tensor? cu_seqlens, int num_rows, "
        "Tensor draft_tokens, Tensor? draft_logprobs, Tensor? verify_lens, Tensor? survival, Tensor? thresholds, "
        "Tensor? temperature, Tensor rng_key, Tensor? stop_token_ids, str method, bool has_draft_logits, "
        "int vocab_size) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("verify_residual(Tensor target_shard, Tensor? cu_seqlens, Tensor draft_tokens, Tensor? draft_logits_shard, "
        "Tensor plan, Tensor temperature, Tensor rng_key, int vocab_start, int vocab_size) -> Tensor");
}

#if defined(TORCH_EXTENSION_NAME) && !defined(DSPARK_SIMT)
#include <Python.h>
// An empty Python module, so that `import dspark_kernels._C` (the ahead-of-time build) works; loading the
// shared object runs the registrations. The JIT build loads the library with torch.ops.load_library.
#define DSPARK_CONCAT_(a, b) a##b
#define DSPARK_CONCAT(a, b) DSPARK_CONCAT_(a, b)
#define DSPARK_STR_(x) #x
#define DSPARK_STR(x) DSPARK_STR_(x)
extern "C" PyObject* DSPARK_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, DSPARK_STR(TORCH_EXTENSION_NAME),
                                   "dspark_kernels CUDA ops (torch.ops.dspark_C)", -1, nullptr};
  return PyModule_Create(&def);
}
#endif
