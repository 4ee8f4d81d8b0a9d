"""Token checks at production shapes: the rule by which a fast path may differ from the reference.

Two float32 implementations of one logit or probability round differently (tensor-core accumulators, FMA
contraction, another summation order), so at a near-tie they may choose different tokens, both correctly. A check
at production shapes therefore compares each request's tokens up to its first difference and excuses that difference
only where the exact value (float64, from the same inputs and the same counter-RNG uniforms) lies within the stated
error bound of both implementations; everything after a difference follows another chain and is not compared. The
functions return the unexcused differences (each with its gap and bound) and the number of excused ones, which the
tests record (JUnit property ``excused_near_ties``); the CPU paths excuse none. ``rng_key`` may live on the CPU
while the tensors are on a GPU (``make_rng_key`` of two ints).

Stated bounds, per implementation, against the exact value:
- a draft logit ``U_t + sum_i W2[t, i] v_i`` (r terms, bf16 or fp32 products, float32 sums): ``r ulp * sum_i
  |W2[t, i] v_i| + ulp * |logit|`` with ``ulp = 2^-23`` (a full ulp a sum, so an accumulator that truncates is
  covered); a sampled key ``logit / T - log(-log u)`` adds an ulp of ``|logit / T|`` and ``8 ulp * (|log(-log u)|
  + 1)`` (the inner logarithm's relative error becomes the outer one's absolute error; approximate logarithms
  included);
- a probability ``softmax(x / T)_v`` over a vocabulary row: relative ``PROB_REL`` (1e-5; the normaliser of 151936
  exponentials summed by a tree of about 20 float32 levels, each exponential within 2 ulp: under 2e-6).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from dspark_kernels.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, uniform_rows

ULP = 2.0 ** -23
PROB_REL = 1e-5

Mismatch = Tuple[int, int, float, float]  # (request, position, exact gap, bound)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> List[Tuple[int, int]]:
    """(request, first differing column) of each row where int tensors ``a`` and ``b`` [N, W] differ."""
    diff = (a != b).cpu()
    rows = diff.any(1).nonzero().flatten().tolist()
    return [(r, int(diff[r].int().argmax())) for r in rows]


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u.double()))


def draft_mismatches(ours: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, temperature: Optional[torch.Tensor],
                     rng_key: torch.Tensor) -> Tuple[List[Mismatch], int]:
    """draft_block with a vanilla head (v = W1[previous token]): tokens ``ours`` against ``ref`` (int [N, K]) for
    U = ``base`` [N, K, V], temperatures float32 [N] (None: greedy) and the key the op drew with."""
    rank, vocab = w2.shape[1], w2.shape[0]
    bad, excused = [], 0
    for r, j in first_difference(ours, ref):
        prev = int(anchors[r]) if j == 0 else int(ref[r, j - 1])
        v = w1[prev].double() if 0 <= prev < w1.shape[0] else torch.zeros(rank, dtype=torch.float64, device=w1.device)
        ids = torch.stack([ref[r, j], ours[r, j]]).long()
        terms = w2[ids].double() * v
        logit = base[r, j, ids].double() + terms.sum(-1)
        bound = rank * ULP * terms.abs().sum(-1) + ULP * logit.abs()
        key, tol = logit, bound.sum()
        t = float(temperature[r]) if temperature is not None else 0.0
        if t > 0:
            u = uniform_rows(rng_key, torch.tensor([r], device=rng_key.device), j, STREAM_DRAFT, vocab)
            g = _gumbel(u.to(ids.device)[0, ids])
            key = logit / t + g
            tol = tol / t + ULP * (logit / t).abs().sum() + 8 * ULP * (g.abs() + 1).sum()
        gap = abs(float(key[0] - key[1]))
        if gap <= float(tol):
            excused += 1
        else:
            bad.append((r, j, gap, float(tol)))
    return bad, excused


def _probs(row: torch.Tensor, t: float) -> torch.Tensor:
    return torch.softmax(row.double() / t, dim=-1)


def verify_mismatches(ours, ref, target: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor,
                      draft_logprobs: torch.Tensor, temperature: torch.Tensor, rng_key: torch.Tensor
                      ) -> Tuple[List[Mismatch], int]:
    """verify_chain, token method, dense ``target`` [N, K+1, V] and ``draft_logits`` [N, K, V] with
    ``draft_logprobs`` [N, K], every request sampled at ``temperature`` [N] (> 0), every draft verified: outputs
    ``ours`` against ``ref`` (``VerifyOutput``). A different accept count is excused where ``u q(d) - p(d)`` lies
    within the probability bound; a different emitted token where the two tokens' race scores (the residual's
    exponential race, or the Gumbel race of p after full acceptance) do."""
    k_len, vocab = drafts.shape[1], target.shape[-1]
    bad, excused = [], 0
    for r, _ in first_difference(torch.cat([ours.num_accepted.view(-1, 1).long(), ours.tokens], 1),
                                 torch.cat([ref.num_accepted.view(-1, 1).long(), ref.tokens], 1)):
        t = float(temperature[r])
        na, nb = int(ref.num_accepted[r]), int(ours.num_accepted[r])
        j = min(na, nb)
        req = torch.tensor([r], device=rng_key.device)
        if na != nb:  # the accept test at position j: u q(d) < p(d)
            d = int(drafts[r, j])
            p_d = float(_probs(target[r, j], t)[d])
            q_d = math.exp(float(draft_logprobs[r, j]))
            u = float(uniform_rows(rng_key, req.view(1, 1), torch.tensor([j], device=rng_key.device), STREAM_ACCEPT,
                                   1).flatten()[0])
            gap, tol = abs(u * q_d - p_d), 2 * PROB_REL * max(p_d, u * q_d)
        else:  # the emitted token at row j
            ids = torch.stack([ref.tokens[r, j], ours.tokens[r, j]]).long()
            u = uniform_rows(rng_key, req, j, STREAM_RESIDUAL, vocab).to(ids.device)[0, ids].double()
            if j == k_len:  # full acceptance: the bonus token from p (Gumbel race)
                key = target[r, j, ids].double() / t + _gumbel(u)
                gap, tol = float(key[0] - key[1]), float(4 * ULP * key.abs().sum() + 2 * PROB_REL)
            else:  # the residual max(p - q, 0) by the exponential race
                p = _probs(target[r, j], t)[ids]
                scaled = draft_logits[r, j].double() / t
                q = torch.exp(scaled[ids] - scaled[int(drafts[r, j])] + float(draft_logprobs[r, j]))
                e = -torch.log(u)
                score = (p - q).clamp(min=0) / e
                gap, tol = float(score[0] - score[1]), float(2 * PROB_REL * ((p + q) / e).sum())
            gap = abs(gap)
        if gap <= tol:
            excused += 1
        else:
            bad.append((r, j, gap, tol))
    return bad, excused
