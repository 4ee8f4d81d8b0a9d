"""Tools around the decode loop: the target's and the drafter's cost tables, STS calibration of the confidence
head."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import warnings
from typing import Optional, Sequence, Tuple

import torch

import dspark_kernels as dk

from .decoder import Scheduler, SpeculativeDecoder, _CallSettings


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_timer = time.perf_counter  # a module attribute so tests can substitute a fake clock


@dataclasses.dataclass(frozen=True)
class ProfiledCostTable(dk.CostTable):
    """A ``dk.CostTable`` measured by ``profile_cost_table``, with how it was measured. ``step_time_ms`` is the
    monotone table (running maximum of the per-point medians); ``raw_median_ms`` the medians as measured;
    ``spread`` each point's IQR / median over its repeats; ``noisy`` whether the machine was too noisy for a
    trustworthy table, with the reasons in ``noise``. ``to_dict`` / ``to_json`` write the plain cost table."""
    raw_median_ms: Tuple[float, ...] = ()
    spread: Tuple[float, ...] = ()
    repeats: int = 0
    noisy: bool = False
    noise: Tuple[str, ...] = ()


def _iqr(samples) -> float:
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1


@torch.no_grad()
def profile_cost_table(target, token_counts: Sequence[int], *, rows_per_request: int = 8, context_len: int = 256,
                       warmup: int = 2, repeats: int = 5, fixed_overhead_ms: float = 0.0,
                       max_spread: float = 0.25, max_drop: float = 0.10, warn: bool = True,
                       path: Optional[str] = None) -> ProfiledCostTable:
    """Time one target forward of B packed tokens for each B in ``token_counts`` (a verify-like batch: requests
    of ``rows_per_request`` rows, each after ``context_len`` cached positions): ``warmup`` untimed runs, then the
    median of ``repeats`` timed ones. A bigger batch never costs less, so the table is made monotone
    non-decreasing (running maximum of the medians). The machine is reported too noisy (``noisy``, the reasons in
    ``noise``, and a ``warnings.warn`` unless ``warn=False``) when a point's spread, IQR / median over its
    repeats, exceeds ``max_spread``, or when a median falls more than ``max_drop`` (a fraction) below the largest
    median of the smaller counts. Returns a ``ProfiledCostTable`` (the plain table also written as JSON to
    ``path``)."""
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = target.input_embeddings.weight.device
    medians, spreads = [], []
    for b in token_counts:
        b = int(b)
        n = max(1, -(-b // rows_per_request))
        sizes = [b // n + (1 if r < b % n else 0) for r in range(n)]
        target.alloc_cache(n, context_len + max(sizes) + 1)
        cu = torch.tensor([0] + sizes, device=dev).cumsum(0).int()
        pos = torch.cat([torch.arange(context_len, context_len + s, device=dev) for s in sizes])
        toks = torch.randint(0, target.vocab_size, (b,), device=dev)
        med, spread = _median_ms(lambda: target(toks, pos, cu, max(sizes), context_len + max(sizes)), dev, warmup,
                                 int(repeats))
        medians.append(med)
        spreads.append(spread)
    return _monotone_table("profile_cost_table", token_counts, medians, spreads, int(repeats), fixed_overhead_ms,
                           max_spread, max_drop, warn, path)


@torch.no_grad()
def profile_draft_cost(decoder: SpeculativeDecoder, request_counts: Sequence[int], *, context_len: int = 256,
                       temperature: float = 0.0, warmup: int = 2, repeats: int = 5, max_spread: float = 0.25,
                       max_drop: float = 0.10, warn: bool = True, path: Optional[str] = None) -> ProfiledCostTable:
    """Time one drafting pass of ``decoder`` (the drafter's forward over each request's block after
    ``context_len`` cached positions, then ``dk.draft_block`` at ``temperature``) for each number of requests N in
    ``request_counts``: the median of ``repeats`` timed runs after ``warmup``, made monotone and checked for noise as
    :func:`profile_cost_table` does. The table's ``token_counts`` are request counts: ``Scheduler.draft_cost``.
    The caches are allocated afresh (their contents do not change the time); nothing is decoded."""
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dr = decoder.drafter
    dev = dr.fc.weight.device
    call = _CallSettings(Scheduler(), decoder._confidence(None), float(temperature), None)
    medians, spreads = [], []
    for n in request_counts:
        n = int(n)
        dr.alloc_cache(decoder.target.alloc_cache(n, context_len + dr.block_size + 1))
        anchors = torch.randint(0, decoder.target.vocab_size, (n,), device=dev)
        positions = torch.full((n,), context_len, dtype=torch.long, device=dev)
        med, spread = _median_ms(lambda: decoder._draft(anchors, positions, context_len, call, 0), dev, warmup,
                                 int(repeats))
        medians.append(med)
        spreads.append(spread)
    return _monotone_table("profile_draft_cost", request_counts, medians, spreads, int(repeats), 0.0, max_spread,
                           max_drop, warn, path)


def _median_ms(fn, dev, warmup: int, repeats: int) -> Tuple[float, float]:
    """(median milliseconds of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones, IQR / median)."""
    samples = []
    for i in range(warmup + repeats):
        _sync(dev)
        t0 = _timer()
        fn()
        _sync(dev)
        dt_ms = (_timer() - t0) * 1e3
        if i >= warmup:
            samples.append(dt_ms)
    med = max(statistics.median(samples), 1e-6)
    return med, _iqr(samples) / med


def _monotone_table(who: str, counts, medians, spreads, repeats: int, fixed_overhead_ms: float, max_spread: float,
                    max_drop: float, warn: bool, path: Optional[str]) -> ProfiledCostTable:
    counts = [int(b) for b in counts]
    monotone, noise, top = [], [], 0.0
    for b, med, spr in zip(counts, medians, spreads):
        if spr > max_spread:
            noise.append(f"B={b}: spread (IQR / median) {spr:.2f} > {max_spread:.2f}")
        if top > 0 and med < (1.0 - max_drop) * top:
            noise.append(f"B={b}: median {med:.3g} ms is {100 * (1 - med / top):.0f}% below a smaller batch's "
                         f"{top:.3g} ms")
        top = max(top, med)
        monotone.append(top)
    table = ProfiledCostTable(counts, monotone, fixed_overhead_ms=fixed_overhead_ms, raw_median_ms=tuple(medians),
                              spread=tuple(spreads), repeats=repeats, noisy=bool(noise), noise=tuple(noise))
    if noise and warn:
        warnings.warn(f"{who}: this machine is too noisy for a trustworthy cost table (the table was made "
                      "monotone; profile again on a quiet machine or with more repeats): " + "; ".join(noise),
                      RuntimeWarning, stacklevel=4)  # the caller (through torch.no_grad's wrapper)
    if path:
        table.to_json(path)
    return table


def ece_per_position(conf_logits, accepted, verify_lens, sts_temperatures=None) -> list:
    """ECE of the survival ``a_k`` (with ``sts_temperatures``, or raw) against ``accepted >= k``, per position k,
    over the rows that verified at least k drafts (logged request-steps: ``[M, K]``, ``[M]``, ``[M]``)."""
    t = None if sts_temperatures is None else torch.as_tensor(sts_temperatures, dtype=torch.float32)
    surv = dk.survival_from_conf(conf_logits.float(), t)
    return [dk.expected_calibration_error(surv[verify_lens >= k, k - 1], (accepted[verify_lens >= k] >= k).float())
            for k in range(1, conf_logits.shape[1] + 1)]


def calibrate(decoder: SpeculativeDecoder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
              stop_token_ids: Sequence[int] = (), path: Optional[str] = None, **fit_kw) -> dict:
    """Decode ``prompts`` verifying every draft (scheduler "fixed"), log the confidence logits and accepted lengths
    of every request-step, and fit the STS temperatures with ``dk.fit_sts``. A request stops at its first
    ``stop_token_ids`` token, as it will when served; a draft after an accepted stop token was never judged and is
    no observation (``observed_lens``). Returns (and writes to ``path`` as JSON) ``{"sts_temperatures",
    "ece_before", "ece_after" (per position), "rows"}``."""
    log = {}
    decoder.generate(prompts, max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids,
                     scheduler=Scheduler("fixed"), log=log)
    active = torch.cat(log["active"])
    conf = torch.cat(log["conf_logits"])[active].float()
    acc = torch.cat(log["num_accepted"])[active].long()
    vlen = torch.cat(log["observed_lens"])[active].long()
    temps = dk.fit_sts(conf, acc, verify_lens=vlen, **fit_kw)
    out = {"sts_temperatures": temps.tolist(), "ece_before": ece_per_position(conf, acc, vlen),
           "ece_after": ece_per_position(conf, acc, vlen, temps), "rows": int(conf.shape[0])}
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=2)
    return out
