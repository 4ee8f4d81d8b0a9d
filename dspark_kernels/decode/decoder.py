"""The speculative decode loop: draft -> schedule -> verify -> commit, for a batch of ragged requests.

State of request r (DESIGN "One decode step"): committed tokens ``t_1..t_S``; the anchor ``t_S`` at position
``S-1``; the target KV cache and the drafter context hold positions ``0..S-2``. Prefill runs the target over prompt
tokens ``0..P-2`` (KV + drafter context) and the last prompt token is the first anchor, so every generated token,
the first included, comes out of ``dk.verify_chain``. The hot path never synchronises with the host except
``_host_read`` once per step (the verify batch's row count, together with the stop check and progress).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

import dspark_kernels as dk

from .drafter import DSparkDrafter, check_layer_ids

SCHEDULER_MODES = ("fixed", "threshold", "exact", "argmax")


@dataclass
class Scheduler:
    """How many drafts each request verifies. fixed: ``verify_len`` (default K); threshold: the leading positions
    with survival >= ``thresholds[k]``; exact / argmax: ``dk.schedule_verify_lens`` with ``cost_table``."""
    mode: str = "fixed"
    verify_len: Optional[int] = None
    thresholds: Optional[Sequence[float]] = None
    cost_table: Optional[dk.CostTable] = None
    sts_temperatures: Optional[Sequence[float]] = None  # calibrates the confidence head (all modes)
    min_len: int = 0
    min_gain: float = 0.0


@dataclass
class GenerationStats:
    """Timing excludes one-time warm-up: the first decode step of a call (where first-call costs land: kernel
    compilation and loading, allocator growth, lazy initialisation) is the warm-up step. It is timed on its own
    (``time_s["warmup"]``, its tokens in ``warmup_tokens``) and left out of ``tokens_per_second`` and of the
    draft / verify / bookkeeping split, which cover the steps after it (``time_s["timed"]``). ``time_s["total"]``
    and ``tokens_per_second_with_warmup`` cover the whole loop. A call of a single step has no steady state: then
    ``warmup_steps`` is 0 and ``tokens_per_second`` equals ``tokens_per_second_with_warmup``. Prefill is not timed.
    ``conditional_acceptance[j]`` is NaN where no draft at position j+1 was verified after an accepted prefix."""
    steps: int = 0
    generated_tokens: int = 0
    acceptance_length: float = 0.0          # tokens committed per request-step, the bonus token included
    conditional_acceptance: List[float] = field(default_factory=list)  # P(accept d_k | d_1..d_{k-1} accepted, verified)
    verified_tokens_per_step: float = 0.0    # target rows per step (sum over the batch of L_r + 1)
    time_s: dict = field(default_factory=dict)  # draft / verify / bookkeeping / timed (after warm-up), warmup, total
    tokens_per_second: float = 0.0           # steady state: tokens of the steps after the warm-up step / their time
    tokens_per_second_with_warmup: float = 0.0  # all generated tokens / the whole loop's wall time
    warmup_steps: int = 0                    # steps left out of tokens_per_second (1, or 0 for a one-step call)
    warmup_tokens: int = 0                   # tokens those steps committed
    drafts_verified: int = 0                 # drafts sent to the target over the call (all requests, all steps)


@dataclass
class GenerationResult:
    tokens: List[List[int]]
    stats: GenerationStats


def _host_read(t: torch.Tensor) -> list:
    """The one designated device->host read of a step."""
    return t.tolist()


_now = time.perf_counter  # the host clock (a module attribute so tests can substitute a fake one)


class _Clock:
    """Phase timer: CUDA events on a GPU (read once at the end), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda, self.marks, self.warm_at = device.type == "cuda", [], None

    def mark(self, phase: Optional[str]):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((phase, ev))
        else:
            self.marks.append((phase, _now()))

    def end_warmup(self):
        """The warm-up ends at the latest mark: totals(warm=False) starts there."""
        self.warm_at = len(self.marks) - 1

    def totals(self, warm: bool = False) -> dict:
        """Phase times after the warm-up (``warm=False``; all marks if it never ended) or of the warm-up alone."""
        if self.cuda:
            torch.cuda.synchronize()
        w = self.warm_at
        if w is None:
            marks = [] if warm else self.marks
        else:
            marks = self.marks[:w + 1] if warm else self.marks[w:]
        out = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
        for (_, a), (phase, b) in zip(marks, marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[phase or "bookkeeping"] = out.get(phase or "bookkeeping", 0.0) + dt
        return out


class SpeculativeDecoder:
    def __init__(self, target, drafter: DSparkDrafter, *, kv_block_size: int = 16, max_seq_len: Optional[int] = None,
                 seed: int = 0, verify_method: str = "token", backend: str = "auto", kv_shuffle_seed=None):
        if drafter.config.backbone.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab {drafter.config.backbone.vocab_size} != target vocab {target.vocab_size}")
        check_layer_ids(drafter.config.target_layer_ids, target.num_layers)
        self.target, self.drafter = target, drafter
        self.kv_block_size, self.max_seq_len, self.seed = kv_block_size, max_seq_len, seed
        self.method, self.backend, self.kv_shuffle_seed = verify_method, backend, kv_shuffle_seed
        target.hidden_layer_ids = list(drafter.config.target_layer_ids)
        self.head, self.rank = self._markov_head()

    def _markov_head(self):
        m, w2 = self.drafter.markov_head, None
        if m is None:  # no Markov head: a zero-rank-1 head adds nothing
            v = self.target.vocab_size
            w1 = w2 = self.drafter.fc.weight.new_zeros(v, 1)
            return dk.MarkovHead("vanilla", w1, w2), 1
        kw = {}
        if m.kind == "gated":
            kw = dict(wg=m.gate_proj.weight, bg=m.gate_proj.bias)
        elif m.kind == "rnn":
            kw = dict(wj=m.joint_proj.weight, bj=m.joint_proj.bias)
        return dk.MarkovHead(m.kind, m.markov_w1.weight, m.markov_w2.weight, **kw), m.markov_w1.weight.shape[1]

    def _confidence(self, sts):
        c = self.drafter.confidence_head
        if c is None:
            return None
        w = c.proj.weight.reshape(-1)
        d = self.drafter.config.backbone.hidden_size
        w = torch.cat([w, w.new_zeros(d + self.rank - w.numel())])  # head without the Markov features
        t = None if sts is None else torch.as_tensor(sts, dtype=torch.float32, device=w.device)
        return dk.ConfidenceHead(w, c.proj.bias, t)

    def _schedule(self, s: Scheduler, d, prev_survival, k: int):
        n, dev = d.tokens.shape[0], d.tokens.device
        if s.mode == "fixed":
            return torch.full((n,), min(k, s.verify_len if s.verify_len is not None else k), dtype=torch.int32,
                              device=dev)
        if s.mode == "threshold":
            thr = torch.as_tensor(s.thresholds, dtype=torch.float32, device=dev)
            lens = (d.survival >= thr).int().cumprod(1).sum(1)
            return lens.clamp(min=s.min_len).int()
        extra = dict(budget_survival=prev_survival, min_gain=s.min_gain) if s.mode == "argmax" else {}
        return dk.schedule_verify_lens(d.survival, cost_table=s.cost_table, min_len=s.min_len, mode=s.mode,
                                       backend=self.backend, **extra).verify_lens

    def _check(self, prompts, max_new_tokens, scheduler, k):
        if not prompts:
            raise ValueError("prompts is empty")
        v = self.target.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty (a request needs at least one token)")
            if min(p) < 0 or max(p) >= v:
                raise ValueError(f"prompt {i} has token ids outside [0, {v})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = max(map(len, prompts)) + max_new_tokens + k + 1
        if self.max_seq_len is not None and need > self.max_seq_len:
            raise ValueError(f"the longest prompt ({max(map(len, prompts))} tokens) + max_new_tokens "
                             f"({max_new_tokens}) + block ({k + 1}) needs {need} cache positions, more than "
                             f"max_seq_len={self.max_seq_len}")
        if scheduler.mode not in SCHEDULER_MODES:
            raise ValueError(f"scheduler.mode must be one of {SCHEDULER_MODES}, got {scheduler.mode!r}")
        if scheduler.mode != "fixed" and self.drafter.confidence_head is None:
            raise ValueError(f"scheduler mode {scheduler.mode!r} needs a drafter with a confidence head")
        if scheduler.mode in ("exact", "argmax") and scheduler.cost_table is None:
            raise ValueError(f"scheduler mode {scheduler.mode!r} needs a cost_table")
        if scheduler.mode == "threshold" and (scheduler.thresholds is None or len(scheduler.thresholds) != k):
            raise ValueError(f"scheduler mode 'threshold' needs {k} thresholds")
        return need

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 stop_token_ids: Sequence[int] = (), scheduler: Optional[Scheduler] = None, progress: bool = False,
                 log: Optional[dict] = None) -> GenerationResult:
        """Generate for a batch of token-id prompts. ``log`` (a dict) receives per-step conf_logits, verify_lens
        and num_accepted tensors for calibration. Returns tokens (cut after the first stop token) and stats."""
        sched = scheduler or Scheduler()
        prompts = [[int(t) for t in p] for p in prompts]
        tgt, dft, k, bk = self.target, self.drafter, self.drafter.block_size, self.backend
        cap = self._check(prompts, max_new_tokens, sched, k)
        dev, n = dft.fc.weight.device, len(prompts)
        cache = tgt.alloc_cache(n, cap, block_size=self.kv_block_size, shuffle_seed=self.kv_shuffle_seed)
        dft.alloc_cache(cache)
        conf = self._confidence(sched.sts_temperatures)
        stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev) if stop_token_ids else None
        temp = float(temperature)
        lens = [len(p) for p in prompts]
        max_p = max(lens)
        # prefill: prompt tokens 0..P-2 -> target KV and drafter context; the last prompt token is the anchor
        if max_p > 1:
            toks = torch.tensor([t for p in prompts for t in p[:-1]], device=dev)
            pos = torch.tensor([i for p in prompts for i in range(len(p) - 1)], device=dev)
            req = torch.tensor([r for r, p in enumerate(prompts) for _ in range(len(p) - 1)], device=dev)
            cu = torch.tensor([0] + [n_p - 1 for n_p in lens], device=dev).cumsum(0).int()
            no_rows = torch.empty(0, dtype=torch.long, device=dev)  # prefill needs no logits
            out = tgt(toks, pos, cu, max_p - 1, max_p - 1, logit_rows=no_rows)
            dft.write_context(out.hidden, pos, cache.slots(req, pos))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        max_lens = seq_lens + max_new_tokens
        anchor = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=dev)
        finished = torch.zeros(n, dtype=torch.bool, device=dev)
        width = max_new_tokens + k + 1
        out_buf = torch.full((n * width + 1,), -1, dtype=torch.long, device=dev)  # last element: trash slot
        gen_len = torch.zeros(n, dtype=torch.long, device=dev)
        reached = torch.zeros(k, dtype=torch.long, device=dev)
        n_verified = torch.zeros(k, dtype=torch.long, device=dev)
        accepted = torch.zeros(k, dtype=torch.long, device=dev)
        kpos = torch.arange(k, device=dev)
        cols = torch.arange(k + 1, device=dev)
        rows_total = active_total = steps = warm_tokens = 0
        prev_survival = None
        bar = _progress(progress, n * max_new_tokens)
        clock = _Clock(dev)
        t0 = _now()
        clock.mark(None)
        while True:
            # 1-3: draft a block per request, choose verify lengths
            ctx_len = max_p - 1 + min(max_new_tokens, steps * (k + 1))
            base, hidden = dft.forward_block(anchor, seq_lens - 1, ctx_len)
            d = dk.draft_block(base, anchor, self.head, hidden=hidden, confidence=conf, temperature=temp,
                               seed=self.seed, offset=2 * steps, return_logits=temp > 0, backend=bk)
            vlen = torch.where(finished, 0, self._schedule(sched, d, prev_survival, k).int())
            cu = torch.nn.functional.pad((vlen + 1).cumsum(0), (1, 0)).int()
            clock.mark("draft")
            num_rows, num_active, emitted = _host_read(torch.stack([cu[-1].long(), (~finished).sum(), gen_len.sum()]))
            if steps == 1:
                warm_tokens = emitted  # committed by the warm-up step (read with this step's designated read)
            if bar is not None:
                bar.update(emitted - bar.n)
            if num_active == 0:
                break
            # 4-5: one packed ragged target forward over [anchor, d_1..d_L], then verification
            rows = torch.arange(num_rows, device=dev)
            req = torch.searchsorted(cu[1:].long(), rows, right=True)
            j = rows - cu[req]
            toks = torch.where(j == 0, anchor[req], d.tokens[req, (j - 1).clamp(min=0)])
            pos = (seq_lens[req] - 1 + j).long()
            out = tgt(toks, pos, cu, k + 1, ctx_len + k + 1)
            # draft_logprobs: the accept tests use log q(d) from the drafter, so only rejected draft rows are read
            v = dk.verify_chain(out.logits, d.tokens, cu_seqlens=cu, draft_logits=d.logits,
                                draft_logprobs=d.draft_logprobs if d.logits is not None else None, temperature=temp,
                                seed=self.seed, offset=2 * steps + 1, stop_token_ids=stops, method=self.method,
                                backend=bk)
            clock.mark("verify")
            # 6: commit. The target's paged KV needs no copy: positions past new_seq_lens - 1 are simply not read and
            # get overwritten. Finished requests emit nothing (their length limit is their current length).
            s = dk.accept_prefix_scan(v.tokens, seq_lens, num_accepted=v.num_accepted, verify_cu_seqlens=cu,
                                      block_table=cache.block_table, block_size=cache.block_size,
                                      max_seq_lens=torch.where(finished, seq_lens, max_lens), stop_token_ids=stops,
                                      backend=bk)
            clock.mark("bookkeeping")
            # The drafter context gains the hidden states of the committed rows [anchor, d_1..d_n] at their KV slots
            # (the scan's hidden_rows / kv_slots, -1 padded past cu_out[N]). A padding entry i rewrites verify row i
            # at its own slot: a committed row (the same value again) or a stale one past the committed length.
            kept = s.hidden_rows[:num_rows].long()
            src = torch.where(kept >= 0, kept, rows)
            dft.write_context(out.hidden[src], pos[src], torch.where(kept >= 0, s.kv_slots[:num_rows],
                                                                     cache.slots(req, pos)))
            clock.mark("draft")
            e = (s.cu_out[1:] - s.cu_out[:-1]).long()
            dest = torch.arange(n, device=dev).view(n, 1) * width + gen_len.view(n, 1) + cols
            dest = torch.where(cols < e.view(n, 1), dest, n * width)
            out_buf.index_copy_(0, dest.reshape(-1), v.tokens.reshape(-1))
            gen_len += e
            anchor = torch.where(e > 0, s.next_anchor, anchor)
            seq_lens = s.new_seq_lens
            n_acc = v.num_accepted.long().view(n, 1)
            verified = (kpos < vlen.view(n, 1)) & ~finished.view(n, 1)
            reached += (verified & (kpos <= n_acc)).sum(0)
            accepted += (verified & (kpos < n_acc)).sum(0)
            n_verified += verified.sum(0)
            if log is not None:
                for key, val in (("conf_logits", d.conf_logits), ("verify_lens", vlen), ("num_accepted", n_acc[:, 0]),
                                 ("active", ~finished)):
                    log.setdefault(key, []).append(val)
            finished = finished | s.finished
            prev_survival = d.survival
            rows_total, active_total, steps = rows_total + num_rows, active_total + num_active, steps + 1
            clock.mark("bookkeeping")
            if steps == 1:
                clock.end_warmup()  # step 0 is the warm-up step: timed apart (host-side mark, no sync)
        wall = _now() - t0
        if bar is not None:
            bar.close()
        tokens = _host_read(out_buf[:-1].view(n, width)[:, :max_new_tokens])
        stop_set = set(stop_token_ids)
        for r, row in enumerate(tokens):
            row = [t for t in row if t >= 0]
            cut = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
            tokens[r] = row[:cut]
        generated = sum(map(len, tokens))
        reached_l, accepted_l, verified_l = _host_read(torch.stack([reached, accepted, n_verified]))
        steady = steps > 1
        if not steady:
            clock.warm_at = None  # one step: no steady state, time the whole loop
        times = clock.totals()
        timed = sum(times.values())
        times["timed"] = timed
        times["warmup"] = sum(clock.totals(warm=True).values())
        times["total"] = wall
        with_warmup = generated / wall if wall > 0 else 0.0
        steady = steady and timed > 0
        stats = GenerationStats(
            steps=steps, generated_tokens=generated,
            acceptance_length=generated / max(active_total, 1),
            conditional_acceptance=[a / r if r else float("nan") for a, r in zip(accepted_l, reached_l)],
            verified_tokens_per_step=rows_total / max(steps, 1), time_s=times,
            tokens_per_second=max(generated - warm_tokens, 0) / timed if steady else with_warmup,
            tokens_per_second_with_warmup=with_warmup, warmup_steps=1 if steady else 0,
            warmup_tokens=warm_tokens if steady else 0, drafts_verified=int(sum(verified_l)))
        return GenerationResult(tokens, stats)


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="tok", leave=False)
