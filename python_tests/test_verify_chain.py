import itertools

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
    vocab = 6
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
    # offsets whose differences overflow int64: no rows (end <= start, or start outside [0, R))
    for cu in ([0, -2**63], [-1, 2**63 - 1], [2**63 - 1, -2**63], [1, 2**63 - 1]):
        out = dk.verify_chain(rows, drafts[:1], cu_seqlens=torch.tensor(cu))
        assert out.tokens.tolist() == ([[-1, -1, -1]] if cu[0] != 1 else [[2, -1, -1]]), cu


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
    """A map of distinct ids only places the rows: the result equals verifying dense rows (-inf off the map)
    exactly, with the map or with its target -> draft table."""
    gen = torch.Generator().manual_seed(4)
    n, k, vocab, vd = 5, 3, 30, 8
    target = torch.randn(n, k + 1, vocab, generator=gen)
    d2t = torch.randperm(vocab, generator=gen)[:vd]
    rows = torch.randn(n, k, vd, generator=gen)
    dense = torch.full((n, k, vocab), float("-inf"))
    dense[..., d2t] = rows
    drafts = d2t[torch.randint(0, vd, (n, k), generator=gen)]
    inv = dk.target_to_draft_map(d2t, vocab)
    for method in ("token", "block"):
        kw = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]), seed=3, method=method)
        want = dk.verify_chain(target, drafts, draft_logits=dense, **kw)
        got = dk.verify_chain(target, drafts, draft_logits=rows, draft_to_target=d2t, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), method
        got = dk.verify_chain(target, drafts, draft_logits=rows, target_to_draft=inv, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), method
    with pytest.raises(ValueError, match="draft_to_target needs draft_logits"):
        dk.verify_chain(target, drafts, draft_to_target=d2t)
    with pytest.raises(ValueError, match="draft_logits"):
        dk.verify_chain(target, drafts, draft_logits=rows[..., :7], draft_to_target=d2t)
    with pytest.raises(ValueError, match="draft_to_target"):
        dk.verify_chain(target, drafts, draft_logits=rows, draft_to_target=d2t.float())
    with pytest.raises(ValueError, match="target_to_draft"):
        dk.verify_chain(target, drafts, draft_logits=rows, target_to_draft=inv[:-1])
    with pytest.raises(ValueError, match="not both"):
        dk.verify_chain(target, drafts, draft_logits=rows, target_to_draft=inv, draft_to_target=d2t)


def test_target_to_draft_map_rules():
    """The last column naming an id gives it its q; entries outside [0, V) are dropped (never written)."""
    d2t = torch.tensor([3, 15, 7, 3, 9, -2])
    assert dk.target_to_draft_map(d2t, 12).tolist() == [-1, -1, -1, 3, -1, -1, -1, 2, -1, 4, -1, -1]
    assert dk.target_to_draft_map(d2t, 12).dtype == torch.int32


@pytest.mark.parametrize("layout", ["reduced", "topk"])
def test_draft_rows_are_read_as_they_are(host_backend, layout):
    """q of a reduced or top-k row is the softmax over its own columns (a column mapped outside [0, V) keeps its
    share of the normaliser), at the last column naming an id: the token rule's accept count equals u q(d) < p(d)
    with explicit uniforms; with draft_logprobs q(d) is exp(logprob) and the row is normalised by it."""
    gen = torch.Generator().manual_seed(6)
    n, vocab, temp = 400, 12, 0.9
    ids = torch.tensor([3, 15, 7, 3, 9, -2])            # 15 and -2 outside [0, 12); id 3 in columns 0 and 3
    last = {3: 3, 7: 2, 9: 4}
    target = torch.randn(n, 2, vocab, generator=gen)
    rows = torch.randn(n, 1, ids.numel(), generator=gen)
    drafts = torch.tensor([3, 7, 9])[torch.randint(0, 3, (n, 1), generator=gen)]
    kw = dict(draft_to_target=ids) if layout == "reduced" else dict(draft_candidates=ids.expand(n, 1, -1))
    out = dk.verify_chain(target, drafts, draft_logits=rows, temperature=temp, seed=11, **kw)
    q = torch.softmax(rows[:, 0] / temp, -1).gather(1, torch.tensor([last[int(d)] for d in drafts[:, 0]]).view(n, 1))
    p = torch.softmax(target[:, 0] / temp, -1).gather(1, drafts)
    u = rng.uniform(torch.tensor([11, 0]), torch.arange(n), 0, rng.STREAM_ACCEPT, 0).view(n, 1)
    assert out.num_accepted.view(n, 1).tolist() == (u * q < p).int().tolist()
    assert 50 < int(out.num_accepted.sum()) < 350
    lp = torch.full((n, 1), -0.5)
    out = dk.verify_chain(target, drafts, draft_logits=rows, draft_logprobs=lp, temperature=temp, seed=11, **kw)
    assert out.num_accepted.view(n, 1).tolist() == (u * lp.exp() < p).int().tolist()


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
        (dict(draft_logits=torch.zeros(2, 3, 0), draft_candidates=torch.zeros(2, 3, 0, dtype=torch.int64)),
         "draft_logits"),
        (dict(draft_logits=torch.zeros(2, 3, 0), draft_to_target=torch.zeros(0, dtype=torch.int64)), "draft_logits"),
        (dict(draft_logits=torch.zeros(2, 3, 0), target_to_draft=torch.zeros(9, dtype=torch.int32)), "draft_logits"),
    ]
    for override, name in cases:
        kwargs = dict(target_logits=t, draft_tokens=d)
        kwargs.update(override)
        with pytest.raises((ValueError, TypeError), match=name):
            dk.verify_chain(kwargs.pop("target_logits"), kwargs.pop("draft_tokens"), **kwargs)


def opcheck_calls(backend=None):
    """Argument tuples of torch.ops.*.verify_chain covering the draft layouts, packed rows and greedy calls."""
    torch.manual_seed(0)
    n, k, vocab = 3, 4, 13
    dl = torch.randn(n, k, vocab)
    drafts = torch.randint(0, vocab, (n, k))
    temps = torch.tensor([0.0, 1.0, 0.7])
    tail = (backend,) if backend else ()
    args = (torch.randn(n, k + 1, vocab), None, drafts, dl, None, None, draft_logprobs_of(dl, drafts, temps),
            torch.tensor([4, 2, 0]), None, None, temps, torch.tensor([3, 4]), torch.tensor([5]), "block") + tail
    yield args
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    yield (torch.randn(9, vocab), cu) + args[2:13] + ("token",) + tail
    yield args[:10] + (None,) + args[11:]   # temperature None: every request greedy
    d2t = torch.tensor([5, 2, 11, 0], dtype=torch.int64)
    yield args[:3] + (torch.randn(n, k, 4), dk.target_to_draft_map(d2t, vocab), None, None) + args[7:]
    cands = torch.randint(0, vocab, (n, k, 5))
    yield args[:3] + (torch.randn(n, k, 5), None, cands, None) + args[7:13] + ("token",) + tail


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_opcheck(backend):
    for args in opcheck_calls(backend):
        torch.library.opcheck(torch.ops.dspark.verify_chain.default, args)


# ---------------------------------------------------------------- Triton twin (interpreter on the CPU)
TRITON_CASES = [  # N, K, V, dtype, method, with draft logits, packed
    (1, 1, 1, torch.float32, "token", False, False),
    (3, 5, 17, torch.bfloat16, "block", True, True),
    (3, 7, 1000, torch.float16, "token", True, False),
    (3, 16, 17, torch.float32, "block", False, False),
    (9, 5, 17, torch.float32, "token", True, True),
    (9, 4, 23, torch.float32, "block", True, False),
    (64, 5, 17, torch.float32, "token", True, True),
    (64, 4, 23, torch.float32, "block", True, False),
    (2, 7, 32000, torch.bfloat16, "block", True, False),
    (2, 3, 32003, torch.float32, "token", False, True),
]


# N = 64 runs 800 programs through the interpreter (a program per (request, row)): CI's slow leg; N = 9 by default
@pytest.mark.parametrize("n,k,vocab,dtype,method,with_logits,packed", [
    pytest.param(*case, marks=pytest.mark.slow if case[0] == 64 else ()) for case in TRITON_CASES])
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


@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_draft_rows_read_as_they_are(triton_device, method):
    """Reduced and top-k draft rows in their own layout (an entry outside [0, V), a repeated id): the reference's
    tokens (two shapes of map_calls)."""
    for i, (args, kwargs) in enumerate(map_calls(method)):
        if i % 4 not in (0, 3):
            continue
        ref = dk.verify_chain(*args, backend="reference", **kwargs)
        on_dev = {key: v.to(triton_device) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
        out = dk.verify_chain(*(a.to(triton_device) for a in args), backend="triton", **on_dev)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, ref)), (out.tokens, ref.tokens)


def test_triton_infinite_temperature(triton_device):
    for args, kwargs in infinite_temperature_calls():
        out = run_both(triton_device, lambda fn: fn(), args, kwargs, backend="triton")
        assert out.num_accepted[0] == args[1].shape[1]


@pytest.mark.parametrize("case", [(9, 4, 23, torch.float32, "token", "logprobs", False, "mixed"),
                                  (9, 5, 17, torch.bfloat16, "block", "logprobs", True, "mixed")],
                         ids=["token", "block-packed-bf16"])
def test_triton_dense_rows_with_logprobs_match_the_reference(triton_device, case):
    """Dense draft rows with draft_logprobs (q(d_j) from them, the rejected row's normaliser implied by them), beside
    greedy requests, an invalid draft, stop tokens, lengths and thresholds (make_case): the reference's tokens."""
    run_both(triton_device, lambda fn: fn(), *kernel_case(*case), backend="triton")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_triton_nan_before_finite_no_rows_and_low_temperature(triton_device):
    for args, kwargs in [*nan_before_finite_calls(), *no_rows_and_empty_batch_calls(), *low_temperature_calls()]:
        run_both(triton_device, lambda fn: fn(), args, kwargs, backend="triton")


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
    # int64 offsets whose differences overflow: requests without rows, whatever the memory past the tensor holds
    cu = torch.tensor([0, -2**63, 2**63 - 1, -1, 2**63 - 1, 2, 2**63 - 1])
    yield (torch.randn(3, 9), torch.randint(0, 9, (6, 2))), dict(cu_seqlens=cu, temperature=1.0)


def low_temperature_calls():
    """Logits a few ulps apart near 20 at T = 1e-5 and 2e-6, where x / T is far from 0: p and q must be formed from x / T
    as torch rounds it (an ulp of x / T is a large step in exp's argument)."""
    for seed in (10, 33):
        gen = torch.Generator().manual_seed(seed)
        n, k, vocab = 4, 3, 50
        target = 20 + torch.randint(-7, 8, (n, k + 1, vocab), generator=gen).float() * 2e-6
        draft_logits = 20 + torch.randint(-7, 8, (n, k, vocab), generator=gen).float() * 2e-6
        drafts = torch.randint(0, vocab, (n, k), generator=gen)
        for temperature, method in itertools.product((1e-5, 2e-6), ("token", "block")):
            yield (target, drafts), dict(temperature=temperature, seed=seed, method=method, draft_logits=draft_logits)


def infinite_temperature_calls():
    """T = inf (alone and beside finite and greedy rows): every scaled logit is 0, so p and q are uniform and every
    draft is accepted (p / q = 1), and the bonus is a uniform draw. V = 17: a row that does not fill its block."""
    gen = torch.Generator().manual_seed(7)
    n, k, vocab = 3, 3, 17
    target = torch.randn(n, k + 1, vocab, generator=gen) * 2
    draft_logits = torch.randn(n, k, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    for temperature, method in itertools.product((float("inf"), torch.tensor([float("inf"), 1.0, 0.0])),
                                                 ("token", "block")):
        yield (target, drafts), dict(temperature=temperature, seed=3, method=method, draft_logits=draft_logits)


def infinite_logits_at_infinite_temperature_calls():
    """T = inf with infinite logits: l / T is NaN there, so torch's softmax of that row is NaN, its draft is rejected
    and nothing is sampled from it. V = 300: the infinity sits in the first 256-token block of a row that goes on with
    finite logits (the CPU kernel once dropped that block from the row's statistics and accepted the draft)."""
    gen = torch.Generator().manual_seed(41)
    n, k, vocab = 4, 2, 300
    target = torch.randn(n, k + 1, vocab, generator=gen)
    draft_logits = torch.zeros(n, k, vocab)        # q uniform at T = inf: p / q = 1 accepts on finite rows
    drafts = torch.full((n, k), 7)
    target[0, 0, 1] = float("inf")                 # a target row: rejected at position 0
    target[1, 1, 299] = float("-inf")              # -inf / inf is NaN too: rejected at position 1
    draft_logits[2, 0, 5] = float("inf")           # a draft row: q is NaN, rejected at position 0
    for method in ("token", "block"):
        for temperature in (float("inf"), torch.tensor([float("inf"), float("inf"), float("inf"), 1.0])):
            yield (target, drafts), dict(temperature=temperature, method=method, seed=4, draft_logits=draft_logits)


def nan_before_finite_calls():
    """A NaN that a thread reads before any finite logit (an unaligned row's scalar head; a NaN run at an aligned
    row's start; -inf then NaN), in a target row and in a draft row: torch's softmax of the row is NaN, so its draft is
    rejected and nothing is sampled from it."""
    gen = torch.Generator().manual_seed(31)
    n, k, vocab = 4, 2, 17                     # 17 float32 columns: every other row starts unaligned
    target = torch.randn(n, k + 1, vocab, generator=gen) * 2
    target[:, 0, 10] = BIG
    target[1, 0, 0] = NAN
    target[2, 0, :4] = NAN
    target[3, 0, :6] = float("-inf")
    target[3, 0, 6] = NAN
    drafts = torch.full((n, k), 10)
    for method in ("token", "block"):
        yield (target, drafts), dict(temperature=torch.ones(n), method=method, seed=1)
    clean = torch.where(torch.isnan(target), 0.0, target)
    draft_logits = torch.randn(n, k, vocab, generator=gen)
    draft_logits[1, 0, 0] = NAN
    draft_logits[2, 0, :4] = NAN
    yield (clean, drafts), dict(temperature=torch.ones(n), seed=2, draft_logits=draft_logits)


@pytest.mark.parametrize("n,k,vocab,dtype,method,draft_mode,packed,temps", CUDA_CASES)
def test_cuda_matches_reference(cuda_device, simt_check, n, k, vocab, dtype, method, draft_mode, packed, temps):
    run_both(cuda_device, simt_check, *kernel_case(n, k, vocab, dtype, method, draft_mode, packed, temps))


def beyond_the_cuda_limits_calls():
    """K = 17 drafts a request, and a top-k draft row of 1025 columns: past the CUDA kernels' limits (K <= 16, top-k
    rows of at most 1024 columns), within the other backends'."""
    gen = torch.Generator().manual_seed(17)
    n, k, vocab = 2, 17, 40
    target = torch.randn(n, k + 1, vocab, generator=gen)
    drafts = target[:, :k].argmax(-1)
    yield (target, drafts), {}
    yield (target, drafts), dict(temperature=1.0, draft_logits=torch.randn(n, k, vocab, generator=gen))
    k, vocab, width = 2, 1100, 1025
    target = torch.randn(n, k + 1, vocab, generator=gen)
    cands = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in range(n * k)]).view(n, k, width)
    yield (target, cands[..., 0]), dict(temperature=1.0, draft_logits=torch.randn(n, k, width, generator=gen),
                                        draft_candidates=cands)


def test_cuda_refuses_calls_beyond_its_limits_naming_them(cuda_device):
    for (args, kwargs), name in zip(beyond_the_cuda_limits_calls(), ("K in", "K in", "at most 1024 columns")):
        on_dev = {key: val.to(cuda_device) if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
        with pytest.raises(RuntimeError, match=name):
            dk.verify_chain(*(a.to(cuda_device) for a in args), backend="cuda", **on_dev)


def test_auto_runs_triton_where_the_cuda_kernels_cannot(monkeypatch, triton_device):
    """"auto" on a GPU picks the CUDA kernels; a call beyond their limits (which they refuse) runs Triton instead,
    with the reference's result; an explicit backend (argument or DSPARK_BACKEND) is kept."""
    import sys
    mod = sys.modules["dspark_kernels.ops.verify_chain"]  # the module (the package exports the function)
    picked = []
    real = mod.VERIFY_CHAIN

    class Spy:
        name = real.name

        def __call__(self, *args, backend):
            if backend != "reference":
                picked.append(backend)
            return real(*args, backend="triton" if backend == "cuda" else backend)  # no CUDA kernel here
    monkeypatch.setattr(mod, "VERIFY_CHAIN", Spy())
    monkeypatch.setattr(mod, "resolve_backend",
                        lambda backend, device, op: {"auto": "cuda"}.get(mod.requested_backend(backend),
                                                                         mod.requested_backend(backend)))
    monkeypatch.delenv("DSPARK_BACKEND", raising=False)
    for args, kwargs in beyond_the_cuda_limits_calls():
        on_dev = {key: val.to(triton_device) if isinstance(val, torch.Tensor) else val
                  for key, val in kwargs.items()}
        out = dk.verify_chain(*(a.to(triton_device) for a in args), **on_dev)
        ref = dk.verify_chain(*args, backend="reference", **kwargs)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, ref))
    assert picked[-1] == "triton" and picked.count("triton") == 3
    target = torch.randn(1, 3, 9)
    dk.verify_chain(target, target[:, :2].argmax(-1))
    assert picked[-1] == "cuda"                         # within the limits "auto" keeps the CUDA kernels
    args, kwargs = next(beyond_the_cuda_limits_calls())
    monkeypatch.setenv("DSPARK_BACKEND", "cuda")       # asked for by name: kept (and refused by the kernels)
    mod.verify_chain(*args, **kwargs)
    assert picked[-1] == "cuda"


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


def test_cuda_low_temperature(cuda_device, simt_check):
    for args, kwargs in low_temperature_calls():
        run_both(cuda_device, simt_check, args, kwargs)


def test_cuda_infinite_temperature(cuda_device, simt_check):
    for args, kwargs in infinite_temperature_calls():
        out = run_both(cuda_device, simt_check, args, kwargs)
        assert out.num_accepted[0] == args[1].shape[1]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_infinite_logits_at_infinite_temperature(cuda_device, simt_check):
    for args, kwargs in infinite_logits_at_infinite_temperature_calls():
        out = run_both(cuda_device, simt_check, args, kwargs)
        assert out.num_accepted[0] == 0 and out.num_accepted[2] == 0
        if kwargs["method"] == "token":
            assert out.num_accepted[1] == 1


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_nan_before_finite(cuda_device, simt_check):
    for args, kwargs in nan_before_finite_calls():
        out = run_both(cuda_device, simt_check, args, kwargs)
        assert out.num_accepted[1:3].eq(0).all()   # rows 1 and 2 hold a NaN in every call


# ---------------------------------------------------------------- CPU kernels (csrc/cpu)
CPU = torch.device("cpu")


def run_cpu(args, kwargs):
    return run_both(CPU, lambda fn: fn(), args, kwargs, backend="cpu")


@pytest.mark.parametrize("n,k,vocab,dtype,method,draft_mode,packed,temps", CUDA_CASES)
def test_cpu_matches_reference(n, k, vocab, dtype, method, draft_mode, packed, temps):
    run_cpu(*kernel_case(n, k, vocab, dtype, method, draft_mode, packed, temps))


@pytest.mark.parametrize("calls", [mixed_dtype_and_large_vocab_calls, no_rows_and_empty_batch_calls,
                                   lambda: adversarial_calls("token"), lambda: adversarial_calls("block"),
                                   lambda: wide_logit_range_calls("token"), lambda: wide_logit_range_calls("block"),
                                   nan_before_finite_calls, low_temperature_calls, infinite_temperature_calls,
                                   infinite_logits_at_infinite_temperature_calls],
                         ids=["mixed_dtype_large_vocab", "no_rows_empty_batch", "adversarial_token",
                              "adversarial_block", "wide_range_token", "wide_range_block", "nan_before_finite",
                              "low_temperature", "infinite_temperature", "infinite_logits_infinite_temperature"])
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


def map_calls(method):
    """Reduced and top-k draft rows (a map entry outside [0, V), a repeated id), with and without draft_logprobs,
    bf16 and fp32, drafts the target mostly accepts."""
    for layout, n, k, vocab, width, dtype in (("reduced", 5, 4, 300, 40, torch.float32),
                                             ("topk", 3, 7, 5000, 64, torch.bfloat16),
                                             ("reduced", 3, 5, 4099, 64, torch.bfloat16),
                                             ("topk", 4, 3, 301, 12, torch.float32)):
        for mode in ("logits", "logprobs"):
            yield map_case(layout, n, k, vocab, width, dtype, method, mode, seed=n + k + width)


def map_case(layout, n, k, vocab, width, dtype, method, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(n, k + 1, vocab, generator=gen) * 2
    if layout == "reduced":
        ids = torch.randperm(vocab, generator=gen)[:width]
        ids[1], ids[2] = vocab + 5, ids[3]            # outside [0, V); a repeated id
        place = ids.clamp(max=vocab - 1).expand(n, k, width)
    else:
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in range(n * k)]).view(n, k, width)
        ids[0, 0, 1], ids[..., 2] = -3, ids[..., 4]
        place = ids.clamp(min=0)
    rows = target[:, :k].gather(-1, place) + 0.3 * torch.randn(n, k, width, generator=gen)
    target[:, :k].scatter_(-1, place, rows + 3.0)     # the target puts its mass where the draft does
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3] * n)[:n]
    t = torch.where(temps > 0, temps, 1.0).view(n, 1, 1)
    col = torch.multinomial(torch.softmax(rows / t, -1).view(-1, width), 1, generator=gen).view(n, k)
    drafts = (ids.expand(n, k, width) if layout == "reduced" else ids).gather(-1, col.unsqueeze(-1)).squeeze(-1)
    kw = dict(draft_logits=rows.to(dtype), temperature=temps, seed=seed, method=method,
              verify_lens=torch.randint(k // 2, k + 1, (n,), generator=gen),
              **({"draft_to_target": ids} if layout == "reduced" else {"draft_candidates": ids}))
    if mode == "logprobs":
        kw["draft_logprobs"] = torch.log_softmax(rows.to(dtype).float() / t, -1).gather(-1, col.unsqueeze(-1))[..., 0]
    return (target.to(dtype), drafts), kw


@pytest.mark.parametrize("method", ["token", "block"])
def test_cuda_draft_rows_read_as_they_are(cuda_device, simt_check, method):
    """Reduced [N, K, Vd] and top-k [N, K, k] draft rows go to the kernels as they are: the reference's tokens."""
    for args, kwargs in map_calls(method):
        run_both(cuda_device, simt_check, args, kwargs)


@pytest.mark.parametrize("method", ["token", "block"])
def test_cpu_draft_rows_read_as_they_are(method):
    for args, kwargs in map_calls(method):
        run_cpu(args, kwargs)


def residual_tail_case(n, k, vocab, seed):
    """Rows whose residual max(0, p - q) lives in the tail: p has 40 tall peaks that the draft overweights, and
    drafts are tokens p gives no mass (rejected at row 0)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(n, k + 1, vocab, generator=gen) * 0.5
    peaks = torch.randperm(vocab - 1, generator=gen)[:40] + 1
    target[:, :, peaks] += 10.0
    target[:, :, 0] = float("-inf")
    draft_logits = target[:, :k].clone()
    draft_logits[:, :, 0] = 0.0
    draft_logits[:, :, peaks] += 2.0
    drafts = torch.zeros(n, k, dtype=torch.int64)
    return target, drafts, draft_logits


@pytest.mark.parametrize("method,draft_mode", [("token", "logits"), ("token", "logprobs"), ("block", "logits")])
def test_cuda_residual_in_the_tail(cuda_device, simt_check, method, draft_mode):
    """The residual's winner where p's tallest tokens carry none of it: the reference's tokens exactly."""
    target, drafts, draft_logits = residual_tail_case(8, 2, 4096, seed=3)
    temps = torch.tensor([1.0, 0.9, 1.2, 1.0, 1.0, 0.8, 1.0, 1.1])
    kwargs = dict(draft_logits=draft_logits, temperature=temps, method=method, seed=7)
    if draft_mode == "logprobs":
        kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temps)
    out = run_both(cuda_device, simt_check, (target, drafts), kwargs)
    assert out.num_accepted.tolist() == [0] * 8 and (out.tokens[:, 0] > 0).all()


# ---------------------------------------------------------------- CUDA: bytes moved, CTAs, launches, access
def _record(fn, access=False):
    from dspark_kernels import simt
    with simt.record(access=access) as rec:
        out = fn()
    return out, rec


def _floors():
    import importlib.util
    import os
    import sys
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "floors.py")
    spec = importlib.util.spec_from_file_location("dspark_bench_floors", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dspark_bench_floors"] = mod
    spec.loader.exec_module(mod)
    return mod


SMS = 132  # the harness's default multiprocessor count (an H200)


def headline_case(n, k, mode, verified, seed=0):
    """V = 151936 bf16 rows (target randn * 2, draft = target + randn * 2); requests r < `verified` verify all K
    drafts, the others none (so large N stays cheap on the CPU). mode "greedy": drafts are the target's argmax with
    one mismatch in the middle; "token": drafts sampled from the draft, with draft_logprobs. Returns the call's
    args, kwargs and its bytes floor (bench/floors.py)."""
    vocab = 151936
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(torch.bfloat16)
    lens = torch.where(torch.arange(n) < verified, k, 0)
    kwargs = dict(verify_lens=lens)
    if mode == "greedy":
        drafts = target[:, :k].float().argmax(-1)
        drafts[:, k // 2] = (drafts[:, k // 2] + 1) % vocab
    else:  # the draft rows of requests that verify nothing are never read: zeros
        draft_logits = torch.zeros(n, k, vocab, dtype=torch.bfloat16)
        draft_logits[:verified] = (target[:verified, :k].float() +
                                   torch.randn(verified, k, vocab, generator=gen) * 2).to(torch.bfloat16)
        drafts = torch.zeros(n, k, dtype=torch.int64)
        drafts[:verified] = torch.multinomial(torch.softmax(draft_logits[:verified].float().view(-1, vocab), -1), 1,
                                              generator=gen).view(verified, k)
        temps = torch.ones(n)
        logprobs = torch.zeros(n, k)
        logprobs[:verified] = draft_logprobs_of(draft_logits[:verified], drafts[:verified], temps[:verified])
        kwargs.update(draft_logits=draft_logits, draft_logprobs=logprobs, temperature=temps, seed=seed + 2)
    floor = _floors().verify_chain(lens.tolist(), k, vocab, sampled=mode != "greedy",
                                   draft_logits_bytes=2 if mode != "greedy" else None, draft_logprobs=mode != "greedy")
    return (target, drafts), kwargs, floor.total


def check_headline(n, k, mode, verified):
    """Bytes (read and written, every partial included) at most 1.02x the floor, exactly the reference's tokens,
    one launch (greedy) or two (token sampling), and at N = 1 a CTA for every multiprocessor in each launch."""
    args, kwargs, floor = headline_case(n, k, mode, verified)
    out, rec = _record(lambda: dk.verify_chain(*args, backend="cuda", **kwargs))
    # the reference on the requests that verify drafts (the same request indices, so the same random numbers)
    head = {key: v[:verified] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for key, v in kwargs.items()}
    ref = dk.verify_chain(*(a[:verified] for a in args), backend="reference", **head)
    assert all(torch.equal(a[:verified], b) for a, b in zip(out, ref))
    assert (out.num_accepted[verified:] == 0).all() and (out.tokens[verified:, 0] >= 0).all()
    assert rec.kernels() == (["verify_chain_rows"] if mode == "greedy" else
                             ["verify_chain_rows", "verify_chain_sample"]), rec.kernels()
    assert rec.bytes <= 1.02 * floor, (rec.bytes, floor, rec.bytes / floor)
    if n == 1:
        assert all(launch["ctas"] >= SMS for launch in rec.launches), [launch["ctas"] for launch in rec.launches]
    return out


@pytest.mark.simt
@pytest.mark.parametrize("n,k", [(1, 7), (1, 15), (64, 7)])
@pytest.mark.parametrize("mode", ["greedy", "token"])
def test_cuda_bytes_at_the_headline_vocab(monkeypatch, n, k, mode):
    """V = 151936 bf16, N = 1 (every request verifies K drafts) and N = 64 (four do, the others none): bytes at most
    1.02x bench/floors.py's floor (greedy: the verified target rows; token sampling with draft_logprobs: those and
    one draft row per request). Sampled requests read target rows 0..L-1 in pass A and the emitting row in pass B,
    so even a rejection reads L + 1 target rows."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    out = check_headline(n, k, mode, verified=1 if n == 1 else 4)
    assert int((out.num_accepted[:1] < k).sum()) == 1   # the first request rejects a draft


@pytest.mark.simt
@pytest.mark.slow
@pytest.mark.parametrize("n,k", [(64, 15), (256, 7), (256, 15)])
@pytest.mark.parametrize("mode", ["greedy", "token"])
def test_cuda_bytes_at_the_headline_vocab_large_batch(monkeypatch, n, k, mode):
    monkeypatch.setenv("DSPARK_SIMT", "1")
    check_headline(n, k, mode, verified=4)


def _bytes_case(method, draft_mode, temperature, vocab=32000):
    gen = torch.Generator().manual_seed(1)
    n, k = 4, 4
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2).to(torch.bfloat16)
    draft_logits = (target[:, :k].float() + torch.randn(n, k, vocab, generator=gen) * 2).to(torch.bfloat16)
    drafts = torch.multinomial(torch.softmax(draft_logits.float().view(-1, vocab), -1), 1, generator=gen).view(n, k)
    kwargs = dict(temperature=temperature, method=method, seed=1, verify_lens=torch.tensor([4, 3, 0, 2]))
    if draft_mode != "none":
        kwargs["draft_logits"] = draft_logits
    if draft_mode == "logprobs":
        kwargs["draft_logprobs"] = draft_logprobs_of(draft_logits, drafts, temperature)
    return target, drafts, kwargs


LAUNCHES = {  # (method, sampled) -> kernels
    ("token", False): ["verify_chain_rows"],
    ("token", True): ["verify_chain_rows", "verify_chain_sample"],
    ("block", True): ["verify_chain_rows", "verify_chain_mass", "verify_chain_sample"],
}


@pytest.mark.simt
@pytest.mark.parametrize("method,draft_mode,temperature", [
    ("token", "logits", 0.0), ("token", "logprobs", 1.0), ("token", "logits", 1.0), ("token", "none", 1.0),
    ("block", "logprobs", 1.0), ("block", "logits", 1.0)])
def test_cuda_bytes_against_the_floor(monkeypatch, method, draft_mode, temperature):
    """Bytes against bench/floors.py's floor (N = 4, K = 4, V = 32000 bf16; verify lengths 4, 3, 0, 2), and the
    launches: within 1.02x of it plus 64 bytes a CTA (its request's state and partials, which rows this short do not
    hide; the headline test holds 1.02x with everything), and below it for token sampling with draft_logprobs (a
    draft row is read only where a draft was rejected). Token sampling without draft_logprobs reads the emitting
    draft row a second time (pass B), block verification target and draft rows 1..L-1 a second time (pass M: S_i
    needs rho_i) and the emitting draft rows in pass B."""
    monkeypatch.setenv("DSPARK_SIMT", "1")
    target, drafts, kwargs = _bytes_case(method, draft_mode, temperature)
    n, k1, vocab = target.shape
    out, rec = _record(lambda: dk.verify_chain(target, drafts, backend="cuda", **kwargs))
    ref = dk.verify_chain(target, drafts, backend="reference", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert rec.kernels() == LAUNCHES[(method, bool(temperature))], rec.kernels()
    lens = kwargs["verify_lens"].tolist()
    row = vocab * 2
    floor = _floors().verify_chain(lens, k1 - 1, vocab, sampled=bool(temperature),
                                   draft_logits_bytes=2 if draft_mode != "none" else None,
                                   draft_logprobs=draft_mode == "logprobs").total
    rejected = sum(a < L for a, L in zip(out.num_accepted.tolist(), lens))
    again = 0
    if temperature and draft_mode == "logits":
        again = rejected * row                                  # pass B's draft row
    if temperature and method == "block":
        again = sum(2 * max(L - 1, 0) for L in lens) * row      # pass M
        again += (rejected * row if draft_mode != "none" else 0)
    per_cta = 64 * rec.ctas   # a CTA's request state and partials: a few percent of rows this short
    assert rec.bytes <= 1.02 * (floor + again) + per_cta, (rec.bytes, floor, again, per_cta)
    if method == "token" and draft_mode == "logprobs":
        assert rec.bytes <= floor


@pytest.mark.simt
@pytest.mark.parametrize("call", ["greedy", "sampled"])
def test_cuda_rows_pass_access_at_every_alignment(monkeypatch, call):
    """Pass A's sweeps on packed bf16 rows of V = 32003 (rows at every 2-byte offset modulo 16: a row's head up to
    its first 32-byte boundary is scalar, its body 16-byte loads of consecutive lanes), its partials and its
    finisher: every line at the ideal sectors and shared-memory wavefronts."""
    from access import ideal_access
    monkeypatch.setenv("DSPARK_SIMT", "1")
    args, kwargs = make_case(5, 4, 32003, torch.bfloat16, "none" if call == "greedy" else "logits", True,
                             "greedy" if call == "greedy" else "mixed", seed=2)
    kwargs.update(verify_lens=None, stop_token_ids=None)
    ref = dk.verify_chain(*args, backend="reference", **kwargs)
    out, rec = ideal_access(lambda: dk.verify_chain(*args, backend="cuda", **kwargs))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert rec.kernels()[0] == "verify_chain_rows"


@pytest.mark.simt
@pytest.mark.parametrize("method,draft_dtype,draft_mode", [("token", torch.float32, "logprobs"),
                                                           ("token", torch.bfloat16, "logits"),
                                                           ("block", torch.bfloat16, "logprobs"),
                                                           ("token", None, "none")])
def test_cuda_sample_and_mass_access(monkeypatch, method, draft_dtype, draft_mode):
    """Passes M and B read the target row and the draft row beside it in steps of 16 bytes of the wider of the two
    (bf16 target, fp32 draft: 8 + 16 bytes a lane), V = 32000: every kernel's lines at the ideal sectors and
    wavefronts."""
    from access import ideal_access
    monkeypatch.setenv("DSPARK_SIMT", "1")
    args, kwargs = make_case(4, 4, 32000, torch.bfloat16, draft_mode, False, "mixed", seed=8, draft_dtype=draft_dtype)
    kwargs.update(method=method, stop_token_ids=None)
    ref = dk.verify_chain(*args, backend="reference", **kwargs)
    out, rec = ideal_access(lambda: dk.verify_chain(*args, backend="cuda", **kwargs))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert rec.kernels() == LAUNCHES[(method, True)], rec.kernels()


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
    for args in opcheck_calls():
        torch.library.opcheck(torch.ops.dspark_simt.verify_chain.default, args)


@pytest.mark.sass
def test_sass_rows_sweep_has_four_16_byte_loads_in_flight():
    """sm_90a SASS (tools/check_cuda.py's report): every pass-A instance at the design occupancy without spills, and
    each of its innermost loops that loads 16-byte vectors issues at least four of them per iteration (the sampled
    and the greedy sweep)."""
    from sass_facts import sass_facts
    kernels = sass_facts("verify::rows_kernel<")
    assert len(kernels) == 9  # every (target, draft) dtype pair
    for k in kernels:
        name = k.get("demangled", k["kernel"])
        assert k["spill_bytes"] == 0 and k["registers"] <= 65536 // (256 * 2), name
        sweeps = [lp for lp in k["sass"]["loops"] if lp["LDG.E.128"] > 0]
        assert len(sweeps) >= 2 and all(lp["LDG.E.128"] >= 4 for lp in sweeps), (name, sweeps)


@pytest.mark.sass
@pytest.mark.parametrize("kernel", ["verify::sample_kernel<", "verify::mass_kernel<"])
def test_sass_sample_and_mass_have_no_spills(kernel):
    """sm_90a SASS: passes B and M at two CTAs an SM (<= 128 registers at 256 threads) without spills."""
    from sass_facts import sass_facts
    kernels = sass_facts(kernel)
    assert len(kernels) == 9
    for k in kernels:
        assert k["spill_bytes"] == 0 and k["registers"] <= 65536 // (256 * 2), k.get("demangled", k["kernel"])


# ---------------------------------------------------------------- production shapes (python_tests/near_ties.py)
def production_case(n: int, device: str, seed: int = 0):
    """K = 7, V = 151936: float32 draft logits as draft_block returns them, drafts sampled from them at T = 1 with
    their log-probabilities, bf16 target rows near the draft rows (most drafts accepted), a random bonus row."""
    g = torch.Generator(device).manual_seed(seed)
    k, vocab = 7, 151936
    draft_logits = 2 * torch.randn(n, k, vocab, generator=g, device=device)
    u = torch.rand(n, k, vocab, generator=g, device=device).clamp(min=1e-12)
    drafts = (draft_logits - torch.log(-torch.log(u))).argmax(-1)
    del u
    logprobs = torch.log_softmax(draft_logits, -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    target = torch.cat([draft_logits + 0.7 * torch.randn(n, k, vocab, generator=g, device=device),
                        2 * torch.randn(n, 1, vocab, generator=g, device=device)], 1).bfloat16()
    return target, drafts, draft_logits, logprobs


def check_production_greedy(n, backend, device):
    """Greedy: every token, count and mask equal the reference's (an argmax of bf16 values has no rounding)."""
    target, drafts, _, _ = production_case(n, device)
    greedy = target[:, :-1].argmax(-1)
    drafts = torch.where(torch.arange(7, device=device) % 3 == 2, drafts, greedy)  # a mix of accepts and rejects
    ours = dk.verify_chain(target, drafts, backend=backend)
    ref = dk.verify_chain(target, drafts, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert 0 < int(ref.num_accepted.sum()) < 7 * n or n == 1


def check_production_sampled(n, backend, device, record_property):
    """Token sampling with the draft rows and their log-probabilities (the engine's call): differences excused only
    at a near-tie within the stated bound; returns the excused count."""
    from near_ties import verify_mismatches
    target, drafts, draft_logits, logprobs = production_case(n, device)
    temperature = torch.ones(n, device=device)
    kw = dict(draft_logits=draft_logits, draft_logprobs=logprobs, temperature=temperature, seed=3, offset=4)
    ours = dk.verify_chain(target, drafts, backend=backend, **kw)
    ref = dk.verify_chain(target, drafts, backend="reference", **kw)
    bad, excused = verify_mismatches(ours, ref, target, drafts, draft_logits, logprobs, temperature,
                                     rng.make_rng_key(3, 4, device))
    record_property("excused_near_ties", excused)
    assert not bad, f"differences beyond the bound (request, position, gap, bound): {bad[:8]}"
    assert excused <= 2 + n // 100, excused  # near-ties are rare: many excuses mean a biased kernel
    return excused


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_production_shape_greedy(n, backend):
    check_production_greedy(n, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_production_shape_sampled(n, backend, record_property):
    check_production_sampled(n, backend, "cuda", record_property)


def test_cpu_production_shape_excuses_none(record_property):
    """The CPU kernel at the production shape (N = 2): greedy equal, sampled with no difference excused."""
    check_production_greedy(2, "cpu", "cpu")
    assert check_production_sampled(2, "cpu", "cpu", record_property) == 0


def test_near_tie_rule_can_fail():
    """A changed accept count at a clear decision and a changed emitted token at a clear race are reported; equal
    outputs are not."""
    from near_ties import verify_mismatches
    target, drafts, draft_logits, logprobs = production_case(3, "cpu", seed=1)
    target, drafts, draft_logits, logprobs = target[..., :500], drafts % 500, draft_logits[..., :500], None
    t = torch.ones(3)
    logprobs = torch.log_softmax(draft_logits, -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    key = rng.make_rng_key(3, 4, "cpu")
    ref = dk.verify_chain(target, drafts, draft_logits=draft_logits, draft_logprobs=logprobs, temperature=t, seed=3,
                          offset=4, backend="reference")
    args = (target, drafts, draft_logits, logprobs, t, key)
    assert verify_mismatches(ref, ref, *args) == ([], 0)
    r = int(ref.num_accepted.argmin())
    j = int(ref.num_accepted[r])
    count = ref.num_accepted.clone()
    count[r] += 1 if j < 7 else -1
    bad, excused = verify_mismatches(ref._replace(num_accepted=count), ref, *args)
    assert [b[0] for b in bad] == [r] and excused == 0
    tokens = ref.tokens.clone()
    tokens[r, j] = (tokens[r, j] + 1) % 500
    bad, excused = verify_mismatches(ref._replace(tokens=tokens), ref, *args)
    assert [b[:2] for b in bad] == [(r, j)] and excused == 0


# ---------------------------------------------------------------- losslessness of one batched call, every backend
def one_call_case(layout, use_logprobs, n, k=3, vocab=12, temps=(0.7, 1.3), seed=0, top=8, draft_vocab=8):
    """One verify_chain call's inputs for ``n`` independent requests: every request's target rows are one table
    ``p_logits [K+1, V]`` (request r at temperature ``temps[r % 2]``, a per-request tensor) and every request the
    same draft rows (the target's plus noise: one fixed q per position, so a wrong correction law does not average
    out over requests) in ``layout``: "dense" ``[N, K, V]``, "reduced" ``[N, K, Vd]`` over a shuffled
    ``draft_to_target`` of ``draft_vocab`` ids, "topk" ``[N, K, top]`` over random ``draft_candidates`` per position,
    or "onehot" (no draft rows); drafts drawn from softmax(row / T) (torch's generator)."""
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    temp = torch.tensor(temps, dtype=torch.float32).repeat(n // len(temps) + 1)[:n]
    kw = dict(temperature=temp)
    if layout == "reduced":
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab].expand(n, k, -1)
        kw["draft_to_target"] = ids[0, 0]
    elif layout == "topk":
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:top] for _ in range(k)]).expand(n, k, top)
        kw["draft_candidates"] = ids
    else:
        ids = torch.arange(vocab).expand(n, k, -1)
    rows = (p_logits[:k].gather(-1, ids[0]) + torch.randn(k, ids.shape[-1], generator=gen) * 2.0).expand(
        n, k, -1)                                               # a related but wrong draft
    scaled = torch.log_softmax(rows / temp.view(n, 1, 1), -1)
    col = torch.multinomial(scaled.exp().view(n * k, -1), 1, generator=gen).view(n, k)
    drafts = ids.gather(-1, col.unsqueeze(-1)).squeeze(-1)
    if layout != "onehot":
        kw["draft_logits"] = rows
        if use_logprobs:
            kw["draft_logprobs"] = scaled.gather(-1, col.unsqueeze(-1)).squeeze(-1)
    return p_logits.unsqueeze(0).expand(n, -1, -1).contiguous(), drafts, kw, temp


def completed_by_the_target(out_tokens, num_accepted, p_logits, temp, seed=1):
    """Each request's emitted tokens (the accepted drafts, then the correction or bonus), continued from the target
    itself (softmax(row m / T), torch's generator) up to K+1 tokens: lossless verification makes this sequence's law
    the target's, prod_m softmax(p_logits[m] / T), whatever the verifier accepted."""
    gen = torch.Generator().manual_seed(seed)
    n, width = out_tokens.shape
    p = torch.softmax(p_logits[0].unsqueeze(0) / temp.view(n, 1, 1), -1)         # [N, K+1, V]
    fresh = torch.multinomial(p.view(n * width, -1), 1, generator=gen).view(n, width)
    emitted = torch.arange(width).unsqueeze(0) <= num_accepted.long().cpu().unsqueeze(1)
    return torch.where(emitted, out_tokens.cpu(), fresh), p


def one_call_law_passes(tokens, p, temp):
    """Chi-square of every position's tokens, per temperature, against softmax(p_logits[m] / T); False at the first
    failing (temperature, position)."""
    for t in temp.unique():
        group = temp == t
        for m in range(tokens.shape[1]):
            if not passes(counts(tokens[group, m], p.shape[-1]), p[group, m].sum(0).double()):
                return False
    return True


def check_one_call_law(backend, method, layout, use_logprobs, n, device="cpu", seed=0, against_reference=False,
                       temps=(0.7, 1.3), verify=None):
    """One call of ``n`` requests (one_call_case) through ``verify`` (dk.verify_chain by default; called as it is,
    with ``backend``), its tokens equal to the reference's when asked, and the law of its tokens completed by the
    target (chi-square per temperature and position)."""
    target, drafts, kw, temp = one_call_case(layout, use_logprobs, n, temps=temps, seed=seed)
    on = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    out = (verify or dk.verify_chain)(target.to(device), drafts.to(device), seed=seed + 5, method=method,
                                      backend=backend, **on)
    out_tokens, num_accepted = out.tokens.cpu(), out.num_accepted.cpu()
    if against_reference:
        ref = dk.verify_chain(target, drafts, seed=seed + 5, method=method, backend="reference", **kw)
        assert torch.equal(out_tokens, ref.tokens) and torch.equal(num_accepted, ref.num_accepted)
    assert 0 < float(num_accepted.float().mean()) < drafts.shape[1] - 0.5  # both acceptance and rejection occur
    tokens, p = completed_by_the_target(out_tokens, num_accepted, target, temp, seed=seed + 1)
    assert one_call_law_passes(tokens, p, temp), (backend, method, layout, use_logprobs)


ONE_CALL = [(method, layout, logprobs) for method in ("token", "block")
            for layout, logprobs in (("dense", True), ("reduced", False), ("reduced", True), ("topk", False),
                                     ("topk", True), ("onehot", False))]


@pytest.mark.parametrize("method,layout,use_logprobs", ONE_CALL)
def test_one_call_is_lossless(host_backend, method, layout, use_logprobs):
    """Null hypothesis: one call's emitted tokens, continued from the target, follow the target's law at every
    position (prod_m softmax(p_logits[m] / T), T per request), for every draft-row layout, with and without
    draft_logprobs; 8000 requests of one call, chi-square per (temperature, position)."""
    check_one_call_law(host_backend, method, layout, use_logprobs, 8000, seed=ONE_CALL.index(
        (method, layout, use_logprobs)))


def test_one_call_law_detects_a_wrong_correction(monkeypatch):
    """The one-call check has the power to fail at the Triton / SIMT tests' size (2000 requests, reduced and top-k
    rows): the reference drawing each correction uniformly over the residual's support instead of from the
    residual fails it, the true reference passes. (Drawing the correction from p instead of the residual, in the
    CPU, CUDA and Triton kernels, failed it too: 3-5x the pass bound at this size.)"""
    import importlib
    ref_mod = importlib.import_module("dspark_kernels.reference.verify_chain")
    race = ref_mod.exponential_race

    def law_passes(layout, method):
        target, drafts, kw, temp = one_call_case(layout, True, 2000, seed=3)
        out = dk.verify_chain(target, drafts, seed=8, method=method, backend="reference", **kw)
        tokens, p = completed_by_the_target(out.tokens, out.num_accepted, target, temp, seed=4)
        return one_call_law_passes(tokens, p, temp)
    cases = [("reduced", "token"), ("topk", "block")]
    assert all(law_passes(*case) for case in cases)
    monkeypatch.setattr(ref_mod, "exponential_race", lambda w, u: race((w > 0).float(), u))
    assert not any(law_passes(*case) for case in cases)


# Through the Triton interpreter a call of 2000 requests takes minutes: the Triton cases run on a GPU (pytest -m gpu,
# bench/gpu_check.sh); through the SIMT harness about 10 s: two cases in the default run, the others in the slow
# leg. Every draft-row layout (dense, reduced, top-k, one-hot: each a kind of q in the kernels) under both rules, with
# and without draft_logprobs; the CUDA kernels' dense rows token + logprobs and block without them are also in
# test_cuda_lossless_joint_law, so only Triton's list adds them.
ONE_CALL_KERNELS = [("token", "reduced", True), ("block", "topk", True), ("block", "reduced", False),
                    ("token", "topk", False), ("token", "dense", False), ("block", "dense", True),
                    ("token", "onehot", False), ("block", "onehot", False)]
ONE_CALL_TRITON = ONE_CALL_KERNELS + [("token", "dense", True), ("block", "dense", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("method,layout,use_logprobs", ONE_CALL_TRITON)
def test_triton_one_call_is_lossless(triton_device, method, layout, use_logprobs):
    """Null hypothesis: the Triton kernels' emitted tokens, continued from the target, follow the target's law at
    every position (per request temperature); every draft-row layout, token and block, with and without
    draft_logprobs; the tokens also equal the reference's."""
    check_one_call_law("triton", method, layout, use_logprobs, 2000, device=triton_device, seed=40,
                       against_reference=True)


@pytest.mark.parametrize("method,layout,use_logprobs", [
    pytest.param(*case, marks=pytest.mark.harness_slow if i >= 2 else ()) for i, case in enumerate(ONE_CALL_KERNELS)])
def test_cuda_one_call_is_lossless(cuda_device, method, layout, use_logprobs):
    """Null hypothesis: as test_triton_one_call_is_lossless, through the CUDA kernels (one SIMT schedule; the
    exact-equality tests compare schedules)."""
    check_one_call_law("cuda", method, layout, use_logprobs, 2000, device=cuda_device, seed=40,
                       against_reference=True)


# ---------------------------------------------------------------- infinite temperature: a uniform target
INF = float("inf")


def check_infinite_temperature_by_hand(backend, device, method, n=64, vocab=6):
    """T = inf, K = 1, every output from the generator's uniforms: each scaled logit is 0, so p is uniform whatever
    the (wild, finite) target logits. One-hot drafts: d is accepted iff u < 1/V (token: u q(d) < p(d) with q(d) = 1;
    block: eta <= h_1 = rho_1 = 1/V); a rejection emits the argmax over v != d of row 0's residual-stream uniforms
    (the race over the residual max(0, p - q), uniform off d), a full acceptance the argmax of all V of row 1's (the
    race over a uniform p). Dense draft rows: q is uniform too (p / q = 1), so every draft is accepted and row 1's
    argmax follows."""
    gen = torch.Generator().manual_seed(9)
    target = torch.randn(n, 2, vocab, generator=gen) * 30
    drafts = torch.randint(0, vocab, (n, 1), generator=gen)
    key, requests = torch.tensor([6, 2]), torch.arange(n)
    u = rng.uniform(key, requests, 0, rng.STREAM_ACCEPT, 0)
    race = [rng.uniform_rows(key, requests, row, rng.STREAM_RESIDUAL, vocab) for row in (0, 1)]
    bonus = race[1].argmax(-1)
    accepted = u < 1.0 / vocab
    assert 0 < int(accepted.sum()) < n
    correction = race[0].scatter(1, drafts, 0.0).argmax(-1)
    onehot = torch.stack([torch.where(accepted, drafts[:, 0], correction), torch.where(accepted, bonus, -1)], 1)
    for draft_logits, expected in ((None, onehot), (torch.randn(n, 1, vocab, generator=gen) * 30,
                                                     torch.cat([drafts, bonus.unsqueeze(1)], 1))):
        out = dk.verify_chain(target.to(device), drafts.to(device), temperature=INF, seed=6, offset=2, method=method,
                              backend=backend, draft_logits=None if draft_logits is None else draft_logits.to(device))
        assert torch.equal(out.tokens.cpu(), expected), (method, draft_logits is None)


@pytest.mark.parametrize("method", ["token", "block"])
def test_infinite_temperature_by_hand(host_backend, method):
    check_infinite_temperature_by_hand(host_backend, CPU, method)


@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_infinite_temperature_by_hand(triton_device, method):
    check_infinite_temperature_by_hand("triton", triton_device, method, n=24)


@pytest.mark.parametrize("method", ["token", "block"])
def test_cuda_infinite_temperature_by_hand(cuda_device, method):
    check_infinite_temperature_by_hand("cuda", cuda_device, method)


# Half the requests at T = inf, half at 0.7, in one call: at T = inf the one-hot and sparse rows reject (p / q is 1/V
# at a one-hot draft, Vd/V and top/V at a sparse one), so the residual race over the ids q misses is exercised at
# every position; dense rows accept everything and test the bonus's race.
ONE_CALL_INF = [(method, layout, logprobs) for method in ("token", "block")
                for layout, logprobs in (("dense", True), ("reduced", True), ("topk", False), ("onehot", False))]
ONE_CALL_INF_KERNELS = [("token", "reduced", True), ("block", "topk", False)]


@pytest.mark.parametrize("method,layout,use_logprobs", ONE_CALL_INF)
def test_one_call_is_lossless_at_infinite_temperature(host_backend, method, layout, use_logprobs):
    """Null hypothesis: at T = inf the emitted tokens, continued from the target, are uniform at every position
    (and follow softmax(p_logits[m] / 0.7) for the requests beside them); 8000 requests of one call."""
    check_one_call_law(host_backend, method, layout, use_logprobs, 8000, temps=(INF, 0.7),
                       seed=100 + ONE_CALL_INF.index((method, layout, use_logprobs)))


@pytest.mark.gpu
@pytest.mark.parametrize("method,layout,use_logprobs", ONE_CALL_INF_KERNELS)
def test_triton_one_call_is_lossless_at_infinite_temperature(triton_device, method, layout, use_logprobs):
    """Null hypothesis: as test_one_call_is_lossless_at_infinite_temperature, through the Triton kernels; the tokens
    also equal the reference's."""
    check_one_call_law("triton", method, layout, use_logprobs, 2000, device=triton_device, seed=41,
                       against_reference=True, temps=(INF, 0.7))


@pytest.mark.harness_slow
@pytest.mark.parametrize("method,layout,use_logprobs", ONE_CALL_INF_KERNELS)
def test_cuda_one_call_is_lossless_at_infinite_temperature(cuda_device, method, layout, use_logprobs):
    """Null hypothesis: as test_one_call_is_lossless_at_infinite_temperature, through the CUDA kernels; the tokens
    also equal the reference's."""
    check_one_call_law("cuda", method, layout, use_logprobs, 2000, device=cuda_device, seed=41,
                       against_reference=True, temps=(INF, 0.7))
