"""FlashInfer's ``flashinfer.sampling.chain_speculative_sampling`` on ``dk.verify_chain``: same signature, same
outputs, so an engine that calls FlashInfer's (TensorRT-LLM, SGLang) can switch with one import. No FlashInfer
needed.

The distributions arrive as probabilities; ``dk.verify_chain`` reads logits, so the shim passes ``log p`` and
``log q`` at temperature 1 (``softmax(log p) = p``) and ``log q(d_j)`` as ``draft_logprobs`` (the accept tests use
``q(d_j)`` itself). Randomness: dk's counter-based generator keyed by ``(seed, offset)``; without them the key is
drawn from ``generator`` (or torch's default one) on the device. Results are deterministic for a given key whatever
``deterministic`` says.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

import dspark_kernels as dk
from dspark_kernels import rng

__all__ = ["chain_speculative_sampling"]

_SEED_HIGH = 2 ** 62


def _key_part(name: str, value, device) -> Union[int, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: dspark_kernels keys a batch with one (seed, offset); got a tensor of "
                             f"{value.numel()} elements (per-request seeds are not supported)")
        return value.reshape(1).to(device=device, dtype=torch.int64)
    return int(value)


def _check(draft_probs, draft_token_ids, target_probs):
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [batch, num_speculate_tokens], got {tuple(draft_token_ids.shape)}")
    b, n = draft_token_ids.shape
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (b, n):
        raise ValueError(f"draft_probs must be [{b}, {n}, vocab], got {tuple(draft_probs.shape)}")
    vocab = draft_probs.shape[2]
    if tuple(target_probs.shape) != (b, n + 1, vocab):
        raise ValueError(f"target_probs must be [{b}, {n + 1}, {vocab}], got {tuple(target_probs.shape)}")
    if n < 1:
        raise ValueError("draft_token_ids must have num_speculate_tokens >= 1")


def chain_speculative_sampling(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    seed: Optional[Union[int, torch.Tensor]] = None,
    offset: Optional[Union[int, torch.Tensor]] = None,
):
    """Lossless chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of a batch of draft chains.

    Args:
        draft_probs: float ``[B, n, V]``, the distributions the drafts were sampled from.
        draft_token_ids: int ``[B, n]``.
        target_probs: float ``[B, n + 1, V]``; row j scores draft j, row n the bonus token.
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: int ``[B]``; when given, this call's
            counts are added to them in place (and they are returned).
        deterministic: accepted for signature parity (always deterministic for a given key).
        generator: draws the key when ``seed`` / ``offset`` are not both given.
        seed, offset: ints or one-element int tensors (device tensors allowed).

    Returns:
        ``(output_token_ids int32 [B, n + 1], output_accepted_token_num int32 [B],
        output_emitted_draft_token_num int32 [B])``: the accepted drafts then the correction or bonus token, -1
        after; the number of drafts that pass the accept test when each is tested on its own (a metric: it does
        not stop at the first rejection); the number of drafts emitted (the accepted prefix).
    """
    _check(draft_probs, draft_token_ids, target_probs)
    dev = target_probs.device
    b, n = draft_token_ids.shape
    if seed is None or offset is None:
        gen_dev = generator.device if generator is not None else dev
        seed = torch.randint(0, _SEED_HIGH, (1,), generator=generator, device=gen_dev, dtype=torch.int64).to(dev)
        offset = 0
    seed, offset = _key_part("seed", seed, dev), _key_part("offset", offset, dev)
    q = draft_probs.float()
    drafts = draft_token_ids.to(torch.int64)
    valid = (drafts >= 0) & (drafts < q.shape[-1])
    q_d = q.gather(-1, drafts.clamp(0, q.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    drafts = torch.where(valid & (q_d > 0), drafts, -1)  # a draft its distribution gives no mass is rejected
    out = dk.verify_chain(target_probs.float().log(), drafts, draft_logits=q.log(), draft_logprobs=q_d.log(),
                          temperature=1.0, seed=seed, offset=offset)
    emitted = out.num_accepted.to(torch.int32)
    accepted = _independent_accepts(target_probs, drafts, q_d, seed, offset)
    if maybe_output_accepted_token_num is not None:
        accepted = maybe_output_accepted_token_num.add_(accepted.to(maybe_output_accepted_token_num.dtype))
    if maybe_output_emitted_draft_token_num is not None:
        emitted = maybe_output_emitted_draft_token_num.add_(emitted.to(maybe_output_emitted_draft_token_num.dtype))
    return out.tokens.to(torch.int32), accepted, emitted


def _independent_accepts(target_probs, drafts, q_d, seed, offset) -> torch.Tensor:
    """int32 ``[B]``: drafts whose accept test ``u_j q(d_j) < p(d_j)`` passes, with the uniforms verify_chain used
    (``rng`` stream ACCEPT at each position), counted at every position."""
    b, n = drafts.shape
    dev = drafts.device
    p_d = target_probs[:, :n].float().gather(-1, drafts.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (drafts >= 0)
    key = rng.make_rng_key(seed, offset, dev)
    u = rng.uniform_rows(key, torch.arange(b, device=dev).unsqueeze(-1), torch.arange(n, device=dev),
                         rng.STREAM_ACCEPT, 1).squeeze(-1)
    return (u * q_d < p_d).sum(-1).to(torch.int32)
