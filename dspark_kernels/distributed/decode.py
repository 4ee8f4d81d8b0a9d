"""The decode loop with target and drafter vocabulary-parallel: ``VocabParallelDecoder`` runs ``SpeculativeDecoder``
on one rank's vocabulary shard.

Each rank holds the same models and computes only its shard of every vocabulary-sized product: the target's LM
head (``hidden @ W_lm[s:s+Vl].T``), the drafter's LM head (its base logits U) and the Markov head's W2; W1, the
backbones and everything else are replicated. The loop's two vocabulary-wide ops become
``distributed.draft_block`` and ``distributed.verify_chain``; scheduling and ``accept_prefix_scan`` run replicated on
the (identical) small outputs. Every rank produces the same tokens as the unsharded decoder (P = 1).

The shard is plugged in around ``SpeculativeDecoder.generate`` without changing the decoder: for the duration of
the call the target's ``lm_head``, the drafter's ``lm_head_weight`` and the decoder's Markov head see their row
slices (views, no copies), and the decoder module's ``dk`` namespace resolves ``draft_block`` / ``verify_chain`` to
the distributed ops (everything else to ``dspark_kernels``). The first call of each op validates the shard layout
across ranks; later ones skip the host read. Supports ``decode.model.TargetModel`` targets.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

import dspark_kernels

from ..decode import decoder as decoder_module
from ..decode.decoder import SpeculativeDecoder
from .draft_block import draft_block
from .verify_chain import verify_chain


class _RowSlice(nn.Module):
    """``linear(x, W[start:stop])`` of a full ``nn.Linear(d, V, bias=False)``: one vocabulary shard of an LM head."""

    def __init__(self, full: nn.Linear, start: int, stop: int):
        super().__init__()
        self.full, self.start, self.stop = full, start, stop

    def forward(self, x):
        return nn.functional.linear(x, self.full.weight[self.start:self.stop])


class _ShardedOps:
    """``dspark_kernels`` with draft_block / verify_chain on one vocabulary shard."""

    def __init__(self, vocab_start: int, vocab_size: int, group):
        self.vocab_start, self.vocab_size, self.group = vocab_start, vocab_size, group
        self.validated = set()

    def __getattr__(self, name):
        return getattr(dspark_kernels, name)

    def _shard_args(self, op: str) -> dict:
        validate = op not in self.validated
        self.validated.add(op)
        return dict(vocab_start=self.vocab_start, vocab_size=self.vocab_size, group=self.group, validate=validate)

    def draft_block(self, base_logits, anchor_tokens, head, *, top_k=None, **kw):
        if top_k is not None:  # VocabParallelDecoder refuses draft_top_k first
            raise ValueError("top_k: top-k proposals are not sharded yet")
        return draft_block(base_logits, anchor_tokens, head, **self._shard_args("draft_block"), **kw)

    def verify_chain(self, target_logits, draft_tokens, *, draft_logits=None, draft_to_target=None,
                     draft_candidates=None, **kw):
        if draft_to_target is not None or draft_candidates is not None:  # refused before: the head, the decoder
            raise ValueError("draft_to_target / draft_candidates: reduced or top-k draft rows are not sharded yet")
        return verify_chain(target_logits, draft_tokens, draft_logits_shard=draft_logits,
                            **self._shard_args("verify_chain"), **kw)


class VocabParallelDecoder:
    """``SpeculativeDecoder(target, drafter, **kw)`` on the vocabulary shard ``[vocab_start, vocab_start + size)``
    of this rank (the shards of ``group`` tile the target's vocabulary). ``generate`` takes the decoder's
    arguments and returns its result, the same on every rank."""

    def __init__(self, target, drafter, *, vocab_start: int, size: int, group=None, **kw):
        if not isinstance(getattr(target, "lm_head", None), nn.Linear):
            raise TypeError("VocabParallelDecoder needs a target with an nn.Linear lm_head (decode.model.TargetModel)")
        if not (0 <= vocab_start and size >= 1 and vocab_start + size <= target.vocab_size):
            raise ValueError(f"the shard [{vocab_start}, {vocab_start + size}) must lie in [0, {target.vocab_size})")
        if drafter.config.draft_vocab_size:
            raise ValueError("VocabParallelDecoder: a drafter over a reduced vocabulary (draft_vocab_size) is not "
                             "sharded yet (distributed.draft_block drafts over the target vocabulary only)")
        if kw.get("draft_top_k") is not None:
            raise ValueError("VocabParallelDecoder: draft_top_k (top-k proposals) is not sharded yet")
        self.decoder = SpeculativeDecoder(target, drafter, **kw)
        self.span, self.group = (vocab_start, vocab_start + size), group
        self.ops = _ShardedOps(vocab_start, target.vocab_size, group)

    def generate(self, *args, **kw):
        with self._sharded():
            return self.decoder.generate(*args, **kw)

    @contextlib.contextmanager
    def _sharded(self):
        dec, (start, stop) = self.decoder, self.span
        target, drafter = dec.target, dec.drafter
        saved = (target.lm_head, drafter.__dict__["lm_head_weight"], dec.head, decoder_module.dk)
        target.lm_head = _RowSlice(saved[0], start, stop)
        drafter.__dict__["lm_head_weight"] = saved[1][start:stop]
        dec.head = dataclasses.replace(saved[2], w2=saved[2].w2[start:stop])
        decoder_module.dk = self.ops
        try:
            with torch.no_grad():
                yield
        finally:
            target.lm_head = saved[0]
            drafter.__dict__["lm_head_weight"] = saved[1]
            dec.head = saved[2]
            decoder_module.dk = saved[3]
