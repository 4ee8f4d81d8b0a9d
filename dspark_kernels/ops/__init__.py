"""Public ops: host-side checks, backend dispatch, and the ``torch.library`` registration of each op."""

from .accept_prefix_scan import ScanOutput, accept_prefix_scan
from .draft_block import (ConfidenceHead, DraftBlockOutput, MarkovHead, draft_block, draft_to_target_from_offsets,
                          quantize_w2)
from .rng_uniform import rng_uniform
from .schedule_verify_lens import ScheduleOutput, schedule_verify_lens
from .verify_chain import VerifyOutput, target_to_draft_map, verify_chain

__all__ = [
    "ScanOutput", "accept_prefix_scan", "ConfidenceHead", "DraftBlockOutput", "MarkovHead", "draft_block",
    "draft_to_target_from_offsets", "quantize_w2",
    "rng_uniform", "ScheduleOutput", "schedule_verify_lens", "VerifyOutput", "target_to_draft_map", "verify_chain",
]
