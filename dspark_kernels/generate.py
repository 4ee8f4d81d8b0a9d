"""Command line: ``python -m dspark_kernels.generate --target DIR --draft DIR --prompt "..."``.

Loads a Hugging Face target folder (config.json + safetensors + tokenizer.json) and a DSpark draft folder, decodes
speculatively and prints the text and the statistics. ``--profile-cost-table OUT.json`` times the target to build a
cost table; ``--calibrate OUT.json`` fits STS temperatures on the given prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _stop_ids(target_dir):
    ids = []
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(target_dir, name)
        if os.path.isfile(f):
            with open(f) as fh:
                eos = json.load(fh).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted(set(ids))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default; a required option has none, and an option whose default is None says in its
    own help text what happens without it (``(default: ...)``)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint folder (Qwen3 / Llama, HF layout, with "
                   "tokenizer.json)")
    p.add_argument("--draft", required=True, help="DSpark draft checkpoint folder (DeepSpec layout)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch) (default: none; "
                   "at least one is needed except with --profile-cost-table)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--mode", default="fixed", choices=["fixed", "threshold", "exact", "argmax"],
                   help="how many drafts each request verifies per step: fixed (--verify-len), threshold "
                   "(--thresholds on the confidence head's survival), exact / argmax (the scheduler on --cost-table)")
    p.add_argument("--verify-len", type=int, default=None,
                   help="fixed mode: drafts verified per step (default: the drafter's block size K)")
    p.add_argument("--thresholds", type=float, nargs="+", default=None,
                   help="threshold mode: one survival threshold per draft position (default: none; required there)")
    p.add_argument("--cost-table", default=None, help="cost table JSON, e.g. from --profile-cost-table (default: "
                   "none; required by the exact and argmax modes)")
    p.add_argument("--sts", default=None, help="STS temperatures JSON from --calibrate (default: none, the "
                   "confidence head uncalibrated)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None,
                   help="stop generation after these token ids (default: the checkpoint's eos ids)")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=list(DTYPES),
                   help="weight and activation dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "triton", "reference"],
                   help="op backend (auto: CUDA where it loads, else Triton on a GPU, else the reference)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown for --max-new-tokens >= 64)")
    p.add_argument("--profile-cost-table", metavar="OUT", default=None,
                   help="time the target, write a cost table to OUT and exit (default: off)")
    p.add_argument("--draft-cost", default=None, help="the drafting pass's cost table JSON (from "
                   "--profile-draft-cost; needs --mode exact or argmax and --cost-table): steps where drafting does "
                   "not pay run the target alone (default: none, every step drafts)")
    p.add_argument("--profile-draft-cost", metavar="OUT", default=None,
                   help="time one drafting pass for 1 to 64 requests, write its cost table to OUT and exit "
                        "(default: off)")
    p.add_argument("--profile-repeats", type=int, default=5,
                   help="--profile-cost-table / --profile-draft-cost: timed repeats per point (the median is kept)")
    p.add_argument("--calibrate", metavar="OUT", default=None,
                   help="fit STS temperatures on the prompts, write them to OUT and exit (default: off)")
    return p


def conditional_acceptance_lines(values) -> list:
    """The per-position conditional acceptance, ``n/a`` where no draft was verified at that position (NaN)."""
    line = "conditional acceptance  " + " ".join("n/a" if math.isnan(a) else f"{a:.2f}" for a in values)
    missing = [j + 1 for j, a in enumerate(values) if math.isnan(a)]
    if not missing:
        return [line]
    return [line, f"                        (n/a: no drafts verified at position{'s' if len(missing) > 1 else ''} "
                  f"{', '.join(map(str, missing))})"]


def no_drafts_explanation(args, stats):
    """One line saying why a run verified no drafts at all, or None when some were verified."""
    if stats.drafts_verified > 0:
        return None
    if args.mode == "exact":
        return ("exact mode verified no drafts: with this cost table the first draft's expected gain does not pay "
                "for its verify cost (the scheduler stops before its first admission); use --mode argmax or a cost "
                "table profiled on this machine (--profile-cost-table)")
    if args.mode == "argmax":
        return ("argmax mode verified no drafts: with this cost table no verify length's predicted throughput beats "
                "verifying none; use a cost table profiled on this machine (--profile-cost-table)")
    if args.mode == "threshold":
        return (f"threshold mode verified no drafts: no first draft's survival reached --thresholds[0] = "
                f"{args.thresholds[0]}; lower the thresholds")
    return "fixed mode verified no drafts (--verify-len 0)"


def profile(args, dec) -> int:
    """--profile-cost-table / --profile-draft-cost: time, write the table(s), print them, exit 0."""
    from .decode import profile_cost_table, profile_draft_cost
    jobs = [(args.profile_cost_table, lambda out: profile_cost_table(
                dec.target, [1, 2, 4, 8, 16, 32, 64, 128, 256], repeats=args.profile_repeats, warn=False, path=out)),
            (args.profile_draft_cost, lambda out: profile_draft_cost(
                dec, [1, 2, 4, 8, 16, 32, 64], temperature=args.temperature, repeats=args.profile_repeats,
                warn=False, path=out))]
    for out, run in jobs:
        if not out:
            continue
        table = run(out)
        if table.noisy:
            print("warning: this machine was too noisy for a trustworthy cost table (the table written is the "
                  "running maximum of the medians): " + "; ".join(table.noise), file=sys.stderr)
        print(json.dumps(table.to_dict()))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import dspark_kernels as dk
    from tokenizers import Tokenizer

    from .decode import Scheduler, SpeculativeDecoder, calibrate, load_drafter, load_target

    dtype = DTYPES[args.dtype]
    try:
        target = load_target(args.target, dtype=dtype, device=args.device)
        drafter = load_drafter(args.draft, target, dtype=dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dec = SpeculativeDecoder(target, drafter, seed=args.seed, backend=args.backend)
    if args.profile_cost_table or args.profile_draft_cost:
        return profile(args, dec)
    tok_file = os.path.join(args.target, "tokenizer.json")
    if not os.path.isfile(tok_file):
        print(f"error: {args.target!r} has no tokenizer.json", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_file(tok_file)
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    if not prompts or any(len(p) == 0 for p in prompts):
        print("error: give at least one non-empty --prompt", file=sys.stderr)
        return 2
    stops = args.stop_token_ids if args.stop_token_ids is not None else _stop_ids(args.target)
    if args.calibrate:
        res = calibrate(dec, prompts, args.max_new_tokens, temperature=args.temperature, stop_token_ids=stops,
                        path=args.calibrate)
        print(json.dumps(res))
        return 0
    sts = None
    if args.sts:
        with open(args.sts) as fh:
            sts = json.load(fh)["sts_temperatures"]
    sched = Scheduler(args.mode, verify_len=args.verify_len, thresholds=args.thresholds, sts_temperatures=sts,
                      cost_table=dk.CostTable.from_json(args.cost_table) if args.cost_table else None,
                      draft_cost=dk.CostTable.from_json(args.draft_cost) if args.draft_cost else None)
    try:
        res = dec.generate(prompts, args.max_new_tokens, temperature=args.temperature, stop_token_ids=stops,
                           scheduler=sched, progress=not args.no_progress and args.max_new_tokens >= 64)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, toks in zip(args.prompt, res.tokens):
        print(f"=== {prompt}")
        print(tokenizer.decode(toks))
    s = res.stats
    print("--- stats")
    print(f"generated tokens        {s.generated_tokens} in {s.steps} steps")
    print(f"acceptance length       {s.acceptance_length:.3f} (tokens per request-step, bonus included)")
    for line in conditional_acceptance_lines(s.conditional_acceptance):
        print(line)
    print(f"verified tokens / step  {s.verified_tokens_per_step:.2f} ({s.drafts_verified} drafts verified)")
    if args.draft_cost:
        print(f"drafting steps          {s.draft_steps} of {s.steps} (the others ran the target alone)")
    why = no_drafts_explanation(args, s)
    if why:
        print(why)
    print("time (s)                " + " ".join(f"{k}={v:.3f}" for k, v in s.time_s.items()))
    if s.warmup_steps:
        print(f"tokens / second         {s.tokens_per_second:.1f} (steady state: after the first, warm-up step; "
              f"{s.tokens_per_second_with_warmup:.1f} with it)")
    else:
        print(f"tokens / second         {s.tokens_per_second:.1f} (one step: warm-up included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
