"""By hand (not a CI test): the DSpark proposer inside vLLM against the package's own loop, same prompts and lengths.

    DSPARK_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \\
        python -m integration_tests.vllm.compare_acceptance [--prompts 8] [--new-tokens 64] [-k 7] [--json out.json]

(from the repository root, in the venv of ``.ci/vllm.sh``). Greedy, fixed K, the first ``--prompts`` shipped
prompts. Starts two engines in this process, one after the other: vLLM without speculation, then vLLM with the
plugin's DSpark proposer. Prints, for vLLM (its own spec-decode metrics) and for the package's loop run from vLLM's
first drafting state (see ``acceptance.py`` for why that state): drafts, accepted drafts, acceptance length
``1 + accepted / drafts`` and accepted drafts per position; the package's loop as its demo reports it (tokens per
request-step on the plain prompts); how many of vLLM's proposals equal the package drafter's drafts for the same
committed tokens; vLLM's tokens/s with and without speculation (greedy, after one warm-up generate, best of
``--repeats`` timed runs); and whether the outputs are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: its proposer can be observed
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("DSPARK_VLLM", "1")


def timed(llm, prompts, n_new, repeats):
    """(greedy outputs, best tokens/s over ``repeats`` runs) after one warm-up generate."""
    from .engines import greedy
    greedy(llm, prompts[:1], 8)
    best, out = 0.0, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = greedy(llm, prompts, n_new)
        best = max(best, sum(map(len, out)) / (time.perf_counter() - t0))
    return out, best


def main(argv=None):
    from dspark_kernels.demo.demo import ASSETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="the first N shipped prompts (default 8)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=7, help="drafts per step (fixed)")
    p.add_argument("--drafter", default="dspark_vanilla", help="a drafter folder in the demo assets, or a path")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine (best is reported)")
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args(argv)
    if os.environ.get("DSPARK_VLLM") != "1":
        raise SystemExit("DSPARK_VLLM must be 1: the plugin verifies and routes the proposer's draft probabilities")
    if a.prompts < 1 or a.new_tokens < 2 or a.k < 1:
        raise SystemExit("--prompts >= 1, --new-tokens >= 2 and -k >= 1 are needed")

    from dspark_kernels.integrations import vllm as dkv

    from . import acceptance as acc
    from .engines import greedy, make_llm, release
    drafter = a.drafter if os.path.isdir(a.drafter) else os.path.join(ASSETS, a.drafter)
    with open(os.path.join(ASSETS, "prompts.json")) as fh:
        prompts = json.load(fh)["prompts"][:a.prompts]

    llm = make_llm()
    plain, plain_tps = timed(llm, prompts, a.new_tokens, a.repeats)
    release(llm)

    llm = make_llm(speculative_config=dkv.speculative_config(drafter, num_speculative_tokens=a.k))
    greedy(llm, prompts[:1], 8)  # warm-up, outside the counters
    before = acc.vllm_counters(llm, a.k)
    t0 = time.perf_counter()
    with acc.recorded_proposals() as rec:
        spec = greedy(llm, prompts, a.new_tokens)
    spec_wall = time.perf_counter() - t0
    ours = acc.vllm_counters(llm, a.k) - before
    if not rec.proposals:
        raise SystemExit("no proposals recorded: the engine core must run in this process "
                         "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    _, spec_tps = timed(llm, prompts, a.new_tokens, a.repeats)
    release(llm)

    pkg_tokens, theirs = acc.package_from_vllm_state(drafter, prompts, [o[0] for o in spec], a.new_tokens, a.k)
    reported, pkg_all, pkg_later = acc.package_as_reported(drafter, prompts, a.new_tokens, a.k)
    equal, compared, first_diff = acc.same_state_agreement(drafter, rec.proposals, a.k)

    def row(name, c):
        return (f"  {name:34s} {c.drafts:7d} {c.accepted:9d} {c.length:8.3f}   "
                + " ".join(f"{x:4d}" for x in c.per_position))
    print(f"\n{os.path.basename(drafter)}, K = {a.k} (fixed), greedy, first {len(prompts)} shipped prompts x "
          f"{a.new_tokens} new tokens")
    print(f"  {'':34s} {'drafts':>7s} {'accepted':>9s} {'length':>8s}   accepted per position 1..{a.k}")
    print(row("vLLM + DSpark proposer (metrics)", ours))
    print(row("package loop from vLLM's state", theirs))
    print(row("package loop, plain prompts", pkg_all))
    print(row("  the same without its first step", pkg_later))
    print(f"  package loop as its demo reports it: {reported:.3f} tokens per request-step (bonus included)")
    print(f"same committed tokens, same drafts: {equal} of {compared} proposals"
          + ("" if first_diff is None else f" (first difference: vLLM {first_diff[1]}, package {first_diff[2]}, "
                                           f"after {len(first_diff[0])} tokens)"))
    print(f"outputs: vLLM with speculation == without: {spec == plain}; == package loop: {pkg_tokens == spec}")
    print(f"vLLM tokens/s (greedy, batch {len(prompts)}, best of {a.repeats}): without speculation {plain_tps:.1f}, "
          f"with DSpark K={a.k} {spec_tps:.1f} ({spec_tps / plain_tps:.2f}x)")
    print(f"time in the proposer (the recorded run): {rec.calls} calls, {1e3 * rec.seconds / max(rec.calls, 1):.1f} ms "
          f"each, {100 * rec.seconds / spec_wall:.0f}% of the run's {spec_wall:.2f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"drafter": os.path.basename(drafter), "k": a.k, "prompts": len(prompts),
                       "new_tokens": a.new_tokens, "vllm": ours._asdict() | {"length": ours.length},
                       "package_from_vllm_state": theirs._asdict() | {"length": theirs.length},
                       "package_plain_prompts": pkg_all._asdict() | {"length": pkg_all.length},
                       "package_tokens_per_request_step": reported,
                       "same_state_drafts": {"equal": equal, "compared": compared},
                       "vllm_equal_no_spec": spec == plain, "vllm_equal_package": pkg_tokens == spec,
                       "vllm_tokens_per_s": {"no_spec": plain_tps, "dspark": spec_tps},
                       "proposer": {"calls": rec.calls, "seconds": rec.seconds, "run_seconds": spec_wall}},
                      fh, indent=1)
    return 0 if spec == plain == pkg_tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
