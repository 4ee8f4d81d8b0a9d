"""The speculative decode loop: draft -> schedule -> verify -> commit, for a batch of ragged requests.

State of request r (DESIGN "One decode step"): committed tokens ``t_1..t_S``; the anchor ``t_S`` at position
``S-1``; the target KV cache and the drafter context hold positions ``0..S-2``. Prefill runs the target over prompt
tokens ``0..P-2`` (KV + drafter context) and the last prompt token is the first anchor, so every generated token,
the first included, comes out of ``dk.verify_chain``. The hot path never synchronises with the host except
``_host_read`` once per step (the verify batch's row count, together with the stop check and progress).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence

import torch

import dspark_kernels as dk

from .draft_gate import DraftGate
from .drafter import DSparkDrafter, check_layer_ids

SCHEDULER_MODES = ("fixed", "threshold", "exact", "argmax")


@dataclass
class Scheduler:
    """How many drafts each request verifies. fixed: ``verify_len`` (default K); threshold: the leading positions
    with survival >= ``thresholds[k]``; exact / argmax: ``dk.schedule_verify_lens`` with ``cost_table``.

    Whether to draft at all (``draft_cost``, a ``dk.CostTable`` of one drafting pass against the number of
    requests, as ``tools.profile_draft_cost`` measures it; with ``cost_table``): see ``draft_gate.DraftGate``.
    Steps without drafting run the target alone (the bonus token only): output and losslessness are unchanged."""
    mode: str = "fixed"
    verify_len: Optional[int] = None
    thresholds: Optional[Sequence[float]] = None
    cost_table: Optional[dk.CostTable] = None
    sts_temperatures: Optional[Sequence[float]] = None  # calibrates the confidence head (all modes)
    min_len: int = 0
    min_gain: float = 0.0
    draft_cost: Optional[dk.CostTable] = None  # ms of one drafting pass by request count; None: always draft
    draft_margin: float = 0.05                 # with draft_cost: the gain over the target alone drafting must show
    draft_window: int = 32                     # with draft_cost: request-steps that judge drafting
    plain_steps: int = 16                      # with draft_cost: steps without drafting after drafting lost


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
    draft_steps: int = 0                     # steps that drafted (the others ran the target alone: draft_cost)


@dataclass
class GenerationResult:
    tokens: List[List[int]]
    stats: GenerationStats


def _host_read(t: torch.Tensor) -> list:
    """The one designated device->host read of a step."""
    return t.tolist()


_now = time.perf_counter  # the host clock (a module attribute so tests can substitute a fake one)


class _Clock:
    """Phase timer: CUDA events on a GPU (read once at the end), perf_counter on the CPU. Each mark closes a segment
    that counts toward a phase (draft / verify / bookkeeping) and names a part of it; with ``profile`` the step
    also marks its parts (drafter backbone, each op, the target forward), reported by ``split``."""

    def __init__(self, device, profile: bool = False):
        self.cuda, self.marks, self.warm_at, self.profile = device.type == "cuda", [], None, profile

    def mark(self, phase: Optional[str], part: Optional[str] = None):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((phase, part or phase, ev))
        else:
            self.marks.append((phase, part or phase, _now()))

    def detail(self, phase: str, part: str):
        """A mark that only a profiling run makes (so the default run's marks stay one per phase)."""
        if self.profile:
            self.mark(phase, part)

    def end_warmup(self):
        """The warm-up ends at the latest mark: totals(warm=False) starts there."""
        self.warm_at = len(self.marks) - 1

    def _segments(self, warm: bool):
        if self.cuda:
            torch.cuda.synchronize()
        w = self.warm_at
        if w is None:
            marks = [] if warm else self.marks
        else:
            marks = self.marks[:w + 1] if warm else self.marks[w:]
        for (_, _, a), (phase, part, b) in zip(marks, marks[1:]):
            yield phase or "bookkeeping", part or "bookkeeping", (a.elapsed_time(b) / 1e3 if self.cuda else b - a)

    def totals(self, warm: bool = False) -> dict:
        """Phase times after the warm-up (``warm=False``; all marks if it never ended) or of the warm-up alone."""
        out = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
        for phase, _, dt in self._segments(warm):
            out[phase] = out.get(phase, 0.0) + dt
        return out

    def split(self) -> dict:
        """Time per part after the warm-up (meaningful with ``profile``)."""
        out = {}
        for _, part, dt in self._segments(False):
            out[part] = out.get(part, 0.0) + dt
        return out


@dataclass
class _Batch:
    """The loop's per-request state (N requests, block K, ``width = max_new_tokens + K + 1`` output slots each)."""
    cache: object                # the target's paged KV cache (its block table gives the scan's KV slots)
    seq_lens: torch.Tensor       # int32 [N]: committed lengths S
    max_seq_lens: torch.Tensor   # int32 [N]: S + max_new_tokens at the start
    anchors: torch.Tensor        # int64 [N]: the last committed token of each request
    finished: torch.Tensor       # bool [N]
    out_tokens: torch.Tensor     # int64 [N * width + 1]: generated tokens, -1 padded; the last slot is a trash slot
    generated: torch.Tensor      # int64 [N]: tokens generated so far
    prompt_context: int          # the longest prompt's context length (its tokens minus the anchor)
    max_new_tokens: int
    width: int
    prev_survival: Optional[torch.Tensor] = None  # the previous step's survival (the argmax scheduler's budget)
    gate: Optional[DraftGate] = None  # host: whether each step drafts (Scheduler.draft_cost); None: every step


class _CallSettings(NamedTuple):
    """What one ``generate`` call fixes for all its steps."""
    scheduler: Scheduler
    confidence: Optional[dk.ConfidenceHead]
    temperature: float
    stop_token_ids: Optional[torch.Tensor]  # int64 [S] or None


class StepResult(NamedTuple):
    """One decode step: its drafts, verify lengths and (unless every request had finished) what it committed."""
    drafts: dk.DraftBlockOutput
    verify_lens: torch.Tensor                 # int32 [N], 0 for finished requests
    num_rows: int                             # rows of the packed verify batch (host value of this step's read)
    num_active: int                           # requests still running at the start of the step
    generated_before: int                     # tokens generated before the step
    drafted: bool = True                      # False: a plain step (placeholder drafts, every verify length 0)
    verified: Optional[dk.VerifyOutput] = None
    scan: Optional[dk.ScanOutput] = None


class _StatsAccumulator:
    """Acceptance counts on the device (read once at the end) and row / request counts on the host."""

    def __init__(self, k: int, device):
        # per draft position j+1: verified after an accepted prefix, accepted, verified at all
        self.reached = torch.zeros(k, dtype=torch.long, device=device)
        self.accepted = torch.zeros(k, dtype=torch.long, device=device)
        self.verified = torch.zeros(k, dtype=torch.long, device=device)
        self.positions = torch.arange(k, device=device)
        self.steps = self.rows = self.active = self.warmup_tokens = self.draft_steps = 0

    def add(self, step: StepResult, was_finished: torch.Tensor) -> None:
        n_acc = step.verified.num_accepted.long().view(-1, 1)
        verified = (self.positions < step.verify_lens.view(-1, 1)) & ~was_finished.view(-1, 1)
        # the draft after the accepted prefix is reached (judged and rejected) unless an accepted stop token ended
        # acceptance before it
        judged = (self.positions < n_acc) | ((self.positions == n_acc) & ~_ended_by_stop(step).view(-1, 1))
        self.reached += (verified & judged).sum(0)
        self.accepted += (verified & (self.positions < n_acc)).sum(0)
        self.verified += verified.sum(0)
        self.steps, self.rows, self.active = self.steps + 1, self.rows + step.num_rows, self.active + step.num_active
        self.draft_steps += int(step.drafted)

    def result(self, generated: int, clock: _Clock, wall: float) -> GenerationStats:
        reached, accepted, verified = _host_read(torch.stack([self.reached, self.accepted, self.verified]))
        steady = self.steps > 1
        if not steady:
            clock.warm_at = None  # one step: no steady state, time the whole loop
        times = clock.totals()
        timed = sum(times.values())
        times["timed"] = timed
        times["warmup"] = sum(clock.totals(warm=True).values())
        times["total"] = wall
        if clock.profile:
            times["split"] = clock.split()
        with_warmup = generated / wall if wall > 0 else 0.0
        steady = steady and timed > 0
        return GenerationStats(
            steps=self.steps, generated_tokens=generated,
            acceptance_length=generated / max(self.active, 1),
            conditional_acceptance=[a / r if r else float("nan") for a, r in zip(accepted, reached)],
            verified_tokens_per_step=self.rows / max(self.steps, 1), time_s=times,
            tokens_per_second=max(generated - self.warmup_tokens, 0) / timed if steady else with_warmup,
            tokens_per_second_with_warmup=with_warmup, warmup_steps=1 if steady else 0,
            warmup_tokens=self.warmup_tokens if steady else 0, drafts_verified=int(sum(verified)),
            draft_steps=self.draft_steps)


class SpeculativeDecoder:
    def __init__(self, target, drafter: DSparkDrafter, *, kv_block_size: int = 16, max_seq_len: Optional[int] = None,
                 seed: int = 0, verify_method: str = "token", backend: str = "auto", kv_shuffle_seed=None,
                 draft_top_k: Optional[int] = None):
        if drafter.config.backbone.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab {drafter.config.backbone.vocab_size} != target vocab {target.vocab_size}")
        check_layer_ids(drafter.config.target_layer_ids, target.num_layers)
        self.target, self.drafter = target, drafter
        self.kv_block_size, self.max_seq_len, self.seed = kv_block_size, max_seq_len, seed
        self.method, self.backend, self.kv_shuffle_seed = verify_method, backend, kv_shuffle_seed
        self.draft_top_k = draft_top_k  # top-k Markov proposals (dk.draft_block's top_k), or None
        self.head, self.rank = self._markov_head()

    def _markov_head(self):
        """The drafter's Markov head for dk.draft_block (a reduced drafter's map checked here, once)."""
        m, d2t = self.drafter.markov_head, self.drafter.draft_to_target()
        if m is None:  # no Markov head: a zero-rank-1 head adds nothing
            w1 = self.drafter.fc.weight.new_zeros(self.target.vocab_size, 1)
            w2 = self.drafter.fc.weight.new_zeros(self.drafter.draft_lm_head.shape[0], 1)
            return dk.MarkovHead("vanilla", w1, w2, draft_to_target=d2t), 1
        kw = dict(draft_to_target=d2t)
        if m.kind == "gated":
            kw.update(wg=m.gate_proj.weight, bg=m.gate_proj.bias)
        elif m.kind == "rnn":
            kw.update(wj=m.joint_proj.weight, bj=m.joint_proj.bias)
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

    def _schedule(self, s: Scheduler, drafts: dk.DraftBlockOutput, prev_survival, k: int,
                  finished: Optional[torch.Tensor] = None, room: Optional[torch.Tensor] = None):
        """Verify lengths int32 ``[N]``. A ``finished`` request verifies nothing: the cost-aware schedulers leave it
        out (``active``: neither its anchor nor its drafts count in the step's tokens), and its survival (and its
        row of the budget's, which counts whole) is 0 here. A request
        with ``room`` (int ``[N]``, tokens left before its length limit) R emits at most R tokens this step, so
        its drafts d_R.. add no expected token: their survival (and the budget's) is 0 here as well."""
        n, dev = drafts.tokens.shape[0], drafts.tokens.device
        if (finished is not None or room is not None) and drafts.survival is not None:
            live = torch.ones(n, 1, dtype=torch.bool, device=dev) if finished is None else ~finished.view(-1, 1)
            if room is not None:  # column c holds d_{c+1}: useful while c + 1 < R
                live = live & (torch.arange(k, device=dev).view(1, -1) + 1 < room.view(-1, 1))
            drafts = drafts._replace(survival=torch.where(live, drafts.survival, 0.0))
            if prev_survival is not None:
                prev_survival = torch.where(live, prev_survival, 0.0)
        if s.mode == "fixed":
            return torch.full((n,), min(k, s.verify_len if s.verify_len is not None else k), dtype=torch.int32,
                              device=dev)
        if s.mode == "threshold":
            thr = torch.as_tensor(s.thresholds, dtype=torch.float32, device=dev)
            lens = (drafts.survival >= thr).int().cumprod(1).sum(1)
            return lens.clamp(min=s.min_len).int()
        extra = dict(budget_survival=prev_survival, min_gain=s.min_gain) if s.mode == "argmax" else {}
        return dk.schedule_verify_lens(drafts.survival, cost_table=s.cost_table, min_len=s.min_len, mode=s.mode,
                                       active=None if finished is None else ~finished, backend=self.backend,
                                       **extra).verify_lens

    def _draft(self, anchors, positions, ctx_len: int, call: _CallSettings, step: int, clock=None):
        """One drafting pass: the drafter's forward over each request's block, then ``dk.draft_block``."""
        base, hidden = self.drafter.forward_block(anchors, positions, ctx_len)
        if clock is not None:
            clock.detail("draft", "drafter")
        return dk.draft_block(base, anchors, self.head, hidden=hidden, confidence=call.confidence,
                              temperature=call.temperature, seed=self.seed, offset=2 * step,
                              return_logits=call.temperature > 0, top_k=self.draft_top_k, backend=self.backend)

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
        # the verify batch is built from these lengths: a negative one gives a request no row (it never advances,
        # and the loop never ends), one past K reads drafts that do not exist
        v = scheduler.verify_len
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"scheduler.verify_len must be an int >= 0 (None: K = {k}), got {v!r}")
        m = scheduler.min_len
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= k:
            raise ValueError(f"scheduler.min_len must be an int in [0, K = {k}], got {m!r}")
        if scheduler.draft_cost is not None and scheduler.mode not in ("exact", "argmax"):
            raise ValueError(f"scheduler.draft_cost needs mode 'exact' or 'argmax' (it weighs drafting against the "
                             f"cost table), got mode {scheduler.mode!r}")
        for name in ("draft_window", "plain_steps"):
            if int(getattr(scheduler, name)) < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {getattr(scheduler, name)}")
        if not scheduler.draft_margin >= 0.0:
            raise ValueError(f"scheduler.draft_margin must be >= 0, got {scheduler.draft_margin}")
        return need

    def _prefill(self, prompts: List[List[int]], max_new_tokens: int, capacity: int,
                 reuse_caches: bool = False) -> _Batch:
        """Allocate the caches (or, with ``reuse_caches``, keep the target's and the drafter's, of this batch size
        and capacity: positions past a prompt are masked until written); run the target over prompt tokens 0..P-2
        (its KV and the drafter context); the last prompt token of each request is its first anchor."""
        dev, n, k = self.drafter.fc.weight.device, len(prompts), self.drafter.block_size
        if reuse_caches:
            cache = self.target.cache
        else:
            cache = self.target.alloc_cache(n, capacity, block_size=self.kv_block_size,
                                            shuffle_seed=self.kv_shuffle_seed)
            self.drafter.alloc_cache(cache)
        lens = [len(p) for p in prompts]
        context = max(lens) - 1
        if context > 0:
            tokens = torch.tensor([t for p in prompts for t in p[:-1]], device=dev)
            positions = torch.tensor([i for p in prompts for i in range(len(p) - 1)], device=dev)
            requests = torch.tensor([r for r, p in enumerate(prompts) for _ in range(len(p) - 1)], device=dev)
            cu = torch.tensor([0] + [n_p - 1 for n_p in lens], device=dev).cumsum(0).int()
            no_rows = torch.empty(0, dtype=torch.long, device=dev)  # prefill needs no logits
            out = self.target(tokens, positions, cu, context, context, logit_rows=no_rows)
            self.drafter.write_context(out.hidden, positions, cache.slots(requests, positions))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        width = max_new_tokens + k + 1
        return _Batch(cache=cache, seq_lens=seq_lens, max_seq_lens=seq_lens + max_new_tokens,
                      anchors=torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=dev),
                      finished=torch.zeros(n, dtype=torch.bool, device=dev),
                      out_tokens=torch.full((n * width + 1,), -1, dtype=torch.long, device=dev),
                      generated=torch.zeros(n, dtype=torch.long, device=dev),
                      prompt_context=context, max_new_tokens=max_new_tokens, width=width)

    def _plan(self, b: _Batch, step: int, ctx_len: int, call: _CallSettings, clock: _Clock):
        """(drafts, verify lengths int32 ``[N]``, whether the step drafts). A plain step (the gate's choice) drafts
        nothing: placeholder drafts, every length 0, the target alone."""
        k = self.drafter.block_size
        if b.gate is not None and not b.gate.drafts_next():
            drafts = dk.DraftBlockOutput(b.anchors.new_zeros(b.anchors.shape[0], k), None, None, None)
            return drafts, torch.zeros_like(b.seq_lens), False
        drafts = self._draft(b.anchors, b.seq_lens - 1, ctx_len, call, step, clock)
        clock.detail("draft", "draft_block")
        lens = self._schedule(call.scheduler, drafts, b.prev_survival, k, b.finished, b.max_seq_lens - b.seq_lens)
        return drafts, torch.where(b.finished, 0, lens.int()), True

    def _step(self, b: _Batch, step: int, call: _CallSettings, clock: _Clock) -> StepResult:
        """Draft, schedule, verify and scan one step (DESIGN "One decode step"). Stops after the designated read
        when every request has finished (then ``verified`` and ``scan`` are None)."""
        k, dev = self.drafter.block_size, b.seq_lens.device
        temp, stops = call.temperature, call.stop_token_ids
        # 1-3: draft a block per request, choose verify lengths
        ctx_len = b.prompt_context + min(b.max_new_tokens, step * (k + 1))
        drafts, verify_lens, drafted = self._plan(b, step, ctx_len, call, clock)
        # a running request's rows are its anchor and its L verified drafts; a finished one has none
        cu = torch.nn.functional.pad(torch.where(b.finished, 0, verify_lens + 1).cumsum(0), (1, 0)).int()
        clock.mark("draft", "schedule_verify_lens")
        num_rows, num_active, generated = _host_read(torch.stack([cu[-1].long(), (~b.finished).sum(),
                                                                  b.generated.sum()]))
        if b.gate is not None:
            b.gate.observe(generated, drafted, num_rows, num_active)
        result = StepResult(drafts, verify_lens, num_rows, num_active, generated, drafted)
        if num_active == 0:
            return result
        # 4-5: one packed ragged target forward over [anchor, d_1..d_L], then verification
        rows = torch.arange(num_rows, device=dev)
        requests = torch.searchsorted(cu[1:].long(), rows, right=True)
        j = rows - cu[requests]
        tokens = torch.where(j == 0, b.anchors[requests], drafts.tokens[requests, (j - 1).clamp(min=0)])
        positions = (b.seq_lens[requests] - 1 + j).long()
        clock.detail("verify", "rest")
        out = self.target(tokens, positions, cu, k + 1, ctx_len + k + 1)
        clock.detail("verify", "target")
        # draft_logprobs: the accept tests use log q(d) from the drafter, so only rejected draft rows are read;
        # top-k rows come with their candidates' target ids, full rows with the head's map (if any)
        mapped = drafts.logits is not None and drafts.candidates is None
        verified = dk.verify_chain(
            out.logits, drafts.tokens, cu_seqlens=cu, draft_logits=drafts.logits,
            draft_to_target=self.head.draft_to_target if mapped else None, draft_candidates=drafts.candidates,
            draft_logprobs=drafts.draft_logprobs if drafts.logits is not None else None, temperature=temp,
            seed=self.seed, offset=2 * step + 1, stop_token_ids=stops, method=self.method, backend=self.backend)
        clock.mark("verify", "verify_chain")
        # 6: commit. The target's paged KV needs no copy: positions past new_seq_lens - 1 are simply not read and
        # get overwritten. Finished requests emit nothing (their length limit is their current length).
        cache = b.cache
        scan = dk.accept_prefix_scan(verified.tokens, b.seq_lens, num_accepted=verified.num_accepted,
                                     verify_cu_seqlens=cu, block_table=cache.block_table, block_size=cache.block_size,
                                     max_seq_lens=torch.where(b.finished, b.seq_lens, b.max_seq_lens),
                                     stop_token_ids=stops, backend=self.backend)
        clock.mark("bookkeeping", "accept_prefix_scan")
        # The drafter context gains the hidden states of the committed rows [anchor, d_1..d_n] at their KV slots
        # (the scan's hidden_rows / kv_slots, -1 padded past cu_out[N]). A padding entry i rewrites verify row i
        # at its own slot: a committed row (the same value again) or a stale one past the committed length.
        kept = scan.hidden_rows[:num_rows].long()
        src = torch.where(kept >= 0, kept, rows)
        self.drafter.write_context(out.hidden[src], positions[src],
                                   torch.where(kept >= 0, scan.kv_slots[:num_rows], cache.slots(requests, positions)))
        clock.mark("draft", "drafter")
        return result._replace(verified=verified, scan=scan)

    @staticmethod
    def _commit(b: _Batch, step: StepResult) -> None:
        """Append each request's emitted tokens to its output row and advance its state."""
        n, scan, emitted_tokens = b.seq_lens.shape[0], step.scan, step.verified.tokens
        emitted = (scan.cu_out[1:] - scan.cu_out[:-1]).long()
        cols = torch.arange(emitted_tokens.shape[1], device=emitted.device)
        dest = torch.arange(n, device=emitted.device).view(n, 1) * b.width + b.generated.view(n, 1) + cols
        dest = torch.where(cols < emitted.view(n, 1), dest, n * b.width)
        b.out_tokens.index_copy_(0, dest.reshape(-1), emitted_tokens.reshape(-1))
        b.generated += emitted
        b.anchors = torch.where(emitted > 0, scan.next_anchor, b.anchors)
        b.seq_lens = scan.new_seq_lens
        b.finished = b.finished | scan.finished
        if step.drafted:
            b.prev_survival = step.drafts.survival

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 stop_token_ids: Sequence[int] = (), scheduler: Optional[Scheduler] = None, progress: bool = False,
                 log: Optional[dict] = None, profile: bool = False) -> GenerationResult:
        """Generate for a batch of token-id prompts. ``log`` (a dict) receives per-step conf_logits, verify_lens,
        num_accepted and observed_lens tensors for calibration (observed_lens: the positions k whose label
        ``num_accepted >= k`` is known: the verify length, or num_accepted where an accepted stop token ended
        acceptance and left the drafts after it unjudged). ``profile`` adds ``stats.time_s["split"]``: seconds per
        part of the steps after the warm-up (drafter, draft_block, schedule_verify_lens, target, verify_chain,
        accept_prefix_scan, rest). Returns tokens (cut after the first stop token) and stats."""
        scheduler = scheduler or Scheduler()
        prompts = [_token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        stop_token_ids = _token_ids(stop_token_ids, "stop_token_ids")
        capacity = self._check(prompts, max_new_tokens, scheduler, self.drafter.block_size)
        dev, n = self.drafter.fc.weight.device, len(prompts)
        if scheduler.mode == "threshold":  # on the device once per call: a host list copied every step syncs
            scheduler = dataclasses.replace(
                scheduler, thresholds=torch.as_tensor(scheduler.thresholds, dtype=torch.float32, device=dev))
        stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev) if stop_token_ids else None
        call = _CallSettings(scheduler, self._confidence(scheduler.sts_temperatures), float(temperature), stops)
        with _hidden_layers(self.target, self.drafter.config.target_layer_ids):
            b = self._prefill(prompts, max_new_tokens, capacity)
            if scheduler.draft_cost is not None:
                b.gate = DraftGate(scheduler.cost_table, scheduler.draft_cost, scheduler.plain_steps,
                                   scheduler.draft_window, scheduler.draft_margin)
            stats = _StatsAccumulator(self.drafter.block_size, dev)
            bar = _progress(progress, n * max_new_tokens)
            clock = _Clock(dev, profile)
            t0 = _now()
            clock.mark(None)
            while True:
                step = self._step(b, stats.steps, call, clock)
                if stats.steps == 1:
                    stats.warmup_tokens = step.generated_before  # committed by the warm-up step
                if bar is not None:
                    bar.update(step.generated_before - bar.n)
                if step.verified is None:
                    break
                was_finished = b.finished
                self._commit(b, step)
                stats.add(step, was_finished)
                if log is not None and step.drafted:
                    _log_step(log, step, was_finished)
                clock.mark("bookkeeping", "rest")
                if stats.steps == 1:
                    clock.end_warmup()  # step 0 is the warm-up step: timed apart (host-side mark, no sync)
            wall = _now() - t0
        if bar is not None:
            bar.close()
        tokens = _trim(_host_read(b.out_tokens[:-1].view(n, b.width)[:, :max_new_tokens]), set(stop_token_ids))
        return GenerationResult(tokens, stats.result(sum(map(len, tokens)), clock, wall))


def _token_ids(ids, what: str) -> List[int]:
    """``ids`` (prompt ``what``, or the stop tokens) as a list of ints: integer values that fit in int64 only (ints,
    integer numpy scalars or tensors); a float or a bool token is an error, not truncated."""
    out = []
    for t in ids:
        try:
            if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{what} has a token that is not an integer id: {t!r}") from None
        if not -2 ** 63 <= out[-1] < 2 ** 63:
            raise ValueError(f"{what} has a token outside int64: {out[-1]}")
    return out


@contextlib.contextmanager
def _hidden_layers(target, layer_ids):
    """The target returns the hidden states of the drafter's layers for the duration of a call."""
    saved = getattr(target, "hidden_layer_ids", [])
    target.hidden_layer_ids = list(layer_ids)
    try:
        yield
    finally:
        target.hidden_layer_ids = saved


def _ended_by_stop(step: StepResult) -> torch.Tensor:
    """bool ``[N]``: an accepted stop token ended the row's acceptance. verify_chain then writes no bonus token (-1
    after the stop token), and the drafts after it were never judged, neither accepted nor rejected."""
    n_acc = step.verified.num_accepted.long().view(-1, 1)
    return step.verified.tokens.gather(1, n_acc.clamp(max=step.verified.tokens.shape[1] - 1)).view(-1) < 0


def _log_step(log: dict, step: StepResult, was_finished: torch.Tensor) -> None:
    n_acc = step.verified.num_accepted.long()
    observed = torch.where(_ended_by_stop(step), n_acc, step.verify_lens.long())
    for key, val in (("conf_logits", step.drafts.conf_logits), ("verify_lens", step.verify_lens),
                     ("num_accepted", n_acc), ("observed_lens", observed), ("active", ~was_finished)):
        log.setdefault(key, []).append(val)


def _trim(rows: List[List[int]], stop_set: set) -> List[List[int]]:
    """Each request's generated tokens without the -1 padding, cut after its first stop token."""
    out = []
    for row in rows:
        row = [t for t in row if t >= 0]
        out.append(row[:next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))])
    return out


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="tok", leave=False)
