"""Pure-PyTorch reference implementations: the spec of every op, and the CPU path.

Each function takes the flat arguments of the registered op (``torch.ops.dspark.*``), minus ``backend``.
"""

from .accept_prefix_scan import accept_prefix_scan
from .draft_block import draft_block
from .rng_uniform import rng_uniform
from .schedule_verify_lens import schedule_verify_lens
from .verify_chain import verify_chain

__all__ = ["accept_prefix_scan", "draft_block", "rng_uniform", "schedule_verify_lens", "verify_chain"]
