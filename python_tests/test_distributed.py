"""dspark_kernels.distributed: vocabulary-parallel verify_chain and draft_block over gloo, in spawned processes.

Each test spawns one group and runs a list of cases in it; every rank checks its own outputs against the unsharded
reference op on the gathered inputs (integers exactly, floats to 1e-5).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dspark_kernels as dk
import dspark_kernels.distributed as D
from dspark_kernels.distributed import layout as L
from dspark_kernels.distributed.testing import even_sizes, shard_spans, spawn
from dspark_kernels.rng import STREAM_RESIDUAL, make_rng_key, uniform


# ------------------------------------------------------------------------------------------------ inputs
def verify_inputs(n, k, vocab, seed, force_tokens=()):
    """Target / draft logits, drafts sampled from the draft (some rows greedy-correct, one draft out of range, one
    -1), per-request temperatures (mixed greedy) and the matching draft log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, k + 1, vocab, generator=g) * 2
    for i, tok in enumerate(force_tokens):         # rows whose argmax / likely draft is a chosen token
        target[i % n, :, tok] += 8.0
    draft = target[:, :k] + torch.randn(n, k, vocab, generator=g) * 2
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 1.0][:n] * (n // 8 + 1))[:n]
    t = torch.where(temps > 0, temps, 1.0).view(n, 1, 1)
    drafts = torch.softmax(draft / t, -1).view(-1, vocab).multinomial(1, generator=g).view(n, k)
    drafts[0] = target[0, :k].argmax(-1)
    drafts[min(1, n - 1), -1] = vocab + 3
    drafts[min(2, n - 1), min(1, k - 1)] = -1
    logprobs = torch.log_softmax(draft / t, -1).gather(-1, drafts.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    return dict(target=target, draft=draft, drafts=drafts, temps=temps, logprobs=logprobs)


def verify_modes(inp, methods=("token", "block")):
    """(name, kwargs of dk.verify_chain) covering every mode."""
    n, k = inp["drafts"].shape
    modes = [("greedy", dict(temperature=0.0))]
    for method in methods:
        modes += [(f"{method} one-hot", dict(method=method, temperature=inp["temps"])),
                  (f"{method} draft rows", dict(method=method, temperature=inp["temps"], draft_logits=inp["draft"])),
                  (f"{method} logprobs", dict(method=method, temperature=inp["temps"], draft_logits=inp["draft"],
                                              draft_logprobs=inp["logprobs"]))]
    lens = torch.arange(n) % (k + 1)
    surv = torch.rand(n, k, generator=torch.Generator().manual_seed(5)).sort(-1, descending=True).values
    stops = inp["drafts"][3 % n, :1].clone()
    modes += [("token packed+lens+survival+stops", dict(method="token", temperature=0.9, draft_logits=inp["draft"],
                                                        packed=True, verify_lens=lens, survival=surv,
                                                        thresholds=torch.full((k,), 0.3), stop_token_ids=stops)),
              ("block packed+stops", dict(method="block", temperature=inp["temps"], packed=True,
                                          stop_token_ids=stops))]
    return modes


def _packed(target, lens):
    """Packed [R, V] rows (L_r + 1 per request) and cu_seqlens."""
    rows = [target[r, : int(lens[r]) + 1] for r in range(target.shape[0])]
    cu = torch.tensor([0] + [x.shape[0] for x in rows]).cumsum(0)
    return torch.cat(rows), cu


def check_verify(rank, spans, vocab, inp, modes, seed=11, backend="reference"):
    start, size = spans[rank]
    for i, (name, kw) in enumerate(modes):
        kw = dict(kw)
        target = inp["target"]
        if kw.pop("packed", False):
            target, kw["cu_seqlens"] = _packed(target, (torch.arange(target.shape[0]) * 2 + 1) % target.shape[1])
        ref = dk.verify_chain(target, inp["drafts"], seed=seed, offset=i, backend="reference", **kw)
        draft = kw.pop("draft_logits", None)
        out = D.verify_chain(target[..., start:start + size], inp["drafts"], vocab_start=start, vocab_size=vocab,
                             draft_logits_shard=None if draft is None else draft[..., start:start + size],
                             seed=seed, offset=i, backend=backend, **kw)
        for field, a, b in zip(ref._fields, ref, out):
            assert torch.equal(a, b), (rank, name, field, a, b)


def draft_inputs(n, k, vocab, kind, seed, d=6, r=5):
    g = torch.Generator().manual_seed(seed)
    head = dk.MarkovHead(kind, torch.randn(vocab, r, generator=g), torch.randn(vocab, r, generator=g) * 0.5)
    if kind == "gated":
        head.wg, head.bg = torch.randn(r, d + r, generator=g), torch.randn(r, generator=g)
    if kind == "rnn":
        head.wj, head.bj = torch.randn(3 * r, 2 * r + d, generator=g), torch.randn(3 * r, generator=g)
    conf = dk.ConfidenceHead(torch.randn(d + r, generator=g), 0.3, torch.rand(k, generator=g) + 0.5)
    base = torch.randn(n, k, vocab, generator=g) * 2
    anchors = torch.randint(0, vocab, (n,), generator=g)
    anchors[-1] = -5   # out of range: a zero embedding
    return base, anchors, head, torch.randn(n, k, d, generator=g), conf


def check_draft(rank, spans, vocab, n, k, kinds, temps, seed=3, backend="reference"):
    start, size = spans[rank]
    for i, kind in enumerate(kinds):
        base, anchors, head, hidden, conf = draft_inputs(n, k, vocab, kind, seed + i)
        for j, t in enumerate(temps):
            ref = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, temperature=t, seed=seed,
                                 offset=j, return_logits=True, backend="reference")
            shard = dk.MarkovHead(kind, head.w1, head.w2[start:start + size], head.wg, head.bg, head.wj, head.bj)
            out = D.draft_block(base[..., start:start + size], anchors, shard, vocab_start=start, vocab_size=vocab,
                                hidden=hidden, confidence=conf, temperature=t, seed=seed, offset=j,
                                return_logits=True, backend=backend)
            assert torch.equal(ref.tokens, out.tokens), (rank, kind, t, ref.tokens, out.tokens)
            for a, b in ((ref.draft_logprobs, out.draft_logprobs), (ref.conf_logits, out.conf_logits),
                         (ref.survival, out.survival), (ref.logits[..., start:start + size], out.logits)):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, equal_nan=True)


def mixed_temps(n):
    return torch.tensor([0.0, 1.0, 0.6, 1.5] * n)[:n]


# ------------------------------------------------------------------------------------------------ groups
def _group_three_ranks(rank, world):
    """V = 1000 over 3 ranks in a permuted vocabulary order, every verify mode; every Markov head."""
    vocab = 1000
    spans = shard_spans(even_sizes(vocab, world), order=[1, 2, 0])
    inp = verify_inputs(8, 4, vocab, seed=0)
    check_verify(rank, spans, vocab, inp, verify_modes(inp))
    check_draft(rank, spans, vocab, 5, 4, ("vanilla", "gated", "rnn"), (0.0, mixed_temps(5)))
    # the Triton pieces (the interpreter on the CPU): the stats pass, the decide step, the residual pass, draft_step
    triton_modes = ("greedy", "token draft rows", "block draft rows", "token packed+lens+survival+stops")
    check_verify(rank, spans, vocab, inp, [m for m in verify_modes(inp) if m[0] in triton_modes], backend="triton")
    check_draft(rank, spans, vocab, 5, 4, ("rnn",), (mixed_temps(5),), backend="triton")


def _group_one_token_shards(rank, world):
    """V = 1000 over 4 ranks, two of them one token wide, holding argmaxes and drafts; NaN, +inf and all -inf
    rows."""
    vocab = 1000
    spans = shard_spans([1, 499, 499, 1], order=[2, 0, 3, 1])     # rank 2 holds token 0, rank 1 token 999
    inp = verify_inputs(6, 3, vocab, seed=1, force_tokens=(0, 999, 999))
    inp["drafts"][3] = torch.tensor([0, 999, 999])
    inp["target"][4, 1, 500] = float("nan")    # a row torch.softmax turns into NaN
    inp["target"][5, 2] = float("-inf")        # a row without a finite logit
    inp["draft"][3, 0, 7] = float("inf")       # a draft row softmax turns into NaN
    check_verify(rank, spans, vocab, inp, verify_modes(inp, methods=("token", "block"))[:5])
    triton_modes = ("greedy", "token one-hot", "token draft rows", "block one-hot")   # Triton stats and decide
    check_verify(rank, spans, vocab, inp, [m for m in verify_modes(inp) if m[0] in triton_modes], backend="triton")
    check_draft(rank, spans, vocab, 4, 3, ("gated",), (0.0, mixed_temps(4)))


def _group_large_vocab(rank, world, backend="auto"):
    """V = 32003 over 2 ranks: draft_block (return_logits) feeding verify_chain with its shard of the draft logits
    and its draft_logprobs, against the unsharded chain. ``backend``: of the local pieces."""
    vocab, n, k = 32003, 3, 3
    spans = shard_spans(even_sizes(vocab, world))
    start, size = spans[rank]
    base, anchors, head, hidden, conf = draft_inputs(n, k, vocab, "rnn", seed=7)
    temps = torch.tensor([0.0, 1.0, 0.8])
    ref_d = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, temperature=temps, seed=2,
                           return_logits=True, backend="reference")
    shard = dk.MarkovHead("rnn", head.w1, head.w2[start:start + size], wj=head.wj, bj=head.bj)
    out_d = D.draft_block(base[..., start:start + size], anchors, shard, vocab_start=start, vocab_size=vocab,
                          hidden=hidden, confidence=conf, temperature=temps, seed=2, return_logits=True,
                          backend=backend)
    assert torch.equal(ref_d.tokens, out_d.tokens)
    target = ref_d.logits.new_zeros(n, k + 1, vocab)
    target[:, :k] = ref_d.logits + torch.randn(n, k, vocab, generator=torch.Generator().manual_seed(3))
    target[:, k] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * 2
    for method in ("token", "block"):
        ref = dk.verify_chain(target, ref_d.tokens, draft_logits=ref_d.logits, draft_logprobs=ref_d.draft_logprobs,
                              temperature=temps, seed=9, method=method, backend="reference")
        out = D.verify_chain(target[..., start:start + size], out_d.tokens, vocab_start=start, vocab_size=vocab,
                             draft_logits_shard=out_d.logits, draft_logprobs=out_d.draft_logprobs,
                             temperature=temps, seed=9, method=method, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), (method, ref, out)


def _group_cuda_one_token_shards(rank, world):
    """P = 4 with two one-token shards holding argmaxes and drafts (NaN, +inf and all -inf rows): the CUDA pieces."""
    vocab = 1000
    spans = shard_spans([1, 499, 499, 1], order=[2, 0, 3, 1])
    inp = verify_inputs(6, 3, vocab, seed=1, force_tokens=(0, 999, 999))
    inp["drafts"][3] = torch.tensor([0, 999, 999])
    inp["target"][4, 1, 500] = float("nan")
    inp["target"][5, 2] = float("-inf")
    inp["draft"][3, 0, 7] = float("inf")
    check_verify(rank, spans, vocab, inp, verify_modes(inp), backend="cuda")
    check_draft(rank, spans, vocab, 4, 3, ("gated",), (0.0, mixed_temps(4)), backend="cuda")


def _group_cuda_pieces(rank, world):
    """V = 1000 over 3 uneven ranks (one of them a single token): the CUDA pieces on every rank (the SIMT harness on
    the CPU): draft_step (greedy and mixed temperatures, a vanilla and an rnn head), verify_stats, verify_decide and
    verify_residual (every verify mode; block verification's S_i goes through the residual pass)."""
    vocab = 1000
    cpu = torch.device("cpu")
    pieces = ("draft_step", "verify_stats", "verify_decide", "verify_residual", "draft_logprobs")
    assert [D.ops.piece_backend("cuda", cpu, p) for p in pieces] == ["cuda"] * 4 + ["reference"]
    spans = shard_spans([1, 600, 399], order=[1, 0, 2])
    check_draft(rank, spans, vocab, 5, 3, ("vanilla", "rnn"), (0.0, mixed_temps(5)), backend="cuda")
    inp = verify_inputs(6, 3, vocab, seed=2, force_tokens=(0,))
    check_verify(rank, spans, vocab, inp, verify_modes(inp), backend="cuda")


@pytest.mark.parametrize("world,group,args", [
    (3, "_group_cuda_pieces", ()), (4, "_group_cuda_one_token_shards", ()),
    pytest.param(2, "_group_large_vocab", ("cuda",), marks=pytest.mark.harness_slow),  # V = 32003: CI's slow leg
    (2, "_second_exchange_case", ("cuda",))], ids=["P3-every-mode", "P4-one-token", "P2-V32003", "P2-second-exchange"])
def test_sharded_ops_with_the_cuda_pieces(cuda_device, world, group, args):
    """P = 3 with every mode; P = 4 with one-token shards; P = 2 over V = 32003 (draft_block feeding verify_chain)
    and a token only the second exchange gives."""
    if cuda_device.type != "cpu":
        pytest.skip("gloo groups of CPU processes: the SIMT harness on each rank")
    spawn(world, globals()[group], *args)


@pytest.mark.slow
@pytest.mark.parametrize("world,group", [(3, _group_three_ranks), (4, _group_one_token_shards),
                                         (2, _group_large_vocab)], ids=["P3-V1000", "P4-one-token", "P2-V32003"])
def test_sharded_equals_unsharded(world, group):
    """The reference and Triton pieces on every rank against the unsharded chain (spawned gloo groups, 20-100 CPU
    seconds each: CI's slow leg). The default run keeps the same modes and the one-token shards through the CUDA
    pieces (test_sharded_ops_with_the_cuda_pieces) and each Triton piece against the reference in one process
    (test_triton_verify_*_equals_the_reference)."""
    spawn(world, group)


# ------------------------------------------------------------------------------------------------ second exchange
def _second_exchange_case(rank, world, backend="reference"):
    """A flat row rejecting a one-hot draft d whose race key is the row's best, the second best in the same shard:
    the first decide call names the emitting row (its token -1), and the second exchange's residual race decides
    (the second best: the race over p would give d). ``backend``: of the pieces (each piece's choice,
    ops.piece_backend)."""
    piece = lambda name: D.ops.piece_backend(backend, torch.device("cpu"), name)  # noqa: E731
    vocab, half = 64, 32
    start, size = shard_spans([half, half])[rank]
    ids = torch.arange(vocab)
    for off in range(500):
        keys = -torch.log(-torch.log(uniform(make_rng_key(5, off, "cpu"), 0, 0, STREAM_RESIDUAL, ids)))
        top2 = keys.topk(2).indices
        if bool((top2 < half).all()):
            break
    target = torch.zeros(1, 2, vocab)
    drafts = top2[:1].view(1, 1)
    temps = torch.ones(1)
    ref = dk.verify_chain(target, drafts, temperature=temps, seed=5, offset=off, backend="reference")
    assert ref.num_accepted.item() == 0 and ref.tokens[0, 0].item() == top2[1].item()
    out = D.verify_chain(target[..., start:start + size], drafts, vocab_start=start, vocab_size=vocab,
                         temperature=temps, seed=5, offset=off, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    # the local pieces by hand: the plan asks for the emitting row, whose token the second exchange gives
    key = make_rng_key(5, off, "cpu")
    shards = torch.tensor(shard_spans([half, half]))
    stats = D.comm.all_gather(D.ops.verify_stats(target[..., start:start + size], None, drafts, None, temps, start,
                                                 vocab, piece("verify_stats")), None)
    args = (None, 0, drafts, None, None, None, None, temps, key, None, "token", False, vocab, piece("verify_decide"))
    first = D.ops.verify_decide(stats, shards, None, *args)
    assert first[3][0, 0, L.PLAN_NEED].item() == 1.0 and first[3][0, 0, L.PLAN_ROW].item() == 0.0
    assert first[0][0, 0].item() == -1
    res = D.ops.verify_residual(target[..., start:start + size], None, drafts, None, first[3], temps, key, start,
                                vocab, piece("verify_residual"))
    final = D.ops.verify_decide(stats, shards, D.comm.all_gather(res, None), *args)
    assert torch.equal(final[0], ref.tokens)


def _traffic_case(rank, world):
    """The bytes counted on the collectives equal the model the bench uses."""
    vocab = 50
    start, size = shard_spans(even_sizes(vocab, world))[rank]
    inp = verify_inputs(4, 3, vocab, seed=2)
    for method, draft, temps in (("token", True, inp["temps"]), ("block", False, inp["temps"]), ("token", False, 0.0)):
        with D.count_traffic() as t:
            D.verify_chain(inp["target"][..., start:start + size], inp["drafts"], vocab_start=start, vocab_size=vocab,
                           draft_logits_shard=inp["draft"][..., start:start + size] if draft else None,
                           temperature=temps, method=method)
        model = D.traffic.verify_calls(4, 3, world, sampled=not isinstance(temps, float), draft_logits=draft,
                                       method=method)
        assert t.calls == model.calls, (t.calls, model.calls)
    base, anchors, head, hidden, conf = draft_inputs(4, 3, vocab, "vanilla", seed=1)
    with D.count_traffic() as t:
        D.draft_block(base[..., start:start + size], anchors, dk.MarkovHead("vanilla", head.w1,
                      head.w2[start:start + size]), vocab_start=start, vocab_size=vocab, temperature=1.0)
    assert t.calls == D.traffic.draft_calls(4, 3, world).calls


# ------------------------------------------------------------------------------------------------ bad input
def _bad_input_cases(rank, world):
    """Every rank raises, and the group stays usable for the next case (nobody is left inside a collective)."""
    vocab, n, k = 100, 4, 2
    inp = verify_inputs(n, k, vocab, seed=4)

    def verify(span, drafts=inp["drafts"], **kw):
        start, size = span
        return D.verify_chain(inp["target"][:drafts.shape[0], :, start:start + size], drafts, vocab_start=start,
                              vocab_size=vocab, **kw)

    with pytest.raises(D.ShardLayoutError, match=r"do not tile \[0, 100\).*overlaps"):
        verify([(0, 60), (50, 50)][rank])
    with pytest.raises(D.ShardLayoutError, match=r"leaves \[50, 60\) to no rank"):
        verify([(0, 50), (60, 40)][rank])
    with pytest.raises(D.ShardLayoutError, match=r"they end at 90"):
        verify([(0, 50), (50, 40)][rank])
    good = shard_spans([50, 50])[rank]
    with pytest.raises(D.ShardLayoutError, match=r"N \(draft_tokens.shape\[0\]\) differs across ranks "
                                                 r"\(rank 0: 4, rank 1: 3\)"):
        verify(good, drafts=inp["drafts"][: n - rank])
    with pytest.raises(D.ShardLayoutError, match=r"sampling \(temperature\) differs"):
        verify(good, temperature=[0.0, inp["temps"]][rank])
    if rank == 1:
        with pytest.raises(ValueError, match=r"draft_tokens must have dtype"):
            verify(good, drafts=inp["drafts"].float())
        with pytest.raises(ValueError, match=r"\[vocab_start, vocab_start \+ Vl\) = \[50, 150\)"):
            D.verify_chain(torch.zeros(n, k + 1, 100), inp["drafts"], vocab_start=50, vocab_size=vocab)
    else:
        for _ in range(2):
            with pytest.raises(D.ShardLayoutError, match=r"rank\(s\) \[1\] rejected their arguments"):
                verify(good)
    base, anchors, head, _, _ = draft_inputs(n, k, vocab, "vanilla", seed=1)
    w2 = head.w2[good[0]:good[0] + good[1] - rank]          # rank 1: one row short
    if rank == 1:
        with pytest.raises(ValueError, match=r"head_shard.w2 must have shape \[50, 5\]"):
            D.draft_block(base[..., 50:], anchors, dk.MarkovHead("vanilla", head.w1, w2), vocab_start=50,
                          vocab_size=vocab)
    else:
        with pytest.raises(D.ShardLayoutError, match=r"rank\(s\) \[1\] rejected"):
            D.draft_block(base[..., :50], anchors, dk.MarkovHead("vanilla", head.w1, w2), vocab_start=0,
                          vocab_size=vocab)
    assert torch.equal(verify(good).tokens, dk.verify_chain(inp["target"], inp["drafts"]).tokens)  # still usable


def _second_exchange_and_bad_input(rank, world):
    _second_exchange_case(rank, world)
    _traffic_case(rank, world)
    _bad_input_cases(rank, world)


def test_second_exchange_traffic_and_bad_input():
    """P = 2: the second exchange of a sampled call, the bytes counted against the model, bad input."""
    spawn(2, _second_exchange_and_bad_input)


# ------------------------------------------------------------------------------------------------ spawn itself
def _abort_once(rank, world, marker):
    """Rank 1 aborts (SIGABRT) the first time the group runs, then passes; ``marker`` counts the runs."""
    import os
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    if rank == 1 and open(marker).read().count("1\n") == 1:
        os.abort()


def _raise_once(rank, world, marker):
    """Rank 1 raises the first time the group runs (a test failure: never run again)."""
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    if rank == 1 and open(marker).read().count("1\n") == 1:
        raise ValueError("rank 1 fails")


def test_spawn_runs_an_aborted_group_once_more_and_nothing_else(tmp_path):
    """A rank killed by SIGABRT (gloo's std::terminate) reruns the group once; a Python exception fails at once."""
    marker = tmp_path / "abort"
    spawn(2, _abort_once, str(marker))
    assert sorted(marker.read_text().split()) == ["0", "0", "1", "1"]
    marker = tmp_path / "raise"
    with pytest.raises(torch.multiprocessing.ProcessRaisedException):  # rank 1's error, or rank 0's broken barrier
        spawn(2, _raise_once, str(marker))
    assert sorted(marker.read_text().split()) == ["0", "1"]


# ------------------------------------------------------------------------------------------------ losslessness
def _joint_law_cases(rank, world):
    """test_verify_chain's joint-law simulation with every verify call going through the sharded path (shards
    [0, 1) and [1, 4) of V = 4), each call checked against the unsharded reference on the same inputs."""
    import test_verify_chain as tvc
    start, size = shard_spans([1, 3])[rank]
    unsharded = dk.verify_chain

    def sharded(target, drafts, *, draft_logits, backend, **kw):
        ref = unsharded(target, drafts, draft_logits=draft_logits, backend="reference", **kw)
        out = D.verify_chain(target[..., start:start + size], drafts, vocab_start=start, vocab_size=target.shape[-1],
                             draft_logits_shard=draft_logits[..., start:start + size], **kw)
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), (kw, ref, out)
        return out

    dk.verify_chain = sharded
    try:
        for method, use_logprobs in (("block", False), ("token", True)):
            tokens, p = tvc.simulate_joint(method, "reference", tvc.JOINT_TRIALS, tvc.JOINT_SEED, use_logprobs)
            assert tvc.joint_passes(tokens, p), (method, rank)
    finally:
        dk.verify_chain = unsharded


def _sampled_draft_law(rank, world, backend="reference", trials=3000, sizes=(7, 23), temp=0.8):
    """``trials`` copies of one request drafted at T through the sharded path (shards of ``sizes``, in rank order;
    vanilla head): position 0's drafts against softmax(logits_0 / T); position 1's against the mean over the requests
    of softmax((U_1 + W2 W1[x_0]) / T) at the token x_0 each drew (the vanilla bias, computed here by hand)."""
    from stats import counts, passes
    vocab, k = sum(sizes), 2
    start, size = shard_spans(sizes)[rank]
    base, _, head, _, _ = draft_inputs(1, k, vocab, "vanilla", seed=12)
    base, anchors = base.expand(trials, -1, -1).contiguous(), torch.full((trials,), 3)
    out = D.draft_block(base[..., start:start + size], anchors, dk.MarkovHead("vanilla", head.w1,
                        head.w2[start:start + size]), vocab_start=start, vocab_size=vocab, temperature=temp,
                        seed=6, backend=backend)
    tokens = out.tokens
    logits = base + torch.stack([head.w1[anchors], head.w1[tokens[:, 0]]], 1) @ head.w2.T   # [N, K, V]
    for j in range(k):
        expected = torch.softmax(logits[:, j] / temp, -1).sum(0).double()
        assert passes(counts(tokens[:, j], vocab), expected), (rank, j)
    assert not passes(counts(tokens[:, 0], vocab), torch.softmax(logits[:, 0], -1).sum(0).double())  # T ignored


def test_sharded_sampled_drafts_follow_the_draft_softmax():
    """Null hypothesis: the sharded draft_block's sampled drafts (the packed race winners' all-reduce) follow
    softmax(logits_k / T) over the whole vocabulary; P = 2 over the reference pieces."""
    spawn(2, _sampled_draft_law)


@pytest.mark.harness_slow  # 3000 requests through the SIMT harness on two ranks (~1.5 min): CI's slow leg
def test_sharded_sampled_drafts_follow_the_draft_softmax_with_the_cuda_pieces(cuda_device):
    """Null hypothesis: as above, each rank's draft step through the CUDA kernels (the SIMT harness)."""
    if cuda_device.type != "cpu":
        pytest.skip("gloo groups of CPU processes: the SIMT harness on each rank")
    spawn(2, _sampled_draft_law, "cuda")


@pytest.mark.slow  # ~15 s: a request's draft step costs ~25 ms on each rank in the Triton interpreter
def test_sharded_sampled_drafts_follow_the_draft_softmax_with_the_triton_pieces():
    """Null hypothesis: as above, each rank's draft step through the Triton kernel (the interpreter); 250 requests
    over shards of 3 and 5 ids at T = 2, where a sampler at T = 1 or 4 fails the same test at position 0."""
    if torch.cuda.is_available():
        pytest.skip("gloo groups of CPU processes: the Triton pieces run on CPU tensors in the interpreter only")
    spawn(2, _sampled_draft_law, "triton", 250, (3, 5), 2.0)


def test_draft_block_refuses_a_reduced_draft_vocabulary():
    """Sharding a draft vocabulary is not built: a head with draft_to_target is an error naming it (validate=False
    raises before any collective, so no process group is needed)."""
    base, anchors, head, _, _ = draft_inputs(2, 3, 20, "vanilla", seed=2)
    mapped = dk.MarkovHead("vanilla", head.w1, head.w2[:8], draft_to_target=torch.arange(8) * 2)
    with pytest.raises(ValueError, match=r"head_shard\.draft_to_target"):
        D.draft_block(base[..., :8], anchors, mapped, vocab_start=0, vocab_size=8, validate=False)


def test_draft_block_refuses_a_head_that_is_not_a_markov_head():
    """A head_shard that is not a MarkovHead is this rank's error naming it, raised where every rank's errors are
    (validate=False: before any collective), not an AttributeError that would leave the other ranks waiting."""
    base, anchors, _, _, _ = draft_inputs(2, 3, 20, "vanilla", seed=2)
    for head in (None, "vanilla"):
        with pytest.raises(TypeError, match=r"head_shard must be a dk\.MarkovHead"):
            D.draft_block(base, anchors, head, vocab_start=0, vocab_size=20, validate=False)


def test_sharded_joint_law_of_two_tokens():
    """Chi-square of the joint law of two generated tokens through the sharded path (token with draft_logprobs,
    block), on a one-token shard and a three-token one; the same case's power is shown in test_verify_chain
    (test_joint_law_detects_a_block_residual_without_rho)."""
    spawn(2, _joint_law_cases)


# ------------------------------------------------------------------------------------------------ local ops
def test_local_ops_opcheck():
    """Each local piece passes torch.library.opcheck (schema, fake, autograd registration) on a shard."""
    vocab, n, k, start, size = 30, 3, 2, 10, 12
    inp = verify_inputs(n, k, vocab, seed=6)
    key = make_rng_key(3, 1, "cpu")
    tgt, dr = inp["target"][..., start:start + size], inp["draft"][..., start:start + size]
    for draft, temps in ((dr, inp["temps"]), (None, inp["temps"]), (None, None)):
        args = (tgt, None, inp["drafts"], draft, temps, start, vocab, "reference")
        torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, args)
    shards = torch.tensor([[0, 15], [15, 15]])   # two shards' worth of statistics (the same one twice)
    for method, temps in (("token", inp["temps"]), ("block", inp["temps"]), ("token", None)):
        stats = torch.stack([D.ops.verify_stats(tgt, None, inp["drafts"], dr, temps, start, vocab, "reference")] * 2)
        dec = (stats, shards, None, None, 0, inp["drafts"], inp["logprobs"], None, None, None, temps, key, None,
               method, True, vocab, "reference")
        torch.library.opcheck(torch.ops.dspark_dist.verify_decide.default, dec)
        plan = D.ops.verify_decide(*dec)[3]
        if temps is not None:
            res = (tgt, None, inp["drafts"], dr, plan, temps, key, start, vocab, "reference")
            torch.library.opcheck(torch.ops.dspark_dist.verify_residual.default, res)
            residual = torch.stack([D.ops.verify_residual(*res)] * 2)
            torch.library.opcheck(torch.ops.dspark_dist.verify_decide.default, (stats, shards, residual) + dec[3:])
    base, anchors, head, _, _ = draft_inputs(n, k, vocab, "vanilla", seed=2)
    v = torch.randn(n, head.w1.shape[1])
    for temps, ret in ((mixed_temps(n), True), (None, False)):
        step = (base[:, 0, start:start + size], v, head.w2[start:start + size], temps, key, 1, start, ret,
                "reference")
        torch.library.opcheck(torch.ops.dspark_dist.draft_step.default, step)
    part = torch.stack([D.ops.draft_step(*step)[1]] * k, dim=1)
    torch.library.opcheck(torch.ops.dspark_dist.draft_logprobs.default,
                          (torch.stack([part, part]), torch.zeros(n, k, dtype=torch.int64), "reference"))


def test_reference_and_triton_pieces_refuse_bad_input():
    """The reference and Triton backends of the pieces with kernels check what the CUDA launchers check (no kernel
    reads past an input): a ValueError naming the argument, for each piece."""
    vocab, n, k, start, size = 30, 3, 2, 10, 12
    inp = verify_inputs(n, k, vocab, seed=6)
    key = make_rng_key(3, 1, "cpu")
    tgt, dr = inp["target"][..., start:start + size], inp["draft"][..., start:start + size]
    drafts, temps = inp["drafts"], inp["temps"]
    stats_args = (tgt, None, drafts, dr, temps, start, vocab)
    stats = torch.stack([D.ops.verify_stats(*stats_args, "reference")] * 2)
    shards = torch.tensor([[0, 15], [15, 15]])
    decide_args = (stats, shards, None, None, 0, drafts, None, None, None, None, temps, key, None, "token", True, vocab)
    plan = D.ops.verify_decide(*decide_args, "reference")[3]
    residual_args = (tgt, None, drafts, dr, plan, temps, key, start, vocab)
    g = torch.Generator().manual_seed(0)
    step_args = (torch.randn(n, size, generator=g), torch.randn(n, 5, generator=g), torch.randn(size, 5, generator=g),
                 temps, key, 1, start, True)
    cases = [
        ("verify_stats", stats_args, 0, tgt[:2], r"target_shard must have shape \[3, 3, \*\]"),
        ("verify_stats", stats_args, 3, dr[:, :1], r"draft_logits_shard must have shape \[3, 2, 12\]"),
        ("verify_stats", stats_args, 4, temps[:2], r"temperature must have shape \[3\]"),
        ("verify_stats", stats_args, 4, temps.double(), r"temperature must have dtype in \(float32\)"),
        ("verify_stats", stats_args, 6, 20, r"\[10, 22\) must lie in \[0, vocab_size = 20\)"),
        ("verify_stats", stats_args, 2, drafts.float(), "draft_tokens must have dtype"),
        ("verify_decide", decide_args, 0, stats[..., :4], r"stats must have shape \[\*, 3, 3, 10\]"),
        ("verify_decide", decide_args, 1, shards[:1], r"shards must have shape \[2, 2\]"),
        ("verify_decide", decide_args, 2, torch.zeros(2, n, 3, L.RES_WIDTH),
         r"residual must have shape \[2, 3, 1, 5\]"),
        ("verify_decide", decide_args, 3, torch.zeros(n, dtype=torch.int64), r"cu_seqlens must have shape \[4\]"),
        ("verify_decide", decide_args, 11, key[:1], r"rng_key must have shape \[2\]"),
        ("verify_decide", decide_args, 13, "greedy", "method must be one of"),
        ("verify_residual", residual_args, 4, plan[:, :, :5], r"plan must have shape \[3, \*, 9\]"),
        ("verify_residual", residual_args, 5, None, "temperature is required"),
        ("draft_step", step_args, 2, step_args[2][:-1], r"w2_shard must have shape \[12, 5\]"),
        ("draft_step", step_args, 1, step_args[1][:2], r"v must have shape \[3, \*\]"),
        ("draft_step", step_args, 3, temps[:2], r"temperature must have shape \[3\]"),
    ]
    for piece, args, i, value, msg in cases:
        wrong = list(args)
        wrong[i] = value
        for backend in ("reference", "triton"):
            with pytest.raises(ValueError, match=msg):
                getattr(D.ops, piece)(*wrong, backend)


def test_triton_draft_step_equals_the_reference():
    """The Triton draft_step (interpreter on the CPU): the same winners, statistics to 1e-5, on odd shard sizes,
    greedy and mixed temperatures, a row holding a NaN and a row of -inf."""
    from dspark_kernels.distributed.local_draft import unpack_id
    key = make_rng_key(4, 9, "cpu")
    for n, local, r in ((4, 1, 3), (5, 300, 40), (3, 257, 7)):
        g = torch.Generator().manual_seed(local)
        base = torch.randn(n, 2, local, generator=g)[:, 1]          # a strided row of U
        base[0, local // 2] = float("nan")
        base[n - 1] = float("-inf")
        v, w2 = torch.randn(n, r, generator=g), torch.randn(local, r, generator=g)
        for temps in (None, mixed_temps(n)):
            args = (base, v, w2, temps, key, 3, 500, True)
            ref, out = D.ops.draft_step(*args, "reference"), D.ops.draft_step(*args, "triton")
            assert torch.equal(unpack_id(ref[0]), unpack_id(out[0])), (n, local, temps)
            torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5, equal_nan=True)
            torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-5, equal_nan=True)
    clean = (torch.randn(3, 257), v, w2, mixed_temps(3), key, 3, 500, True, "triton")   # opcheck compares NaN != NaN
    torch.library.opcheck(torch.ops.dspark_dist.draft_step.default, clean)


def test_triton_verify_residual_equals_the_reference():
    """The Triton residual pass (interpreter on the CPU) against the reference, on the plans the decide step makes:
    token and block, dense and packed, one-hot drafts and draft rows, a NaN row, plan rows outside [0, K] (read as
    the clamped row); winners (of both races) equal, masses to 1e-5."""
    vocab, n, k, start, size = 700, 6, 3, 200, 301
    inp = verify_inputs(n, k, vocab, seed=8)
    inp["target"][2, 1, 250] = float("nan")
    key = make_rng_key(2, 5, "cpu")
    shards = torch.tensor([[0, 200], [200, 301], [501, 199]])
    sl = lambda x: x[..., start:start + size]
    for method, draft, packed in (("token", True, False), ("block", True, True), ("block", False, False),
                                  ("token", False, True)):
        target, cu = inp["target"], None
        if packed:
            target, cu = _packed(target, torch.arange(n) % (k + 1))
        dr = inp["draft"] if draft else None
        stats = torch.stack([D.ops.verify_stats(target[..., a:a + b], cu, inp["drafts"], None if dr is None else
                                                dr[..., a:a + b], inp["temps"], a, vocab, "reference")
                             for a, b in shards.tolist()])
        plan = D.ops.verify_decide(stats, shards, None, cu, target.shape[0] if packed else 0, inp["drafts"], None,
                                   None, None, None, inp["temps"], key, None, method, draft, vocab, "reference")[3]
        plan[..., L.PLAN_NEED] = 1.0         # every slot, so the comparison covers every row
        plan[0, -1, L.PLAN_ROW] = k + 5.0    # rows outside [0, K]: the clamped row, its uniforms included
        plan[1, -1, L.PLAN_ROW] = -3.0
        args = (sl(target), cu, inp["drafts"], None if dr is None else sl(dr), plan, inp["temps"], key, start, vocab)
        ref, out = D.ops.verify_residual(*args, "reference"), D.ops.verify_residual(*args, "triton")
        ids = [L.RES_ID, L.RES_GID]
        assert torch.equal(out[..., ids], ref[..., ids]), (method, draft, packed)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    clean = args[:2] + (inp["drafts"].clamp(0, vocab - 1),) + args[3:] + ("triton",)
    torch.library.opcheck(torch.ops.dspark_dist.verify_residual.default, clean)


def test_triton_pieces_read_a_strided_temperature():
    """The Triton pieces that take the temperature (stats, residual, draft_step) read a strided one (a column of an
    [N, 2] tensor, as distributed.verify_chain passes a float32 view on) as the reference does."""
    from dspark_kernels.distributed.local_draft import unpack_id
    vocab, n, k, start, size = 40, 4, 2, 10, 17
    inp = verify_inputs(n, k, vocab, seed=3)
    temps = torch.stack([torch.tensor([0.3, 1.0, 0.0, 2.5]), torch.full((n,), 50.0)], dim=1)[:, 0]
    key = make_rng_key(1, 2, "cpu")
    tgt, dr = inp["target"][..., start:start + size], inp["draft"][..., start:start + size]
    args = (tgt, None, inp["drafts"], dr, temps, start, vocab)
    ref = D.ops.verify_stats(*args, "reference")
    torch.testing.assert_close(D.ops.verify_stats(*args, "triton"), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    shards = torch.tensor([[0, start], [start, size], [start + size, vocab - start - size]])
    stats = torch.stack([ref] * 3)
    plan = D.ops.verify_decide(stats, shards, None, None, 0, inp["drafts"], None, None, None, None, temps, key, None,
                               "block", True, vocab, "reference")[3]
    plan[..., L.PLAN_NEED] = 1.0
    args = (tgt, None, inp["drafts"], dr, plan, temps, key, start, vocab)
    ref, out = D.ops.verify_residual(*args, "reference"), D.ops.verify_residual(*args, "triton")
    assert torch.equal(out[..., [L.RES_ID, L.RES_GID]], ref[..., [L.RES_ID, L.RES_GID]])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(n, size, generator=g), torch.randn(n, 3, generator=g), torch.randn(size, 3, generator=g),
            temps, key, 1, start, True)
    ref, out = D.ops.draft_step(*args, "reference"), D.ops.draft_step(*args, "triton")
    assert torch.equal(unpack_id(out[0]), unpack_id(ref[0]))
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)


def _stats_case_inputs(n, k, local, vocab_start, vocab, dtype, seed):
    """Target / draft shards with a NaN, a +inf, an all -inf row, a row with three finite logits (the race's
    lowest-id rule over -inf keys), an argmax tied across the shard (and across tiles), drafts on and off it."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, k + 1, local, generator=g) * 2
    draft = target[:, :k] + torch.randn(n, k, local, generator=g)
    target[0, 0, local // 2] = float("nan")
    target[1, k] = float("-inf")
    target[2, 1] = float("-inf")
    target[2, 1, :3] = torch.tensor([0.5, -1.0, 2.0])[:local]
    target[n - 1, 0, local - 1] = float("inf")
    target[3 % n, 2 % (k + 1), :] = 0.0                                     # every column ties
    target[0, 1, local - 1] = target[0, 1, 0] = target[0, 1].max() + 1     # a tie: the lowest id wins
    draft[1, 0, local // 3] = float("nan")
    drafts = torch.randint(0, vocab, (n, k), generator=g)
    drafts[0] = vocab_start + torch.arange(k) % local                      # owned by the shard
    drafts[1, k - 1] = vocab + 3                                            # out of range: reads token 0
    drafts[2, 0] = -1
    return target.to(dtype), draft.to(dtype), drafts


def test_triton_verify_stats_equals_the_reference():
    """The Triton stats pass (interpreter on the CPU) writes the reference's StatsLayout buffer: greedy, sampled
    (mixed greedy requests) with one-hot drafts and with draft rows; dense and packed; float32, bfloat16, float16;
    shards of 1, 5, 333 and 1000 tokens, vocab_start > 0; one tile and many (block_v = 64). Ids and argmax values
    exactly; the other floats to rtol 1e-5, atol 1e-6 (sums in another order)."""
    from dspark_kernels.distributed.triton_stats import verify_stats as triton_stats
    n, k = 4, 2
    temps = torch.tensor([0.0, 1.0, 0.7, 1.6])
    for local, start, vocab, dtype, packed, block in ((1, 999, 1000, torch.float32, False, None),
                                                      (5, 0, 1000, torch.bfloat16, True, None),
                                                      (333, 200, 1000, torch.bfloat16, False, 64),
                                                      (333, 667, 1000, torch.float16, True, 128),
                                                      (1000, 400, 1400, torch.float32, True, None)):
        target, draft, drafts = _stats_case_inputs(n, k, local, start, vocab, dtype, seed=local)
        cu = None
        if packed:
            target, cu = _packed(target, torch.tensor([k, 0, 1, k]))
        for t, d in ((None, None), (temps, None), (temps, draft)):
            args = (target, cu, drafts, d, t, start, vocab)
            ref = D.ops.verify_stats(*args, "reference")
            out = triton_stats(*args, block_v=block)
            case = (local, start, dtype, packed, block, t is not None, d is not None)
            exact = [L.AMAX_VAL, L.AMAX_ID]
            assert torch.equal(out[..., exact], ref[..., exact]), case
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{case}: {m}")
    assert torch.equal(D.ops.verify_stats(*args, "triton"), out)            # the op dispatches to the kernel
    g = torch.Generator().manual_seed(1)
    clean = (torch.randn(3, k + 1, 40, generator=g), None, drafts[:3].clamp(0, 99), torch.randn(3, k, 40, generator=g),
             temps[:3], 60, 100, "triton")                                   # opcheck compares NaN != NaN
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean)
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean[:4] + (None,) + clean[5:])


def _decide_case_inputs(vocab, n, k, shards):
    """verify_inputs with the rows the decide step's branches need, and the random key: request 0 greedy-accepts
    the stop token 7; request 2's row 0 is flat and its draft is the row's race head, the second best in the same
    shard; request 3's p(d_1) = 0.9 (block's S_1 moves tau); a NaN, a +inf and an all -inf row."""
    inp = verify_inputs(n, k, vocab, seed=1, force_tokens=(0, 333))
    inp["drafts"][3] = torch.tensor([333, 0, 5])
    inp["target"][4, 1, 500] = float("nan")
    inp["target"][5, 2] = float("-inf")
    inp["draft"][4, 1, 7] = float("inf")
    inp["drafts"][0] = torch.tensor([5, 7, 9])
    inp["target"][0, torch.arange(k), inp["drafts"][0]] = 50.0
    rest = torch.cat([inp["target"][3, 0, :333], inp["target"][3, 0, 334:]]) / 1.3
    inp["target"][3, 0, 333] = 1.3 * (rest.logsumexp(0) + torch.log(torch.tensor(9.0)))
    inp["draft"][3, 0, 333] = inp["target"][3, 0, 333] + 5.0
    lo, hi = int(shards[0, 1]), int(shards[1, 0] + shards[1, 1])
    for off in range(100):
        key = make_rng_key(7, off, "cpu")
        top2 = uniform(key, 2, 0, STREAM_RESIDUAL, torch.arange(vocab)).topk(2).indices
        if bool((top2 < lo).all() or (top2 >= hi).all()):
            break
    inp["target"][2, 0] = 0.0
    inp["drafts"][2, 0] = top2[0]
    inp["draft"][2, 0, top2[0]] += 30.0
    t = torch.where(inp["temps"] > 0, inp["temps"], 1.0).view(n, 1, 1)
    inp["logprobs"] = torch.log_softmax(inp["draft"] / t, -1).gather(
        -1, inp["drafts"].clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    return inp, key


def _decide_stats(inp, shards, packed, draft, temps):
    """(target, cu_seqlens, the gathered first exchange [P, N, K+1, F]) of the reference stats pass over ``shards``;
    packed: request 1 has no row at all, the others 1 to K + 1 rows."""
    target, cu = inp["target"], None
    if packed:
        counts = torch.tensor([4, 0, 2, 4, 1, 3])[:target.shape[0]]
        target = torch.cat([target[r, :int(c)] for r, c in enumerate(counts)])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    stats = torch.stack([D.ops.verify_stats(target[..., a:a + b], cu, inp["drafts"], None if draft is None else
                                            draft[..., a:a + b], temps, a, inp["target"].shape[-1], "reference")
                         for a, b in shards.tolist()])
    return target, cu, stats


def _check_decide(args, case, backend):
    """The decide step of ``backend`` on ``args``: integer outputs equal to the reference's, the plan to 1e-5 /
    1e-6. "triton": the kernel itself (the interpreter on the CPU); "cuda": the op (the SIMT harness)."""
    from dspark_kernels.distributed.triton_decide import verify_decide as triton_decide
    ref = D.ops.verify_decide(*args, "reference")
    out = triton_decide(*args) if backend == "triton" else D.ops.verify_decide(*args, backend)
    for field, a, b in zip(("tokens", "num_accepted", "accept_mask"), ref[:3], out[:3]):
        assert torch.equal(a, b), (case, field, a, b)
    torch.testing.assert_close(out[3], ref[3], rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{case}: {m}")
    return ref


def _decide_cases(backend):
    """The decide step of ``backend`` against the reference, on the gathered statistics of three uneven shards (333,
    1 and 666 tokens of V = 1000): greedy, token and block with one-hot drafts, draft rows and draft_logprobs;
    dense and packed (a request without rows) with verify_lens and survival + thresholds; stop tokens, mixed
    temperatures with greedy requests, NaN / inf rows; the first call (no residual) and the second with the
    reference residual pass's exchange (the emitted tokens, block's S_i). tokens, num_accepted, accept_mask equal;
    the plan to rtol 1e-5, atol 1e-6. Returns the last call's arguments and the inputs of an opcheck (no NaN:
    opcheck compares NaN != NaN)."""
    vocab, n, k = 1000, 6, 3
    shards = torch.tensor([[0, 333], [333, 1], [334, 666]])
    inp, key = _decide_case_inputs(vocab, n, k, shards)
    surv = torch.rand(n, k, generator=torch.Generator().manual_seed(5)).sort(-1, descending=True).values
    surv[:4] = 1.0
    stops = torch.tensor([999, 7])
    needed = moved = 0
    for method, draft, logprobs, packed in itertools.product(("token", "block"), (False, True), (False, True),
                                                              (False, True)):
        if logprobs and not draft:
            continue
        dr = inp["draft"] if draft else None
        target, cu, stats = _decide_stats(inp, shards, packed, dr, inp["temps"])
        lens = (torch.tensor([3, 2, 2, 3, 1, 3]), surv, torch.full((k,), 0.2)) if packed else (None, None, None)
        args = lambda res, stats=stats, temps=inp["temps"]: (
            stats, shards, res, cu, target.shape[0] if packed else 0, inp["drafts"],
            inp["logprobs"] if logprobs else None, *lens, temps, key, stops, method, draft, vocab)
        case = (method, draft, logprobs, packed)
        first = _check_decide(args(None), case + ("first call",), backend)
        residual = torch.stack([D.ops.verify_residual(target[..., a:a + b], cu, inp["drafts"], None if dr is None else
                                                      dr[..., a:a + b], first[3], inp["temps"], key, a, vocab,
                                                      "reference") for a, b in shards.tolist()])
        second = _check_decide(args(residual), case + ("second call",), backend)
        needed += int((first[3][..., L.PLAN_NEED] > 0).sum()) if method == "token" else 0
        moved += int((first[1] != second[1]).sum()) if method == "block" else 0
        if method == "token" and not draft:   # greedy: the first exchange holds argmaxes only
            greedy = _decide_stats(inp, shards, packed, None, None)[2]
            _check_decide(args(None, greedy, None), case + ("greedy",), backend)
    assert needed > 0 and moved > 0     # the plans asked for rows, S_i moved block's tau
    g = torch.Generator().manual_seed(2)
    clean = dict(inp, target=torch.randn(n, k + 1, vocab, generator=g), draft=torch.randn(n, k, vocab, generator=g))
    _, _, stats = _decide_stats(clean, shards, False, clean["draft"], inp["temps"])
    dec = (stats, shards, None, None, 0, inp["drafts"], inp["logprobs"], None, None, None, inp["temps"], key, stops,
           "token", True, vocab, backend)
    return args(residual), dec


def test_triton_verify_decide_equals_the_reference():
    """``_decide_cases`` for the Triton decide step (the interpreter on the CPU); the op dispatches to it."""
    last, dec = _decide_cases("triton")
    from dspark_kernels.distributed.triton_decide import verify_decide as triton_decide
    assert all(torch.equal(a, b) for a, b in zip(D.ops.verify_decide(*last, "triton"), triton_decide(*last)))
    torch.library.opcheck(torch.ops.dspark_dist.verify_decide.default, dec)


def test_cuda_verify_decide_equals_the_reference(cuda_device):
    """``_decide_cases`` for the CUDA decide step (dist_verify_decide.cuh; the SIMT harness on the CPU); opcheck;
    bad input names the argument."""
    if cuda_device.type != "cpu":
        pytest.skip("the cases' tensors are CPU tensors: the SIMT harness")
    last, dec = _decide_cases("cuda")
    torch.library.opcheck(torch.ops.dspark_dist.verify_decide.default, dec)
    for i, value, msg in ((0, dec[0][..., :-1], "stats must have shape"), (1, dec[1][:2], "shards must have shape"),
                          (13, "chain", "method must be 'token' or 'block'"),
                          (10, dec[10].double(), "temperature must be Float")):
        wrong = list(dec)
        wrong[i] = value
        with pytest.raises(RuntimeError, match=msg):
            D.ops.verify_decide(*wrong)


def test_cuda_verify_decide_access(cuda_device):
    """One launch of a one-warp CTA per request: the request's cells of both exchanges copied to shared memory in
    whole sectors, so the bytes read stay within 1.05x of the cells (at N = 1 nothing else is in the tensors) and
    every line is at the ideal sectors and wavefronts; with more shards than shared memory holds (P = 300) lane 0
    reads the cells in place, same outputs."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import ideal_access
    for n, k, vocab, world, method in ((1, 7, 1000, 4, "token"), (5, 3, 1000, 4, "block"), (2, 3, 1200, 300, "token")):
        inp = verify_inputs(n, k, vocab, seed=4)
        shards = torch.tensor(shard_spans([vocab // world] * world))
        target, cu, stats = _decide_stats(inp, shards, False, inp["draft"], inp["temps"])
        key = make_rng_key(3, 1, "cpu")
        args = lambda res: (stats, shards, res, None, 0, inp["drafts"], None, None, None, None,  # noqa: E731
                            inp["temps"], key, None, method, True, vocab)
        plan = D.ops.verify_decide(*args(None), "reference")[3]
        residual = torch.stack([D.ops.verify_residual(target[..., a:a + b], None, inp["drafts"],
                                                      inp["draft"][..., a:a + b], plan, inp["temps"], key, a, vocab,
                                                      "reference") for a, b in shards.tolist()])
        ref = D.ops.verify_decide(*args(residual), "reference")
        out, rec = ideal_access(lambda: D.ops.verify_decide(*args(residual), "cuda"))
        assert all(torch.equal(a, b) for a, b in zip(ref[:3], out[:3])), (n, world)
        torch.testing.assert_close(out[3], ref[3], rtol=1e-5, atol=1e-6)
        assert rec.kernels() == ["dist_verify_decide"] and rec.ctas == n
        cells = (stats.numel() + residual.numel()) * 4
        if n == 1:
            assert cells <= rec.bytes_read <= 1.05 * cells + 1024, (rec.bytes_read, cells)


def test_pack_key_orders_like_argmax():
    """An integer MAX over packed (value, id) pairs is the package's argmax: larger value first, then the lower
    id; NaN counts as -inf; -0.0 ties +0.0; infinities keep their order."""
    from dspark_kernels.distributed.local_draft import pack_key, unpack_id
    values = torch.tensor([1.5, float("nan"), -0.0, 0.0, float("inf"), -float("inf"), -3.0, 1.5, float("inf")])
    ids = torch.tensor([7, 0, 3, 9, 12, 1, 2, 4, 30])
    packed = pack_key(values, ids)
    assert torch.equal(unpack_id(packed), ids)
    order = sorted(range(len(ids)), key=lambda i: packed[i].item(), reverse=True)
    assert [ids[i].item() for i in order] == [12, 30, 4, 7, 3, 9, 2, 0, 1]
    for a in range(len(ids)):          # pairwise: MAX picks torch.argmax's winner over the pair in id order
        for b in range(len(ids)):
            if ids[a] < ids[b]:
                pair = torch.stack([values[a], values[b]])
                want = ids[a] if L.nan_to_neg_inf(pair).argmax().item() == 0 else ids[b]
                assert unpack_id(torch.maximum(packed[a], packed[b])).item() == want.item()


def test_exchange_is_a_small_fraction_of_the_logits():
    """The headline shape: N = 64, K = 7, V = 151936, P = 8, bf16 logits."""
    for sampled, draft in ((False, False), (True, True)):
        ours = D.exchange_bytes("verify_chain", 64, 7, 8, sampled=sampled, draft_logits=draft)
        theirs = D.logits_gather_bytes("verify_chain", 64, 7, 151936, 8, draft_logits=draft)
        assert ours * 100 < theirs, (ours, theirs)
    ours = D.exchange_bytes("draft_block", 64, 7, 8)
    assert ours == 7 * 80 + 7 * round(2 * 7 / 8 * 64 * 8) + 7 * 64 * 7 * 20
    assert ours * 100 < D.logits_gather_bytes("draft_block", 64, 7, 151936, 8, dtype_bytes=4)


# ------------------------------------------------------------------------------------------------ decode loop
def _decode_cases(rank, world, sizes):
    """The decode loop over P vocabulary shards gives the unsharded loop's tokens (greedy, token and block
    sampling, with a stop token)."""
    from dspark_kernels.decode.decoder import SpeculativeDecoder
    from dspark_kernels.decode.testing import tiny_drafter, tiny_target
    from dspark_kernels.distributed.decode import VocabParallelDecoder
    start, size = shard_spans(sizes)[rank]
    target = tiny_target(seed=3, vocab=sum(sizes))
    drafter = tiny_drafter(target, seed=4, block_size=3, markov="gated")
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    for temperature, method in ((0.0, "token"), (1.0, "token"), (0.8, "block")):
        kw = dict(seed=5, verify_method=method)
        with torch.no_grad():
            ref = SpeculativeDecoder(target, drafter, **kw).generate(prompts, 6, temperature=temperature,
                                                                    stop_token_ids=[11])
        out = VocabParallelDecoder(target, drafter, vocab_start=start, size=size, **kw).generate(
            prompts, 6, temperature=temperature, stop_token_ids=[11])
        assert out.tokens == ref.tokens, (rank, temperature, method, out.tokens, ref.tokens)


def test_decode_loop_vocabulary_parallel():
    spawn(3, _decode_cases, [1, 23, 24])
