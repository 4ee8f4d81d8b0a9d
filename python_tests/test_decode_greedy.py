"""Lossless greedy speculative decoding: equals the target's own greedy decoding and transformers' generate."""

import types

import pytest
import torch
import transformers

import dspark_kernels as dk
from dspark_kernels.decode import decoder as decoder_mod
from dspark_kernels.decode.decoder import Scheduler, SpeculativeDecoder
from dspark_kernels.decode.kv_cache import PagedKVCache
from dspark_kernels.decode.model import greedy_reference
from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS5 = [[3, 7, 1], [5], [2, 9, 4, 4, 11, 30, 8, 1, 6, 2, 17], [12, 13], [40, 41, 2, 3, 5, 6, 7]]
COST = dk.CostTable([1, 4, 16, 64], [1.0, 1.1, 1.6, 4.0], fixed_overhead_ms=0.2)
MAX_NEW = 14


def scheduler(mode, k):
    thr = [0.6 - 0.05 * i for i in range(k)]
    return Scheduler(mode=mode, thresholds=thr, cost_table=COST, sts_temperatures=[1.5] * k,
                     verify_len=max(k - 1, 1) if mode == "fixed" else None)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(target, PROMPTS5, MAX_NEW)


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("mode", ["fixed", "threshold", "exact", "argmax"])
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_equals_target(target, reference, k, mode, batch):
    pick = slice(0, 5) if batch == 5 else slice(2, 3)
    prompts, ref = PROMPTS5[pick], reference[pick]
    drafter = oracle_drafter(target, block_size=k, markov=["vanilla", "gated", "rnn"][k % 3])
    drafter.set_reference([p + r for p, r in zip(prompts, ref)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4, kv_shuffle_seed=k)
    res = dec.generate(prompts, MAX_NEW, scheduler=scheduler(mode, k))
    assert res.tokens == ref
    st = res.stats
    assert st.generated_tokens == sum(map(len, ref))
    assert 1.0 <= st.acceptance_length <= k + 1
    if k > 1 and mode == "fixed":
        assert st.acceptance_length > 1.5  # the oracle drafter does get accepted
    assert len(st.conditional_acceptance) == k
    assert set(st.time_s) >= {"draft", "verify", "bookkeeping", "total"} and st.tokens_per_second > 0


def test_random_drafter_is_lossless(target, reference):
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=4, markov="rnn"), kv_block_size=8)
    assert dec.generate(PROMPTS5, MAX_NEW).tokens == reference


@pytest.mark.parametrize("markov,rank", [("vanilla", 8), ("gated", 8), ("vanilla", 0)])
def test_reduced_vocabulary_drafter_is_lossless(target, reference, markov, rank):
    """A drafter over a reduced vocabulary (the target ids the reference uses, but two, and a few others: d2t
    offsets): greedy speculative decoding equals the target's own, and the oracle's drafts are accepted, which
    needs the map (draft id j is target id ids[j]); a random one over the same ids is lossless too."""
    used = sorted({t for seq in PROMPTS5 + reference for t in seq})
    ids = sorted(set(used[2:]) | {44, 45, 46})  # two used ids left out: their positions cannot be drafted
    drafter = oracle_drafter(target, block_size=4, markov=markov, rank=rank, draft_ids=ids, seed=2)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    assert drafter.draft_lm_head.shape[0] == len(ids) < target.vocab_size
    res = SpeculativeDecoder(target, drafter, kv_block_size=4).generate(PROMPTS5, MAX_NEW,
                                                                        scheduler=scheduler("fixed", 4))
    assert res.tokens == reference
    assert res.stats.acceptance_length > 1.5, res.stats.acceptance_length
    rand = tiny_drafter(target, block_size=3, markov=markov, rank=rank, draft_ids=ids)
    assert SpeculativeDecoder(target, rand, kv_block_size=8).generate(PROMPTS5, MAX_NEW).tokens == reference


@pytest.mark.parametrize("top_k,ids", [(4, None), (3, "reduced")])
def test_top_k_proposals_are_lossless(target, reference, top_k, ids):
    """Top-k Markov proposals in the decode loop (over the full vocabulary, or a reduced one): greedy output equals
    the target's own, and the oracle's drafts, which lead U, are among the candidates and accepted."""
    used = sorted({t for seq in PROMPTS5 + reference for t in seq})
    draft_ids = sorted(set(used) | {44, 45, 46}) if ids else None
    drafter = oracle_drafter(target, block_size=4, markov="gated", draft_ids=draft_ids, seed=2)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4, draft_top_k=top_k)
    res = dec.generate(PROMPTS5, MAX_NEW, scheduler=scheduler("fixed", 4))
    assert res.tokens == reference
    assert res.stats.acceptance_length > 1.5, res.stats.acceptance_length


@pytest.mark.parametrize("k", [1, 4, 7])
def test_stop_tokens_and_length_limits(target, reference, k):
    # stop tokens taken from inside the reference continuations: generation must end right after them
    stops = [reference[0][5], reference[2][3]]
    want = greedy_reference(target, PROMPTS5, MAX_NEW, stop_token_ids=stops)
    assert any(len(w) < MAX_NEW for w in want)
    drafter = oracle_drafter(target, block_size=k, markov="gated")
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    for mode in ("fixed", "exact"):
        assert dec.generate(PROMPTS5, MAX_NEW, stop_token_ids=stops, scheduler=scheduler(mode, k)).tokens == want
    for limit in (1, 2, 5):
        assert dec.generate(PROMPTS5, limit).tokens == [r[:limit] for r in reference]


def test_finished_requests_send_no_rows_to_the_target(target, reference, monkeypatch):
    """Once a request has finished (here at a stop token), the steps' target forwards hold no row of it: every
    request with rows in a forward is one still running. Before, each finished request sent its anchor every step."""
    stops = [reference[0][2]]
    want = greedy_reference(target, PROMPTS5, MAX_NEW, stop_token_ids=stops)
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter)
    calls = []
    forward = type(target).__call__
    monkeypatch.setattr(type(target), "__call__", lambda self, tokens, positions, cu, *a, **kw: (
        calls.append(cu.diff().tolist()), forward(self, tokens, positions, cu, *a, **kw))[1])
    res = dec.generate(PROMPTS5, MAX_NEW, stop_token_ids=stops, scheduler=Scheduler("fixed", verify_len=3))
    assert res.tokens == want and len(want[0]) < MAX_NEW
    steps = calls[1:]                                   # calls[0] is the prefill
    assert all(r in (0, 4) for rows in steps for r in rows)   # a running request's anchor and 3 drafts, or nothing
    running = [sum(r > 0 for r in rows) for rows in steps]
    assert running == sorted(running, reverse=True) and running[-1] < len(PROMPTS5) and steps[-1][0] == 0
    assert res.stats.verified_tokens_per_step * res.stats.steps == sum(map(sum, steps))


def test_a_stop_token_is_not_a_rejection_in_the_acceptance_statistics():
    """Request 0 accepts d_1, a stop token, so acceptance ends with no bonus token (-1): d_2 was never judged and
    counts neither as reached nor as rejected. Request 1 accepts d_1 and rejects d_2 (a correction follows). Before,
    request 0's d_2 counted as a rejection: conditional acceptance 1/2 at position 2 instead of 0/1."""
    acc = decoder_mod._StatsAccumulator(3, torch.device("cpu"))
    verified = dk.VerifyOutput(torch.tensor([[9, -1, -1, -1], [4, 8, -1, -1]]), torch.tensor([1, 1], dtype=torch.int32),
                               torch.tensor([[True, False, False], [True, False, False]]))
    drafts = types.SimpleNamespace(conf_logits=torch.zeros(2, 3))
    step = decoder_mod.StepResult(drafts, torch.tensor([3, 3], dtype=torch.int32), 8, 2, 0, True, verified)
    acc.add(step, torch.zeros(2, dtype=torch.bool))
    assert acc.reached.tolist() == [2, 1, 0] and acc.accepted.tolist() == [2, 0, 0]
    # the calibration log: request 0's label "accepted >= k" is known for k <= 1 only, request 1's for k <= 3
    log = {}
    decoder_mod._log_step(log, step, torch.zeros(2, dtype=torch.bool))
    assert log["observed_lens"][0].tolist() == [1, 3] and log["num_accepted"][0].tolist() == [1, 1]


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_finished_requests_take_no_admissions(target, reference, mode, monkeypatch):
    """The scheduler sees a finished request's survival as 0. Before, its drafts (zeroed only after scheduling)
    competed for admissions: with 15 finished requests at survival 0.95 a running one got L = 1 where alone it got
    L = 5."""
    stops = [reference[0][2], reference[2][3]]
    want = greedy_reference(target, PROMPTS5, MAX_NEW, stop_token_ids=stops)
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    seen, orig = [], dk.schedule_verify_lens

    def spy(survival, **kw):
        seen.append((survival.clone(), None if kw.get("budget_survival") is None else kw["budget_survival"].clone(),
                     kw["active"].clone()))
        return orig(survival, **kw)
    monkeypatch.setattr(dk, "schedule_verify_lens", spy)
    log = {}
    assert dec.generate(PROMPTS5, MAX_NEW, stop_token_ids=stops, scheduler=scheduler(mode, 4), log=log).tokens == want
    assert len(seen) == len(log["active"]) + 1  # the last step reads that every request finished, after scheduling
    finished_steps = 0
    for (surv, budget, scheduled), active in zip(seen, log["active"]):
        finished_steps += int(not active.all())
        assert torch.equal(scheduled, active)  # finished requests count in neither B nor tau
        assert (surv[~active] == 0).all() and (surv[active] > 0).any()
        if budget is not None:
            assert (budget[~active] == 0).all()
    assert finished_steps > 0


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_finished_requests_do_not_count_in_the_step(mode):
    """Seven finished requests beside one running: it is scheduled as if alone (L = 5). Counted, the finished
    requests' anchors (7 rows and 7 expected tokens) made its last draft look too dear: L = 4."""
    k, n = 5, 8
    survival = torch.zeros(n, k)
    survival[7] = torch.tensor([0.9, 0.85, 0.8, 0.7, 0.05])
    drafts = dk.DraftBlockOutput(torch.zeros(n, k, dtype=torch.long), None, torch.zeros(n, k), survival)
    s = Scheduler(mode=mode, cost_table=dk.CostTable([1, 8, 16, 64], [10.0, 10.5, 11.0, 20.0]))
    dec = types.SimpleNamespace(backend="reference")
    lens = SpeculativeDecoder._schedule(dec, s, drafts, None, k, finished=torch.arange(n) < 7)
    alone = SpeculativeDecoder._schedule(dec, s, drafts._replace(survival=survival[7:]), None, k)
    assert lens.tolist() == [0] * 7 + alone.tolist() and alone.tolist() == [5]


@pytest.mark.parametrize("mode", ["exact", "argmax", "threshold"])
def test_drafts_past_the_length_limit_take_no_admissions(mode):
    """A request with room for R more tokens emits at most R this step (the scan truncates at its length limit):
    d_1..d_{R-1} and the bonus fill it, so d_R.. add no expected token and only cost target rows. Survival 0.99
    and a flat cost table make every draft pay: rooms 9, 3, 1 and 0 verify 6, 2, 0 and 0 drafts (the brute-force
    optimum of E[min(1 + accepted, R)] * SPS). Before, the scheduler saw d_R.. as worth 0.99 each: 6 for all."""
    k, n = 6, 4
    survival = torch.full((n, k), 0.99)
    drafts = dk.DraftBlockOutput(torch.zeros(n, k, dtype=torch.long), None, torch.zeros(n, k), survival)
    room = torch.tensor([9, 3, 1, 0], dtype=torch.int32)
    flat = dk.CostTable([1, 64], [10.0, 10.0])
    s = Scheduler(mode=mode, cost_table=flat, thresholds=[0.5] * k)
    dec = types.SimpleNamespace(backend="reference")
    lens = SpeculativeDecoder._schedule(dec, s, drafts, survival if mode == "argmax" else None, k, room=room)
    assert lens.tolist() == [6, 2, 0, 0]
    # the unclipped requests keep the schedule they get alone
    alone = SpeculativeDecoder._schedule(dec, s, drafts._replace(survival=survival[:1]), None, k)
    assert alone.tolist() == [6]


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_equals_transformers_generate(model_type):
    target = tiny_target(seed=3, model_type=model_type)
    cfg_cls = transformers.Qwen3Config if model_type == "qwen3" else transformers.LlamaConfig
    lm_cls = transformers.Qwen3ForCausalLM if model_type == "qwen3" else transformers.LlamaForCausalLM
    c = target.config
    hf_cfg = cfg_cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                     pad_token_id=0)
    hf = lm_cls(hf_cfg).eval()
    hf.load_state_dict({("lm_head.weight" if k == "lm_head.weight" else "model." + k): v
                        for k, v in target.state_dict().items()})
    want = []
    for p in PROMPTS5:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
        want.append(out[0, len(p):].tolist())
    assert greedy_reference(target, PROMPTS5, MAX_NEW) == want
    for k in (1, 4, 7):
        drafter = oracle_drafter(target, block_size=k)
        drafter.set_reference([p + w for p, w in zip(PROMPTS5, want)])
        dec = SpeculativeDecoder(target, drafter)
        for mode in ("fixed", "threshold", "exact", "argmax"):
            assert dec.generate(PROMPTS5, MAX_NEW, scheduler=scheduler(mode, k)).tokens == want
        assert dec.generate(PROMPTS5[1:2], MAX_NEW).tokens == want[1:2]


def test_hot_path_host_reads(target, reference, monkeypatch):
    """One designated read per step; every other host sync happens outside the loop (a constant count)."""
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    dec.generate(PROMPTS5, 3)  # warm up
    counts = {"all": 0, "designated": 0}
    for name in ("item", "tolist", "__bool__", "nonzero", "cpu", "numpy", "__int__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, **kw):
            counts["all"] += 1
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    orig_read = decoder_mod._host_read

    def designated(t):
        counts["designated"] += 1
        return orig_read(t)
    monkeypatch.setattr(decoder_mod, "_host_read", designated)
    extra = []
    for max_new in (4, 13):
        counts.update(all=0, designated=0)
        res = dec.generate(PROMPTS5, max_new, scheduler=scheduler("argmax", 4))
        steps = res.stats.steps
        # the loop: one read per step plus the final stop check; after the loop: tokens and stats
        assert counts["designated"] == steps + 1 + 2
        extra.append(counts["all"] - counts["designated"])
    assert extra[0] == extra[1] and extra[0] <= 4, extra  # setup-only syncs, independent of the step count


@pytest.mark.parametrize("mode", ["fixed", "threshold", "exact", "argmax"])
def test_no_host_data_copied_to_the_device_per_step(target, reference, mode, monkeypatch):
    """No step builds a device tensor from host data: on a GPU that copy from pageable memory synchronises the
    stream (before: threshold mode copied its thresholds list to the device every step)."""
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    dec.generate(PROMPTS5, 3, scheduler=scheduler(mode, 4))  # warm up (the cost table's device copy is cached)
    copies = {"n": 0}
    for name in ("tensor", "as_tensor"):
        orig = getattr(torch, name)

        def wrapped(data, *a, _orig=orig, **kw):
            if kw.get("device") is not None and not isinstance(data, torch.Tensor):
                copies["n"] += 1
            return _orig(data, *a, **kw)
        monkeypatch.setattr(torch, name, wrapped)
    per_call = []
    for max_new in (4, 13):
        copies["n"] = 0
        res = dec.generate(PROMPTS5, max_new, scheduler=scheduler(mode, 4))
        assert res.tokens == [r[:max_new] for r in reference]
        per_call.append((copies["n"], res.stats.steps))
    assert per_call[0][1] < per_call[1][1] and per_call[0][0] == per_call[1][0], per_call  # setup only


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_bfloat16_logits_are_read_as_they_are(temperature, monkeypatch):
    """A bf16 model's logits and U reach verify_chain and draft_block in bf16 (no float32 copy of [rows, V]), and
    every token equals the run in which both are first widened to float32: the ops read bf16 exactly."""
    t16 = tiny_target(seed=0).to(torch.bfloat16)
    drafter = tiny_drafter(t16, block_size=4, markov="rnn").to(torch.bfloat16)
    seen = {"verify_chain": set(), "draft_block": set()}  # the dtypes of each op's first tensor (logits, U)

    def spy(name, op):
        def call(x, *a, **kw):
            seen[name].add(x.dtype)
            return op(x, *a, **kw)
        return call

    for name in seen:
        monkeypatch.setattr(dk, name, spy(name, getattr(dk, name)))

    def run():
        return SpeculativeDecoder(t16, drafter, seed=5).generate(
            PROMPTS5, 6, temperature=temperature, scheduler=scheduler("argmax", 4)).tokens

    as_bf16 = run()
    assert seen == {"verify_chain": {torch.bfloat16}, "draft_block": {torch.bfloat16}}
    target_forward, draft_forward = t16.forward, drafter.forward_block

    def widened_target(*a, **kw):
        out = target_forward(*a, **kw)
        return out._replace(logits=out.logits.float())

    def widened_drafter(*a):
        u, h = draft_forward(*a)
        return u.float(), h

    t16.forward, drafter.forward_block = widened_target, widened_drafter  # this test's models only
    assert as_bf16 == run()
    assert [len(t) for t in as_bf16] == [6] * 5 and all(0 <= x < 48 for t in as_bf16 for x in t)


def test_drafter_context_equals_a_fresh_prefill(target, reference):
    """After generation, the drafter's context K/V at positions 0..S-2 (written from the scan's hidden_rows and
    kv_slots) equal those of a fresh target prefill of the committed sequence. Losslessness cannot see a wrong
    context (it only lowers acceptance), so this checks it directly."""
    k = 4
    drafter = oracle_drafter(target, block_size=k, markov="gated")
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4, kv_shuffle_seed=3)
    res = dec.generate(PROMPTS5, MAX_NEW, scheduler=scheduler("exact", k))
    got_k, table = drafter.cache.k.clone(), drafter.cache.block_table
    seqs = [p + t for p, t in zip(PROMPTS5, res.tokens)]
    fresh = tiny_target(seed=0)
    fresh.hidden_layer_ids = list(drafter.config.target_layer_ids)
    cfg = fresh.config
    fresh.cache = cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, len(seqs),
                                       table.shape[1] * 4, block_size=4, block_table=table.clone())
    lens = [len(s) - 1 for s in seqs]           # the context holds positions 0..S-2
    toks = torch.tensor([t for s in seqs for t in s[:-1]])
    pos = torch.tensor([i for n in lens for i in range(n)])
    req = torch.tensor([r for r, n in enumerate(lens) for _ in range(n)])
    cu = torch.tensor([0] + lens).cumsum(0).int()
    with torch.no_grad():
        out = fresh(toks, pos, cu, max(lens), max(lens), logit_rows=torch.empty(0, dtype=torch.long))
        drafter.write_context(out.hidden, pos, cache.slots(req, pos))
    slots = cache.slots(req, pos)
    torch.testing.assert_close(got_k[:, slots], drafter.cache.k[:, slots], rtol=1e-5, atol=1e-5)
    assert res.stats.acceptance_length > 1.5


def test_tokens_per_second_excludes_the_warmup_step(target, reference, monkeypatch):
    """The timed window starts after the first (warm-up) step: with a fake clock that loses 1000 s inside the
    first step's draft and ticks 1 s per read otherwise, the steady-state tokens/s sees none of the 1000 s."""
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    reads = [0]

    def fake_clock():  # read 1: t0, read 2: the loop's first mark, read 3: the end of step 0's draft
        reads[0] += 1
        return float(reads[0] + (1000 if reads[0] >= 3 else 0))
    monkeypatch.setattr(decoder_mod, "_now", fake_clock)
    res = dec.generate(PROMPTS5, MAX_NEW, scheduler=scheduler("fixed", 4))
    st = res.stats
    assert res.tokens == reference and st.steps > 2 and st.warmup_steps == 1
    # step 0: mark(None) -> draft (1001 s), then verify, bookkeeping, draft, bookkeeping (1 s each)
    assert st.time_s["warmup"] == 1001 + 4
    # each later step: 5 marks of 1 s; the final iteration drafts once more, then stops
    assert st.time_s["timed"] == 5 * (st.steps - 1) + 1
    assert st.time_s["draft"] + st.time_s["verify"] + st.time_s["bookkeeping"] == st.time_s["timed"]
    assert st.time_s["total"] == reads[0] - 1 + 1000
    assert 0 < st.warmup_tokens < st.generated_tokens
    assert st.tokens_per_second == (st.generated_tokens - st.warmup_tokens) / st.time_s["timed"]
    assert st.tokens_per_second_with_warmup == st.generated_tokens / st.time_s["total"]
    assert st.tokens_per_second > 0.1 > st.tokens_per_second_with_warmup
    # a single-step call has no steady state: both rates are the whole call's
    reads[0] = 0
    one = dec.generate(PROMPTS5, 1).stats
    assert one.steps == 1 and one.warmup_steps == 0 and one.warmup_tokens == 0 and one.time_s["warmup"] == 0
    assert one.tokens_per_second == one.tokens_per_second_with_warmup == 5 / one.time_s["total"]


@pytest.mark.parametrize("mode", ["exact", "argmax"])
@pytest.mark.parametrize("plain_steps", [1, 3])
def test_drafting_skipped_where_it_does_not_pay(target, reference, mode, plain_steps):
    """A drafting pass that costs more than drafts can win, judged on every step (window 1): the first step's
    loss is read at the second (which has drafted already), then ``plain_steps`` steps run the target alone, then
    a probe, twice as many plain steps, and so on; the output is the target's own. A free drafting pass whose drafts get accepted: every step drafts."""
    k = 4
    drafter = oracle_drafter(target, block_size=k)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    kw = dict(cost_table=COST, sts_temperatures=[1.5] * k, plain_steps=plain_steps, draft_window=1)
    res = dec.generate(PROMPTS5, MAX_NEW, scheduler=Scheduler(mode, draft_cost=dk.CostTable([1, 8], [1e6, 1e6]), **kw))
    assert res.tokens == reference
    st = res.stats
    pattern, run_len = [], plain_steps  # two drafting steps (the loss is read one step late), then P, 2P, 4P ...
    while len(pattern) < st.steps:
        pattern += [True, True] + [False] * run_len
        run_len = min(2 * run_len, 8 * plain_steps)
    assert st.draft_steps == sum(pattern[:st.steps]) < st.steps
    res = dec.generate(PROMPTS5, MAX_NEW, scheduler=Scheduler(mode, draft_cost=dk.CostTable([1], [1e-6]), **kw))
    assert res.tokens == reference
    assert res.stats.draft_steps == res.stats.steps and res.stats.drafts_verified > 0


def test_plain_steps_keep_one_host_read_per_step(target, reference, monkeypatch):
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(PROMPTS5, reference)])
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    reads = {"n": 0}
    orig_read = decoder_mod._host_read

    def designated(t):
        reads["n"] += 1
        return orig_read(t)
    monkeypatch.setattr(decoder_mod, "_host_read", designated)
    sched = Scheduler("exact", cost_table=COST, sts_temperatures=[1.5] * 4, draft_cost=dk.CostTable([1], [1e6]),
                      plain_steps=4, draft_window=1)
    res = dec.generate(PROMPTS5, 9, scheduler=sched)
    assert 0 < res.stats.draft_steps < res.stats.steps
    assert reads["n"] == res.stats.steps + 1 + 2  # as in test_hot_path_host_reads


@pytest.mark.parametrize("edit,match", [(dict(mode="fixed"), "draft_cost needs mode"),
                                        (dict(plain_steps=0), "plain_steps must be >= 1"),
                                        (dict(draft_window=0), "draft_window must be >= 1"),
                                        (dict(draft_margin=float("nan")), "draft_margin must be >= 0")])
def test_bad_draft_cost_settings(target, edit, match):
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=2))
    kw = dict(mode="exact", cost_table=COST, draft_cost=dk.CostTable([1], [1.0]))
    with pytest.raises(ValueError, match=match):
        dec.generate([[1, 2]], 3, scheduler=Scheduler(**{**kw, **edit}))
