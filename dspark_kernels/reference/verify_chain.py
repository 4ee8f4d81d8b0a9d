"""Reference verify_chain: chain verification of a draft block against the target's logits.

Row j of request r's target logits scores draft ``d_{j+1}`` (0-based: ``draft_tokens[r, j]``); row L scores the
bonus token. With ``L`` the verify length of the request:

greedy (temperature 0):
    accept while ``d_j == argmax(row j-1)``; emit ``argmax`` of the first mismatching row, or of row L.
token (lossless rejection sampling, Leviathan et al. 2023; Chen et al. 2023), ``p = softmax(row / T)``, ``q`` the
draft distribution over the target ids (below), or one-hot at the draft without draft logits; ``q(d_j) =
exp(draft_logprobs)`` in the accept tests when those are given:
    accept ``d_j`` iff ``u_j * q(d_j) < p(d_j)``; at the first rejection emit a sample of ``max(0, p - q)``
    (normalised; drawn from ``p`` when its mass is below ``RESIDUAL_EPS``); if all L are accepted, a sample of
    ``p`` at row L.
block (Sun et al. 2024, "Block verification accelerates speculative decoding"), ``rho_0 = 1``:
    ``rho_i = min(rho_{i-1} p_i(d_i) / q_i(d_i), 1)``;
    ``h_i = S_i / (S_i + 1 - rho_i)`` with ``S_i = sum_x max(rho_i p_{i+1}(x) - q_{i+1}(x), 0)`` for i < L, and
    ``h_L = rho_L`` (a zero denominator gives ``h_i = 1``, a NaN one ``h_i = 0``);
    accept the longest prefix ``tau = max{i : eta_i <= h_i}`` (0 if none) and emit a sample of
    ``max(0, rho_tau p - q)`` at row tau (of ``p`` at row L when tau = L).
Then acceptance ends right after an accepted stop token, and no bonus token follows it.

The draft distribution of row j: ``softmax(draft_logits[r, j] / T)`` over the row's columns (V columns, or Vd of a
reduced vocabulary, or k of top-k rows), each column placed at its target id: column ``c`` of a reduced row at the
target id x with ``target_to_draft[x] == c``, column ``c`` of a top-k row at ``draft_candidates[r, j, c]``. A target
id no column maps to has ``q = 0``; a column that maps to no target id keeps its share of the normaliser (the drafter
could draw it; it is never accepted); where several columns of a top-k row name one id, the last of them gives its
q. With ``draft_logprobs`` the normaliser is the one the drafter used: ``q_j(x) = exp(l_j(x) - c_j)`` with
``l_j = draft_logits / T`` and ``c_j = l_j(d_j) - draft_logprobs[r, j]`` (the softmax normaliser when the logprobs
are what the contract says), or the row's own normaliser where ``c_j`` is not finite (a draft off the row, an
infinite logit or log-probability).

Randomness: ``u_j`` / ``eta_j`` is ``uniform(request=r, position=j-1, stream=ACCEPT, token=0)``; the emitted sample at
row j uses ``uniform(r, j, RESIDUAL, v)`` through the exponential race. Everything runs in float32.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..rng import STREAM_ACCEPT, STREAM_RESIDUAL, argmax_nan_low, exponential_race, gumbel_argmax, uniform_rows

RESIDUAL_EPS = 1e-6


def packed_last_row(cu_seqlens: torch.Tensor, total_rows: int, k_len: int) -> torch.Tensor:
    """int64 ``[N]``: the last of each request's packed target rows, -1 for none. Request r owns rows
    ``[cu[r], min(cu[r+1], R))`` when ``0 <= cu[r] < R`` and ``cu[r+1] > cu[r]``, else none; at most K+1 of them.
    Offsets are compared, never subtracted before the comparison, so any int64 pair has this meaning."""
    cu = cu_seqlens.to(torch.int64)
    start, end = cu[:-1], cu[1:]
    owns = (start >= 0) & (start < total_rows) & (end > start)
    rows = torch.where(owns, torch.clamp(end, max=total_rows) - start, 0)
    return torch.clamp(rows, max=k_len + 1) - 1


def gather_target_rows(target_logits: torch.Tensor, cu_seqlens: Optional[torch.Tensor], k_len: int):
    """Dense float32 ``[N, K+1, V]`` target rows and the number of rows each request really has minus one
    (int64 ``[N]``, -1 for none). Packed rows outside ``[0, R)`` are never read."""
    if cu_seqlens is None:
        n = target_logits.shape[0]
        return target_logits.float(), torch.full((n,), k_len, dtype=torch.int64, device=target_logits.device)
    total = target_logits.shape[0]
    cu = cu_seqlens.to(torch.int64)
    start = cu[:-1]
    last = packed_last_row(cu, total, k_len)
    idx = (start.unsqueeze(-1) + torch.arange(k_len + 1, device=cu.device)).clamp(0, max(total - 1, 0))
    if total == 0:
        dense = target_logits.new_zeros((cu.shape[0] - 1, k_len + 1, target_logits.shape[-1]), dtype=torch.float32)
    else:
        dense = target_logits[idx].float()
    return dense, last


def verify_chain(
    target_logits: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    draft_logits: Optional[torch.Tensor],
    target_to_draft: Optional[torch.Tensor],
    draft_candidates: Optional[torch.Tensor],
    draft_logprobs: Optional[torch.Tensor],
    verify_lens: Optional[torch.Tensor],
    survival: Optional[torch.Tensor],
    thresholds: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    rng_key: torch.Tensor,
    stop_token_ids: Optional[torch.Tensor],
    method: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``dspark_kernels.ops.verify_chain`` for shapes; returns (tokens, num_accepted, accept_mask).

    ``draft_logits`` is ``[N, K, V]``, or ``[N, K, Vd]`` with ``target_to_draft`` int ``[V]`` (the column of each
    target id, -1 for none), or ``[N, K, k]`` with ``draft_candidates`` int ``[N, K, k]`` (the target id of each
    column); see the module docstring for the draft distribution they give.
    """
    n, k_len = draft_tokens.shape
    vocab = target_logits.shape[-1]
    dev = draft_tokens.device
    pos = torch.arange(k_len + 1, device=dev)
    requests = torch.arange(n, device=dev)

    # Verify length per request: rows available, verify_lens, survival thresholds; -1 marks "no target rows".
    target, last_row = gather_target_rows(target_logits, cu_seqlens, k_len)
    has_rows = last_row >= 0
    length = last_row.clamp(min=0)
    if verify_lens is not None:
        length = torch.minimum(length, verify_lens.to(torch.int64).clamp(0, k_len))
    if survival is not None and thresholds is not None:
        passes = (survival.float() >= thresholds.float()).to(torch.int64)
        length = torch.minimum(length, passes.cumprod(dim=-1).sum(dim=-1))
    in_block = pos[:k_len] < length.unsqueeze(-1)                                  # [N, K]

    drafts = draft_tokens.to(torch.int64)
    valid = (drafts >= 0) & (drafts < vocab)
    safe_drafts = torch.where(valid, drafts, 0).unsqueeze(-1)

    # Greedy rule (temperature 0, or no temperature tensor at all: every request greedy, known on the host).
    target_argmax = argmax_nan_low(target)                                         # [N, K+1]
    n_acc = _leading_true((drafts == target_argmax[:, :k_len]) & valid & in_block)
    if temperature is not None:  # sampling rules, at each request's temperature
        sampled = temperature > 0
        t = torch.where(sampled, temperature, 1.0).view(n, 1, 1)
        p = torch.softmax(target / t, dim=-1)                                     # [N, K+1, V]
        if draft_logits is not None:
            q = draft_probs(draft_logits, target_to_draft, draft_candidates, drafts, draft_logprobs, t, vocab)
        else:
            q = torch.zeros(n, k_len, vocab, device=dev).scatter_(-1, safe_drafts, valid.unsqueeze(-1).float())
        p_d = p[:, :k_len].gather(-1, safe_drafts).squeeze(-1) * valid
        q_d = q.gather(-1, safe_drafts).squeeze(-1)
        if draft_logprobs is not None:
            q_d = draft_logprobs.float().exp()
        u_accept = uniform_rows(rng_key, requests.unsqueeze(-1), pos[:k_len], STREAM_ACCEPT, 1).squeeze(-1)
        if method == "token":
            n_sampled = _leading_true((u_accept * q_d < p_d) & in_block)
            rho = torch.ones(n, device=dev)
        else:
            n_sampled, rho = _block_accept(p, q, p_d, q_d, u_accept, length, in_block)
        n_acc = torch.where(sampled, n_sampled, n_acc)

    # An accepted stop token ends acceptance right after it, with no bonus token.
    n_acc, stopped = stop_cut(drafts, stop_token_ids, n_acc)

    # The token emitted at row n_acc: a correction after a rejection, or the bonus after full acceptance.
    emitted = target_argmax.gather(1, n_acc.view(n, 1)).squeeze(1)
    if temperature is not None:
        row = n_acc.view(n, 1, 1)
        p_row = p.gather(1, row.expand(n, 1, vocab)).squeeze(1)
        q_row = q.gather(1, row.clamp(max=k_len - 1).expand(n, 1, vocab)).squeeze(1)
        full = n_acc >= length
        residual = torch.where(full.unsqueeze(-1), 0.0, (rho.unsqueeze(-1) * p_row - q_row).clamp(min=0))
        u_emit = uniform_rows(rng_key, requests, n_acc, STREAM_RESIDUAL, vocab)
        from_p = gumbel_argmax(target.gather(1, row.expand(n, 1, vocab)).squeeze(1) / t.view(n, 1), u_emit)
        from_residual = exponential_race(residual, u_emit)
        use_p = full | ~(residual.sum(-1) >= RESIDUAL_EPS)
        emitted = torch.where(sampled, torch.where(use_p, from_p, from_residual), emitted)

    n_acc = torch.where(has_rows, n_acc, 0)
    accept_mask = pos[:k_len] < n_acc.unsqueeze(-1)
    tokens = torch.full((n, k_len + 1), -1, dtype=torch.int64, device=dev)
    tokens[:, :k_len] = torch.where(accept_mask, drafts, -1)
    emit_here = (pos == n_acc.unsqueeze(-1)) & (has_rows & ~stopped).unsqueeze(-1)
    tokens = torch.where(emit_here, emitted.unsqueeze(-1), tokens)
    return tokens, n_acc.to(torch.int32), accept_mask


def target_columns(target_to_draft: Optional[torch.Tensor], draft_candidates: Optional[torch.Tensor], n: int,
                   k_len: int, width: int, vocab: int, device) -> Optional[torch.Tensor]:
    """int64 ``[N, K, V]`` (broadcastable): the draft column each target id takes, -1 for none; None when the draft
    rows are dense (column x is id x). A ``target_to_draft`` entry outside ``[0, width)`` is none; a candidate id
    outside ``[0, V)`` places its column nowhere; of several columns naming one id, the last one."""
    if target_to_draft is not None:
        col = target_to_draft.to(torch.int64)
        return torch.where((col >= 0) & (col < width), col, -1).view(1, 1, vocab)
    if draft_candidates is None:
        return None
    ids = draft_candidates.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    cols = torch.arange(width, device=device).expand(n, k_len, width)
    out = torch.full((n, k_len, vocab + 1), -1, dtype=torch.int64, device=device)   # column V: the invalid ids
    out.scatter_reduce_(2, torch.where(valid, ids, vocab), cols, "amax")
    return out[..., :vocab]


def draft_probs(draft_logits, target_to_draft, draft_candidates, drafts, draft_logprobs, t, vocab: int):
    """float32 ``[N, K, V]``: the draft distribution of each row over the target ids (module docstring). ``t``:
    ``[N, 1, 1]`` temperatures; ``drafts`` int64 ``[N, K]``."""
    n, k_len, width = draft_logits.shape
    scaled = draft_logits.float() / t
    q_cols = torch.softmax(scaled, dim=-1)                                        # [N, K, W]
    col = target_columns(target_to_draft, draft_candidates, n, k_len, width, vocab, scaled.device)
    if draft_logprobs is not None:
        valid = (drafts >= 0) & (drafts < vocab)
        at = drafts.clamp(0, vocab - 1).unsqueeze(-1)
        d_col = at if col is None else col.expand(n, k_len, vocab).gather(-1, at)
        on_row = valid.unsqueeze(-1) & (d_col >= 0)
        c = scaled.gather(-1, d_col.clamp(min=0)) - draft_logprobs.float().unsqueeze(-1)   # [N, K, 1]
        implied = on_row & torch.isfinite(c)
        q_cols = torch.where(implied, torch.exp(scaled - torch.where(implied, c, 0.0)), q_cols)
    if col is None:
        return q_cols
    placed = q_cols.gather(-1, col.clamp(min=0).expand(n, k_len, vocab))
    return torch.where(col >= 0, placed, 0.0)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` number of leading True entries of each row of ``[N, K]``."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _block_accept(p, q, p_d, q_d, eta, length, in_block):
    """Block verification: accepted length tau ``[N]`` and ``rho_tau`` ``[N]`` (see the module docstring)."""
    n, k_len = p_d.shape
    dev = p_d.device
    ratio = torch.nan_to_num(p_d / q_d, nan=0.0, posinf=float("inf"))
    rho = torch.ones(n, k_len + 1, device=dev)                                   # rho_0 .. rho_K
    for i in range(1, k_len + 1):
        rho[:, i] = torch.nan_to_num(torch.minimum(rho[:, i - 1] * ratio[:, i - 1], torch.ones(n, device=dev)), nan=0.0)
    idx = torch.arange(1, k_len + 1, device=dev)
    # S_i for i = 1..K-1 uses row i (the distributions of the token after d_i).
    res_mass = (rho[:, 1:k_len].unsqueeze(-1) * p[:, 1:k_len] - q[:, 1:k_len]).clamp(min=0).sum(-1)  # [N, K-1]
    denom = res_mass + 1 - rho[:, 1:k_len]
    h_mid = torch.where(denom > 0, res_mass / denom, (denom == 0).float())  # 0/0 -> 1; NaN -> 0 (never accept)
    h = torch.cat([h_mid, torch.zeros(n, 1, device=dev)], dim=-1)                 # h_1 .. h_K
    h = torch.where(idx == length.unsqueeze(-1), rho[:, 1:], h)                   # h_L = rho_L
    ok = (eta <= h) & in_block
    tau = torch.where(ok, idx, 0).max(dim=-1).values if k_len > 0 else torch.zeros(n, dtype=torch.int64, device=dev)
    return tau, rho.gather(1, tau.unsqueeze(-1)).squeeze(-1)


def stop_cut(drafts: torch.Tensor, stop_token_ids: Optional[torch.Tensor], n_acc: torch.Tensor):
    """An accepted stop token ends acceptance right after it: ``(n_acc, stopped)`` with ``n_acc`` cut to the first
    accepted stop token (inclusive) and ``stopped`` bool ``[N]`` where that happened. drafts int64 ``[N, K]``."""
    stopped = torch.zeros_like(n_acc, dtype=torch.bool)
    if stop_token_ids is None or stop_token_ids.numel() == 0:
        return n_acc, stopped
    k_len = drafts.shape[1]
    pos = torch.arange(k_len, device=drafts.device)
    is_stop = (drafts.unsqueeze(-1) == stop_token_ids.to(torch.int64)).any(-1) & (pos < n_acc.unsqueeze(-1))
    first_stop = torch.where(is_stop, pos, k_len).min(dim=-1).values
    stopped = first_stop < n_acc
    return torch.where(stopped, first_stop + 1, n_acc), stopped
