"""dspark_kernels: GPU building blocks of DSpark-style speculative decoding.

Public ops (``import dspark_kernels as dk``):

* ``dk.draft_block``          - Markov-head block drafting + confidence/survival, one launch per block
* ``dk.verify_chain``         - fused chain verification (greedy, lossless token-level or block rejection sampling)
* ``dk.accept_prefix_scan``   - acceptance -> packed outputs, new lengths, next anchors, drafter rows, KV slots
* ``dk.schedule_verify_lens`` - confidence scheduler (the paper's Algorithm 1, and the production argmax form)
* ``dk.rng_uniform``          - the shared counter-based generator, for engines that want the same noise

Tools: ``dk.CostTable``, ``dk.fit_sts``, ``dk.survival_from_conf``; ``dk.build_info()``: versions, the prebuilt CUDA
extension's architectures, and the backend each op takes on this machine and why. Every op takes ``backend="auto" |
"cuda" | "triton" | "reference"`` (default from ``DSPARK_BACKEND``).
"""

from . import rng
from ._info import build_info
from .calibration import CostTable, expected_calibration_error, fit_sts, survival_from_conf
from .ops import (
    ConfidenceHead,
    DraftBlockOutput,
    MarkovHead,
    ScanOutput,
    ScheduleOutput,
    VerifyOutput,
    accept_prefix_scan,
    draft_block,
    draft_to_target_from_offsets,
    quantize_w2,
    rng_uniform,
    schedule_verify_lens,
    target_to_draft_map,
    verify_chain,
)

__version__ = "0.1.0"

__all__ = [
    "rng", "build_info", "CostTable", "expected_calibration_error", "fit_sts", "survival_from_conf",
    "ConfidenceHead", "DraftBlockOutput", "MarkovHead", "ScanOutput", "ScheduleOutput", "VerifyOutput",
    "accept_prefix_scan", "draft_block", "draft_to_target_from_offsets", "quantize_w2",
    "rng_uniform", "schedule_verify_lens", "target_to_draft_map", "verify_chain",
]
