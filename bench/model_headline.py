#!/usr/bin/env python
"""bench/model.py's modelled H100 / H200 time of the CUDA kernels at the headline vocabulary, from the SIMT harness's
counters at N = 1 (a MODEL, not a measurement): verify_chain (greedy; token sampling with draft logits and
draft_logprobs) at K in {7, 15}, V = 151936 bf16, and draft_block (vanilla, r = 256, bf16 W2) at K = 7.

    python bench/model_headline.py [--gpu h200] [--json PATH] [--batch N]

verify_chain runs with the warp access model (sectors and wavefronts feed the model's L2 and shared-memory terms);
draft_block without it (its harness run with the model costs an hour here), so its L2 term is the bytes requested
and its shared-memory term is absent: said in each row. Loads in flight per thread come from the kernels' designs
(:data:`LOADS_IN_FLIGHT`; the SASS tests hold the kernels to them); registers limit occupancy when the harness has
them (``DSPARK_SIMT_REGISTERS=build/check_cuda.json``: each launch's ``registers``), else not. Prints the
model's time for the bytes floor in as many launches beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import floor_model_us, model_launch  # noqa: E402

# 16-byte loads each thread has in flight, by kernel, from the kernels' designs (DESIGN.md) and their SASS tests:
# verify_chain's stats and qstats sweeps issue four LDG.E.128 per iteration (test_verify_chain's SASS tests);
# draft_block's tensor-core sweep keeps two 16 KB stages of its cp.async ring in flight per 128-thread CTA (16 per
# thread).
LOADS_IN_FLIGHT = {"verify_chain_stats": 4, "verify_chain_qstats": 4, "draft_block_kernel[mma]": 16}

V = 151936


def _verify_case(n: int, k: int, mode: str):
    """`n` requests verifying all K drafts (target randn * 2; greedy drafts: the argmax with one mismatch in the
    middle; token: drafts sampled from draft = target + randn * 2, with draft_logprobs) -> (args, kwargs)."""
    gen = torch.Generator().manual_seed(0)
    target = (torch.randn(n, k + 1, V, generator=gen) * 2).to(torch.bfloat16)
    kwargs = dict(verify_lens=torch.full((n,), k))
    if mode == "greedy":
        drafts = target[:, :k].float().argmax(-1)
        drafts[:, k // 2] = (drafts[:, k // 2] + 1) % V
        return (target, drafts), kwargs
    draft_logits = (target[:, :k].float() + torch.randn(n, k, V, generator=gen) * 2).to(torch.bfloat16)
    probs = torch.softmax(draft_logits.float().view(-1, V), -1)
    drafts = torch.multinomial(probs, 1, generator=gen).view(n, k)
    logprobs = torch.log_softmax(draft_logits.float(), -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    kwargs.update(draft_logits=draft_logits, draft_logprobs=logprobs, temperature=torch.ones(n), seed=2)
    return (target, drafts), kwargs


def verify_rows(gpu: str, n: int = 1, ks=(7, 15), access: bool = True):
    import dspark_kernels as dk
    from dspark_kernels import simt
    rows = []
    for k in ks:
        for mode in ("greedy", "token"):
            args, kwargs = _verify_case(n, k, mode)
            with simt.record(access=access) as rec:
                out = dk.verify_chain(*args, backend="cuda", **kwargs)
            rejected = int((out.num_accepted < kwargs["verify_lens"]).sum())
            floor = n * (k + 1) * V * 2 + (rejected * V * 2 if mode == "token" else 0)
            rows.append(_row("verify_chain", dict(N=n, K=k, V=V, mode=mode), rec.launches, floor, gpu, access))
    return rows


def draft_rows(gpu: str):
    import dspark_kernels as dk
    from dspark_kernels import simt
    gen = torch.Generator().manual_seed(0)
    k, r = 7, 256
    base = (torch.randn(1, k, V, generator=gen) * 2).to(torch.bfloat16)
    head = dk.MarkovHead("vanilla", w1=(torch.randn(V, r, generator=gen) * 0.05).to(torch.bfloat16),
                         w2=(torch.randn(V, r, generator=gen) * 0.05).to(torch.bfloat16))
    anchors = torch.tensor([11])
    with simt.record() as rec:
        out = dk.draft_block(base, anchors, head, temperature=0.0, seed=1, backend="cuda")
    floor = (base.numel() * 2 + k * V * r * 2 + k * r * 2 + out.tokens.numel() * 8 + out.draft_logprobs.numel() * 4)
    return [_row("draft_block", dict(N=1, K=k, V=V, r=r, mode="greedy"), rec.launches, floor, gpu, False)]


def _row(op, params, launches, floor, gpu, access):
    per = [model_launch(ln, gpu, registers=ln.get("registers"), loads_in_flight=LOADS_IN_FLIGHT.get(ln["kernel"], 1))
           for ln in launches]
    return dict(op=op, **params, launches=len(launches), access_model=access, floor_bytes=floor,
                modelled_us=round(sum(p["modelled_us"] for p in per), 2),
                floor_model_us=round(floor_model_us(floor, len(launches), gpu), 2),
                per_launch_us={ln["kernel"]: round(p["modelled_us"], 2) for ln, p in zip(launches, per)},
                bound=[p["bound"] for p in per], note="modelled (bench/model.py), not measured")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", choices=("h200", "h100"))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--batch", type=int, default=1, help="verify_chain only, at this N and K = 7")
    ap.add_argument("--no-access", action="store_true",
                    help="with --batch: without the access model (its shared-memory term is then absent and its L2 "
                         "term the bytes requested)")
    args = ap.parse_args()
    os.environ.setdefault("DSPARK_SIMT", "1")
    if args.batch == 1:
        rows = verify_rows(args.gpu) + draft_rows(args.gpu)
    else:
        rows = verify_rows(args.gpu, args.batch, ks=(7,), access=not args.no_access)
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
