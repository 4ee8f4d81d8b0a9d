"""dspark_kernels in vLLM 0.32.

* ``rejection_sample``: vLLM's ``rejection_sample`` (same signature and output) on ``dk.verify_chain``.
* ``register``: the ``vllm.general_plugins`` entry point that installs it when ``DSPARK_VLLM=1``.
* ``configure(method="token" | "block")`` / ``DSPARK_VLLM_METHOD``: the verification rule.
* ``stats()``: this process's counters (read them in the engine with ``LLM.collective_rpc``).

See docs/VLLM.md.
"""

from .plugin import installed, register
from .rejection import (configure, current_method, expand_batch_to_tokens, rejection_sample, stats,
                        worker_stats)

__all__ = ["configure", "current_method", "expand_batch_to_tokens", "installed", "register", "rejection_sample",
           "stats", "worker_stats"]
