"""The CUDA-graph step (dspark_kernels/decode/graphs.py): its pieces on the CPU against the eager loop (buckets,
padding, the same tokens, the drafting gate, one host read a step), and on a GPU captured for real."""

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dspark_kernels as dk
from dspark_kernels.decode import graphs as graphs_mod
from dspark_kernels.decode.decoder import Scheduler, SpeculativeDecoder
from dspark_kernels.decode.graphs import GraphDecoder, TargetAlone, default_buckets, pick_bucket
from dspark_kernels.decode import model as model_mod
from dspark_kernels.decode.kv_cache import PagedKVCache, attention_bias, ragged_attention, ragged_batch, sdpa_gqa
from dspark_kernels.decode.model import greedy_reference
from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target
from dspark_kernels.rng import make_rng_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[3, 7, 1], [5], [2, 9, 4, 4, 11, 30, 8]]
MAX_NEW = 10
COST = dk.CostTable([1, 4, 16, 64], [1.0, 1.1, 1.6, 4.0], fixed_overhead_ms=0.2)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(target, PROMPTS, MAX_NEW)


def _oracle(target, reference, k=4):
    drafter = oracle_drafter(target, block_size=k)
    drafter.set_reference([p + r for p, r in zip(PROMPTS, reference)])
    return SpeculativeDecoder(target, drafter, kv_block_size=4)


def test_buckets():
    assert default_buckets(3, 4) == [3, 6, 9, 12, 15]
    assert [pick_bucket(r, [3, 6, 9]) for r in (1, 3, 4, 9)] == [3, 3, 6, 9]
    with pytest.raises(ValueError, match="largest bucket 9"):
        pick_bucket(10, [3, 6, 9])


def test_padding_rows_write_the_trash_slot_and_change_nothing():
    """A packed batch padded to a bucket: the real rows' attention equals the unpadded batch's bit for bit, the
    padding rows write only the trash slot."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 2, 8, 3, 16, block_size=4)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    pos = torch.tensor([4, 5, 7, 2, 3, 4])
    q = torch.randn(6, 4, 8, generator=g)
    plain = ragged_attention(q, cache, 0, ragged_batch(cache, pos, cu, 3, 12), 0.3)
    padded_pos = torch.cat([pos, torch.tensor([9, 1, 0])])
    b = ragged_batch(cache, padded_pos, cu, 3, 12, padded=True)
    assert b.slots[6:].tolist() == [cache.trash_slot] * 3
    assert torch.equal(b.slots[:6], ragged_batch(cache, pos, cu, 3, 12).slots)
    out = ragged_attention(torch.cat([q, torch.randn(3, 4, 8, generator=g)]), cache, 0, b, 0.3)
    assert torch.equal(out[:6], plain)


def test_contiguous_cache_attends_through_a_view():
    cache = PagedKVCache(2, 2, 4, 3, 10, block_size=4)
    shuffled = PagedKVCache(2, 2, 4, 3, 10, block_size=4, shuffle_seed=1)
    assert cache.contiguous and not shuffled.contiguous
    cache.k.copy_(torch.randn_like(cache.k))
    slots = cache.slots(torch.arange(3).view(3, 1).expand(3, 7), torch.arange(7).view(1, 7).expand(3, 7))
    k, _ = cache.gather(1, slots)
    assert k.data_ptr() == cache.k[1].data_ptr() and not k.is_contiguous()
    assert torch.equal(k, cache.k[1].index_select(0, slots.reshape(-1)).view(3, 7, 2, 4).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nq", [1, 3])
def test_folded_attention(dtype, nq):
    """sdpa_gqa (query heads folded onto their KV head) equals attention over repeated K/V heads to rounding, and
    its mask's additive form (rows padded to 16; a row every query shares stays one broadcast row) gives the bits
    of the boolean mask materialised in the folded layout."""
    g = torch.Generator().manual_seed(0)
    n, h, kv, d, length = 3, 8, 2, 16, 37
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((n, h, nq, d), (n, kv, length, d),
                                                                      (n, kv, length, d)))
    last = torch.tensor([5, 20, 36]).view(n, 1, 1, 1) - torch.arange(nq).flip(0).view(1, 1, nq, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for mask in (torch.arange(length) <= last, torch.arange(length) <= last[:, :, -1:]):
        bias = attention_bias(mask, h // kv, dtype)
        rows = h // kv * nq if mask.shape[2] > 1 else 1
        assert bias.dtype == dtype and bias.shape == (n, 1, rows, length)
        assert bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1])
        got = sdpa_gqa(q, k, v, bias, 0.3)
        folded = mask.expand(n, 1, nq, length).repeat(1, 1, h // kv, 1)
        assert torch.equal(got, sdpa(q.reshape(n, kv, -1, d), k, v, attn_mask=folded, scale=0.3).view(n, h, nq, d))
        assert torch.equal(sdpa_gqa(q, k, v, mask, 0.3), got)
        plain = sdpa(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1), attn_mask=mask, scale=0.3)
        torch.testing.assert_close(got, plain, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def test_the_target_builds_its_attention_bias_once_a_forward(monkeypatch):
    """A forward through sdpa_gqa (float32) converts its mask once for all layers; every layer's attention gets
    the additive, aligned form (nothing to convert or pad per call)."""
    target = tiny_target(seed=0)
    target.alloc_cache(2, 16, block_size=4)
    built, masks = [], []
    real_bias, real_sdpa = model_mod.attention_bias, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(model_mod, "attention_bias", lambda *a: built.append(a[1]) or real_bias(*a))

    def sdpa(*args, attn_mask=None, **kw):
        masks.append((attn_mask.dtype, attn_mask.stride()))
        return real_sdpa(*args, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        target(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 3, 5], dtype=torch.int32),
               3, 3)
    assert built == [2] and len(masks) == target.num_layers
    assert all(dt == torch.float32 and st[-1] == 1 and all(s % 16 == 0 for s in st[:-1]) for dt, st in masks)


def test_rng_key_of_adjacent_views_is_a_view():
    """The step keeps int64 [2] keys and bumps their offsets in place: the ops get the key itself, no launch."""
    keys = torch.tensor([[5, 0], [5, 1]])
    key = make_rng_key(keys[1, 0:1], keys[1, 1:2], "cpu")
    assert key.data_ptr() == keys[1].data_ptr() and key.tolist() == [5, 1]
    keys += torch.tensor([[0, 2], [0, 2]])
    assert key.tolist() == [5, 3]
    assert make_rng_key(keys[0, 1:2], keys[1, 0:1], "cpu").tolist() == [2, 5]  # not adjacent: a new key


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["fixed", "threshold", "exact", "argmax"])
def test_same_tokens_as_the_eager_loop(target, reference, temperature, mode):
    """The graph path's pieces, eagerly on the CPU (keys bounded as the eager loop bounds them): the same tokens
    and statistics, greedy and sampled (the same counter RNG); greedy equals the target's own decoding."""
    dec = _oracle(target, reference)
    sched = Scheduler(mode, thresholds=[0.5, 0.4, 0.3, 0.2], cost_table=COST, sts_temperatures=[1.5] * 4,
                      verify_len=3 if mode == "fixed" else None)
    eager = dec.generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
    out = GraphDecoder(dec, static_kv=False).generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
    assert out.tokens == eager.tokens
    if temperature == 0.0:
        assert out.tokens == reference
    a, b = eager.stats, out.stats
    assert (a.steps, a.generated_tokens, a.drafts_verified, a.draft_steps) == (b.steps, b.generated_tokens,
                                                                             b.drafts_verified, b.draft_steps)
    assert a.verified_tokens_per_step == b.verified_tokens_per_step
    assert str(a.conditional_acceptance) == str(b.conditional_acceptance)  # NaN where nothing was verified


def test_static_keys_and_reuse(target, reference):
    """Keys read up to the capacity (the graphs' static shapes), stop tokens, and a second call on the same state
    (a GPU replays its graphs there): greedy tokens equal the target's, both times."""
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=3), kv_block_size=8)
    g = GraphDecoder(dec, static_kv=True, buckets=[3, 5, 12])
    stop = reference[2][4]
    for _ in range(2):
        out = g.generate(PROMPTS, MAX_NEW, stop_token_ids=[stop])
        cut = [r[:r.index(stop) + 1] if stop in r else r for r in reference]
        assert out.tokens == cut
    with pytest.raises(ValueError, match="largest bucket"):
        GraphDecoder(dec, buckets=[3, 6]).generate(PROMPTS, 2)
    dec.target = object.__new__(type("HFTargetLike", (), {}))
    with pytest.raises(ValueError, match="needs a TargetModel"):
        GraphDecoder(dec).generate(PROMPTS, 2)


def test_drafting_gate_runs_plain_steps(target, reference):
    """A drafting pass priced far above its gain: the gate runs plain steps (the plain group, N rows), losslessly."""
    dec = _oracle(target, reference)
    sched = Scheduler("exact", cost_table=COST, sts_temperatures=[1.5] * 4, draft_cost=dk.CostTable([1], [1e6]),
                      draft_window=1, plain_steps=2)
    eager = dec.generate(PROMPTS, MAX_NEW, scheduler=sched)
    out = GraphDecoder(dec, static_kv=False).generate(PROMPTS, MAX_NEW, scheduler=sched)
    assert out.tokens == eager.tokens == reference
    assert out.stats.draft_steps == eager.stats.draft_steps < out.stats.steps


def _write_into(dst, src) -> None:
    """src's values into dst in place (tensors, or named tuples of them)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple):
        for a, b in zip(dst, src):
            _write_into(a, b)


def _weights(models):
    """Each parameter and buffer slot of the models: (module, its _parameters or _buffers, the name, the tensor)."""
    return [(d, name, t) for m in models for sub in m.modules() for d in (sub._parameters, sub._buffers)
            for name, t in d.items() if t is not None]


class _EmulatedGraph:
    """A CUDA graph's contract on the CPU: its capture fixes the tensors it reads and writes (the step state's, and
    the weights of ``models``); a replay reads those and writes into those, whatever Python has bound since (the
    pieces run again against the capture's bindings and their results are copied into the capture's outputs;
    Python's bindings are left as they were)."""

    def __init__(self, state, group, models=()):
        self.state, self.group, self.models = state, group, models
        self.reads, self.weights = dict(vars(state)), _weights(models)
        for _, fn in group:
            fn()
        self.writes = dict(vars(state))

    def replay(self):
        bound = dict(vars(self.state))
        vars(self.state).update(self.reads)
        with _weights_bound(self.weights, self.models):
            for _, fn in self.group:
                fn()
        for name, t in self.writes.items():
            if t is not self.reads.get(name):
                _write_into(t, getattr(self.state, name))
        vars(self.state).update(bound)


@contextlib.contextmanager
def _weights_bound(weights, models):
    """The models' parameters and buffers bound to ``weights`` (a capture's ``_weights``) inside the block."""
    now = _weights(models)
    for d, name, t in weights:
        d[name] = t
    try:
        yield
    finally:
        for d, name, t in now:
            d[name] = t


class _EmulatedOne:
    """``_capture_one``'s graph on the CPU: a replay runs the step on the weights its capture read."""

    def __init__(self, fn, models):
        self.fn, self.models, self.weights = fn, models, _weights(models)
        fn()

    def replay(self):
        with _weights_bound(self.weights, self.models):
            self.fn()


def _emulated_capture(runner, pieces, models=()):
    saved = runner.state.snapshot()
    out = []
    for group in ([[p] for p in pieces] if runner.split else [pieces]):
        graph = _EmulatedGraph(runner.state, group, models)
        out.append((group[-1][0] if runner.split else None, graph, dict(vars(runner.state))))
    runner.state.restore(saved)
    return out


@pytest.mark.parametrize("split", [False, True])
def test_replays_read_what_their_captures_bound(target, reference, monkeypatch, split):
    """With graphs whose replays read and write the tensors their captures bound (emulated on the CPU), the drafting
    gate's plain and drafting groups and buckets captured in any order give the tokens of the same pieces run
    without graphs: greedy (the target's own) and sampled."""
    monkeypatch.setattr(graphs_mod._Runner, "_capture", _emulated_capture)
    dec = _oracle(target, reference)
    sched = Scheduler("exact", cost_table=COST, sts_temperatures=[1.5] * 4, draft_cost=dk.CostTable([1], [1e6]),
                      draft_window=1, plain_steps=1)
    every = list(range(1, len(PROMPTS) * 5 + 1))  # many buckets: new ones are captured after the plain group
    for temperature in (0.0, 1.0):
        plain = GraphDecoder(dec, graphs=False, static_kv=True, buckets=every).generate(
            PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
        graphed = GraphDecoder(dec, graphs=True, split=split, buckets=every)
        out = graphed.generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
        runner = graphed._setup.runner
        assert {k[1] for k in runner.graphs if k[0] == "draft"} == {True, False}  # both groups were captured
        assert out.tokens == plain.tokens and out.stats.draft_steps == plain.stats.draft_steps
        if temperature == 0.0:
            assert out.tokens == reference


class _SyncCounter(TorchDispatchMode):
    """Counts the ops that make a device wait for the host or the host for the device: a scalar read, an output
    whose size depends on data, or host data made into a tensor (a synchronous host->device copy on a GPU)."""
    SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
             "aten::repeat_interleave.Tensor", "aten::item", "aten::lift_fresh", "aten::lift_fresh_copy")

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func._schema.name) in self.SYNCS or func.name() in self.SYNCS:
            self.syncs.append(func.name())
        return func(*args, **(kwargs or {}))


def _counted(fn, counter):
    def run(*args):
        with counter:
            return fn(*args)
    return run


@pytest.mark.parametrize("mode,temperature,gated", [("argmax", 0.0, False), ("exact", 1.0, True),
                                                    ("threshold", 1.0, False)])
def test_one_host_read_a_step(target, reference, monkeypatch, mode, temperature, gated):
    """The steps' only device->host traffic is their designated read, and their groups (the device work) make no
    host data into a tensor: greedy and sampled, each scheduler kind, plain steps of the drafting gate (whose own
    arithmetic is host work on host numbers)."""
    dec = _oracle(target, reference)
    gd = GraphDecoder(dec, static_kv=True)
    sched = Scheduler(mode, cost_table=COST, sts_temperatures=[1.5] * 4, thresholds=[0.5, 0.4, 0.3, 0.2],
                      **(dict(draft_cost=dk.CostTable([1], [1e6]), draft_window=1, plain_steps=2) if gated else {}))
    gd.generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)  # the counted call reuses its state
    reads, tolists, counter = [], [], _SyncCounter()
    real_read, real_tolist = graphs_mod._host_read, torch.Tensor.tolist
    monkeypatch.setattr(graphs_mod, "_host_read", lambda t: reads.append(tuple(t.shape)) or real_read(t))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(tuple(t.shape)) or real_tolist(t))
    # the groups (device work only)
    monkeypatch.setattr(graphs_mod._Runner, "run", _counted(graphs_mod._Runner.run, counter))
    monkeypatch.setattr(GraphDecoder, "_run_eager", staticmethod(_counted(GraphDecoder._run_eager, counter)))
    out = gd.generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
    # one read a step and the read that finds every request finished; then the tokens and the statistics
    assert reads == [(3,)] * (out.stats.steps + 1) + [(3, MAX_NEW)]
    assert counter.syncs == [] and len(tolists) == len(reads) + 1
    assert out.stats.draft_steps < out.stats.steps if gated else out.stats.draft_steps == out.stats.steps


def test_target_alone_equals_greedy_reference(target, reference):
    alone = TargetAlone(target)
    for _ in range(2):
        tokens, secs = alone.generate(PROMPTS, MAX_NEW)
        assert tokens == reference and secs >= 0.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bfloat16_models_same_tokens_as_the_eager_loop(temperature):
    """bf16 models (as on a GPU: the logits and U reach the ops in bf16): the graph path's pieces give the eager
    loop's tokens, and greedy equals the bf16 target's own decoding."""
    target = tiny_target(seed=0).to(torch.bfloat16)
    reference = greedy_reference(target, PROMPTS, MAX_NEW)
    dec = _oracle(target, reference)
    dec.drafter.to(torch.bfloat16)
    sched = Scheduler("argmax", cost_table=COST, sts_temperatures=[1.5] * 4)
    eager = dec.generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
    out = GraphDecoder(dec, static_kv=False).generate(PROMPTS, MAX_NEW, temperature=temperature, scheduler=sched)
    assert out.tokens == eager.tokens
    if temperature == 0.0:
        assert out.tokens == reference


def _run(gd, scheduler, **kw):
    out = gd.generate(PROMPTS, MAX_NEW, scheduler=scheduler, **kw)
    return out.tokens, out.stats.drafts_verified


@pytest.mark.parametrize("emulated", [False, True])
def test_a_second_call_follows_changed_thresholds(target, monkeypatch, emulated):
    """A call on a kept setup (graphs emulated on the CPU, or none) verifies what a fresh decoder verifies with its
    scheduler's thresholds: the same scheduler changed in place, or a new one."""
    monkeypatch.setattr(graphs_mod._Runner, "_capture", _emulated_capture)
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=4), kv_block_size=4)
    fresh = {thr: _run(GraphDecoder(dec, graphs=emulated, static_kv=True), Scheduler("threshold", thresholds=[thr] * 4))
             for thr in (0.0, 2.0)}
    assert fresh[0.0][1] > 0 == fresh[2.0][1]
    gd = GraphDecoder(dec, graphs=emulated, static_kv=True)
    sched = Scheduler("threshold", thresholds=[0.0] * 4)
    assert _run(gd, sched) == fresh[0.0]
    sched.thresholds = [2.0] * 4
    assert _run(gd, sched) == fresh[2.0]
    for thr in (0.0, 2.0):
        assert _run(gd, Scheduler("threshold", thresholds=[thr] * 4)) == fresh[thr]


@pytest.mark.parametrize("emulated", [False, True])
def test_a_second_call_follows_a_changed_seed(target, monkeypatch, emulated):
    """Sampling on a kept setup after ``dec.seed`` changed gives the eager loop's tokens with the new seed."""
    monkeypatch.setattr(graphs_mod._Runner, "_capture", _emulated_capture)
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=4), kv_block_size=4)
    eager = {}
    for seed in (0, 1):
        dec.seed = seed
        eager[seed] = dec.generate(PROMPTS, MAX_NEW, temperature=1.0).tokens
    assert eager[0] != eager[1]
    gd, sched = GraphDecoder(dec, graphs=emulated, static_kv=False), Scheduler()
    for seed in (0, 1, 0):
        dec.seed = seed
        assert gd.generate(PROMPTS, MAX_NEW, temperature=1.0, scheduler=sched).tokens == eager[seed]


@pytest.mark.parametrize("alone", [False, True])
def test_a_second_call_reads_replaced_weights(monkeypatch, alone):
    """A weight replaced by a new tensor between calls (graphs emulated on the CPU, binding the weights their
    capture read) is read by the next call: greedy gives the changed target's own tokens, with the drafter
    (GraphDecoder) and without (TargetAlone)."""
    target = tiny_target(seed=0)
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=4), kv_block_size=4)
    models = (target, dec.drafter)
    monkeypatch.setattr(graphs_mod._Runner, "_capture", lambda runner, pieces: _emulated_capture(runner, pieces, models))
    monkeypatch.setattr(graphs_mod, "_capture_one", lambda fn: _EmulatedOne(fn, models))
    gd = TargetAlone(target, graphs=True) if alone else GraphDecoder(dec, graphs=True)

    def tokens():
        out = gd.generate(PROMPTS, MAX_NEW)
        return out[0] if alone else out.tokens
    assert tokens() == greedy_reference(copy.deepcopy(target), PROMPTS, MAX_NEW)  # a copy: the target keeps its cache
    w = target.lm_head_weight
    for mod in target.modules():
        for name, t in mod._parameters.items():
            if t is w:
                setattr(mod, name, torch.nn.Parameter(w.detach().flip(0).clone()))
    assert tokens() == greedy_reference(copy.deepcopy(target), PROMPTS, MAX_NEW)


class _ForeignReads(TorchDispatchMode):
    """The memory that ops read and that no op under this mode allocated (what a CUDA graph of them reads by
    address, allocated elsewhere): weak references to its storages, with the reading op's name."""

    def __init__(self):
        super().__init__()
        self.made, self.reads = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.dim() > 0:  # 0-dim: Python numbers wrapped for the op
                s = t.untyped_storage()
                if self.made.get(id(s), lambda: None)() is not s:
                    self.reads.append((func.name(), tuple(t.shape), weakref.ref(s)))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made[id(s)] = weakref.ref(s)
        return out


def test_the_step_reads_only_memory_the_decoder_holds(target, reference, monkeypatch):
    """Every tensor the steps read and did not allocate outlives the call that made it, held by the decoder: the
    call's stop ids, confidence head and STS temperatures, its scheduler's cost table (the caller keeps none of them),
    as a CUDA graph's replays in a later call need."""
    reads = _ForeignReads()
    loop = GraphDecoder._loop

    def traced(*args):
        with reads:
            return loop(*args)
    monkeypatch.setattr(GraphDecoder, "_loop", traced)
    gd = GraphDecoder(_oracle(target, reference), graphs=False, static_kv=True)
    gd.generate(PROMPTS, MAX_NEW, temperature=1.0, stop_token_ids=[reference[2][4]],
                scheduler=Scheduler("argmax", cost_table=dk.CostTable([1, 64], [1.0, 4.0]), sts_temperatures=[1.5] * 4))
    gc.collect()
    assert reads.reads and {(op, shape) for op, shape, s in reads.reads if s() is None} == set()


# ---------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("split", [False, True])
def test_cuda_graphs_replay_the_eager_tokens(split, monkeypatch):
    """Captured graphs (fused, and one a piece): greedy equals the target's own decoding, with the drafting gate's
    plain steps too; sampled equals the eager loop on the GPU where every float is the same (keys bounded as the
    eager loop bounds them, a bucket for every row count: the eager loop's GEMM shapes); a call that only replays
    never synchronises but at its designated reads (torch's sync debug mode raises on any other)."""
    dev = torch.device("cuda")
    target = tiny_target(seed=0).to(dev)
    reference = greedy_reference(target, PROMPTS, MAX_NEW)
    drafter = oracle_drafter(target, block_size=4).to(dev)
    drafter.set_reference([p + r for p, r in zip(PROMPTS, reference)], device=dev)
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    g = GraphDecoder(dec, split=split)
    for _ in range(2):  # the first call captures from its second step on, the second its first step's graphs
        assert g.generate(PROMPTS, MAX_NEW).tokens == reference

    def mode(m, fn):
        def run(*a, **kw):
            old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(m)
            try:
                return fn(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(old)
        return run
    monkeypatch.setattr(graphs_mod, "_host_read", mode("default", graphs_mod._host_read))
    monkeypatch.setattr(GraphDecoder, "_loop", mode("error", GraphDecoder._loop))
    assert g.generate(PROMPTS, MAX_NEW).tokens == reference
    monkeypatch.undo()
    gated = Scheduler("exact", cost_table=COST, sts_temperatures=[1.5] * 4, draft_cost=dk.CostTable([1], [1e6]),
                      draft_window=1, plain_steps=1)  # plain and drafting groups interleaved, buckets captured late
    every = list(range(1, len(PROMPTS) * 5 + 1))
    assert GraphDecoder(dec, split=split, buckets=every).generate(PROMPTS, MAX_NEW, scheduler=gated).tokens == \
        reference
    eager = dec.generate(PROMPTS, MAX_NEW, temperature=1.0)
    sampled = GraphDecoder(dec, split=split, static_kv=False, buckets=every)
    assert sampled.generate(PROMPTS, MAX_NEW, temperature=1.0).tokens == eager.tokens
    tokens, _ = TargetAlone(target).generate(PROMPTS, MAX_NEW)
    assert tokens == reference
