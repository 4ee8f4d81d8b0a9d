import itertools
import math

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels import rng
from stats import counts, passes

BIG = 30.0


def logits_with_argmax(argmaxes, vocab):
    """float32 [len, V] rows whose argmax is the given token."""
    rows = torch.zeros(len(argmaxes), vocab)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = BIG
    return rows


# ---------------------------------------------------------------- greedy, by hand
def test_greedy_accept_reject_bonus(host_backend):
    vocab = 7
    target = torch.stack([logits_with_argmax([1, 2, 4, 0], vocab),    # rejects d_3 = 3, emits 4
                          logits_with_argmax([1, 2, 3, 5], vocab),    # accepts all, bonus 5
                          logits_with_argmax([6, 2, 3, 5], vocab)])   # rejects d_1, emits 6
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    out = dk.verify_chain(target, drafts)
    assert out.tokens.tolist() == [[1, 2, 4, -1], [1, 2, 3, 5], [6, -1, -1, -1]]
    assert out.num_accepted.tolist() == [2, 3, 0]
    assert out.num_accepted.dtype == torch.int32 and out.tokens.dtype == torch.int64
    assert out.accept_mask.tolist() == [[True, True, False], [True, True, True], [False, False, False]]


def test_greedy_nan_counts_as_minus_inf_and_infinities_stay():
    big = torch.finfo(torch.float32).max
    rows = torch.tensor([[[float("nan"), float("-inf"), -big, -big],        # -big beats -inf: token 2
                          [big, float("inf"), float("nan"), float("inf")],   # +inf beats big: token 1
                          [float("nan")] * 4]])                              # all NaN: token 0
    out = dk.verify_chain(rows, torch.tensor([[2, 1]]))
    assert out.tokens.tolist() == [[2, 1, 0]]
    for backend in ("reference", "cpu", "triton"):
        drafted = dk.draft_block(rows[:, :2], torch.tensor([0]), dk.MarkovHead("vanilla", torch.zeros(4, 1),
                                                                               torch.zeros(4, 1)), backend=backend)
        assert drafted.tokens.tolist() == [[2, 1]]
        assert dk.verify_chain(rows, torch.tensor([[2, 1]]), backend=backend).tokens.tolist() == [[2, 1, 0]]


def test_greedy_ties_go_to_lowest_index(host_backend):
    target = torch.zeros(1, 2, 5)
    out = dk.verify_chain(target, torch.tensor([[3]]))
    assert out.tokens.tolist() == [[0, -1]]


def test_stop_token_ends_acceptance_without_bonus(host_backend):
    vocab = 7
    target = logits_with_argmax([1, 2, 3, 5], vocab).unsqueeze(0)
    out = dk.verify_chain(target, torch.tensor([[1, 2, 3]]), stop_token_ids=torch.tensor([2, 6]))
    assert out.tokens.tolist() == [[1, 2, -1, -1]]
    assert out.num_accepted.tolist() == [2]
    # A stop token that is the correction is emitted (the request then finishes in the scan).
    target = logits_with_argmax([1, 6, 3, 5], vocab).unsqueeze(0)
    out = dk.verify_chain(target, torch.tensor([[1, 2, 3]]), stop_token_ids=torch.tensor([6]))
    assert out.tokens.tolist() == [[1, 6, -1, -1]]


def test_packed_ragged_layout(host_backend):
    vocab, k = 6, 3
    # request 0 verifies 1 draft (2 rows), request 1 verifies 3 (4 rows), request 2 verifies 0 (1 row)
    rows = logits_with_argmax([1, 4] + [2, 3, 4, 5] + [0], vocab)
    cu = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    drafts = torch.tensor([[1, 2, 3], [2, 3, 1], [5, 5, 5]])
    out = dk.verify_chain(rows, drafts, cu_seqlens=cu)
    assert out.tokens.tolist() == [[1, 4, -1, -1], [2, 3, 4, -1], [0, -1, -1, -1]]
    assert out.num_accepted.tolist() == [2 - 1, 2, 0]
    # the same as the dense layout truncated by verify_lens
    dense = torch.stack([logits_with_argmax(a, vocab) for a in ([1, 4, 0, 0], [2, 3, 4, 5], [0, 0, 0, 0])])
    ref = dk.verify_chain(dense, drafts, verify_lens=torch.tensor([1, 3, 0]))
    assert torch.equal(ref.tokens, out.tokens)


def test_packed_rows_out_of_range_are_never_read(host_backend):
    rows = logits_with_argmax([1, 2], 4)
    drafts = torch.tensor([[1, 2], [1, 2], [1, 2]])
    cu = torch.tensor([0, 2, 9, 50])   # request 1 runs past the end; request 2 starts past it
    out = dk.verify_chain(rows, drafts, cu_seqlens=cu)
    assert out.tokens.tolist() == [[1, 2, -1], [-1, -1, -1], [-1, -1, -1]]
    assert out.num_accepted.tolist() == [1, 0, 0]


def test_verify_lens_clamped_and_thresholds(host_backend):
    vocab = 5
    target = logits_with_argmax([1, 2, 3, 4], vocab).unsqueeze(0).expand(4, 4, vocab)
    drafts = torch.tensor([[1, 2, 3]]).expand(4, 3)
    out = dk.verify_chain(target, drafts, verify_lens=torch.tensor([-3, 1, 3, 99]))
    assert out.tokens.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1], [1, 2, 3, 4], [1, 2, 3, 4]]
    survival = torch.tensor([[0.9, 0.5, 0.2], [0.3, 0.3, 0.3], [0.9, 0.9, 0.9], [0.9, 0.1, 0.9]])
    out = dk.verify_chain(target, drafts, survival=survival, thresholds=torch.tensor([0.4, 0.4, 0.4]))
    assert out.num_accepted.tolist() == [2, 0, 3, 1]
    assert out.tokens[:, -1].tolist() == [-1, -1, 4, -1]
    out = dk.verify_chain(target, drafts, survival=survival, thresholds=torch.tensor([0.4, 0.4, 0.4]),
                          verify_lens=torch.tensor([1, 1, 1, 1]))
    assert out.num_accepted.tolist() == [1, 0, 1, 1]


def test_out_of_range_draft_rejected_and_nan_logits_stay_in_range(host_backend):
    vocab = 5
    target = logits_with_argmax([1, 2, 3], vocab).unsqueeze(0).expand(2, 3, vocab).clone()
    drafts = torch.tensor([[1, 7], [-1, 2]])
    for t in (0.0, 1.0):
        for method in ("token", "block"):
            out = dk.verify_chain(target, drafts, temperature=t, method=method, seed=4)
            assert out.num_accepted.tolist() == [1, 0]
    target[:] = float("nan")
    for t in (0.0, 0.7):
        for method in ("token", "block"):
            for dl in (None, torch.full((2, 2, vocab), float("nan"))):
                out = dk.verify_chain(target, torch.tensor([[1, 2], [3, 4]]), draft_logits=dl, temperature=t,
                                      method=method)
                emitted = out.tokens[out.tokens >= 0]
                assert ((emitted >= 0) & (emitted < vocab)).all() and out.num_accepted.tolist() == [0, 0]
                assert (out.tokens[torch.arange(2), out.num_accepted.long()] >= 0).all()


def test_tiny_shapes(host_backend):
    out = dk.verify_chain(torch.zeros(0, 2, 3), torch.zeros(0, 1, dtype=torch.int64), temperature=1.0)
    assert out.tokens.shape == (0, 2) and out.num_accepted.shape == (0,)
    out = dk.verify_chain(torch.zeros(2, 2, 1), torch.zeros(2, 1, dtype=torch.int64), temperature=1.0)
    assert out.tokens.tolist() == [[0, 0], [0, 0]]


# ---------------------------------------------------------------- sampling, explicit computation
def test_token_rule_matches_explicit_uniforms(host_backend):
    torch.manual_seed(1)
    n, vocab, temp = 400, 6, 0.8
    target = torch.randn(n, 2, vocab)
    draft_logits = torch.randn(n, 1, vocab)
    drafts = torch.randint(0, vocab, (n, 1))
    out = dk.verify_chain(target, drafts, draft_logits=draft_logits, temperature=temp, seed=11, offset=3)
    key = torch.tensor([11, 3])
    u = rng.uniform(key, torch.arange(n), 0, rng.STREAM_ACCEPT, 0)
    p = torch.softmax(target[:, 0] / temp, -1).gather(1, drafts).squeeze(1)
    q = torch.softmax(draft_logits[:, 0] / temp, -1).gather(1, drafts).squeeze(1)
    assert out.num_accepted.tolist() == (u * q < p).int().tolist()
    assert 50 < int(out.num_accepted.sum()) < 350


def test_one_hot_certain_accept_and_certain_reject(host_backend):
    vocab = 8
    target = torch.full((64, 2, vocab), -1e9)
    target[:, 0, 3] = 0.0            # p(3) = 1 at row 0
    target[:, 1] = 0.0
    drafts = torch.full((64, 1), 3)
    out = dk.verify_chain(target, drafts, temperature=1.0, seed=2)
    assert out.num_accepted.tolist() == [1] * 64
    drafts = torch.full((64, 1), 5)  # p(5) = 0: always rejected, correction is the only token with mass
    out = dk.verify_chain(target, drafts, temperature=1.0, seed=2)
    assert out.tokens.tolist() == [[3, -1]] * 64


def test_seed_and_offset_as_tensors_match_ints(host_backend):
    torch.manual_seed(2)
    target = torch.randn(16, 4, 30)
    drafts = torch.randint(0, 30, (16, 3))
    a = dk.verify_chain(target, drafts, temperature=1.0, seed=5, offset=9)
    b = dk.verify_chain(target, drafts, temperature=1.0, seed=torch.tensor([5]), offset=torch.tensor(9))
    c = dk.verify_chain(target, drafts, temperature=1.0, seed=5, offset=10)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_python_zero_temperature_takes_the_greedy_only_path(method, backend):
    """temperature=0.0 (no tensor: softmax and random numbers skipped) equals a tensor of zeros."""
    torch.manual_seed(4)
    target = torch.randn(5, 4, 30)
    drafts = torch.where(torch.rand(5, 3) < 0.7, target[:, :3].argmax(-1), 7)
    a = dk.verify_chain(target, drafts, draft_logits=torch.randn(5, 3, 30), method=method, backend=backend)
    b = dk.verify_chain(target, drafts, draft_logits=torch.randn(5, 3, 30), temperature=torch.zeros(5),
                        method=method, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a.num_accepted.sum() > 0


def test_per_request_temperature_zero_is_greedy(host_backend):
    torch.manual_seed(3)
    target = torch.randn(6, 3, 20)
    drafts = target[:, :2].argmax(-1)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    out = dk.verify_chain(target, drafts, temperature=temps, seed=1)
    greedy = dk.verify_chain(target, drafts)
    assert torch.equal(out.tokens[0::2], greedy.tokens[0::2])


# ---------------------------------------------------------------- losslessness, statistically
def simulate(method, k, temp, use_draft_logits, trials=20000, length=None, vocab=50, seed=0, draft_vocab=None,
             map_shift=0):
    """Generate ``length`` tokens per request by repeated draft + verify; return tokens [trials, length] and the
    per-position target distributions. Target and draft distributions depend on the absolute position only.
    ``draft_vocab``: drafts over that many target ids (a shuffled ``draft_to_target``), verified with the map
    rolled by ``map_shift`` (0: the true map)."""
    length = length or k + 2
    gen = torch.Generator().manual_seed(seed)
    table = length + k + 1
    p_logits = torch.randn(table, vocab, generator=gen) * 1.5
    d2t = torch.randperm(vocab, generator=gen)[:draft_vocab] if draft_vocab else None
    q_logits = (p_logits if d2t is None else p_logits[:, d2t]) + torch.randn(
        table, draft_vocab or vocab, generator=gen) * 2.0   # a related but wrong draft
    out = torch.full((trials, length), -1, dtype=torch.int64)
    made = torch.zeros(trials, dtype=torch.int64)
    step = 0
    while bool((made < length).any()):
        pos = (made.unsqueeze(1) + torch.arange(k + 1)).clamp(max=table - 1)
        draft_l = q_logits[pos[:, :k]]
        drafts = torch.multinomial(torch.softmax(draft_l / temp, -1).view(-1, draft_l.shape[-1]), 1,
                                   generator=gen).view(trials, k)
        verify_map = None
        if d2t is not None:
            drafts, verify_map = d2t[drafts], d2t.roll(map_shift)
        res = dk.verify_chain(p_logits[pos], drafts, draft_logits=draft_l if use_draft_logits else None,
                              draft_to_target=verify_map if use_draft_logits else None, temperature=temp,
                              seed=seed + 1, offset=step, method=method)
        emitted = res.tokens >= 0
        slot = made.unsqueeze(1) + torch.cumsum(emitted.long(), 1) - 1
        keep = emitted & (slot < length)
        out[torch.nonzero(keep, as_tuple=True)[0], slot[keep]] = res.tokens[keep]
        made += emitted.long().sum(1)
        step += 1
    return out, torch.softmax(p_logits[:length] / temp, -1)


# The default run checks each method with and without draft logits, at K = 3 and at K = 1, each temperature at least
# once; CI's slow leg the rest of the matrix (K = 5, the other temperature of each).
LOSSLESS_DEFAULT = {(True, 1.0, 3, "token"), (False, 0.6, 3, "token"), (True, 0.6, 3, "block"),
                    (False, 1.0, 3, "block"), (False, 1.0, 1, "token"), (True, 1.0, 1, "block")}


@pytest.mark.parametrize("use_draft_logits,temp,k,method", [
    pytest.param(*case, marks=() if case in LOSSLESS_DEFAULT else pytest.mark.slow)
    for case in itertools.product([True, False], [0.6, 1.0], [1, 3, 5], ["token", "block"])])
def test_lossless_sampling(host_backend, method, k, temp, use_draft_logits):
    tokens, p = simulate(method, k, temp, use_draft_logits, seed=17 * k + int(10 * temp))
    trials, vocab = tokens.shape[0], p.shape[1]
    for m in range(tokens.shape[1]):
        assert passes(counts(tokens[:, m], vocab), p[m] * trials), f"position {m}"


@pytest.mark.parametrize("method", ["token", "block"])
def test_lossless_sampling_with_a_reduced_draft_vocabulary(host_backend, method):
    """Drafts over 15 of the 50 target ids, verified with their rows over those 15 and the map: the output follows
    the target at every position (the corrections supply the 35 ids never drafted). With a wrong map it does not."""
    tokens, p = simulate(method, 3, 1.0, True, vocab=50, seed=23, draft_vocab=15)
    trials = tokens.shape[0]
    for m in range(tokens.shape[1]):
        assert passes(counts(tokens[:, m], 50), p[m] * trials), f"position {m}"
    tokens, p = simulate(method, 3, 1.0, True, vocab=50, seed=23, draft_vocab=15, map_shift=1)
    assert not all(passes(counts(tokens[:, m], 50), p[m] * trials) for m in range(tokens.shape[1]))


def test_sparse_draft_rows_are_the_dense_rows_with_the_other_ids_at_minus_inf(host_backend):
    """Top-k rows (``draft_candidates``: per-row target ids) only place the logits: the result equals verifying
    dense rows (-inf off the candidates) exactly; bad candidates are errors naming them."""
    gen = torch.Generator().manual_seed(8)
    n, k, vocab, top = 4, 3, 30, 5
    target = torch.randn(n, k + 1, vocab, generator=gen)
    cands = torch.stack([torch.randperm(vocab, generator=gen)[:top] for _ in range(n * k)]).view(n, k, top)
    rows = torch.randn(n, k, top, generator=gen)
    dense = torch.full((n, k, vocab), float("-inf")).scatter(-1, cands, rows)
    drafts = cands.gather(-1, torch.randint(0, top, (n, k, 1), generator=gen)).squeeze(-1)
    for method in ("token", "block"):
        kw = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3]), seed=3, method=method)
        got = dk.verify_chain(target, drafts, draft_logits=rows, draft_candidates=cands.int(), **kw)
        want = dk.verify_chain(target, drafts, draft_logits=dense, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), method
    with pytest.raises(ValueError, match="draft_candidates needs draft_logits"):
        dk.verify_chain(target, drafts, draft_candidates=cands)
    with pytest.raises(ValueError, match="draft_candidates"):
        dk.verify_chain(target, drafts, draft_logits=rows, draft_candidates=cands[:, :2])
    with pytest.raises(ValueError, match="draft_logits"):
        dk.verify_chain(target, drafts, draft_logits=rows[..., :4], draft_candidates=cands)
    with pytest.raises(ValueError, match="not both"):
        dk.verify_chain(target, drafts, draft_logits=rows, draft_candidates=cands, draft_to_target=cands[0, 0])


def test_reduced_draft_rows_are_the_dense_rows_with_the_other_ids_at_minus_inf(host_backend):
    """The map only places the rows: the result equals verifying dense rows (-inf off the map) exactly; a map entry
    outside [0, V) is dropped."""
    gen = torch.Generator().manual_seed(4)
    n, k, vocab, vd = 5, 3, 30, 8
    target = torch.randn(n, k + 1, vocab, generator=gen)
    d2t = torch.randperm(vocab, generator=gen)[:vd]
    d2t[5] = vocab + 3
    rows = torch.randn(n, k, vd, generator=gen)
    dense = torch.full((n, k, vocab), float("-inf"))
    keep = torch.arange(vd) != 5
    dense[..., d2t[keep]] = rows[..., keep]
    drafts = d2t[torch.randint(0, vd, (n, k), generator=gen).clamp(max=4)]
    for method in ("token", "block"):
        kw = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]), seed=3, method=method)
        got = dk.verify_chain(target, drafts, draft_logits=rows, draft_to_target=d2t, **kw)
        want = dk.verify_chain(target, drafts, draft_logits=dense, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), method
    with pytest.raises(ValueError, match="draft_to_target needs draft_logits"):
        dk.verify_chain(target, drafts, draft_to_target=d2t)
    with pytest.raises(ValueError, match="draft_logits"):
        dk.verify_chain(target, drafts, draft_logits=rows[..., :7], draft_to_target=d2t)
    with pytest.raises(ValueError, match="draft_to_target"):
        dk.verify_chain(target, drafts, draft_logits=rows, draft_to_target=d2t.float())


def test_chi_square_detects_a_lossy_verifier():
    """The losslessness check can fail: accepting every draft outputs the draft distribution, not the target's."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 50, 20000
    p_logits = torch.randn(vocab, generator=gen) * 1.5
    q_logits = p_logits + torch.randn(vocab, generator=gen) * 1.5
    drafts = torch.multinomial(torch.softmax(q_logits, -1), trials, replacement=True, generator=gen)
    assert not passes(counts(drafts, vocab), torch.softmax(p_logits, -1) * trials)


def test_block_accepts_at_least_as_much_as_token(host_backend):
    torch.manual_seed(5)
    n, k, vocab = 4000, 5, 30
    p_logits = torch.randn(n, k + 1, vocab)
    q_logits = p_logits + torch.randn(n, k + 1, vocab)
    drafts = torch.multinomial(torch.softmax(q_logits[:, :k], -1).view(-1, vocab), 1).view(n, k)
    acc = {m: dk.verify_chain(p_logits, drafts, draft_logits=q_logits[:, :k], temperature=1.0, method=m, seed=9)
           .num_accepted.float().mean().item() for m in ("token", "block")}
    assert acc["block"] >= acc["token"] - 0.02


# ---------------------------------------------------------------- bad input
def test_bad_input_names_the_argument(host_backend):
    t = torch.zeros(2, 4, 9)
    d = torch.zeros(2, 3, dtype=torch.int64)
    cases = [
        (dict(target_logits=torch.zeros(2, 3, 9)), "target_logits"),
        (dict(target_logits=t.long()), "target_logits"),
        (dict(draft_tokens=d.float()), "draft_tokens"),
        (dict(draft_tokens=torch.zeros(2, dtype=torch.int64)), "draft_tokens"),
        (dict(draft_logits=torch.zeros(2, 3, 8)), "draft_logits"),
        (dict(draft_logits=torch.zeros(2, 3, 9, device="meta")), "draft_logits"),
        (dict(verify_lens=torch.zeros(3, dtype=torch.int64)), "verify_lens"),
        (dict(verify_lens=torch.zeros(2)), "verify_lens"),
        (dict(survival=torch.zeros(2, 3), thresholds=torch.zeros(4)), "thresholds"),
        (dict(survival=torch.zeros(2, 2), thresholds=torch.zeros(3)), "survival"),
        (dict(survival=torch.zeros(2, 3)), "thresholds"),
        (dict(stop_token_ids=torch.zeros(2, 2, dtype=torch.int64)), "stop_token_ids"),
        (dict(temperature=torch.zeros(3)), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(method="tree"), "method"),
        (dict(backend="tpu"), "backend"),
        (dict(seed=1.5), "seed"),
        (dict(target_logits=torch.zeros(7, 9), cu_seqlens=torch.zeros(2, dtype=torch.int32)), "cu_seqlens"),
    ]
    for override, name in cases:
        kwargs = dict(target_logits=t, draft_tokens=d)
        kwargs.update(override)
        with pytest.raises((ValueError, TypeError), match=name):
            dk.verify_chain(kwargs.pop("target_logits"), kwargs.pop("draft_tokens"), **kwargs)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_opcheck(backend):
    torch.manual_seed(0)
    n, k, vocab = 3, 4, 13
    args = (torch.randn(n, k + 1, vocab), None, torch.randint(0, vocab, (n, k)), torch.randn(n, k, vocab), None,
            torch.tensor([4, 2, 0]), None, None, torch.tensor([0.0, 1.0, 0.7]), torch.tensor([3, 4]),
            torch.tensor([5]), "block", backend)
    torch.library.opcheck(torch.ops.dspark.verify_chain.default, args)
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    packed = (torch.randn(9, vocab), cu) + args[2:11] + ("token", backend)
    torch.library.opcheck(torch.ops.dspark.verify_chain.default, packed)
    greedy = args[:8] + (None,) + args[9:]   # temperature None: every request greedy
    torch.library.opcheck(torch.ops.dspark.verify_chain.default, greedy)


# ---------------------------------------------------------------- Triton twin (interpreter on the CPU)
TRITON_CASES = [  # N, K, V, dtype, method, with draft logits, packed
    (1, 1, 1, torch.float32, "token", False, False),
    (3, 5, 17, torch.bfloat16, "block", True, True),
    (3, 7, 1000, torch.float16, "token", True, False),
    (3, 16, 17, torch.float32, "block", False, False),
    (64, 5, 17, torch.float32, "token", True, True),
    (64, 4, 23, torch.float32, "block", True, False),
    (2, 7, 32000, torch.bfloat16, "block", True, False),
    (2, 3, 32003, torch.float32, "token", False, True),
]


@pytest.mark.parametrize("n,k,vocab,dtype,method,with_logits,packed", TRITON_CASES)
def test_triton_matches_reference(triton_device, n, k, vocab, dtype, method, with_logits, packed):
    gen = torch.Generator().manual_seed(n * 1000 + k * 10 + vocab)
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(dtype)
    draft_logits = (target[:, :k].float() + torch.randn(n, k, vocab, generator=gen)).to(dtype)
    drafts = torch.multinomial(torch.softmax(draft_logits.float().view(-1, vocab), -1), 1, generator=gen).view(n, k)
    drafts[0] = target[0, :k].float().argmax(-1)             # a greedy request that accepts
    if n > 2:
        drafts[2, k // 2] = vocab + 3                        # an invalid draft
    temps = torch.tensor([0.0, 1.0, 0.6, 0.0, 1.3] * n)[:n]
    kwargs = dict(draft_logits=draft_logits if with_logits else None, temperature=temps, method=method, seed=n,
                  offset=k, stop_token_ids=drafts[-1, :1].clone(),
                  verify_lens=torch.randint(0, k + 2, (n,), generator=gen),
                  survival=torch.rand(n, k, generator=gen).sort(-1, descending=True).values,
                  thresholds=torch.full((k,), 0.2))
    if packed:
        counts = torch.randint(0, k + 2, (n,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        rows = torch.cat([target[r, : int(counts[r])] for r in range(n)]) if int(cu[-1]) else target[:0, 0]
        args, kwargs["cu_seqlens"] = (rows, drafts), cu
    else:
        args = (target, drafts)
    ref = dk.verify_chain(*args, backend="reference", **kwargs)
    on_device = {key: val.to(triton_device) if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
    out = dk.verify_chain(*(a.to(triton_device) for a in args), backend="triton", **on_device)
    out = type(out)(*(t.cpu() for t in out))
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.accept_mask, ref.accept_mask)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs, on purpose
def test_triton_nan_logits_stay_in_range(triton_device, method):
    target = torch.full((3, 4, 9), float("nan"), device=triton_device)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 0]], device=triton_device)
    for t in (0.0, 1.0):
        out = dk.verify_chain(target, drafts, temperature=t, method=method, backend="triton")
        emitted = out.tokens[out.tokens >= 0]
        assert ((emitted >= 0) & (emitted < 9)).all() and out.num_accepted.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- draft_logprobs (every backend)
def draft_logprobs_of(draft_logits, drafts, temperature):
    """log q(d_j) at each request's temperature, as the drafter sampled them (1 for greedy requests)."""
    n, k, vocab = draft_logits.shape
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((n,), float(temperature) or 1.0)
    t = torch.where(temperature.float() > 0, temperature.float(), 1.0).view(n, 1, 1)
    lp = torch.log_softmax(draft_logits.float() / t, -1)
    return lp.gather(-1, drafts.long().clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("method", ["token", "block"])
def test_reference_with_logprobs_equals_without(method):
    """q(d_j) from draft_logprobs or from the draft rows: the same outputs on many random cases."""
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        n, k, vocab = 16, 1 + seed % 7, [5, 17, 300][seed % 3]
        target = torch.randn(n, k + 1, vocab, generator=gen) * 2
        draft_logits = target[:, :k] + torch.randn(n, k, vocab, generator=gen)
        temps = torch.tensor([0.0, 1.0, 0.6, 1.7] * 4)
        drafts = torch.multinomial(torch.softmax(draft_logits.view(-1, vocab), -1), 1, generator=gen).view(n, k)
        kw = dict(draft_logits=draft_logits, temperature=temps, seed=seed, method=method, backend="reference")
        a = dk.verify_chain(target, drafts, **kw)
        b = dk.verify_chain(target, drafts, draft_logprobs=draft_logprobs_of(draft_logits, drafts, temps), **kw)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), seed


def test_draft_logprobs_bad_input(host_backend):
    t, d = torch.zeros(2, 4, 9), torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_logprobs"):
        dk.verify_chain(t, d, draft_logprobs=torch.zeros(2, 3))              # without draft_logits
    with pytest.raises(ValueError, match="draft_logprobs"):
        dk.verify_chain(t, d, draft_logits=torch.zeros(2, 3, 9), draft_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="draft_logprobs"):
        dk.verify_chain(t, d, draft_logits=torch.zeros(2, 3, 9), draft_logprobs=torch.zeros(2, 3).double())


# ---------------------------------------------------------------- CUDA kernels (SIMT harness on the CPU, or a GPU)
NAN = float("nan")


def make_case(n, k, vocab, dtype, draft_mode, packed, temp_mode, seed, draft_dtype=None):
    """Positional args and kwargs of one verify_chain call (CPU tensors) with the adversarial features mixed in:
    a greedy request that accepts everything, an invalid draft, a stop token, verify_lens beyond K, survival
    thresholds, and temperatures that are 0, negative and NaN (greedy) next to sampled ones."""
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(dtype)
    draft_logits = (target[:, :k].float() + torch.randn(n, k, vocab, generator=gen)).to(draft_dtype or dtype)
    drafts = torch.multinomial(torch.softmax(draft_logits.float().view(-1, vocab), -1), 1, generator=gen).view(n, k)
    drafts[0] = target[0, :k].float().argmax(-1)
    if n > 2:
        drafts[2, k // 2] = vocab + 3
    if temp_mode == "greedy":
        temps = 0.0
    else:
        temps = torch.tensor([0.0, 1.0, 0.6, -1.0, 1.3, NAN, 0.9] * n)[:n]
    kwargs = dict(temperature=temps, method="token", seed=seed, offset=k, stop_token_ids=drafts[-1, :1].clone(),
                  verify_lens=torch.randint(0, k + 3, (n,), generator=gen),
                  survival=torch.rand(n, k, generator=gen).sort(-1, descending=True).values,
                  thresholds=torch.full((k,), 0.1))
    if draft_mode != "none":
        kwargs["draft_logits"] = draft_logits
    if draft_mode == "logprobs":
        kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temps)
    if packed:
        counts = torch.randint(0, k + 2, (n,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        rows = torch.cat([target[r, : int(counts[r])] for r in range(n)]) if int(cu[-1]) else target[:0, 0]
        return (rows, drafts.to(torch.int32)), dict(kwargs, cu_seqlens=cu)
    return (target, drafts), kwargs


def run_both(cuda_device, simt_check, args, kwargs, backend="cuda"):
    """The ``backend`` kernels on ``cuda_device`` (under ``simt_check``) against the reference: integers equal."""
    ref = dk.verify_chain(*args, backend="reference", **kwargs)
    on_dev = {key: val.to(cuda_device) if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
    out = simt_check(lambda: dk.verify_chain(*(a.to(cuda_device) for a in args), backend=backend, **on_dev))
    out = type(out)(*(t.cpu() for t in out))
    assert torch.equal(out.tokens, ref.tokens), (out.tokens, ref.tokens)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.accept_mask, ref.accept_mask)
    return out


CUDA_CASES = [  # N, K, V, dtype, method, drafts ("none" = one-hot, "logits", "logprobs"), packed, temperatures
    (1, 1, 1, torch.float32, "token", "none", False, "mixed"),
    (3, 5, 17, torch.bfloat16, "block", "logits", True, "mixed"),
    (3, 7, 1000, torch.float16, "token", "logprobs", False, "mixed"),
    (3, 16, 17, torch.float32, "block", "none", False, "mixed"),
    (17, 5, 4099, torch.bfloat16, "token", "logprobs", True, "mixed"),
    (64, 1, 17, torch.float32, "block", "logits", True, "mixed"),
    (64, 7, 1000, torch.float32, "token", "logits", False, "mixed"),
    (3, 7, 32003, torch.bfloat16, "block", "logprobs", False, "mixed"),
    (17, 16, 1000, torch.float16, "block", "logprobs", True, "mixed"),
    (17, 1, 32003, torch.float32, "token", "none", True, "mixed"),
    (64, 5, 1000, torch.bfloat16, "token", "logits", False, "greedy"),
    (3, 16, 4099, torch.float16, "block", "none", True, "greedy"),
]


def kernel_case(n, k, vocab, dtype, method, draft_mode, packed, temps):
    args, kwargs = make_case(n, k, vocab, dtype, draft_mode, packed, temps, seed=n * 1000 + k * 10 + vocab)
    return args, dict(kwargs, method=method)


def mixed_dtype_and_large_vocab_calls():
    """Draft logits in another dtype than the target's; one headline-sized vocabulary (V = 151936)."""
    yield make_case(3, 5, 1000, torch.float16, "logprobs", False, "mixed", seed=5, draft_dtype=torch.float32)
    args, kwargs = make_case(1, 3, 151936, torch.bfloat16, "logprobs", False, "sampled", seed=6)
    kwargs.update(temperature=torch.tensor([0.8]), verify_lens=None, survival=None, thresholds=None)
    kwargs["draft_logprobs"] = draft_logprobs_of(kwargs["draft_logits"], args[1], kwargs["temperature"])
    yield args, kwargs


def adversarial_calls(method):
    """NaN, -inf and +inf rows, ties, all-accept, reject-first, out-of-range drafts, stop tokens at every position,
    verify_lens beyond K."""
    gen = torch.Generator().manual_seed(11)
    n, k, vocab = 12, 4, 17
    target = torch.randn(n, k + 1, vocab, generator=gen) * 2
    target[1, 0] = NAN                         # a NaN row
    target[2, 1, 3] = NAN                      # one NaN in a row
    target[3, :2] = float("-inf")              # -inf rows
    target[4, 0, 5] = float("inf")             # +inf
    target[5, :, 2] = 9.0
    target[5, :, 7] = 9.0                      # ties
    draft_logits = target[:, :k].clone()
    draft_logits[6:] += torch.randn(n - 6, k, vocab, generator=gen) * 3
    draft_logits[7, 0] = NAN                   # a NaN draft row
    drafts = torch.where(torch.isnan(target[:, :k]), -1e9, target[:, :k]).argmax(-1)   # all accept greedily
    drafts[8] = target[8, :k].argmin(-1)       # reject first
    drafts[9, 0], drafts[9, 1], drafts[10, 2] = -1, vocab, vocab + 100                   # out of range
    target[11, 0, drafts[11, 0]] = float("-inf")  # p(d_1) = 0
    for temperature in (0.0, torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.0, 1.0, 1.5, 1.0, 0.0, 1.0, 1.0])):
        for mode in ("none", "logits", "logprobs"):
            kwargs = dict(temperature=temperature, method=method, seed=3, verify_lens=torch.tensor([5, 9] * 6))
            if mode != "none":
                kwargs["draft_logits"] = draft_logits
            if mode == "logprobs":
                kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temperature)
            yield (target, drafts), kwargs
    for pos in range(k):  # a stop token at every position
        yield (target, drafts), dict(temperature=torch.ones(n), method=method, seed=pos, draft_logits=draft_logits,
                                     stop_token_ids=drafts[:, pos].unique())


def wide_logit_range_calls(method):
    """Logits spread far apart (most tokens more than 16.7 below the leading race key: the sweeps bound their race
    keys without drawing their uniforms), at several temperatures and draft modes."""
    gen = torch.Generator().manual_seed(21)
    n, k, vocab = 6, 3, 3000
    target = torch.randn(n, k + 1, vocab, generator=gen) * 12
    draft_logits = target[:, :k] + torch.randn(n, k, vocab, generator=gen) * 6
    drafts = torch.multinomial(torch.softmax(draft_logits.view(-1, vocab), -1), 1, generator=gen).view(n, k)
    temps = torch.tensor([1.0, 0.3, 2.0, 1.0, 0.05, 1.0])
    for mode in ("none", "logits", "logprobs"):
        kwargs = dict(temperature=temps, method=method, seed=5)
        if mode != "none":
            kwargs["draft_logits"] = draft_logits
        if mode == "logprobs":
            kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temps)
        yield (target, drafts), kwargs


def no_rows_and_empty_batch_calls():
    cu = torch.tensor([0, 0, 7, 9])   # request 0: no rows; request 1 runs past R; request 2: two rows
    yield (torch.randn(4, 9), torch.randint(0, 9, (3, 2))), dict(cu_seqlens=cu, temperature=1.0)
    yield (torch.randn(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64)), {}


@pytest.mark.parametrize("n,k,vocab,dtype,method,draft_mode,packed,temps", CUDA_CASES)
def test_cuda_matches_reference(cuda_device, simt_check, n, k, vocab, dtype, method, draft_mode, packed, temps):
    run_both(cuda_device, simt_check, *kernel_case(n, k, vocab, dtype, method, draft_mode, packed, temps))


def test_cuda_mixed_draft_dtype_and_large_vocab(cuda_device, simt_check):
    for args, kwargs in mixed_dtype_and_large_vocab_calls():
        run_both(cuda_device, simt_check, args, kwargs)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_adversarial_rows(cuda_device, simt_check, method):
    """The CUDA kernels give the reference's tokens exactly on adversarial rows."""
    for args, kwargs in adversarial_calls(method):
        run_both(cuda_device, simt_check, args, kwargs)


@pytest.mark.parametrize("method", ["token", "block"])
def test_cuda_wide_logit_range(cuda_device, simt_check, method):
    for args, kwargs in wide_logit_range_calls(method):
        run_both(cuda_device, simt_check, args, kwargs)


def test_cuda_no_rows_and_empty_batch(cuda_device, simt_check):
    for args, kwargs in no_rows_and_empty_batch_calls():
        run_both(cuda_device, simt_check, args, kwargs)


# ---------------------------------------------------------------- CPU kernels (csrc/cpu)
CPU = torch.device("cpu")


def run_cpu(args, kwargs):
    return run_both(CPU, lambda fn: fn(), args, kwargs, backend="cpu")


@pytest.mark.parametrize("n,k,vocab,dtype,method,draft_mode,packed,temps", CUDA_CASES)
def test_cpu_matches_reference(n, k, vocab, dtype, method, draft_mode, packed, temps):
    run_cpu(*kernel_case(n, k, vocab, dtype, method, draft_mode, packed, temps))


@pytest.mark.parametrize("calls", [mixed_dtype_and_large_vocab_calls, no_rows_and_empty_batch_calls,
                                   lambda: adversarial_calls("token"), lambda: adversarial_calls("block"),
                                   lambda: wide_logit_range_calls("token"), lambda: wide_logit_range_calls("block")],
                         ids=["mixed_dtype_large_vocab", "no_rows_empty_batch", "adversarial_token",
                              "adversarial_block", "wide_range_token", "wide_range_block"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cpu_special_cases_match_reference(calls):
    for args, kwargs in calls():
        run_cpu(args, kwargs)


@pytest.mark.parametrize("n,k,vocab,dtype,mode", [(1, 7, 49152, torch.bfloat16, "greedy"),
                                                  (8, 7, 49152, torch.float32, "logprobs"),
                                                  (4, 7, 32000, torch.bfloat16, "logits")])
def test_cpu_decode_shapes(n, k, vocab, dtype, mode):
    """The decode loop's shapes (N = 1..8, K = 7, V = 49152): most drafts the target's argmax, so chains run deep."""
    args, kwargs = make_case(n, k, vocab, dtype, "none" if mode == "greedy" else mode, False,
                             "greedy" if mode == "greedy" else "mixed", seed=n + vocab)
    kwargs.update(verify_lens=None, survival=None, thresholds=None)
    run_cpu(args, kwargs)


# ---------------------------------------------------------------- CUDA: bytes moved, CTAs, launches
def _record(fn, sm_count=None, access=False):
    from dspark_kernels import simt
    with simt.record(sm_count=sm_count, access=access) as rec:
        out = fn()
    return out, rec


SMS = 132          # the harness's default multiprocessor count (an H200)
MIN_CHUNK = 4096   # verify::kMinChunk (stats)
MIN_QCHUNK = 1024  # verify::kMinQChunk (qstats)
CTAS_PER_SM = 2    # verify::kStatsCtasPerSm, the stats kernel's design occupancy
ITEM_COST = 4096   # verify::kItemCost


def stats_chunks(rows, vocab, min_chunk=MIN_CHUNK):
    """Chunks per row of the stats split (verify::stats_split): the least per-CTA cost waves x (chunk + ITEM_COST)
    of a persistent grid of the resident CTAs at the design occupancy, over 1 .. 4x the chunks that give about one
    item per resident CTA; ties to fewer chunks."""
    resident = SMS * CTAS_PER_SM

    def chunk_of(per_row):
        return max(min_chunk, -(-(-(-vocab // per_row)) // 32) * 32)

    def cost(chunk):
        return -(-rows * -(-vocab // chunk) // resident) * (chunk + ITEM_COST)

    first = -(-vocab // chunk_of(-(-resident // rows)))
    best = min((chunk_of(want) for want in range(1, 4 * first + 1)), key=lambda c: (cost(c), -c))
    return -(-vocab // best)


def test_stats_split_by_hand():
    """The per-CTA costs of stats_split's rule at V = 151936, 264 resident CTAs: K = 15 (16 rows) takes 16 chunks of
    9504 (one wave: 9504 + 4096 = 13600) over 33 of 4608 (two waves: 2 x 8704 = 17408); K = 7 (8 rows) 33 chunks of
    4608 (one wave); N = 64, K = 7 (512 rows) whole rows (two waves of 151936 + 4096)."""
    assert [stats_chunks(rows, 151936) for rows in (16, 8, 512)] == [16, 33, 1]


def resident_ctas(block):
    """CTAs of `block` threads the persistent grids hold: the occupancy by threads, capped at the design occupancy
    (what a GPU gives the kernels at their registers; the harness's occupancy query knows registers only when the
    SASS report is loaded)."""
    return SMS * min(2048 // block, CTAS_PER_SM)


def headline_case(n, k, mode, verified, seed=0):
    """V = 151936 bf16 rows (target randn * 2, draft = target + randn * 2); requests r < `verified` verify all K
    drafts, the others none (so large N stays cheap on the CPU). mode "greedy": drafts are the target's argmax with
    one mismatch in the middle; "token": drafts sampled from the draft, with draft_logprobs. Returns the call's
    args, kwargs and the bytes floor's rows besides the rejected requests' draft rows."""
    vocab = 151936
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(torch.bfloat16)
    lens = torch.where(torch.arange(n) < verified, k, 0)
    kwargs = dict(verify_lens=lens)
    if mode == "greedy":
        drafts = target[:, :k].float().argmax(-1)
        drafts[:, k // 2] = (drafts[:, k // 2] + 1) % vocab
    else:
        draft_logits = (target[:, :k].float() + torch.randn(n, k, vocab, generator=gen) * 2).to(torch.bfloat16)
        drafts = torch.multinomial(torch.softmax(draft_logits.float().view(-1, vocab), -1), 1,
                                   generator=gen).view(n, k)
        temps = torch.ones(n)
        kwargs.update(draft_logits=draft_logits, draft_logprobs=draft_logprobs_of(draft_logits, drafts, temps),
                      temperature=temps, seed=seed + 2)
    return (target, drafts), kwargs, int((lens + 1).sum())


def check_headline_bytes(n, k, mode, verified):
    """Bytes read at most 1.01x the floor (verified target rows once, + the draft row of each request that rejects:
    all the bookkeeping included), the launches, and a stats grid of exactly the resident CTAs (or every work item
    when there are fewer)."""
    args, kwargs, verified_rows = headline_case(n, k, mode, verified)
    vocab = args[0].shape[-1]
    out, rec = _record(lambda: dk.verify_chain(*args, backend="cuda", **kwargs))
    ref = dk.verify_chain(*args, backend="reference", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    lens = kwargs["verify_lens"]
    rejected = int((out.num_accepted < lens).sum())
    assert rejected > 0
    floor = (verified_rows + (rejected if mode == "token" else 0)) * vocab * 2
    assert len(rec.launches) == (3 if mode == "token" else 2), rec.kernels()
    stats = rec.launches[0]
    assert stats["kernel"] == "verify_chain_stats"
    items = n * (k + 1) * stats_chunks(n * (k + 1), vocab)
    assert stats["ctas"] == min(items, resident_ctas(stats["block"][0])), (stats["ctas"], items)
    assert floor <= rec.bytes_read <= 1.01 * floor, (rec.bytes_read / floor)
    return rec


@pytest.mark.simt
@pytest.mark.parametrize("k", [7, 15])
@pytest.mark.parametrize("mode", ["greedy", "token"])
def test_cuda_bytes_at_the_headline_vocab(monkeypatch, k, mode):
    """N = 1, V = 151936 bf16: bytes read within 1.01x of the floor, the stats items in one wave, 2 launches (greedy)
    / 3 (token sampling with draft_logprobs: + qstats over the rejecting request's draft row, with a split of its own
    that fills the GPU)."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    rec = check_headline_bytes(1, k, mode, verified=1)
    stats = rec.launches[0]   # one wave: every (row, chunk) item has a resident CTA of its own
    assert stats["ctas"] == (k + 1) * stats_chunks(k + 1, 151936) <= resident_ctas(stats["block"][0]), stats["ctas"]
    if mode == "token":
        q = rec.launches[2]
        assert q["kernel"] == "verify_chain_qstats"
        assert q["ctas"] == min(stats_chunks(1, 151936, MIN_QCHUNK), resident_ctas(q["block"][0])) >= SMS, q["ctas"]


@pytest.mark.simt
@pytest.mark.slow
@pytest.mark.parametrize("n,k", [(64, 7), (64, 15), (256, 7), (256, 15)])
@pytest.mark.parametrize("mode", ["greedy", "token"])
def test_cuda_bytes_at_the_headline_vocab_large_batch(monkeypatch, n, k, mode):
    """N = 64 and 256 (four requests verify every draft, the others none: a CPU-sized run of the same grid):
    bytes within 1.01x of the floor, a stats grid of exactly the resident CTAs."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    check_headline_bytes(n, k, mode, verified=4)


def _bytes_case(method, draft_mode, temperature):
    gen = torch.Generator().manual_seed(1)
    n, k, vocab = 4, 7, 32003
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(torch.bfloat16)
    draft_logits = (target[:, :k].float() + torch.randn(n, k, vocab, generator=gen) * 2).to(torch.bfloat16)
    drafts = torch.multinomial(torch.softmax(draft_logits.float().view(-1, vocab), -1), 1, generator=gen).view(n, k)
    kwargs = dict(temperature=temperature, method=method, seed=1, verify_lens=torch.tensor([7, 3, 0, 5]))
    if draft_mode != "none":
        kwargs["draft_logits"] = draft_logits
    if draft_mode == "logprobs":
        kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temperature)
    return target, drafts, kwargs


# Global bytes per warp instruction of the stats pass, at least: a warp of 16-byte loads carries 512; the same
# sweep with 4-byte loads would carry at most 128, with bf16 scalars 64 (measured here: 403 greedy, 210-268 sampled,
# where the per-row statistics, candidate lists and the draft rows' heads and tails add small accesses).
BYTES_PER_STATS_INSTRUCTION = 192
# Shared-memory warp instructions of the stats pass per element of the verified target rows, at most: the threads'
# candidate lists are registers and the top-kTopM extraction is warp reductions, so what is left is the CTA's
# statistics merges (measured here: 0.043 greedy, 0.126 - 0.137 sampled; kTopM block reductions instead give
# 0.28 - 0.29 sampled, candidate lists in shared memory 0.54 - 0.55).
SHARED_PER_STATS_ELEMENT = 0.2


@pytest.mark.simt
@pytest.mark.parametrize("method,draft_mode,temperature", [("token", "none", 0.0), ("token", "logprobs", 1.0),
                                                            ("block", "logits", 1.0)])
def test_cuda_stats_pass_reads_whole_sectors(monkeypatch, method, draft_mode, temperature):
    """The warp access model on the stats pass: its global loads touch at most 1.05x the 32-byte sectors their
    bytes need, with V = 32003 bf16 rows starting at every 2-byte offset modulo 16 (a row's unaligned head and tail
    are scalar, its body 16-byte loads of consecutive lanes); wide loads carry the bytes; and shared memory serves
    only the CTA merges."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    from dspark_kernels import simt
    if not simt.access_model_available():
        pytest.skip("the AddressSanitizer build has no access model; the counting build runs this test")
    target, drafts, kwargs = _bytes_case(method, draft_mode, temperature)
    out, rec = _record(lambda: dk.verify_chain(target, drafts, backend="cuda", **kwargs), access=True)
    ref = dk.verify_chain(target, drafts, backend="reference", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    (stats,) = [ln for ln in rec.launches if ln["kernel"] == "verify_chain_stats"]
    assert stats["global_sectors"] <= 1.05 * stats["global_sectors_ideal"], \
        (stats["global_sectors"], stats["global_sectors_ideal"])
    per_instruction = (stats["bytes_read"] + stats["bytes_written"]) / stats["global_instructions"]
    assert per_instruction >= BYTES_PER_STATS_INSTRUCTION, per_instruction
    elements = sum(n + 1 for n in kwargs["verify_lens"].tolist()) * target.shape[-1]
    per_element = stats["shared_instructions"] / elements
    assert per_element <= SHARED_PER_STATS_ELEMENT, per_element


TOP_M = 8            # candidates kept per (row, chunk) for the emitted token (verify::kTopM)
TOPLIST_BYTES = 136  # one (row, chunk) candidate list (verify::TopList)


def bookkeeping_allowance(n, rows, chunks):
    """O(N * K * chunks * M) bookkeeping: per (row, chunk) a 64-byte statistics partial written and read, a candidate
    list written and (for the emitting row) read, kTopM gathered draft logits; plus 1 KiB per request."""
    return (2 * 64 + 2 * TOPLIST_BYTES + TOP_M * 4) * rows * chunks + 1024 * n


LAUNCHES = {  # launches per call: (method, sampled, draft mode)
    ("token", False, "logits"): 2,   # stats, decide
    ("token", True, "none"): 2,      # stats, decide (+ emit)
    ("token", True, "logits"): 2,
    ("token", True, "logprobs"): 3,  # stats, decide, qstats (+ emit)
    ("block", True, "logprobs"): 3,  # stats, decide, mass (+ tau, emit)
    ("block", True, "logits"): 3,
}


@pytest.mark.simt
@pytest.mark.parametrize("method,draft_mode,temperature", [
    ("token", "logits", 0.0), ("token", "logprobs", 1.0), ("token", "logits", 1.0), ("token", "none", 1.0),
    ("block", "logprobs", 1.0)])
def test_cuda_bytes_against_the_floor(monkeypatch, method, draft_mode, temperature):
    """Bytes read against the floor (N = 4, K = 7, V = 32003 bf16; verify lengths 7, 3, 0, 5), and launches per call.

    floor: every verified target row once (greedy); + with draft_logprobs the draft row each rejecting request
    samples its correction from; + without them every verified draft row once. Token sampling stays within 1.05x of
    it plus the bookkeeping allowance (the emitted token is raced over the kept candidates; the exact fallback pass
    did not run in this case). Block verification also reads target and draft rows 1..L-1 a second time (the
    residual masses S_i need rho_i).
    """
    monkeypatch.setenv("DSPARK_SIMT", "1")
    target, drafts, kwargs = _bytes_case(method, draft_mode, temperature)
    n, k1, vocab = target.shape
    out, rec = _record(lambda: dk.verify_chain(target, drafts, backend="cuda", **kwargs))
    ref = dk.verify_chain(target, drafts, backend="reference", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    row = vocab * 2
    lens = kwargs["verify_lens"].tolist()
    n_acc = out.num_accepted.tolist()
    stats = rec.launches[0]
    chunks = stats["grid"][0] // (n * k1)
    allowance = bookkeeping_allowance(n, n * k1, chunks)
    floor = sum(L + 1 for L in lens) * row
    reread = 0
    if temperature:
        rejected = [a < L for a, L in zip(n_acc, lens)]
        if draft_mode == "logprobs" and method == "token":
            floor += sum(rejected) * row
        elif draft_mode != "none":
            floor += sum(lens) * row
        if method == "block":
            floor = sum(2 * L + 1 for L in lens) * row
            reread = sum(2 * max(L - 1, 0) for L in lens) * row
    assert len(rec.launches) == LAUNCHES[(method, bool(temperature), draft_mode)], rec.kernels()
    assert floor <= rec.bytes_read <= 1.05 * (floor + reread) + allowance, (rec.bytes_read, floor, reread)
    if method == "token":
        assert rec.bytes_read <= 1.01 * floor + allowance, (rec.bytes_read, floor)
    assert rec.bytes_written <= allowance + n * (k1 * 8 + 8)


def fallback_case(n, k, vocab, killed, seed):
    """Rows whose kept candidates (the chunks' best tokens of the race over p) carry little or no residual: p has
    40 tall peaks, the draft puts more mass on them (so max(0, p - q) lives in the tail), and drafts are tokens p
    gives no mass (rejected at row 0). Requests < `killed`: every peak has q >= p (the candidates' residual is 0:
    the whole row is passed again); the others keep one peak per 2048-token block with q < p (winner and mass
    usually certified, some chunks not)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(n, k + 1, vocab, generator=gen) * 0.5
    peaks = torch.randperm(vocab - 1, generator=gen)[:40] + 1
    target[:, :, peaks] += 10.0
    target[:, :, 0] = float("-inf")
    draft_logits = target[:, :k].clone()
    draft_logits[:, :, 0] = 0.0
    draft_logits[:, :, peaks] += 2.0
    for r in range(killed, n):
        for blk in range(0, vocab, 2048):
            inside = peaks[(peaks >= blk) & (peaks < blk + 2048)]
            if len(inside):
                draft_logits[r, :, inside[0]] -= 4.0
    drafts = torch.zeros(n, k, dtype=torch.int64)
    return target, drafts, draft_logits


@pytest.mark.simt
@pytest.mark.parametrize("method,draft_mode", [("token", "logits"), ("token", "logprobs"), ("block", "logits")])
def test_cuda_certificate_fallback(monkeypatch, simt_check, method, draft_mode):
    """The exact fallback of the candidate race runs (bytes show the extra pass) and still gives the reference's
    tokens exactly, both when the mass is not certified (whole-row pass) and when some chunks are not."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    n, k, vocab, killed = 8, 2, 4096, 4
    target, drafts, draft_logits = fallback_case(n, k, vocab, killed, seed=3)
    temps = torch.tensor([1.0, 0.9, 1.2, 1.0, 1.0, 0.8, 1.0, 1.1])
    kwargs = dict(draft_logits=draft_logits, temperature=temps, method=method, seed=7)
    if draft_mode == "logprobs":
        kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temps)
    ref = dk.verify_chain(target, drafts, backend="reference", **kwargs)
    out, rec = _record(lambda: simt_check(lambda: dk.verify_chain(target, drafts, backend="cuda", **kwargs)))
    assert all(torch.equal(a, b) for a, b in zip(out, ref)), (out.tokens, ref.tokens)
    assert out.num_accepted.tolist() == [0] * n
    assert (out.tokens[:, 0] > 0).all()
    row = vocab * 4
    runs = len(rec.launches) // LAUNCHES[(method, True, draft_mode)]  # simt_check runs the op several times
    floor = n * (k + 1) * row + (n * row if draft_mode == "logprobs" else n * k * row)
    if method == "block":
        floor = n * (2 * k + 1) * row
    per_run = rec.bytes_read / runs
    assert per_run >= floor + killed * 2 * row, (per_run, floor)   # the whole-row passes ran


# ---------------------------------------------------------------- CUDA: losslessness on the joint law
def simulate_joint(method, backend, trials, seed, use_logprobs, k=3, length=2, vocab=4, p_scale=2.5, q_scale=3.0,
                   device="cpu"):
    """``length`` tokens per request from repeated draft + verify (target/draft laws depend on the absolute
    position only; verify_chain's inputs on ``device``); returns the tokens [trials, length] and the target's
    per-position distributions, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    table = length + k + 1
    p_logits = torch.randn(table, vocab, generator=gen) * p_scale
    q_logits = p_logits + torch.randn(table, vocab, generator=gen) * q_scale
    out = torch.full((trials, length), -1, dtype=torch.int64)
    made = torch.zeros(trials, dtype=torch.int64)
    step = 0
    while bool((made < length).any()):
        pos = (made.unsqueeze(1) + torch.arange(k + 1)).clamp(max=table - 1)
        draft_l = q_logits[pos[:, :k]]
        drafts = torch.multinomial(torch.softmax(draft_l, -1).view(-1, vocab), 1, generator=gen).view(trials, k)
        kw = dict(draft_logits=draft_l.to(device), temperature=1.0, seed=seed + 1, offset=step, method=method,
                  backend=backend)
        if use_logprobs:
            kw["draft_logprobs"] = draft_logprobs_of(draft_l, drafts, 1.0).to(device)
        res_tokens = dk.verify_chain(p_logits[pos].to(device), drafts.to(device), **kw).tokens.cpu()
        emitted = res_tokens >= 0
        slot = made.unsqueeze(1) + torch.cumsum(emitted.long(), 1) - 1
        keep = emitted & (slot < length)
        out[torch.nonzero(keep, as_tuple=True)[0], slot[keep]] = res_tokens[keep]
        made += emitted.long().sum(1)
        step += 1
    return out, torch.softmax(p_logits[:length], -1)


def joint_passes(tokens, p):
    """Chi-square of the joint law of all generated positions against the product of the target's laws."""
    length, vocab = p.shape
    idx = torch.zeros(tokens.shape[0], dtype=torch.int64)
    expected = torch.ones(1)
    for m in range(length):
        idx = idx * vocab + tokens[:, m]
        expected = (expected.unsqueeze(-1) * p[m]).flatten()
    return passes(counts(idx, vocab ** length), expected * tokens.shape[0])


JOINT_TRIALS, JOINT_SEED = 3000, 1


def test_joint_law_detects_a_block_residual_without_rho(monkeypatch):
    """The joint test below has the power to fail: the reference with rho_tau dropped from the block residual
    (max(0, p - q) instead of max(0, rho_tau p - q)) fails it on the same case, the true reference passes."""
    import importlib
    ref_mod = importlib.import_module("dspark_kernels.reference.verify_chain")
    tokens, p = simulate_joint("block", "reference", JOINT_TRIALS, JOINT_SEED, False)
    assert joint_passes(tokens, p)
    block_accept = ref_mod._block_accept

    def without_rho(*a):
        tau, rho = block_accept(*a)
        return tau, torch.ones_like(rho)
    monkeypatch.setattr(ref_mod, "_block_accept", without_rho)
    tokens, p = simulate_joint("block", "reference", JOINT_TRIALS, JOINT_SEED, False)
    assert not joint_passes(tokens, p)


@pytest.mark.parametrize("method,use_logprobs", [("block", False), ("token", True)])
def test_cpu_lossless_joint_law(method, use_logprobs):
    tokens, p = simulate_joint(method, "cpu", JOINT_TRIALS, JOINT_SEED, use_logprobs)
    assert joint_passes(tokens, p)


@pytest.mark.harness_slow  # thousands of verifications through the SIMT harness: CI's slow leg runs it (quick on a GPU)
@pytest.mark.parametrize("method,use_logprobs", [("block", False), ("token", True)])
def test_cuda_lossless_joint_law(cuda_device, method, use_logprobs):
    tokens, p = simulate_joint(method, "cuda", JOINT_TRIALS, JOINT_SEED, use_logprobs, device=cuda_device)
    if cuda_device.type == "cpu":
        ref, _ = simulate_joint(method, "reference", JOINT_TRIALS, JOINT_SEED, use_logprobs)
        assert torch.equal(tokens, ref)
    assert joint_passes(tokens, p)


@pytest.mark.simt
def test_cuda_opcheck(monkeypatch):
    monkeypatch.setenv("DSPARK_SIMT", "1")
    from dspark_kernels import simt
    simt.module()
    torch.manual_seed(0)
    n, k, vocab = 3, 4, 13
    dl = torch.randn(n, k, vocab)
    drafts = torch.randint(0, vocab, (n, k))
    temps = torch.tensor([0.0, 1.0, 0.7])
    args = (torch.randn(n, k + 1, vocab), None, drafts, dl, draft_logprobs_of(dl, drafts, temps),
            torch.tensor([4, 2, 0]), None, None, temps, torch.tensor([3, 4]), torch.tensor([5]), "block")
    torch.library.opcheck(torch.ops.dspark_simt.verify_chain.default, args)
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.dspark_simt.verify_chain.default,
                          (torch.randn(9, vocab), cu) + args[2:11] + ("token",))
    torch.library.opcheck(torch.ops.dspark_simt.verify_chain.default, args[:8] + (None,) + args[9:])


@pytest.mark.sass
def test_sass_stats_sweep_has_four_16_byte_loads_in_flight():
    """sm_90a SASS (tools/check_cuda.py's report): every stats instance at the design occupancy without spills, and
    each of its innermost loops that loads 16-byte vectors issues at least four of them per iteration (the
    sampled and the greedy sweep)."""
    from sass_facts import sass_facts
    kernels = sass_facts("verify::stats_kernel<")
    assert len(kernels) == 9  # every (target, draft) dtype pair
    for k in kernels:
        name = k.get("demangled", k["kernel"])
        assert k["spill_bytes"] == 0 and k["registers"] <= 65536 // (256 * CTAS_PER_SM), name
        assert k["ctas_per_sm"]["256"] >= CTAS_PER_SM, name
        sweeps = [lp for lp in k["sass"]["loops"] if lp["LDG.E.128"] > 0]
        assert len(sweeps) >= 2 and all(lp["LDG.E.128"] >= 4 for lp in sweeps), (name, sweeps)


@pytest.mark.sass
def test_sass_qstats_sweep_has_four_16_byte_loads_in_flight():
    """sm_90a SASS: every qstats instance at the design occupancy without spills, its draft-row sweep issuing four
    16-byte loads per iteration (scan_chunk, as the stats pass; the emission's loops after it load fewer)."""
    from sass_facts import sass_facts
    kernels = sass_facts("verify::qstats_kernel<")
    assert len(kernels) == 9
    for k in kernels:
        name = k.get("demangled", k["kernel"])
        assert k["spill_bytes"] == 0 and k["registers"] <= 65536 // (256 * CTAS_PER_SM), name
        assert max(lp["LDG.E.128"] for lp in k["sass"]["loops"]) >= 4, name
