"""dspark_kernels in vLLM 0.32.

* ``rejection_sample``: vLLM's ``rejection_sample`` (same signature and output) on ``dk.verify_chain``.
* ``register``: the ``vllm.general_plugins`` entry point that installs it when ``DSPARK_VLLM=1``.
* ``configure(method="token" | "block")`` / ``DSPARK_VLLM_METHOD``: the verification rule.
* ``speculative_config(drafter_dir, num_speculative_tokens=K, scheduler=...)``: DSpark drafting in vLLM's V1
  engine (the ``custom_class`` proposer of ``proposer.py``).
* ``stats()``: this process's counters (read them in the engine with ``LLM.collective_rpc``).

See docs/VLLM.md.
"""

from .plugin import installed, register
from .proposer import speculative_config
from .rejection import (configure, current_method, expand_batch_to_tokens, rejection_sample, stats,
                        worker_stats)

__all__ = ["configure", "current_method", "expand_batch_to_tokens", "installed", "register", "rejection_sample",
           "speculative_config", "stats", "worker_stats"]
