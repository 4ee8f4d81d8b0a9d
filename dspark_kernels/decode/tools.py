"""Tools around the decode loop: the target's cost table and STS calibration of the confidence head."""

from __future__ import annotations

import json
import statistics
import time
from typing import Optional, Sequence

import torch

import dspark_kernels as dk

from .decoder import Scheduler, SpeculativeDecoder


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile_cost_table(target, token_counts: Sequence[int], *, rows_per_request: int = 8, context_len: int = 256,
                       warmup: int = 2, repeats: int = 5, fixed_overhead_ms: float = 0.0,
                       path: Optional[str] = None) -> dk.CostTable:
    """Time one target forward of B packed tokens for each B in ``token_counts`` (a verify-like batch: requests
    of ``rows_per_request`` rows, each after ``context_len`` cached positions); median of ``repeats``.
    Returns a ``dk.CostTable`` (also written as JSON to ``path``)."""
    dev = target.input_embeddings.weight.device
    times = []
    for b in token_counts:
        b = int(b)
        n = max(1, -(-b // rows_per_request))
        sizes = [b // n + (1 if r < b % n else 0) for r in range(n)]
        target.alloc_cache(n, context_len + max(sizes) + 1)
        cu = torch.tensor([0] + sizes, device=dev).cumsum(0).int()
        pos = torch.cat([torch.arange(context_len, context_len + s, device=dev) for s in sizes])
        toks = torch.randint(0, target.vocab_size, (b,), device=dev)
        samples = []
        for i in range(warmup + repeats):
            _sync(dev)
            t0 = time.perf_counter()
            target(toks, pos, cu, max(sizes), context_len + max(sizes))
            _sync(dev)
            if i >= warmup:
                samples.append((time.perf_counter() - t0) * 1e3)
        times.append(max(statistics.median(samples), 1e-6))
    table = dk.CostTable([int(b) for b in token_counts], times, fixed_overhead_ms=fixed_overhead_ms)
    if path:
        table.to_json(path)
    return table


def calibrate(decoder: SpeculativeDecoder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
              path: Optional[str] = None, **fit_kw) -> dict:
    """Decode ``prompts`` verifying every draft (scheduler "fixed"), log the confidence logits and accepted lengths
    of every request-step, and fit the STS temperatures with ``dk.fit_sts``. Returns (and writes to ``path`` as
    JSON) ``{"sts_temperatures", "ece_before", "ece_after" (per position), "rows"}``."""
    log = {}
    decoder.generate(prompts, max_new_tokens, temperature=temperature, scheduler=Scheduler("fixed"), log=log)
    active = torch.cat(log["active"])
    conf = torch.cat(log["conf_logits"])[active].float()
    acc = torch.cat(log["num_accepted"])[active].long()
    vlen = torch.cat(log["verify_lens"])[active].long()
    temps = dk.fit_sts(conf, acc, verify_lens=vlen, **fit_kw)

    def ece(t):  # per position k, over the rows that verified at least k drafts
        surv = dk.survival_from_conf(conf, t)
        return [dk.expected_calibration_error(surv[vlen >= k, k - 1], (acc[vlen >= k] >= k).float())
                for k in range(1, conf.shape[1] + 1)]

    out = {"sts_temperatures": temps.tolist(), "ece_before": ece(None), "ece_after": ece(temps),
           "rows": int(conf.shape[0])}
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=2)
    return out
