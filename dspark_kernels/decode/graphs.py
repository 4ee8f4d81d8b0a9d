"""The speculative step replayed from CUDA graphs (gpt-fast / vLLM style), with SpeculativeDecoder's tokens.

A step of ``SpeculativeDecoder`` (decoder.py, "One decode step" in DESIGN) is cut into pieces over static tensors:

* the drafting group: the drafter's forward, ``dk.draft_block``, the scheduler, the verify batch's rows (all
  N (K+1) of them: rows past the batch are padding). Then the step's one host read, ``[rows, running requests,
  generated tokens]`` (the eager loop's), picks the bucket: the smallest of ``buckets`` that holds the rows;
* the bucket's group: the target's forward over the bucket's rows (padding rows write the cache's trash slot),
  ``dk.verify_chain``, ``dk.accept_prefix_scan`` and the commit (outputs, lengths, anchors, the drafter context,
  the acceptance counts, the random keys' offsets bumped in place: the draft key is ``keys[0]`` = (seed,
  2 step), the verify key ``keys[1]`` = (seed, 2 step + 1), as the eager loop numbers them).

On a GPU (``graphs=True``) each group is captured the first time it is needed (the drafting group per drafting
mode; a bucket's group per bucket and drafting group, since it reads that group's outputs where its capture put
them; the first step runs eagerly, so every kernel is loaded before a capture) and replayed after; ``split=True``
captures each piece on its own instead, so a profile can time them. After a replay the state's tensors are those
the replayed group's capture bound, so a group captured next reads what the last replay wrote. Every tensor the
graphs read is held by the decoder's ``_Setup``, but the models' weights: a second ``generate`` whose step holds the
same constants (batch size, capacity, the settings of ``_Setup``'s key, every weight where it was: ``_weights_key``)
copies its own values (the seed, the stop ids, the confidence head, the thresholds) into the setup's tensors and
replays the graphs already captured. Weights changed in place (``load_state_dict``, ``copy_``) are read by the
replays; a weight replaced by a new tensor makes the next call capture again. On the CPU the same pieces run
eagerly. With ``static_kv`` (graphs' default) the drafter and the target read keys up to the cache's capacity
(masked past each request's length); without it, up to the eager loop's per-step bound, which gives the eager
loop's exact rounding.

The drafting gate (``Scheduler.draft_cost``) works as in the eager loop: a plain step replays the plain group
(placeholder drafts, every verify length 0) and its bucket of N rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import dspark_kernels as dk

from .decoder import (GenerationResult, Scheduler, SpeculativeDecoder, _CallSettings, _Clock, _hidden_layers,
                      _StatsAccumulator, _token_ids, _trim)
from .draft_gate import DraftGate
from .model import TargetModel

Piece = Tuple[str, Callable[[], None]]
PHASE = {"drafter": "draft", "draft_block": "draft", "draft_hook": "draft", "schedule_verify_lens": "draft",
         "rows": "draft", "plain": "draft", "target": "verify", "verify_chain": "verify", "accept_prefix_scan": "bookkeeping",
         "commit": "bookkeeping"}
PART = {"rows": "rest", "plain": "rest", "commit": "rest", "draft_hook": "draft_hook"}  # the eager loop's names for the time split


def _host_read(t: torch.Tensor) -> list:
    """The one designated device->host read of a step."""
    return t.tolist()


def default_buckets(n: int, k: int) -> List[int]:
    """Verify-row buckets of a batch of n requests, block k: n (1 + L) rows for L = 0..k."""
    return [n * (1 + length) for length in range(k + 1)]


def pick_bucket(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``rows`` rows."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"{rows} verify rows exceed the largest bucket {max(buckets)}")


class StepState:
    """The static tensors of a batch's steps (N requests, block K, ``width`` output slots per request). The
    persistent ones (``PERSISTENT``) carry state between steps and are only ever written in place; the others are
    rebound by the pieces (a capture binds them to the graph's own tensors)."""

    PERSISTENT = ("anchors", "seq_lens", "max_seq_lens", "finished", "out_tokens", "generated", "prev_survival",
                  "keys", "reached", "accepted", "verified_drafts", "read")

    def __init__(self, n: int, k: int, width: int, dev: torch.device):
        long = dict(dtype=torch.long, device=dev)
        self.n, self.k, self.width = n, k, width
        self.anchors = torch.zeros(n, **long)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.max_seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.finished = torch.zeros(n, dtype=torch.bool, device=dev)
        self.out_tokens = torch.full((n * width + 1,), -1, **long)
        self.generated = torch.zeros(n, **long)
        self.prev_survival = torch.zeros(n, k, dtype=torch.float32, device=dev)
        self.keys = torch.zeros(2, 2, **long)  # (seed, offset) of the draft and verify keys
        self.key_step = torch.tensor([[0, 2], [0, 2]], **long)
        self.reached, self.accepted, self.verified_drafts = (torch.zeros(k, **long) for _ in range(3))
        self.read = torch.zeros(3, **long)  # rows, running requests, generated tokens
        self.draft_positions = torch.arange(k, device=dev)
        self.all_rows = torch.arange(n * (k + 1), device=dev)

    def load(self, b, seed: int) -> None:
        """Start from a prefilled batch (``decoder._Batch``), the keys at (seed, 0) and (seed, 1)."""
        for name in ("anchors", "seq_lens", "max_seq_lens", "finished", "out_tokens", "generated"):
            getattr(self, name).copy_(getattr(b, name))
        self.keys[:, 0] = seed
        self.keys[:, 1] = torch.arange(2, device=self.keys.device)
        for t in (self.prev_survival, self.reached, self.accepted, self.verified_drafts):
            t.zero_()

    def snapshot(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name).clone() for name in self.PERSISTENT}

    def restore(self, saved: Dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            getattr(self, name).copy_(t)


class _Runner:
    """Runs groups of pieces: eagerly, or from CUDA graphs captured on first use (one shared memory pool)."""

    def __init__(self, state: StepState, capture: bool, split: bool):
        self.state, self.capture, self.split = state, capture, split
        self.graphs: Dict[tuple, list] = {}
        self.pool = None

    def run(self, key: tuple, pieces: List[Piece], done: Callable[[str], None]) -> None:
        if not self.capture:
            for name, fn in pieces:
                fn()
                done(name)
            return
        if key not in self.graphs:
            self.graphs[key] = self._capture(pieces)
        for name, graph, _ in self.graphs[key]:
            graph.replay()
            done(name)
        # the replay wrote into the tensors its capture bound: a group captured next must read those
        vars(self.state).update(self.graphs[key][-1][2])

    def _capture(self, pieces: List[Piece]) -> list:
        saved = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up run (the state is restored after it)
            for _, fn in pieces:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.state.restore(saved)
        out = []
        for group in ([[p] for p in pieces] if self.split else [pieces]):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                for _, fn in group:
                    fn()
            self.pool = graph.pool()
            # the tensors the capture bound stay alive with the graph (later captures never reuse them)
            out.append((group[-1][0] if self.split else None, graph, dict(vars(self.state))))
        return out


def _weights_key(*models) -> tuple:
    """What a captured step holds of the models' weights: each parameter's and buffer's address, shape, strides
    and dtype (a model that is not an ``nn.Module`` is searched one attribute deep, as ``HFTarget.model``). A weight
    replaced by another tensor, not copied into, changes the key, so the step is captured again."""
    mods = [m for x in models for m in ([x] if isinstance(x, torch.nn.Module) else vars(x).values())
            if isinstance(m, torch.nn.Module)]
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                 for m in mods for t in itertools.chain(m.parameters(), m.buffers()))


def _call_tensors(call: _CallSettings, dev) -> Dict[str, Optional[torch.Tensor]]:
    """The tensors a call gives the step (None where it has none)."""
    s, c = call.scheduler, call.confidence or dk.ConfidenceHead(None, None)
    thresholds = torch.as_tensor(s.thresholds, dtype=torch.float32, device=dev) if s.mode == "threshold" else None
    return {"stops": call.stop_token_ids, "thresholds": thresholds, "conf_weight": c.weight, "conf_bias": c.bias,
            "sts": c.sts_temperatures}


class _Setup:
    """What a ``GraphDecoder`` keeps between calls: the state, the runner and its graphs, the caches they write,
    and every tensor they read that a call gives: copies of the call's tensors (``_call_tensors``), which each call
    refreshes, and the first call's cost table (equal to every later call's, by ``key``), whose device copies the
    scheduler reads. ``key``: what the captured step holds as constants; a call of an equal key runs on this setup
    with its values copied in (``refresh``) and its seed loaded into the state's keys (``StepState.load``)."""

    def __init__(self, key: tuple, st: StepState, runner: _Runner, tensors: dict, cost_table):
        self.key, self.st, self.runner, self.caches = key, st, runner, (None, None)
        self.buffers = {name: None if t is None else t.clone() for name, t in tensors.items()}
        self.cost_table = cost_table

    def refresh(self, call: _CallSettings, tensors: dict) -> _CallSettings:
        """The settings the step reads: ``call``'s, its tensors copied into this setup's."""
        b = self.buffers
        for name, t in tensors.items():
            if t is not None:
                b[name].copy_(t)
        conf = None if b["conf_weight"] is None else dk.ConfidenceHead(b["conf_weight"], b["conf_bias"], b["sts"])
        s = dataclasses.replace(call.scheduler, thresholds=b["thresholds"], cost_table=self.cost_table)
        return call._replace(scheduler=s, confidence=conf, stop_token_ids=b["stops"])


class GraphDecoder:
    """``SpeculativeDecoder.generate`` with the step replayed from CUDA graphs (see the module docstring).

    ``buckets``: verify-row bucket sizes (default ``default_buckets``; the largest must hold N (K+1) rows).
    ``graphs``: capture (default: on a CUDA device). ``split``: a graph per piece (for ``profile``).
    ``static_kv``: read keys up to the capacity (default: as ``graphs``). ``draft_hook(state)``: called after
    ``draft_block`` inside the drafting group (device work only), e.g. to force drafts in a benchmark.
    """

    def __init__(self, dec: SpeculativeDecoder, *, buckets: Optional[Sequence[int]] = None,
                 graphs: Optional[bool] = None, split: bool = False, static_kv: Optional[bool] = None,
                 draft_hook: Optional[Callable[[StepState], None]] = None):
        self.dec, self.buckets_arg, self.graphs_arg = dec, buckets, graphs
        self.split, self.static_kv_arg, self.draft_hook = split, static_kv, draft_hook
        self._setup: Optional[_Setup] = None  # the last call's: reused by a call of the same key

    # ---------------------------------------------------------------------------------------------- the pieces
    def _draft_pieces(self, st: StepState, call: _CallSettings, drafted: bool, kv: int, has_prev: bool
                      ) -> List[Piece]:
        dec, n, k = self.dec, st.n, st.k

        def drafter():
            st.base, st.hidden_k = dec.drafter.forward_block(st.anchors, st.seq_lens - 1, kv)

        def draft_block():
            st.drafts = dk.draft_block(st.base, st.anchors, dec.head, hidden=st.hidden_k, confidence=call.confidence,
                                       temperature=call.temperature, seed=st.keys[0, 0:1], offset=st.keys[0, 1:2],
                                       return_logits=call.temperature > 0, top_k=dec.draft_top_k,
                                       backend=dec.backend)

        def schedule():  # the thresholds are already on the device (_Setup.refresh)
            lens = dec._schedule(call.scheduler, st.drafts, st.prev_survival if has_prev else None, k, st.finished,
                                 st.max_seq_lens - st.seq_lens)
            st.lens = torch.where(st.finished, 0, lens.int())

        def plain():
            st.drafts = dk.DraftBlockOutput(st.anchors.new_zeros(n, k), None, None, None)
            st.lens = torch.zeros_like(st.seq_lens)

        def rows():
            # a running request's rows are its anchor and its verified drafts; a finished one has none
            st.cu = torch.nn.functional.pad(torch.where(st.finished, 0, st.lens + 1).cumsum(0), (1, 0)).int()
            cu = st.cu.long()
            req = torch.searchsorted(cu[1:], st.all_rows, right=True).clamp(max=n - 1)
            j = st.all_rows - cu[req]
            draft = st.drafts.tokens[req, (j - 1).clamp(0, k - 1)]
            st.row_tokens = torch.where(j == 0, st.anchors[req], draft)
            st.row_pos = (st.seq_lens[req] - 1 + j).long()
            st.read.copy_(torch.stack([cu[-1], (~st.finished).sum(), st.generated.sum()]))

        if not drafted:
            return [("plain", plain), ("rows", rows)]
        hook = [("draft_hook", lambda: self.draft_hook(st))] if self.draft_hook is not None else []
        return [("drafter", drafter), ("draft_block", draft_block)] + hook + [
            ("schedule_verify_lens", schedule), ("rows", rows)]

    def _bucket_pieces(self, st: StepState, call: _CallSettings, bucket: int, drafted: bool, kv: int
                       ) -> List[Piece]:
        dec, n, k = self.dec, st.n, st.k
        cache = dec.target.cache

        def target():
            st.out = dec.target(st.row_tokens[:bucket], st.row_pos[:bucket], st.cu, k + 1, kv + k + 1, padded=True)

        def verify():
            d = st.drafts
            mapped = d.logits is not None and d.candidates is None
            st.verified = dk.verify_chain(
                st.out.logits, d.tokens, cu_seqlens=st.cu, draft_logits=d.logits,
                draft_to_target=dec.head.draft_to_target if mapped else None, draft_candidates=d.candidates,
                draft_logprobs=d.draft_logprobs if d.logits is not None else None, temperature=call.temperature,
                seed=st.keys[1, 0:1], offset=st.keys[1, 1:2], stop_token_ids=call.stop_token_ids,
                method=dec.method, backend=dec.backend)

        def scan():
            st.scan = dk.accept_prefix_scan(
                st.verified.tokens, st.seq_lens, num_accepted=st.verified.num_accepted, verify_cu_seqlens=st.cu,
                block_table=cache.block_table, block_size=cache.block_size,
                max_seq_lens=torch.where(st.finished, st.seq_lens, st.max_seq_lens),
                stop_token_ids=call.stop_token_ids, backend=dec.backend)

        def commit():
            sc, ver = st.scan, st.verified
            # the drafter context gains the committed verify rows [anchor, d_1..d_n] (the scan's hidden_rows and
            # kv_slots, -1 past its end: those entries write the trash slot)
            kept = sc.hidden_rows.long()
            keep = kept >= 0
            src = torch.where(keep, kept, 0)
            dec.drafter.write_context(st.out.hidden[src], st.row_pos[src],
                                      torch.where(keep, sc.kv_slots, dec.drafter.cache.trash_slot))
            # acceptance counts (the eager loop's _StatsAccumulator.add)
            n_acc = ver.num_accepted.long().view(-1, 1)
            verified = (st.draft_positions < st.lens.view(-1, 1)) & ~st.finished.view(-1, 1)
            st.reached += (verified & (st.draft_positions <= n_acc)).sum(0)
            st.accepted += (verified & (st.draft_positions < n_acc)).sum(0)
            st.verified_drafts += verified.sum(0)
            # the eager loop's _commit, in place
            emitted = (sc.cu_out[1:] - sc.cu_out[:-1]).long()
            cols = torch.arange(ver.tokens.shape[1], device=emitted.device)
            dest = torch.arange(n, device=emitted.device).view(n, 1) * st.width + st.generated.view(n, 1) + cols
            dest = torch.where(cols < emitted.view(n, 1), dest, n * st.width)
            st.out_tokens.index_copy_(0, dest.reshape(-1), ver.tokens.reshape(-1))
            st.generated += emitted
            st.anchors.copy_(torch.where(emitted > 0, sc.next_anchor, st.anchors))
            st.seq_lens.copy_(sc.new_seq_lens)
            st.finished |= sc.finished
            if drafted:
                st.prev_survival.copy_(st.drafts.survival)
            st.keys += st.key_step

        return [("target", target), ("verify_chain", verify), ("accept_prefix_scan", scan), ("commit", commit)]

    # ---------------------------------------------------------------------------------------------- the loop
    def _prepare(self, call: _CallSettings, n: int, capacity: int, max_new_tokens: int, dev, graphs: bool
                 ) -> Tuple[_Setup, _CallSettings, bool]:
        """The setup of this call (the last call's when the key is the same and the caches its graphs write are
        still the target's and the drafter's, else a new one), the settings the step reads, and whether the setup
        is the last call's."""
        dec, s, tensors = self.dec, call.scheduler, _call_tensors(call, dev)
        layout = tuple((name, t if t is None else (t.shape, t.dtype)) for name, t in tensors.items())
        key = (n, capacity, max_new_tokens, graphs, self.split, self.draft_hook, call.temperature, layout, s.mode,
               s.verify_len, s.min_len, s.min_gain, s.cost_table, dec.draft_top_k, dec.method, dec.backend,
               _weights_key(dec.target, dec.drafter))
        old = self._setup
        reuse = (old is not None and old.key == key
                 and all(a is b for a, b in zip(old.caches, (dec.target.cache, dec.drafter.cache))))
        if not reuse:
            k = dec.drafter.block_size
            st = StepState(n, k, max_new_tokens + k + 1, dev)
            self._setup = _Setup(key, st, _Runner(st, graphs, self.split), tensors, s.cost_table)
        return self._setup, self._setup.refresh(call, tensors), reuse

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 stop_token_ids: Sequence[int] = (), scheduler: Optional[Scheduler] = None,
                 profile: bool = False) -> GenerationResult:
        """As ``SpeculativeDecoder.generate`` (without ``log`` and ``progress``). ``profile``: the time split of
        ``stats.time_s["split"]`` per piece (meaningful with ``split=True`` when graphs are captured)."""
        dec = self.dec
        if not isinstance(dec.target, TargetModel):
            raise ValueError(f"the graph path needs a TargetModel target (a paged cache it can pad into), got "
                             f"{type(dec.target).__name__}; use SpeculativeDecoder.generate")
        scheduler = scheduler or Scheduler()
        prompts = [_token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        stop_token_ids = _token_ids(stop_token_ids, "stop_token_ids")
        k, dev, n = dec.drafter.block_size, dec.drafter.fc.weight.device, len(prompts)
        capacity = dec._check(prompts, max_new_tokens, scheduler, k)
        stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev) if stop_token_ids else None
        call = _CallSettings(scheduler, dec._confidence(scheduler.sts_temperatures), float(temperature), stops)
        graphs = dev.type == "cuda" if self.graphs_arg is None else bool(self.graphs_arg)
        buckets = sorted(self.buckets_arg or default_buckets(n, k))
        if buckets[-1] < n * (k + 1):
            raise ValueError(f"the largest bucket ({buckets[-1]}) must hold N (K+1) = {n * (k + 1)} rows")
        setup, call, reuse = self._prepare(call, n, capacity, max_new_tokens, dev, graphs)
        st = setup.st
        with _hidden_layers(dec.target, dec.drafter.config.target_layer_ids):
            b = dec._prefill(prompts, max_new_tokens, capacity, reuse_caches=reuse)
            setup.caches = (dec.target.cache, dec.drafter.cache)
            st.load(b, dec.seed)
            stats, clock = _StatsAccumulator(k, dev), _Clock(dev, profile)
            t0 = time.perf_counter()
            clock.mark(None)
            static_kv = graphs if self.static_kv_arg is None else bool(self.static_kv_arg)
            bound = (lambda step: capacity - k - 1) if static_kv else (
                lambda step: b.prompt_context + min(max_new_tokens, step * (k + 1)))
            self._loop(st, setup.runner, call, buckets, bound, static_kv, reuse, stats, clock)
            wall = time.perf_counter() - t0
        stats.reached, stats.accepted, stats.verified = st.reached, st.accepted, st.verified_drafts
        tokens = _trim(_host_read(st.out_tokens[:-1].view(n, st.width)[:, :max_new_tokens]), set(stop_token_ids))
        return GenerationResult(tokens, stats.result(sum(map(len, tokens)), clock, wall))

    def _loop(self, st: StepState, runner: _Runner, call: _CallSettings, buckets: List[int],
              bound: Callable[[int], int], static_kv: bool, reuse: bool, stats: _StatsAccumulator,
              clock: _Clock) -> None:
        """Steps until every request has finished: the drafting group, the read, the bucket's group."""
        s = call.scheduler
        gate = (DraftGate(s.cost_table, s.draft_cost, s.plain_steps, s.draft_window, s.draft_margin)
                if s.draft_cost is not None else None)
        has_prev = False  # a step has drafted: the argmax scheduler's budget is the previous survival

        def done(name, group="draft"):
            clock.mark(PHASE.get(name, group), PART.get(name, name) if name else group)

        while True:
            step = stats.steps
            kv = bound(step)
            drafted = gate is None or gate.drafts_next()
            # the first step of a new state runs eagerly: every kernel is loaded before a capture
            run = self._run_eager if step == 0 and not reuse else runner.run
            draft_key = ("draft", drafted, has_prev, kv if not static_kv else None)
            run(draft_key, self._draft_pieces(st, call, drafted, kv, has_prev), done)
            rows, active, generated = _host_read(st.read)
            if gate is not None:
                gate.observe(generated, drafted, rows, active)
            if step == 1:
                stats.warmup_tokens = generated
            if active == 0:
                return
            bucket = pick_bucket(rows, buckets)
            # a bucket's graph reads the drafting graph's outputs where that graph's capture put them: one graph
            # per bucket and drafting graph
            run(("bucket", bucket) + draft_key[1:], self._bucket_pieces(st, call, bucket, drafted, kv),
                lambda name: done(name, "verify"))
            stats.steps, stats.rows, stats.active = stats.steps + 1, stats.rows + rows, stats.active + active
            stats.draft_steps += int(drafted)
            has_prev = has_prev or drafted
            if stats.steps == 1:
                clock.end_warmup()

    @staticmethod
    def _run_eager(key, pieces: List[Piece], done: Callable[[str], None]) -> None:
        for name, fn in pieces:
            fn()
            done(name)


class TargetAlone:
    """Greedy decoding with the target alone, one token a request a step (the baseline a speculative step is
    measured against), the step replayed from a CUDA graph on a GPU (``graphs``, default: on CUDA). Keys are read
    up to the capacity (masked past each request's position). A second ``generate`` of the same batch size and
    lengths, with every weight where it was (``_weights_key``), replays the graph already captured."""

    def __init__(self, target, graphs: Optional[bool] = None):
        self.target, self.graphs_arg = target, graphs
        self._setup = None

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Tuple[List[List[int]], float]:
        """Returns each request's tokens and the seconds of its steps after the first two (0.0 for fewer than 3
        tokens): the first step runs eagerly, the graph is captured before the second."""
        target, n = self.target, len(prompts)
        dev = target.input_embeddings.weight.device
        lens = [len(p) for p in prompts]
        capacity = max(lens) + max_new_tokens + 1
        graphs = dev.type == "cuda" if self.graphs_arg is None else bool(self.graphs_arg)
        key = (n, capacity, max_new_tokens, graphs, _weights_key(target))
        if self._setup is None or self._setup[0] != key or self._setup[1]["cache"] is not target.cache:
            target.alloc_cache(n, capacity)
            long = dict(dtype=torch.long, device=dev)
            s = dict(tok=torch.zeros(n, **long), pos=torch.zeros(n, **long), col=torch.zeros(1, **long),
                     out=torch.zeros(n, max_new_tokens, **long),
                     cu=torch.arange(n + 1, dtype=torch.int32, device=dev), graph=None, cache=target.cache)
            self._setup = (key, s)
        s = self._setup[1]

        def step():
            nxt = target(s["tok"], s["pos"], s["cu"], 1, capacity).logits.argmax(-1)
            s["col"] += 1
            s["out"].index_copy_(1, s["col"], nxt.view(n, 1))
            s["tok"].copy_(nxt)
            s["pos"] += 1

        # prefill: every prompt token; each prompt's last row gives its first token
        toks = torch.tensor([t for p in prompts for t in p], device=dev)
        pos = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).int()
        first = target(toks, pos, cu, max(lens), max(lens), logit_rows=cu[1:].long() - 1).logits.argmax(-1)
        s["tok"].copy_(first)
        s["pos"].copy_(torch.tensor(lens, device=dev))
        s["col"].zero_()
        s["out"][:, 0] = first
        elapsed = 0.0
        state = ("tok", "pos", "col", "out")
        for i in range(1, max_new_tokens):
            if graphs and s["graph"] is None and i > 1:  # the first step ran eagerly: capture now
                saved = {name: s[name].clone() for name in state}
                s["graph"] = _capture_one(step)
                for name in state:
                    s[name].copy_(saved[name])
            if i == 2:
                _sync(dev)
                t0 = time.perf_counter()
            s["graph"].replay() if s["graph"] is not None else step()
        if max_new_tokens > 2:
            _sync(dev)
            elapsed = time.perf_counter() - t0
        return _host_read(s["out"]), elapsed


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _capture_one(fn: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of fn, after a warm-up run of fn on a side stream (the caller undoes its effects)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
