"""Reference (pure PyTorch) local pieces of a vocabulary-parallel verify_chain: the spec of the shard passes.

A shard holds target (and draft) logits for the global token ids ``[vocab_start, vocab_start + Vl)``. Three pieces,
the two passes of ``dk.verify_chain`` with the merges between them replicated on every rank:

* ``verify_stats``    (per shard)  the first exchange's buffer: argmax, softmax statistics and the logits at the
                                   drafts of every row (``layout.StatsLayout``);
* ``verify_decide``   (replicated) the gathered statistics of every shard -> ``dk.verify_chain``'s outputs and the
                                   residual plan (``layout.PLAN_*``): the rows sampling needs; called again with the
                                   second exchange, which makes the sampled outputs final;
* ``verify_residual`` (per shard)  over the planned rows: the residual's mass and race winner, and the race over p.

``verify_decide`` reproduces ``dspark_kernels.reference.verify_chain`` decision by decision; see
docs/DESIGN.md, "Vocabulary-parallel drafting and verification" for why each merge is exact.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..reference.verify_chain import RESIDUAL_EPS, gather_target_rows, packed_last_row, stop_cut
from ..rng import STREAM_ACCEPT, STREAM_RESIDUAL, uniform, uniform_rows
from . import layout as L
from .layout import StatsLayout, argmax_lowest, ids_to_slots, slots_to_ids, softmax_prob


def sampling_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """float32 [N, 1, 1]: T for sampled requests, 1 for greedy ones (the reference's softmax temperature)."""
    return torch.where(temperature > 0, temperature, 1.0).view(-1, 1, 1)


def _draft_rows(draft_tokens: torch.Tensor, vocab_start: int, local: int, vocab_size: int):
    """(valid, global safe ids, local index clamped into the shard, owned) of each draft token [N, K]; a draft
    outside [0, V) reads token 0 (and is rejected), as in the unsharded op."""
    drafts = draft_tokens.to(torch.int64)
    valid = (drafts >= 0) & (drafts < vocab_size)
    safe = torch.where(valid, drafts, 0)
    idx = safe - vocab_start
    owned = (idx >= 0) & (idx < local)
    return valid, safe, idx.clamp(0, local - 1), owned


def verify_stats(target_shard: torch.Tensor, cu_seqlens: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                 draft_logits_shard: Optional[torch.Tensor], temperature: Optional[torch.Tensor], vocab_start: int,
                 vocab_size: int) -> torch.Tensor:
    """float32 ``[N, K+1, StatsLayout.width]``: this shard's part of the first exchange (see ``layout``)."""
    n, k_len = draft_tokens.shape
    target, _ = gather_target_rows(target_shard, cu_seqlens, k_len)                 # [N, K+1, Vl]
    local = target.shape[-1]
    lay = StatsLayout(temperature is not None, draft_logits_shard is not None)
    out = torch.zeros(n, k_len + 1, lay.width, dtype=torch.float32, device=target.device)
    raw = L.nan_to_neg_inf(target)
    amax = raw.argmax(-1, keepdim=True)
    out[..., L.AMAX_VAL] = raw.gather(-1, amax).squeeze(-1)
    out[..., L.AMAX_ID] = ids_to_slots(amax.squeeze(-1) + vocab_start)
    if temperature is None:
        return out
    t = sampling_temperature(temperature)
    scaled = target / t
    _, _, idx, owned = _draft_rows(draft_tokens, vocab_start, local, vocab_size)
    no_draft = torch.full((n, 1), float("-inf"), device=target.device)   # row K has no draft
    out[..., L.T_MAX], out[..., L.T_SUM], out[..., L.T_BAD] = L.local_softmax_stats(scaled)
    at = torch.where(owned, scaled[:, :k_len].gather(-1, idx.unsqueeze(-1)).squeeze(-1), float("-inf"))
    out[..., L.T_AT] = torch.cat([at, no_draft], dim=1)
    if draft_logits_shard is not None:
        dscaled = draft_logits_shard.float() / t                                      # [N, K, Vl]
        qm, qs, qbad = L.local_softmax_stats(dscaled)
        pad = torch.zeros(n, 1, device=target.device)
        out[..., L.Q_MAX] = torch.cat([qm, no_draft], dim=1)
        out[..., L.Q_SUM] = torch.cat([qs, pad], dim=1)
        out[..., L.Q_BAD] = torch.cat([qbad, pad], dim=1)
        at = torch.where(owned, dscaled.gather(-1, idx.unsqueeze(-1)).squeeze(-1), float("-inf"))
        out[..., L.Q_AT] = torch.cat([at, no_draft], dim=1)
    return out


def packed_rows_left(cu_seqlens: Optional[torch.Tensor], num_rows: int, n: int, k_len: int, device) -> torch.Tensor:
    """int64 [N]: each request's last target row (-1: none), as ``gather_target_rows`` computes it."""
    if cu_seqlens is None:
        return torch.full((n,), k_len, dtype=torch.int64, device=device)
    return packed_last_row(cu_seqlens, num_rows, k_len)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _pick(stats: torch.Tensor, slot: int, owner: torch.Tensor) -> torch.Tensor:
    """``stats[owner[n, j], n, j, slot]`` for [P, N, J, F] stats and an owner index [N, J]."""
    return stats[..., slot].permute(1, 2, 0).gather(-1, owner.unsqueeze(-1)).squeeze(-1)


def _at_row(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``x[..., n, row[n]]`` for x [..., N, J] and row [N]."""
    idx = row.view(*([1] * (x.dim() - 2)), -1, 1).expand(*x.shape[:-1], 1)
    return x.gather(-1, idx).squeeze(-1)


def verify_decide(stats: torch.Tensor, shards: torch.Tensor, residual: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], num_rows: int, draft_tokens: torch.Tensor,
                  draft_logprobs: Optional[torch.Tensor], verify_lens: Optional[torch.Tensor],
                  survival: Optional[torch.Tensor], thresholds: Optional[torch.Tensor],
                  temperature: Optional[torch.Tensor], rng_key: torch.Tensor, stop_token_ids: Optional[torch.Tensor],
                  method: str, has_draft_logits: bool, vocab_size: int):
    """Outputs of ``dk.verify_chain`` from every shard's statistics ``stats`` [P, N, K+1, F] (shard p holds ids
    ``shards[p, 0] + [0, shards[p, 1])``), plus the residual plan [N, R, PLAN_WIDTH] (R = 0 greedy, 1 token, K+1
    block).

    Without ``residual`` the outputs are final for greedy requests; a sampled request's emitted token is -1 (and,
    for block verification, its accepted count is provisional: S_i is taken as 0) and the plan names the rows the
    second exchange must cover (token: the emitting row; block: every row 0..L, for S_i and the emission). With
    ``residual`` [P, N, R, RES_WIDTH] (the second exchange) every output is final.
    """
    n, k_len = draft_tokens.shape
    dev = draft_tokens.device
    pos = torch.arange(k_len + 1, device=dev)
    requests = torch.arange(n, device=dev)
    has_rows, length = _verify_lengths(cu_seqlens, num_rows, n, k_len, verify_lens, survival, thresholds, dev)
    in_block = pos[:k_len] < length.unsqueeze(-1)
    drafts = draft_tokens.to(torch.int64)
    valid, safe, _, _ = _draft_rows(drafts, 0, vocab_size, vocab_size)

    _, target_argmax = argmax_lowest(stats[..., L.AMAX_VAL], slots_to_ids(stats[..., L.AMAX_ID]), 0)  # [N, K+1]
    n_acc = _leading_true((drafts == target_argmax[:, :k_len]) & valid & in_block)
    plan = torch.zeros(n, 0, L.PLAN_WIDTH, device=dev)
    if temperature is not None:
        sampled = temperature > 0
        t_stats = L.merge_softmax_stats(stats[..., L.T_MAX], stats[..., L.T_SUM], stats[..., L.T_BAD])
        owner = L.owner_of(safe, shards)
        p_d = softmax_prob(_pick(stats[:, :, :k_len], L.T_AT, owner), *(x[:, :k_len] for x in t_stats)) * valid
        q_d, q_norm = valid.float(), None
        if has_draft_logits:
            q_norm = L.merge_softmax_stats(*(stats[:, :, :k_len, s] for s in (L.Q_MAX, L.Q_SUM, L.Q_BAD)))
            q_at = _pick(stats[:, :, :k_len], L.Q_AT, owner)
            q_d = softmax_prob(q_at, *q_norm)
            if draft_logprobs is not None:
                q_norm = _drafter_norm(q_norm, q_at, draft_logprobs.float(), valid)
        if draft_logprobs is not None:
            q_d = draft_logprobs.float().exp()
        u_accept = uniform_rows(rng_key, requests.unsqueeze(-1), pos[:k_len], STREAM_ACCEPT, 1).squeeze(-1)
        if method == "token":
            n_sampled = _leading_true((u_accept * q_d < p_d) & in_block)
            rho = torch.ones(n, k_len + 1, device=dev)
        else:
            rho = _block_rho(p_d, q_d)
            res_mass = (residual[..., L.RES_MASS].sum(0)[:, :k_len] if residual is not None
                        else torch.zeros(n, k_len, device=dev))
            n_sampled = _block_tau(rho, res_mass[:, 1:], u_accept, length, in_block)
        n_acc = torch.where(sampled, n_sampled, n_acc)

    n_acc, stopped = stop_cut(drafts, stop_token_ids, n_acc)

    emitted = target_argmax.gather(1, n_acc.view(n, 1)).squeeze(1)
    if temperature is not None:
        slot = torch.zeros_like(n_acc) if method == "token" else n_acc
        if method == "token":
            need = sampled & has_rows & ~stopped
            plan = _plan(n_acc.unsqueeze(-1), need.unsqueeze(-1), rho.gather(1, n_acc.view(n, 1)), t_stats, q_norm,
                         k_len)
        else:
            rows = pos.expand(n, k_len + 1)
            need = sampled.unsqueeze(-1) & has_rows.unsqueeze(-1) & (rows <= length.unsqueeze(-1))
            plan = _plan(rows, need, rho, t_stats, q_norm, k_len)
        from_res = torch.full_like(n_acc, -1)
        if residual is not None:
            from_res = _emitted(residual, requests, slot, n_acc >= length)
        emitted = torch.where(sampled, from_res, emitted)

    return _outputs(drafts, n_acc, has_rows, stopped, emitted) + (plan,)


def _drafter_norm(q_norm, q_at, logprobs, valid):
    """The draft rows' normalisers where draft_logprobs give them: (l(d) - logprob, 1, False) where that is finite
    (d on the vocabulary), else the rows' merged statistics."""
    c = q_at - logprobs
    given = valid & torch.isfinite(c)
    return (torch.where(given, c, q_norm[0]), torch.where(given, 1.0, q_norm[1]), torch.where(given, False, q_norm[2]))


def _plan(rows, need, rho, t_stats, q_norm, k_len):
    """[N, R, PLAN_WIDTH]: the plan's slots at rows ``rows`` [N, R] (the draft's normaliser from row min(row, K-1))."""
    n, slots = rows.shape
    plan = torch.zeros(n, slots, L.PLAN_WIDTH, device=rows.device)
    plan[..., L.PLAN_ROW] = rows.float()
    plan[..., L.PLAN_NEED] = need.float()
    plan[..., L.PLAN_RHO] = rho
    take = lambda x, r: x.gather(1, r)   # noqa: E731
    plan[..., L.PLAN_T_MAX], plan[..., L.PLAN_T_SUM] = take(t_stats[0], rows), take(t_stats[1], rows)
    plan[..., L.PLAN_T_BAD] = take(t_stats[2], rows).float()
    if q_norm is not None:
        qrows = rows.clamp(max=k_len - 1)
        plan[..., L.PLAN_Q_MAX], plan[..., L.PLAN_Q_SUM] = take(q_norm[0], qrows), take(q_norm[1], qrows)
        plan[..., L.PLAN_Q_BAD] = take(q_norm[2], qrows).float()
    return plan


def _emitted(residual, requests, slot, full):
    """The token emitted from the second exchange at each request's slot: the race over p after a full acceptance
    or where the residual's mass is below RESIDUAL_EPS (NaN included), else the residual's race."""
    r = residual[:, requests, slot]                                                     # [P, N, RES_WIDTH]
    _, from_res = argmax_lowest(r[..., L.RES_SCORE], slots_to_ids(r[..., L.RES_ID]), 0)
    _, from_p = argmax_lowest(r[..., L.RES_GSCORE], slots_to_ids(r[..., L.RES_GID]), 0)
    use_p = full | ~(r[..., L.RES_MASS].sum(0) >= RESIDUAL_EPS)
    return torch.where(use_p, from_p, from_res)


def _verify_lengths(cu_seqlens, num_rows, n, k_len, verify_lens, survival, thresholds, dev):
    """(has rows [N] bool, verify length L [N]): rows available, verify_lens, survival thresholds."""
    last_row = packed_rows_left(cu_seqlens, num_rows, n, k_len, dev)
    caps = [last_row.clamp(min=0)]                    # the length is the smallest of these caps
    if verify_lens is not None:
        caps.append(verify_lens.to(torch.int64).clamp(0, k_len))
    if survival is not None and thresholds is not None:
        caps.append(_leading_true(survival.float() >= thresholds.float()))
    return last_row >= 0, torch.stack(caps).amin(0)


def _outputs(drafts, n_acc, has_rows, stopped, emitted):
    """(tokens int64 [N, K+1], num_accepted int32 [N], accept_mask bool [N, K]) as dk.verify_chain lays them out."""
    n, k_len = drafts.shape
    pos = torch.arange(k_len + 1, device=drafts.device)
    n_acc = torch.where(has_rows, n_acc, 0)
    accept_mask = pos[:k_len] < n_acc.unsqueeze(-1)
    tokens = torch.full((n, k_len + 1), -1, dtype=torch.int64, device=drafts.device)
    tokens[:, :k_len] = torch.where(accept_mask, drafts, -1)
    emit_here = (pos == n_acc.unsqueeze(-1)) & (has_rows & ~stopped).unsqueeze(-1)
    tokens = torch.where(emit_here, emitted.unsqueeze(-1), tokens)
    return tokens, n_acc.to(torch.int32), accept_mask


def _block_rho(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K+1]: rho_0 = 1, rho_i = min(rho_{i-1} p_i(d_i) / q_i(d_i), 1) (NaN -> 0)."""
    n, k_len = p_d.shape
    ratio = torch.nan_to_num(p_d / q_d, nan=0.0, posinf=float("inf"))
    rho = torch.ones(n, k_len + 1, device=p_d.device)
    one = torch.ones(n, device=p_d.device)
    for i in range(1, k_len + 1):
        rho[:, i] = torch.nan_to_num(torch.minimum(rho[:, i - 1] * ratio[:, i - 1], one), nan=0.0)
    return rho


def _block_tau(rho, res_mass, eta, length, in_block) -> torch.Tensor:
    """Block verification's accepted length tau [N] from rho [N, K+1] and S_i [N, K-1] (rows 1..K-1)."""
    n, k_len = eta.shape
    dev = eta.device
    denom = res_mass + 1 - rho[:, 1:k_len]
    h_mid = torch.where(denom > 0, res_mass / denom, (denom == 0).float())   # 0/0 -> 1; NaN -> 0 (never accept)
    h = torch.cat([h_mid, torch.zeros(n, 1, device=dev)], dim=-1)
    idx = torch.arange(1, k_len + 1, device=dev)
    h = torch.where(idx == length.unsqueeze(-1), rho[:, 1:], h)                # h_L = rho_L
    return torch.where((eta <= h) & in_block, idx, 0).max(dim=-1).values


def verify_residual(target_shard: torch.Tensor, cu_seqlens: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                    draft_logits_shard: Optional[torch.Tensor], plan: torch.Tensor, temperature: torch.Tensor,
                    rng_key: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """float32 ``[N, R, RES_WIDTH]``: for each planned (request, row) with NEED set, over this shard: the mass of
    max(rho p - q, 0) and its race winner (score, global id), and the race over p (key, global id);
    (0, -inf, EMPTY_ID, -inf, EMPTY_ID) elsewhere."""
    n, k_len = draft_tokens.shape
    slots = plan.shape[1]
    dev = draft_tokens.device
    out = torch.zeros(n, slots, L.RES_WIDTH, device=dev)
    out[..., L.RES_SCORE] = out[..., L.RES_GSCORE] = float("-inf")
    out[..., L.RES_ID] = out[..., L.RES_GID] = ids_to_slots(torch.full((n, slots), L.EMPTY_ID, device=dev))
    if slots == 0:
        return out
    target, _ = gather_target_rows(target_shard, cu_seqlens, k_len)
    local = target.shape[-1]
    t = sampling_temperature(temperature)
    row = plan[..., L.PLAN_ROW].to(torch.int64).clamp(0, k_len)
    qrow = row.clamp(max=k_len - 1)
    ids = vocab_start + torch.arange(local, device=dev)
    stat = lambda *s: (plan[..., s[0], None], plan[..., s[1], None], plan[..., s[2], None] > 0)  # noqa: E731
    x = target.gather(1, row.unsqueeze(-1).expand(n, slots, local)) / t
    p = softmax_prob(x, *stat(L.PLAN_T_MAX, L.PLAN_T_SUM, L.PLAN_T_BAD))
    if draft_logits_shard is not None:
        d = draft_logits_shard.float().gather(1, qrow.unsqueeze(-1).expand(n, slots, local)) / t
        q = softmax_prob(d, *stat(L.PLAN_Q_MAX, L.PLAN_Q_SUM, L.PLAN_Q_BAD))
    else:
        valid, safe, _, _ = _draft_rows(draft_tokens, 0, vocab_size, vocab_size)
        q = ((ids == safe.gather(1, qrow).unsqueeze(-1)) & valid.gather(1, qrow).unsqueeze(-1)).float()
    w = (plan[..., L.PLAN_RHO, None] * p - q).clamp(min=0)
    u = uniform(rng_key, torch.arange(n, device=dev).view(n, 1, 1), row.unsqueeze(-1), STREAM_RESIDUAL, ids)
    need = plan[..., L.PLAN_NEED] > 0
    out[..., L.RES_MASS] = torch.where(need, w.sum(-1), 0.0)
    for score, s_slot, i_slot in ((w / -torch.log(u), L.RES_SCORE, L.RES_ID),
                                  (x - torch.log(-torch.log(u)), L.RES_GSCORE, L.RES_GID)):
        best, col = argmax_lowest(score, torch.arange(local, device=dev).expand_as(score), -1)
        out[..., s_slot] = torch.where(need, best, float("-inf"))
        out[..., i_slot] = ids_to_slots(torch.where(need, col + vocab_start, L.EMPTY_ID))
    return out
