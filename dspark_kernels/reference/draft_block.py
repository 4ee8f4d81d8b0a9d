"""Reference draft_block: the sequential Markov head over a parallel drafter's block, plus confidence and survival.

Position k (0-based) of request n reads the token x_k that precedes it (x_0 = the anchor, x_k = the draft of
position k-1) through the Markov head's embedding ``e = W1[x_k]`` and corrects the backbone's base logits:

    vanilla:  B = W2 @ e
    gated:    g = sigmoid(Wg [h_k; e] + bg),                  B = W2 @ (g * e)
    rnn:      [g, c, o] = chunk(Wj [s; e; h_k] + bj, 3),
              s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c),  B = W2 @ tanh(o)     (s starts at 0)

    logits_k = U_k + B          (an fp8 W2 with per-row scales s: B_j = s_j (W2_j . v), in float32)
    draft_k  = argmax(logits_k)                                 temperature 0 (ties: lowest index)
             = argmax(logits_k / T - log(-log(u)))              temperature T > 0 (Gumbel-max / exponential race)
    conf_k   = w . [h_k; e] + b,   survival_k = prod_{i<=k} sigmoid(conf_i / T_i)
    logprob_k = log_softmax(logits_k / T)[draft_k]             T = 1 for greedy requests (T <= 0 or NaN)

Top-k proposals (``top_k`` = k > 0): at each position only the k candidates ``C_k`` = the k largest entries of U_k
(``topk_candidates``: ranked by value, NaN below -inf, -0 equal to +0, ties to the lower id) get a bias, and the
proposal is the softmax over them alone: ``logits_k = U_k[C_k] + B[C_k]`` (k of them, in increasing id order), drafts,
ties and log-probabilities as above over those k (ties to the lowest id). Every other token has q = 0.

A reduced draft vocabulary (``draft_to_target``, int ``[Vd]``): U, W2 and the sweep cover Vd draft ids, the
drafted id j is emitted as the target id ``draft_to_target[j]`` (which the next position's ``W1`` gather reads, so
W1 has the target vocabulary's rows), and every random draw is keyed by the draft id. Without it Vd = V and the
map is the identity.

``draft_logprobs`` is log q(d_k), the log-probability of each drafted token under the distribution it was drawn
from, softmax(logits_k / T); verify_chain's accept test uses q(d) = exp(draft_logprobs). For greedy requests the
sampling distribution is a point mass (its T -> 0 limit gives log q = 0, which says nothing), so they report the
draft model's own log-probability at T = 1 instead; the verifier never reads it for greedy requests. A row holding
a NaN or +inf logit (or only -inf) gives NaN, exactly as torch.log_softmax does.

Everything is computed in float32 whatever the input dtypes. A token outside W1's rows (an anchor, or a map entry
outside them) reads a zero embedding.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..rng import STREAM_DRAFT, argmax_nan_low, gumbel_argmax, uniform_rows


def markov_embed(w1: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, r]`` rows ``W1[tokens]``; zero rows for tokens outside W1's rows."""
    valid = (tokens >= 0) & (tokens < w1.shape[0])
    rows = w1[torch.where(valid, tokens, 0)].float()
    return rows * valid.unsqueeze(-1)


def topk_candidates(base_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """int64 ``[..., top_k]``: the ids of the ``top_k`` largest entries of each row, in increasing id order.

    The order is total: by the float32 value (-0 = +0; NaN below every number, -inf included), ties to the lower id;
    so the set is unique whatever the values. Keys are ``ordered(value) * 2^32 + (2^32 - 1 - id)`` in int64, where
    ``ordered`` maps float32 bits to a signed integer of the same order.
    """
    bits = (base_logits.float() + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0 into +0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = torch.where(torch.isnan(base_logits.float()), -(2 ** 31), ordered)
    ids = torch.arange(base_logits.shape[-1], device=base_logits.device, dtype=torch.int64)
    keys = ordered * 2 ** 32 + (2 ** 32 - 1 - ids)
    top = torch.topk(keys, top_k, dim=-1).values
    return (2 ** 32 - 1 - (top & 0xFFFFFFFF)).sort(dim=-1).values


def proposal_logits(u: torch.Tensor, w2f: torch.Tensor, w2_scale: Optional[torch.Tensor], v: torch.Tensor,
                    ids: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 ``U + B`` at every draft id (``ids`` None: ``[N, V]``) or at the candidates ``ids`` (``[N, top_k]``)."""
    if ids is None:
        bias = v @ w2f.T
        return u + (bias * w2_scale.float() if w2_scale is not None else bias)
    bias = (w2f[ids] @ v.unsqueeze(-1)).squeeze(-1)
    return u.gather(-1, ids) + (bias * w2_scale.float()[ids] if w2_scale is not None else bias)


def draft_block(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    head_kind: str,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: Optional[torch.Tensor],
    draft_to_target: Optional[torch.Tensor],
    wg: Optional[torch.Tensor],
    bg: Optional[torch.Tensor],
    wj: Optional[torch.Tensor],
    bj: Optional[torch.Tensor],
    hidden: Optional[torch.Tensor],
    conf_weight: Optional[torch.Tensor],
    conf_bias: Optional[torch.Tensor],
    sts_temperatures: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    rng_key: torch.Tensor,
    return_logits: bool,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``dspark_kernels.ops.draft_block`` for shapes; returns (tokens, logits, conf_logits, survival,
    draft_logprobs, candidates), with empty tensors for the outputs that were not asked for."""
    n, k_len, vocab = base_logits.shape
    dev = base_logits.device
    w2f = w2.float()
    requests = torch.arange(n, device=dev)
    safe_t = torch.ones(n, 1, dtype=torch.float32, device=dev)  # T of the log-probabilities: 1 for greedy rows
    if temperature is not None:  # None: every request greedy (known on the host), no random numbers needed
        sampled = temperature > 0
        safe_t = torch.where(sampled, temperature, 1.0).unsqueeze(-1)

    cands = topk_candidates(base_logits, top_k) if top_k > 0 else None  # [N, K, top_k] draft ids
    tokens = torch.empty(n, k_len, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, k_len, dtype=torch.float32, device=dev)
    width = top_k if top_k > 0 else vocab
    logits_out = torch.empty(n, k_len, width, dtype=torch.float32, device=dev) if return_logits else None
    conf = torch.empty(n, k_len, dtype=torch.float32, device=dev) if conf_weight is not None else None
    state = torch.zeros(n, w1.shape[1], dtype=torch.float32, device=dev)  # rnn head state s_k
    prev = anchor_tokens.to(torch.int64)
    for k in range(k_len):
        e = markov_embed(w1, prev)
        h = hidden[:, k].float() if hidden is not None else None
        if head_kind == "vanilla":
            v = e
        elif head_kind == "gated":
            g = torch.sigmoid(torch.cat([h, e], dim=-1) @ wg.float().T + bg.float())
            v = g * e
        else:  # rnn
            gate, cand, out = (torch.cat([state, e, h], dim=-1) @ wj.float().T + bj.float()).chunk(3, dim=-1)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
            v = torch.tanh(out)
        if conf is not None:
            conf[:, k] = torch.cat([h, e], dim=-1) @ conf_weight.float() + conf_bias.float()
        ids = cands[:, k] if cands is not None else None  # [N, top_k] draft ids, or every id
        logits = proposal_logits(base_logits[:, k].float(), w2f, w2_scale, v, ids)  # columns in increasing id order
        col = argmax_nan_low(logits)  # ties to the lowest column, which is the lowest id
        if temperature is not None:
            u = uniform_rows(rng_key, requests, k, STREAM_DRAFT, vocab)  # keyed by the draft id
            col = torch.where(sampled, gumbel_argmax(logits / safe_t, u if ids is None else u.gather(-1, ids)), col)
        drafted = col if ids is None else ids.gather(-1, col.unsqueeze(-1)).squeeze(-1)  # a draft id
        prev = draft_to_target[drafted].to(torch.int64) if draft_to_target is not None else drafted
        tokens[:, k] = prev
        logprobs[:, k] = torch.log_softmax(logits / safe_t, dim=-1).gather(-1, col.unsqueeze(-1)).squeeze(-1)
        if logits_out is not None:
            logits_out[:, k] = logits

    def empty() -> torch.Tensor:  # outputs that were not asked for (distinct tensors: outputs may not alias)
        return torch.empty(0, dtype=torch.float32, device=dev)

    logits_out = logits_out if logits_out is not None else empty()
    candidates = torch.empty(0, dtype=torch.int64, device=dev)
    if cands is not None and return_logits:  # target ids of the sparse logits' columns
        candidates = draft_to_target.to(torch.int64)[cands] if draft_to_target is not None else cands
    if conf is None:
        return tokens, logits_out, empty(), empty(), logprobs, candidates
    temps = sts_temperatures.float() if sts_temperatures is not None else torch.ones(k_len, device=dev)
    survival = torch.cumprod(torch.sigmoid(conf / temps), dim=-1)
    return tokens, logits_out, conf, survival, logprobs, candidates
