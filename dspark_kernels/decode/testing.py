"""Tiny random models for tests and examples, and an oracle drafter that knows the target's continuation."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .drafter import DrafterConfig, DSparkDrafter
from .model import ModelConfig, TargetModel


def tiny_hf_config(model_type: str = "qwen3", vocab: int = 48, layers: int = 3, **kw) -> dict:
    cfg = dict(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(kw)
    return cfg


def tiny_target(seed: int = 0, model_type: str = "qwen3", vocab: int = 48, **kw) -> TargetModel:
    return TargetModel(ModelConfig.from_hf(tiny_hf_config(model_type, vocab, **kw))).init_random(seed).eval()


def tiny_drafter_config(target: TargetModel, block_size: int = 4, markov: str = "vanilla", rank: int = 8,
                        confidence: bool = True, layer_ids: Sequence[int] = (0, 1), **kw) -> DrafterConfig:
    t = target.config
    cfg = dict(model_type="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
               intermediate_size=t.intermediate_size, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
               block_size=block_size, mask_token_id=t.vocab_size - 1, target_layer_ids=list(layer_ids),
               markov_rank=rank, markov_head_type=markov, enable_confidence_head=confidence,
               confidence_head_with_markov=True, num_anchors=512)
    cfg.update(kw)
    return DrafterConfig.from_hf(cfg)


def _built(cls, target: TargetModel, seed: int, draft_ids: Optional[Sequence[int]], kw) -> DSparkDrafter:
    """A random drafter of class ``cls``; over the reduced vocabulary ``draft_ids`` (target ids) when given."""
    if draft_ids is not None:
        kw = dict(kw, draft_vocab_size=len(draft_ids))
    drafter = cls.for_target(tiny_drafter_config(target, **kw), target).init_random(seed).eval()
    if draft_ids is not None:
        drafter.set_draft_ids(torch.as_tensor(list(draft_ids)))
    return drafter


def tiny_drafter(target: TargetModel, seed: int = 1, draft_ids: Optional[Sequence[int]] = None,
                 **kw) -> DSparkDrafter:
    return _built(DSparkDrafter, target, seed, draft_ids, kw)


class OracleDrafter(DSparkDrafter):
    """Adds a large one-hot of the true continuation (``reference[r][p]`` for the token at position p) to the
    backbone's logits, wrong on a deterministic subset of positions, so tests see long acceptances, full blocks
    with a bonus token, rejections and stop tokens inside blocks."""

    def set_reference(self, sequences: Sequence[Sequence[int]], wrong_every: int = 3, scale: float = 200.0,
                      device: Optional[torch.device] = None):
        width = max(map(len, sequences)) + 64
        ref = torch.zeros(len(sequences), width, dtype=torch.long)
        for r, s in enumerate(sequences):
            ref[r, :len(s)] = torch.tensor(s)
        self.ref, self.wrong_every, self.scale = ref.to(device or self.fc.weight.device), wrong_every, scale

    def forward_block(self, anchor, anchor_pos, kv_len):
        base, h = super().forward_block(anchor, anchor_pos, kv_len)
        n, k, v = base.shape
        p = (anchor_pos.long().view(n, 1) + 1 + torch.arange(k, device=base.device)).clamp(max=self.ref.shape[1] - 1)
        tok = self.ref[torch.arange(n, device=base.device).view(n, 1), p]
        known = torch.ones_like(tok, dtype=torch.bool)
        if self.config.draft_vocab_size:  # the true token's draft id, where the draft vocabulary has it
            t2d = torch.full((self.config.backbone.vocab_size,), -1, dtype=torch.long, device=base.device)
            t2d[self.draft_to_target()] = torch.arange(v, device=base.device)
            tok = t2d[tok]
            known = tok >= 0
            tok = tok.clamp(min=0)
        r = torch.arange(n, device=base.device).view(n, 1)
        wrong = ((p * 7 + r * 3) % self.wrong_every) == 0
        tok = torch.where(wrong, (tok + 1) % (v - 1), tok)
        hot = base.new_zeros(n, k, v).scatter_(-1, tok.unsqueeze(-1), known.unsqueeze(-1).to(base.dtype))  # no sync
        return base + self.scale * hot, h


def oracle_drafter(target: TargetModel, seed: int = 1, draft_ids: Optional[Sequence[int]] = None,
                   **kw) -> OracleDrafter:
    return _built(OracleDrafter, target, seed, draft_ids, kw)


# chi-square goodness of fit with the project's pass rule (the sampling tests and the demo use it)
def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, after merging bins with expected count < 5.

    Bins whose expectation is below 5 are pooled into one bin; if the pool itself is below 5 it joins the
    smallest remaining bin. ``observed`` and ``expected`` are float ``[B]`` with equal sums.
    """
    observed, expected = observed.double(), expected.double()
    assert abs(observed.sum().item() - expected.sum().item()) < 1e-6 * max(1.0, expected.sum().item())
    small = expected < 5
    obs = observed[~small].tolist()
    exp = expected[~small].tolist()
    pool_o, pool_e = observed[small].sum().item(), expected[small].sum().item()
    if pool_e > 0 or pool_o > 0:
        if pool_e >= 5 or not exp:
            obs.append(pool_o)
            exp.append(pool_e)
        else:
            i = min(range(len(exp)), key=exp.__getitem__)
            obs[i] += pool_o
            exp[i] += pool_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    if any(e == 0 and o > 0 for o, e in zip(obs, exp)):
        stat = math.inf  # an outcome the null says is impossible
    return stat, len(exp) - 1


def passes(observed: torch.Tensor, expected: torch.Tensor) -> bool:
    """The pass rule: chi2 < df + 10 sqrt(2 df) (a ~7-sigma bound, so failures mean a real bias)."""
    stat, df = chi_square(observed, expected)
    return stat < df + 10 * math.sqrt(2 * max(df, 1))
