"""draft_block's top-k Markov proposals (``top_k``): the candidates, the proposal they define, every backend against
the reference, the sampled law, lossless verification with the sparse rows, and the CUDA kernel's traffic."""

import dataclasses

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels.reference.draft_block import topk_candidates
from stats import counts, passes
from test_draft_block import (INTERPRETED, _nbytes, assert_float_outputs_close, assert_low_temperature_logprobs,
                               fp8_case, low_temperature_case, make_triton_case, reduced_case, zero_rank_case)


def test_topk_candidates_by_hand():
    """The order: value (NaN lowest, -0 = +0), ties to the lower id; the ids come back in increasing order."""
    nan, inf = float("nan"), float("inf")
    row = torch.tensor([1.0, nan, 3.0, -0.0, 3.0, 0.0, -inf, 2.0])
    # ranks: 2 (3), 4 (3), 7 (2), 0 (1), 3 (-0), 5 (+0), 6 (-inf), 1 (NaN)
    want = {1: [2], 2: [2, 4], 4: [0, 2, 4, 7], 5: [0, 2, 3, 4, 7], 7: [0, 2, 3, 4, 5, 6, 7], 8: list(range(8))}
    for k, ids in want.items():
        assert topk_candidates(row, k).tolist() == ids, k
    assert topk_candidates(row.bfloat16().expand(2, 3, -1), 3).shape == (2, 3, 3)


def test_topk_proposal_by_hand():
    """V = 4, r = 1, W1 = 1, W2 = [0, 0, 0, 10]: the full proposal drafts id 3 (0.1 + 10); with top_k = 3 the
    candidates are ids 0..2 (U = 1, 0.5, 0.2), no bias reaches id 3, and the draft is id 0 with log q =
    log_softmax([1, 0.5, 0.2])[0]. With a map [7, 4, 9, 1] the token is 7 and the candidates are 7, 4, 9."""
    w1, w2 = torch.ones(10, 1), torch.tensor([[0.0], [0.0], [0.0], [10.0]])
    base = torch.tensor([[[1.0, 0.5, 0.2, 0.1]] * 2])
    head = dk.MarkovHead("vanilla", w1[:4], w2)
    assert dk.draft_block(base, torch.tensor([0]), head, backend="reference").tokens.tolist() == [[3, 3]]
    out = dk.draft_block(base, torch.tensor([0]), head, top_k=3, return_logits=True, backend="reference")
    assert out.tokens.tolist() == [[0, 0]]
    assert out.candidates.tolist() == [[[0, 1, 2]] * 2]
    torch.testing.assert_close(out.logits, torch.tensor([[[1.0, 0.5, 0.2]] * 2]))
    torch.testing.assert_close(out.draft_logprobs, torch.log_softmax(torch.tensor([1.0, 0.5, 0.2]), 0)[[0, 0]][None])
    mapped = dk.MarkovHead("vanilla", w1, w2, draft_to_target=torch.tensor([7, 4, 9, 1]))
    out = dk.draft_block(base, torch.tensor([0]), mapped, top_k=3, return_logits=True, backend="reference")
    assert out.tokens.tolist() == [[7, 7]] and out.candidates.tolist() == [[[7, 4, 9]] * 2]
    assert dk.draft_block(base, torch.tensor([0]), head, top_k=3).candidates is None  # no logits asked


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_topk_is_the_full_proposal_with_the_other_ids_masked(kind):
    """Drafting with top_k equals the full proposal over U with -inf off the candidates (greedy and sampled: the
    draws are keyed by the draft id), and top_k = V is the full proposal itself."""
    base, anchors, head, hidden, conf, temps = make_triton_case(kind, 4, 5, 60, 6, 7, torch.float32, "mixed", "sts",
                                                                seed=3)
    kw = dict(hidden=hidden, confidence=conf, temperature=temps, seed=5, return_logits=True, backend="reference")
    top = dk.draft_block(base, anchors, head, top_k=9, **kw)
    cand = topk_candidates(base, 9)
    masked = torch.full_like(base, float("-inf")).scatter(-1, cand, base.gather(-1, cand))
    full = dk.draft_block(masked, anchors, head, **kw)
    assert torch.equal(top.tokens, full.tokens) and torch.isin(top.tokens, cand).all()
    assert torch.equal(top.candidates, cand)
    torch.testing.assert_close(top.logits, full.logits.gather(-1, cand))
    for name in ("draft_logprobs", "conf_logits", "survival"):
        torch.testing.assert_close(getattr(top, name), getattr(full, name), msg=name)
    every = dk.draft_block(base, anchors, head, top_k=60, **kw)
    dense = dk.draft_block(base, anchors, head, **kw)
    assert torch.equal(every.tokens, dense.tokens)
    torch.testing.assert_close(every.logits, dense.logits)


def tied(case, step=0.5):
    """U rounded to multiples of ``step``: many ties at the top_k boundary, which the lowest ids must win."""
    base = (case[0].float() / step).round() * step
    return (base.to(case[0].dtype),) + tuple(case[1:])


TOPK_CASES = [  # (case name, args of its builder), top_k, return_logits
    ("plain", ("vanilla", 3, 4, 1000, 16, 5, torch.float32, "mixed", "sts"), 8, True),
    ("tied", ("gated", 5, 3, 300, 12, 9, torch.bfloat16, "sampled", "conf"), 16, True),
    ("plain", ("rnn", 3, 5, 257, 8, 6, torch.float16, "mixed", "none"), 1, True),
    ("plain", ("vanilla", 2, 2, 4099, 33, 4, torch.bfloat16, "greedy", "none"), 64, False),
    ("tied", ("vanilla", 2, 3, 2500, 8, 3, torch.float32, "mixed", "none"), 1024, True),   # buffer compactions
    ("fp8", ("gated", 3, 3, 500, 32, 7, torch.bfloat16, "mixed", "sts"), 24, True),
    ("reduced", ("rnn", 3, 4, 300, 900, 8, 5, torch.float32, "mixed", "conf"), 12, True),
]


def topk_case(name, args, seed):
    if name == "reduced":
        return reduced_case(*args, seed=seed)
    case = (fp8_case if name == "fp8" else make_triton_case)(*args, seed=seed)
    return tied(case) if name == "tied" else case


def run_topk(dev, case, top_k, return_logits, backend, wrap=lambda fn: fn()):
    base, anchors, head, hidden, conf, temps = case
    kw = dict(hidden=hidden if (head.kind != "vanilla" or conf is not None) else None, confidence=conf,
              temperature=temps, seed=11, offset=2, return_logits=return_logits, top_k=top_k)
    ref = dk.draft_block(base, anchors, head, backend="reference", **kw)
    move = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
    dev_head = dataclasses.replace(head, **{f.name: move(getattr(head, f.name)) for f in dataclasses.fields(head)})
    dev_conf = None if conf is None else dk.ConfidenceHead(*(move(x) for x in (conf.weight, conf.bias,
                                                                                conf.sts_temperatures)))
    out = wrap(lambda: dk.draft_block(move(base), move(anchors), dev_head, backend=backend,
                                      **{**kw, "hidden": move(kw["hidden"]), "confidence": dev_conf,
                                         "temperature": move(temps)}))
    return ref, type(out)(*(None if t is None else t.cpu() for t in out))


def assert_topk_matches(ref, out):
    """Integers exactly; floats within float32 rounding of a different summation order."""
    assert torch.equal(out.tokens, ref.tokens)
    assert (out.candidates is None) == (ref.candidates is None)
    if ref.candidates is not None:
        assert out.candidates.dtype == torch.int64 and torch.equal(out.candidates, ref.candidates)
    assert_float_outputs_close(ref, out)


@pytest.mark.parametrize("name,args,top_k,with_logits",  # the interpreter's selection costs O(top_k V): 1024 slow
                         [pytest.param(*c, marks=pytest.mark.slow) if c[2] >= 1024 else c for c in TOPK_CASES])
def test_triton_topk_matches_reference(triton_device, name, args, top_k, with_logits):
    case = topk_case(name, args, seed=top_k + len(name))
    assert_topk_matches(*run_topk(triton_device, case, top_k, with_logits, "triton"))


@pytest.mark.parametrize("name,args,top_k,with_logits", TOPK_CASES)
def test_cuda_topk_matches_reference(cuda_device, simt_check, name, args, top_k, with_logits):
    case = topk_case(name, args, seed=top_k + len(name))
    assert_topk_matches(*run_topk(cuda_device, case, top_k, with_logits, "cuda", wrap=simt_check))


def assert_nan_and_inf_logits(dev, backend, wrap=lambda fn: fn()):
    """NaN ranks lowest and is a candidate only when fewer than top_k others exist; a NaN or +inf candidate makes
    the log-probability NaN; the token is always a candidate."""
    base, anchors, head, _, _, _ = make_triton_case("vanilla", 4, 3, 9, 3, 2, torch.float32, "greedy", "none")
    base[0] = float("nan")
    base[1, :, ::2] = float("nan")
    base[2, :, 3] = float("inf")
    base[3] = float("-inf")
    for temps in (0.0, torch.tensor([1.0, 0.0, 0.5, 2.0])):
        for top_k in (3, 6):
            ref, out = run_topk(dev, (base, anchors, head, None, None, temps), top_k, True, backend, wrap)
            assert_topk_matches(ref, out)
            assert (out.tokens.unsqueeze(-1) == out.candidates).any(-1).all()
            assert out.draft_logprobs[0].isnan().all() and out.draft_logprobs[2].isnan().all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_triton_topk_nan_and_inf_logits(triton_device):
    assert_nan_and_inf_logits(triton_device, "triton")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_topk_nan_and_inf_logits(cuda_device, simt_check):
    assert_nan_and_inf_logits(cuda_device, "cuda", simt_check)


def topk_law_case(form, vocab, k):
    """One request's inputs for the law tests, and the width of the token ids: a float W2 ("dense"), an fp8 W2 with
    row scales ("fp8"), or ``vocab`` draft ids mapped into 2 vocab + 3 target ids ("reduced")."""
    args = ("vanilla", 1, k, vocab, 4, 3, torch.float32, "greedy", "none")
    if form == "reduced":
        vt = 2 * vocab + 3
        return reduced_case(*args[:4], vt, *args[4:], seed=9), vt
    return (fp8_case if form == "fp8" else make_triton_case)(*args, seed=9), vocab


def assert_samples_follow_the_topk_softmax(dev, run, backend, trials, vocab=40, top_k=10, k=1, temp=0.8,
                                           form="dense"):
    """Chi-square of each position's drafts against softmax(logits / T) over the candidates (zero elsewhere: off the
    candidates, and off the map of a reduced head), summed over the requests (later positions: their logits depend
    on the previous draft)."""
    (base, _, head, _, _, _), width = topk_law_case(form, vocab, k)
    head = dataclasses.replace(head, **{f.name: getattr(head, f.name).to(dev) for f in dataclasses.fields(head)
                                        if isinstance(getattr(head, f.name), torch.Tensor)})
    out = run(lambda: dk.draft_block(base.expand(trials, -1, -1).to(dev), torch.full((trials,), 7, device=dev), head,
                                     temperature=temp, seed=4, top_k=top_k, return_logits=True, backend=backend))
    tokens, logits, cand = out.tokens.cpu(), out.logits.cpu(), out.candidates.cpu()
    for j in range(k):
        expected = torch.zeros(trials, width, dtype=torch.float64).scatter(
            1, cand[:, j], torch.softmax(logits[:, j] / temp, -1).double()).sum(0)
        observed, on = counts(tokens[:, j], width), expected > 0
        assert observed[~on].sum() == 0, j
        assert passes(observed[on], expected[on]), j
        assert not passes(observed[on].flip(0), expected[on]), j  # the check can fail
    lp = torch.log_softmax(logits / temp, -1)
    col = (tokens.unsqueeze(-1) == cand).int().argmax(-1)
    torch.testing.assert_close(out.draft_logprobs.cpu(), lp.gather(-1, col.unsqueeze(-1)).squeeze(-1),
                               rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("form", ["dense", "fp8", "reduced"])
def test_topk_samples_follow_the_draft_softmax(form):
    assert_samples_follow_the_topk_softmax(torch.device("cpu"), lambda fn: fn(), "reference", 20000, form=form)


@pytest.mark.harness_slow  # a statistical test through the SIMT harness: CI's slow leg (quick on a GPU)
@pytest.mark.parametrize("form", ["dense", "fp8", "reduced"])
def test_cuda_topk_samples_follow_the_draft_softmax(cuda_device, form):
    """One schedule (the exact-equality tests compare schedules): a CTA walks each of the 1500 requests."""
    assert_samples_follow_the_topk_softmax(cuda_device, lambda fn: fn(), "cuda", 1500, form=form)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=INTERPRETED)])  # ~12 s in the interpreter
@pytest.mark.parametrize("form", ["dense", "fp8", "reduced"])
def test_triton_topk_samples_follow_the_draft_softmax(triton_device, backend, form):
    """Null hypothesis: the Triton kernels' top-k drafts follow softmax(logits / T) over each row's candidates, at
    both positions of the walk; 200 requests over top-4 of V = 6 at T = 3, where a sampler at T = 1, 1.5 or 6 fails
    the same test."""
    assert_samples_follow_the_topk_softmax(triton_device, lambda fn: fn(), backend, 200, vocab=6, top_k=4, k=2,
                                           temp=3.0, form=form)


def simulate_topk(method, trials, top_k, shift=0, length=2, k=3, vocab=12, temp=1.0, seed=0):
    """``length`` tokens per request by repeated draft_block(top_k) + verify_chain with the sparse rows; the target's
    law depends on the absolute position only. ``shift`` rolls the candidate ids handed to the verifier (0: true)."""
    gen = torch.Generator().manual_seed(seed)
    table = length + k + 1
    p_logits = torch.randn(table, vocab, generator=gen) * 1.5
    u = p_logits + torch.randn(table, vocab, generator=gen) * 1.5  # a related but wrong drafter
    head = dk.MarkovHead("vanilla", torch.randn(vocab, 3, generator=gen), torch.randn(vocab, 3, generator=gen) * 0.5)
    out = torch.full((trials, length), -1, dtype=torch.int64)
    made = torch.zeros(trials, dtype=torch.int64)
    anchors = torch.zeros(trials, dtype=torch.int64)
    step = 0
    while bool((made < length).any()):
        pos = (made.unsqueeze(1) + torch.arange(k + 1)).clamp(max=table - 1)
        d = dk.draft_block(u[pos[:, :k]], anchors, head, temperature=temp, seed=seed, offset=step, top_k=top_k,
                           return_logits=True, backend="reference")
        res = dk.verify_chain(p_logits[pos], d.tokens, draft_logits=d.logits, draft_candidates=d.candidates.roll(
            shift, -1), draft_logprobs=d.draft_logprobs, temperature=temp, seed=seed + 1, offset=step, method=method)
        emitted = res.tokens >= 0
        slot = made.unsqueeze(1) + torch.cumsum(emitted.long(), 1) - 1
        keep = emitted & (slot < length)
        out[torch.nonzero(keep, as_tuple=True)[0], slot[keep]] = res.tokens[keep]
        made += emitted.long().sum(1)
        anchors = res.tokens.gather(1, (res.num_accepted.long()).unsqueeze(1)).squeeze(1)
        step += 1
    return out, torch.softmax(p_logits[:length] / temp, -1)


@pytest.mark.parametrize("method", ["token", "block"])
def test_topk_verification_is_lossless_on_the_joint_law(method):
    """Two generated tokens through top-4 drafting (of 12 ids) and verification with the sparse rows: their joint law
    is the target's (chi-square over the 144 pairs). With the candidate ids shifted it is not."""
    trials, vocab = 20000, 12

    def joint(tokens):
        return counts(tokens[:, 0] * vocab + tokens[:, 1], vocab * vocab)

    tokens, p = simulate_topk(method, trials, 4, seed=31)
    expected = (p[0][:, None] * p[1][None, :]).flatten().double() * trials
    assert passes(joint(tokens), expected)
    tokens, p = simulate_topk(method, trials, 4, shift=1, seed=31)
    assert not passes(joint(tokens), expected)


def test_cuda_topk_reads_u_once_and_top_k_rows_of_w2(cuda_device):
    """Two launches (the selection, a CTA a row of U; the walk, a CTA a request, a programmatic dependent launch), no
    grid barrier, and the traffic within 1.1x of the top-k floor: U once, top_k rows of W2 (and of its scales) per
    request and position, W1 rows, the outputs; W2 itself is never streamed whole."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    n, k, vocab, rank, top_k = 3, 4, 30011, 64, 32
    base, anchors, head, _, _, temps = fp8_case("vanilla", n, k, vocab, rank, 3, torch.bfloat16, "mixed", "none",
                                                seed=6)
    with simt.record() as rec:
        out = dk.draft_block(base, anchors, head, temperature=temps, seed=1, top_k=top_k, return_logits=True,
                             backend="cuda")
    assert rec.kernels() == ["draft_topk_select", "draft_topk_walk"]
    assert [r["ctas"] for r in rec.launches] == [n * k, n]
    assert [r["pdl"] for r in rec.launches] == [False, True]
    assert not any(r["cooperative"] or r["grid_barriers"] for r in rec.launches)
    w2_rows = n * k * top_k * (rank * head.w2.element_size() + 4)
    floor = (_nbytes(base, anchors) + w2_rows + n * k * rank * head.w1.element_size()
             + _nbytes(out.tokens, out.draft_logprobs, out.logits, out.candidates))
    moved = rec.bytes_read + rec.bytes_written
    assert _nbytes(base) <= rec.bytes_read and moved <= 1.1 * floor, (moved, floor, moved / floor)
    assert moved < _nbytes(base) + _nbytes(head.w2)  # the full proposal would read W2 K times


@pytest.mark.parametrize("kind,conf", [("vanilla", "none"), ("rnn", "sts")])
def test_cuda_topk_ideal_access(cuda_device, kind, conf):
    """The walk at the access rule (python_tests/access.py: no bank conflict, global sectors within 1.05x of the ideal,
    line by line; U's values at the candidates come from the selection, not gathered), the selection's global loads
    too (its shared-memory buffer, select_top.cuh's bitonic sort and atomic slots, is not held to the bank rule);
    tokens equal the reference's."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import check_launches
    from dspark_kernels import simt
    if not simt.access_model_available():
        pytest.skip("needs the harness's warp access model")
    base, anchors, head, hidden, confidence, temps = make_triton_case(kind, 3, 2, 1024, 64, 16, torch.bfloat16,
                                                                      "mixed", conf, seed=8)
    kw = dict(hidden=hidden if kind != "vanilla" or confidence is not None else None, confidence=confidence,
              temperature=temps, seed=1, top_k=32, return_logits=True)
    with simt.record(access=True) as rec:
        out = dk.draft_block(base, anchors, head, backend="cuda", **kw)
    assert rec.kernels() == ["draft_topk_select", "draft_topk_walk"]
    check_launches(rec.launches[1:])
    select = rec.launches[0]
    assert select["global_sectors"] <= 1.05 * select["global_sectors_ideal"], select
    assert torch.equal(out.tokens, dk.draft_block(base, anchors, head, backend="reference", **kw).tokens)


def topk_opcheck(backend):
    base, anchors, head, _, _, _ = make_triton_case("vanilla", 2, 3, 40, 4, 3, torch.float32, "greedy", "none")
    for return_logits in (True, False):
        args = (base, anchors, "vanilla", head.w1, head.w2, None, None, None, None, None, None, None, None, None,
                None, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), return_logits, 5, backend)
        torch.library.opcheck(torch.ops.dspark.draft_block.default, args)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_topk_opcheck(backend):
    topk_opcheck(backend)


def test_cuda_topk_opcheck(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("the opcheck's inputs are CPU tensors: the SIMT harness")
    topk_opcheck("cuda")


def test_bad_top_k_names_the_argument():
    base, anchors, head, _, _, _ = make_triton_case("vanilla", 2, 3, 40, 4, 3, torch.float32, "greedy", "none")
    for bad in (0, -1, 41, 1.0, True, "8"):
        with pytest.raises(ValueError, match="top_k"):
            dk.draft_block(base, anchors, head, top_k=bad)
    big = torch.zeros(1, 1, 2000)
    with pytest.raises(ValueError, match=r"top_k must be None or an int in \[1, min\(V, 1024\)\]"):
        dk.draft_block(big, torch.tensor([0]), dk.MarkovHead("vanilla", torch.zeros(2000, 2), torch.zeros(2000, 2)),
                       top_k=1025)


@pytest.mark.parametrize("n", [1, 3])
def test_cuda_topk_low_temperature_logprobs(cuda_device, simt_check, n):
    """Top-k proposals at T = 1e-5 / 2e-6 (and greedy at the same scale): the reference's log-probabilities within
    LOW_T_TOL, never above 0."""
    base, anchors, head, temps = low_temperature_case(n, seed=n + 10)
    ref, out = run_topk(cuda_device, (base, anchors, head, None, None, temps), 24, False, "cuda", wrap=simt_check)
    assert_low_temperature_logprobs(ref, out)


def test_triton_topk_low_temperature_logprobs(triton_device):
    base, anchors, head, temps = low_temperature_case(3, seed=13)
    assert_low_temperature_logprobs(*run_topk(triton_device, (base, anchors, head, None, None, temps), 24, False,
                                              "triton"))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_cuda_topk_zero_rank(cuda_device, simt_check, kind):
    case = zero_rank_case(kind, 3)
    ref, out = run_topk(cuda_device, case, 8, True, "cuda", wrap=simt_check)
    assert_topk_matches(ref, out)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_triton_topk_zero_rank(triton_device, kind):
    assert_topk_matches(*run_topk(triton_device, zero_rank_case(kind, 3), 8, True, "triton"))
