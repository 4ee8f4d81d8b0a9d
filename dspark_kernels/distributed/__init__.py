"""Vocabulary-parallel drafting and verification over ``torch.distributed``: exchange O(N K) statistics, never logits.

* ``verify_chain``  - ``dk.verify_chain`` on logits sharded by vocabulary (every rank gets the same VerifyOutput)
* ``draft_block``   - ``dk.draft_block`` with base logits and W2 sharded by vocabulary (W1 replicated)
* ``ops``           - the local pieces as ``torch.ops.dspark_dist`` custom ops, for engines with their own
                      communicator; ``layout`` describes the buffers they exchange
* ``exchange_bytes``, ``logits_gather_bytes`` - what a call moves, against all-gathering the logits

Design and exactness argument: docs/DESIGN.md, "Vocabulary-parallel drafting and verification".
"""

from . import comm, layout, ops
from .comm import ShardLayoutError, count_traffic
from .draft_block import draft_block
from .traffic import exchange_bytes, logits_gather_bytes
from .verify_chain import verify_chain

__all__ = ["comm", "layout", "ops", "ShardLayoutError", "count_traffic", "draft_block", "verify_chain",
           "exchange_bytes", "logits_gather_bytes"]
