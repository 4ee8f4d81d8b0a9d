"""The decode step end to end: a Qwen3-8B-shaped bf16 target alone against the speculative step with a DSpark
drafter of the paper's shape, both replayed from CUDA graphs (dspark_kernels/decode/graphs.py).

    python bench/step.py [--tiny] [--batch 1 8 64] [--tau 1 3.6 6.2] [--out-dir DIR] [--record]

Models (random weights built on the device, nothing to download): the target has Qwen3-8B's shape (hidden 4096,
36 layers, 32 query / 8 key-value heads of 128, intermediate 12288, V = 151936, bf16); the drafter the paper's
(5 Qwen3 layers reading target layers 1, 9, 17, 25, 33, a vanilla Markov head of rank 256, a confidence head,
K = 7). The target's random weights have a planted next-token map (its LM head is a random permutation of its
embedding rows and its attention / MLP outputs are scaled by 1/64), so each greedy decision wins by a wide margin
and the verify forward, whose GEMMs round differently from the one-row decode forward, decides as the target alone
does. Prompts: 512 random tokens; 256 new tokens per request; batch 1, 8, 64.

Acceptance is FORCED (random drafters accept nothing): after draft_block the drafts are replaced by the target's
own greedy continuation (from the target-alone run), cut at a seeded position per request and step: every position
is accepted with conditional probability c, with c chosen so that verifying all K drafts gives tau tokens a step
(1 + c + ... + c^K = tau), and the scheduler (exact mode, on a cost table of this GPU's graphed verify forwards,
with the drafting gate on a measured drafting cost) sees survival c^j. Two acceptances are reported: the profile
run's, where every step drafts (``drafted_tokens_per_step``: what the forced drafts give), and the timed run's,
where the gate may run the target alone (``measured_tokens_per_step``: what the speed was measured with). On the
CPU the cost table is flat at the median of its measured times (the tiny shape's verify forwards differ by less
than the noise), so the scheduler there verifies every draft and the forced acceptance depends on no timing.

Reported per batch and tau: the target alone's tokens/s and step time against its weights-read floor (the
target's bytes less the embedding table, at this GPU's measured copy bandwidth); the speculative step's split
(drafter, draft_block, scheduler, verify forward, verify_chain, scan, the rest; a profile run with a graph per
piece); tokens/s of both and their ratio; whether the greedy outputs are equal. JSON: ``<machine>_step.json``,
``{"machine": {...}, "runs": [...]}``, written again after every run (``machine.complete`` is false until the last),
so that a run stopped by a time limit keeps what it measured. ``--tiny`` runs a tiny shape on the CPU (no graphs)
to check the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Iterator, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("DSPARK_USE_INSTALLED") != "1":  # bench/gpu_check.sh sets it to run an installed wheel
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import dspark_kernels as dk  # noqa: E402
from dspark_kernels.decode import DrafterConfig, DSparkDrafter, ModelConfig, TargetModel  # noqa: E402
from dspark_kernels.decode.decoder import Scheduler, SpeculativeDecoder  # noqa: E402
from dspark_kernels.decode.graphs import GraphDecoder, TargetAlone  # noqa: E402
from dspark_kernels.decode.model import RopeTable  # noqa: E402
from machine import machine_id, machine_info  # noqa: E402

QWEN3_8B = dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                draft_layers=5, layer_ids=(1, 9, 17, 25, 33), rank=256, prompt=512, new=256)
TINY = dict(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128,
            draft_layers=1, layer_ids=(0, 2), rank=16, prompt=16, new=16)
K = 7
SPLIT = ("drafter", "draft_block", "schedule_verify_lens", "target", "verify_chain", "accept_prefix_scan", "rest")
OPS = ("draft_block", "schedule_verify_lens", "verify_chain", "accept_prefix_scan")


def _config(s: dict, layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                       head_dim=s["head_dim"], rope_theta=1e6)


def _on_device(make, dev, dtype):
    """A module built on the meta device, then given uninitialised storage of ``dtype`` on ``dev`` (its rope table,
    which is no parameter, built again off the meta device)."""
    with torch.device("meta"):
        m = make()
    m = m.to(dtype).to_empty(device=dev).eval()
    m.rope = RopeTable(m.config.backbone if isinstance(m, DSparkDrafter) else m.config)
    return m


@torch.no_grad()
def _init_(module, gen, skip=()) -> None:
    """Norm weights 1, biases 0, every other matrix N(0, 1/fan_in) (on the device, from ``gen``)."""
    for name, p in module.named_parameters():
        if name in skip:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


@torch.no_grad()
def build_models(s: dict, dev, dtype, seed: int = 0):
    """The target (random, with the planted next-token map) and the drafter, on ``dev``."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    target = _on_device(lambda: TargetModel(_config(s, s["layers"])), dev, dtype)
    _init_(target, gen)
    target.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
    perm = torch.randperm(s["vocab"], generator=torch.Generator().manual_seed(seed)).to(dev)
    target.lm_head.weight.copy_(target.embed_tokens.weight[perm])  # next(t) = the v with perm[v] = t
    for layer in target.layers:
        layer.self_attn.o_proj.weight.mul_(1 / 64)
        layer.mlp.down_proj.weight.mul_(1 / 64)
    cfg = DrafterConfig(_config(s, s["draft_layers"]), K, s["vocab"] - 1, list(s["layer_ids"]), s["rank"],
                        "vanilla", True)
    drafter = _on_device(lambda: DSparkDrafter.for_target(cfg, target), dev, dtype)
    _init_(drafter, gen)
    return target, drafter


def conditional_acceptance(tau: float, k: int = K) -> float:
    """c with 1 + c + ... + c^k = tau (bisection; tau in [1, k + 1])."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if 1 + sum(c ** j for j in range(1, k + 1)) < tau else (lo, c)
    return (lo + hi) / 2


class ForcedAcceptance:
    """GraphDecoder's draft hook: drafts = the reference continuation up to a seeded cut, a wrong token from there;
    survival = c^j. The cut of request r at step s is the number of leading draws u < c (precomputed; the step is
    read from the draft key's offset, 2 s, on the device)."""

    def __init__(self, reference: torch.Tensor, c: float, steps: int, seed: int):
        n, dev = reference.shape[0], reference.device
        u = torch.rand(steps, n, K, generator=torch.Generator().manual_seed(seed))
        self.cuts = (u < c).int().cumprod(2).sum(2).to(dev)  # accepted drafts of (step, request)
        self.reference, self.vocab = reference, None
        self.survival = torch.tensor([c ** j for j in range(1, K + 1)], dtype=torch.float32, device=dev)
        self.cols = torch.arange(K, device=dev)

    def __call__(self, st) -> None:
        step = (st.keys[0, 1:2] // 2).clamp(max=self.cuts.shape[0] - 1)
        cut = self.cuts.index_select(0, step).view(-1, 1)
        at = (st.seq_lens.long().view(-1, 1) + self.cols).clamp(max=self.reference.shape[1] - 1)
        true = self.reference.gather(1, at)
        wrong = (true + 1) % st.base.shape[-1]
        n = true.shape[0]
        st.drafts = st.drafts._replace(tokens=torch.where(self.cols < cut, true, wrong),
                                       survival=self.survival.expand(n, K).contiguous())


def _time_ms(fn, dev, reps: int = 5) -> float:
    """Median milliseconds of fn()."""
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(dev) -> float:
    """Bytes a second of a 1 GiB device copy (read + write)."""
    nbytes = 2 ** 30 if dev.type == "cuda" else 2 ** 26
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    return 2 * nbytes / (_time_ms(lambda: y.copy_(x), dev) / 1e3)


@torch.no_grad()
def cost_table(target, n: int, context: int, capacity: int, dev) -> dk.CostTable:
    """The target's verify forward (graphed on a GPU) at each bucket N (1 + L), L = 0..K, after ``context``
    positions: the scheduler's cost table. On the CPU it is flat at the median time: the tiny shape's forwards differ
    by less than a busy machine's noise, whose spikes would otherwise decide the schedule."""
    counts, times = [], []
    target.alloc_cache(n, capacity)
    for length in range(K + 1):
        q = 1 + length
        toks = torch.zeros(n * q, dtype=torch.long, device=dev)
        pos = (context + torch.arange(q, device=dev)).repeat(n)
        cu = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev)

        def forward():
            target(toks, pos, cu, q, capacity)
        run = forward
        if dev.type == "cuda":
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            run = graph.replay
        counts.append(n * q)
        times.append(max(_time_ms(run, dev), 1e-3))
    if dev.type != "cuda":
        times = [statistics.median(times)] * len(times)
    times = [max(times[:i + 1]) for i in range(len(times))]  # never cheaper for more tokens
    return dk.CostTable(counts, times)


def _split(stats, steps: int) -> dict:
    """ms a step per part of the split profile."""
    split = stats.time_s.get("split", {})
    out = {name: 1e3 * split.get(name, 0.0) / max(steps, 1) for name in SPLIT}
    out["rest"] += 1e3 * sum(v for k, v in split.items() if k not in SPLIT) / max(steps, 1)
    return out


@torch.no_grad()
def run_batch(target, drafter, s: dict, n: int, taus, dev, bw: float, seed: int) -> Iterator[dict]:
    """Batch ``n``'s runs, one per tau, each yielded as soon as it is measured."""
    gen = torch.Generator().manual_seed(seed + n)
    prompts = torch.randint(0, s["vocab"] - 1, (n, s["prompt"]), generator=gen).tolist()
    new = s["new"]
    # the target alone (graphed): its tokens/s, step time, floor; its greedy continuation is the forced drafts' source
    alone = TargetAlone(target)
    alone.generate(prompts, new)
    ref, secs = alone.generate(prompts, new)
    target_tps = n * (new - 2) / secs
    step_ms = 1e3 * secs / (new - 2)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in target.named_parameters()
                       if not name.startswith("embed_tokens"))
    floor_ms = 1e3 * weight_bytes / bw
    del alone  # its graph and its cache (the next allocations take their memory)
    reference = torch.tensor([p + r for p, r in zip(prompts, ref)], device=dev)
    capacity = s["prompt"] + new + K + 1
    table = cost_table(target, n, s["prompt"], capacity, dev)
    dec = SpeculativeDecoder(target, drafter)
    for tau in taus:
        c = conditional_acceptance(tau)
        hook = ForcedAcceptance(reference, c, new + 2, seed + 1000 + n)
        # the split: a graph per piece, every step drafting (its drafting time is the gate's drafting cost)
        prof = GraphDecoder(dec, split=True, draft_hook=hook)
        sched = Scheduler("exact", cost_table=table)
        prof.generate(prompts, new // 4, scheduler=sched, profile=True)
        pr = prof.generate(prompts, new // 4, scheduler=sched, profile=True)
        split = _split(pr.stats, pr.stats.steps - 1)
        del prof
        draft_ms = split["drafter"] + split["draft_block"] + split["schedule_verify_lens"]
        gated = Scheduler("exact", cost_table=table, draft_cost=dk.CostTable([n], [max(draft_ms, 1e-3)]))
        spec = GraphDecoder(dec, draft_hook=hook)
        spec.generate(prompts, new, scheduler=gated)
        res = spec.generate(prompts, new, scheduler=gated)
        del spec
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        total = sum(split.values())
        st = res.stats
        run = dict(
            batch=n, tau=tau, target_tokens_per_s=round(target_tps, 1),
            spec_tokens_per_s=round(st.tokens_per_second, 1), speedup=round(st.tokens_per_second / target_tps, 3),
            ops_share=round(sum(split[o] for o in OPS) / total, 4) if total > 0 else None,
            target_floor_ratio=round(step_ms / floor_ms, 3), greedy_equal=res.tokens == ref,
            conditional_acceptance=round(c, 4), measured_tokens_per_step=round(st.acceptance_length, 3),
            drafted_tokens_per_step=round(pr.stats.acceptance_length, 3),
            target_step_ms=round(step_ms, 3), target_floor_ms=round(floor_ms, 3),
            spec_step_split_ms={k: round(v, 4) for k, v in split.items()}, drafting_steps=st.draft_steps,
            steps=st.steps, cost_table_ms=[round(t, 3) for t in table.step_time_ms])
        print(f"batch {n:3d} tau {tau:4.1f}: target {target_tps:9.1f} tok/s ({step_ms:.2f} ms, "
              f"{step_ms / floor_ms:.2f}x floor), spec {st.tokens_per_second:9.1f} tok/s "
              f"({run['speedup']:.2f}x), {st.acceptance_length:.2f} tok/step, ops {run['ops_share']}, "
              f"drafting {st.draft_steps}/{st.steps}, greedy equal {run['greedy_equal']}", flush=True)
        yield run


def measure(s: dict, batches, taus, dev, seed: int = 0, bw: Optional[float] = None,
            on_run: Optional[Callable[[list, float], None]] = None) -> Tuple[list, float]:
    """The models of shape ``s`` built on ``dev`` (bf16 on a GPU, float32 on the CPU) and every batch's runs:
    ``(runs, copy bandwidth in bytes/s)`` (``bw``, or measured here). ``on_run(runs so far, bw)`` is called after
    each run, so that a run cut short keeps what it measured."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, drafter = build_models(s, dev, dtype, seed)
    bw = bw or copy_bandwidth(dev)
    runs = []
    for n in batches:
        for run in run_batch(target, drafter, s, n, taus, dev, bw, seed):
            runs.append(run)
            if on_run is not None:
                on_run(runs, bw)
    return runs, bw


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (CPU-speed; no graphs on the CPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 8 64; tiny: 1 2)")
    ap.add_argument("--tau", type=float, nargs="+", default=[1.0, 3.6, 6.2], help="forced tokens per step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens a request (default 256; tiny: 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default=None, help="file stem (default: <machine id>); the file is <stem>_step.json")
    ap.add_argument("--record", action="store_true", help="also copy the JSON into bench/records/")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    s = dict(TINY if args.tiny else QWEN3_8B)
    s.update({key: v for key, v in (("prompt", args.prompt_len), ("new", args.new_tokens)) if v is not None})
    if s["new"] < 4:
        raise SystemExit("--new-tokens must be >= 4 (the timed steps follow two untimed ones)")
    batches = args.batch or ([1, 2] if args.tiny else [1, 8, 64])
    if any(not 1.0 <= t <= K + 1 for t in args.tau):
        raise SystemExit(f"--tau must lie in [1, {K + 1}]")
    t0 = time.perf_counter()
    info = machine_info(dev)
    info.update(shape="tiny" if args.tiny else "qwen3-8b", forced_acceptance=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{args.name or machine_id(info)}_step.json")

    def write(runs: list, bw: float, complete: bool) -> None:
        """The record as it stands: ``complete`` is false until every (batch, tau) has run, so a run stopped by a
        time limit leaves the rows it measured, marked as a part."""
        info.update(copy_bandwidth_gbs=round(bw / 1e9, 1), seconds=round(time.perf_counter() - t0, 1),
                    complete=complete)
        with open(path + ".tmp", "w") as f:
            json.dump({"machine": info, "runs": runs}, f, indent=1)
        os.replace(path + ".tmp", path)

    runs, bw = measure(s, batches, args.tau, dev, args.seed, on_run=lambda r, b: write(r, b, False))
    write(runs, bw, True)
    if args.record:
        shutil.copy(path, os.path.join(HERE, "records", os.path.basename(path)))
    print(f"wrote {path} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
