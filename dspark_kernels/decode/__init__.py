"""A thin speculative decode loop over the dspark_kernels ops (gpt-fast style, one concern per file).

model.py (target) - kv_cache.py (paged cache, ragged attention) - drafter.py (DSpark drafter) - checkpoint.py
(loading / saving) - hf_target.py (any transformers causal LM as the target) - decoder.py (the loop) - graphs.py
(its step replayed from CUDA graphs, and the graphed target alone) - tools.py (cost table, STS calibration) -
testing.py (tiny random models, an oracle drafter).
"""

from .checkpoint import load_drafter, load_target, save_drafter, save_target
from .decoder import GenerationResult, GenerationStats, Scheduler, SpeculativeDecoder
from .drafter import DrafterConfig, DSparkDrafter
from .graphs import GraphDecoder, TargetAlone
from .hf_target import HFTarget
from .model import ModelConfig, TargetModel, greedy_reference
from .tools import ProfiledCostTable, calibrate, profile_cost_table, profile_draft_cost

__all__ = [
    "load_drafter", "load_target", "save_drafter", "save_target", "GenerationResult", "GenerationStats", "Scheduler",
    "SpeculativeDecoder", "GraphDecoder", "TargetAlone", "DrafterConfig", "DSparkDrafter", "HFTarget", "ModelConfig",
    "TargetModel", "greedy_reference", "calibrate", "profile_cost_table", "profile_draft_cost", "ProfiledCostTable",
]
