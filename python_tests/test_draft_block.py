import dataclasses

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels.rng import make_rng_key
from stats import counts, passes


def make_case(kind, n=3, k=4, vocab=11, rank=5, d=6, seed=0, conf=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    head = dk.MarkovHead(kind, r(vocab, rank), r(vocab, rank))
    if kind == "gated":
        head.wg, head.bg = r(rank, d + rank), r(rank)
    if kind == "rnn":
        head.wj, head.bj = r(3 * rank, 2 * rank + d), r(3 * rank)
    confidence = dk.ConfidenceHead(r(d + rank), 0.3, torch.rand(k, generator=g) + 0.5) if conf else None
    return r(n, k, vocab), torch.randint(0, vocab, (n,), generator=g), head, r(n, k, d), confidence


def explicit(base, anchors, head, hidden, conf):
    """One request and one position at a time, written straight from DESIGN.md's formulas."""
    n, k, vocab = base.shape
    tokens, logits, zs = [], [], []
    for i in range(n):
        x, s = int(anchors[i]), torch.zeros(head.w1.shape[1])
        row_t, row_l, row_z = [], [], []
        for j in range(k):
            e, h = head.w1[x], hidden[i, j]
            if head.kind == "vanilla":
                b = head.w2 @ e
            elif head.kind == "gated":
                gate = torch.sigmoid(head.wg @ torch.cat([h, e]) + head.bg)
                b = head.w2 @ (gate * e)
            else:
                g_, c_, o_ = (head.wj @ torch.cat([s, e, h]) + head.bj).chunk(3)
                s = torch.sigmoid(g_) * s + (1 - torch.sigmoid(g_)) * torch.tanh(c_)
                b = head.w2 @ torch.tanh(o_)
            lg = base[i, j] + b
            x = int(torch.argmax(lg))
            row_t.append(x)
            row_l.append(lg)
            row_z.append(conf.weight @ torch.cat([h, e]) + conf.bias)
        tokens.append(row_t)
        logits.append(torch.stack(row_l))
        zs.append(torch.stack(row_z))
    z = torch.stack(zs)
    c = torch.sigmoid(z / conf.sts_temperatures)
    survival = torch.stack([c[:, : j + 1].prod(-1) for j in range(k)], -1)
    return torch.tensor(tokens), torch.stack(logits), z, survival


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_greedy_matches_explicit_formulas(host_backend, kind):
    base, anchors, head, hidden, conf = make_case(kind)
    out = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True)
    tokens, logits, z, survival = explicit(base, anchors, head, hidden, conf)
    assert out.tokens.tolist() == tokens.tolist()
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.conf_logits, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.survival, survival, rtol=1e-5, atol=1e-6)
    assert out.tokens.dtype == torch.int64 and out.logits.dtype == torch.float32


def test_markov_head_changes_the_draft(host_backend):
    """Hand case: V = 3, r = 1. The head adds +10 to token (x_{k-1} + 1) % 3, so drafts cycle from the anchor."""
    w1 = torch.tensor([[1.0], [2.0], [3.0]])
    w2 = torch.tensor([[0.0], [0.0], [0.0]])
    base = torch.zeros(1, 4, 3)
    # with w2 = 0 the drafts are argmax(base) = 0 everywhere
    out = dk.draft_block(base, torch.tensor([2]), dk.MarkovHead("vanilla", w1, w2))
    assert out.tokens.tolist() == [[0, 0, 0, 0]]
    # B(x)_v = w2[v] * w1[x]; choose w2 so that v = (x + 1) % 3 wins: B(0)=[0,1,-1]*... use base to break ties
    w2 = torch.tensor([[-1.0], [1.0], [0.0]])   # B(x) = w1[x] * [-1, 1, 0]
    base = torch.tensor([[[0.0, 0.0, 1.5]] * 4])
    # x=2 (w1=3): logits [-3, 3, 1.5] -> 1; x=1 (w1=2): [-2, 2, 1.5] -> 1; stays at 1
    out = dk.draft_block(base, torch.tensor([2]), dk.MarkovHead("vanilla", w1, w2))
    assert out.tokens.tolist() == [[1, 1, 1, 1]]
    # anchor outside [0, V) reads a zero embedding: logits = base -> 2, then x=2 -> 1
    out = dk.draft_block(base, torch.tensor([7]), dk.MarkovHead("vanilla", w1, w2))
    assert out.tokens.tolist() == [[2, 1, 1, 1]]


def test_confidence_without_sts_and_no_confidence(host_backend):
    base, anchors, head, hidden, conf = make_case("gated")
    out = dk.draft_block(base, anchors, head, hidden=hidden, confidence=dk.ConfidenceHead(conf.weight.view(1, -1),
                                                                                         torch.tensor([0.3])))
    torch.testing.assert_close(out.survival, torch.cumprod(torch.sigmoid(out.conf_logits), -1))
    out = dk.draft_block(base, anchors, head, hidden=hidden)
    assert out.conf_logits is None and out.survival is None and out.logits is None


@pytest.mark.parametrize("temp", [0.6, 1.0])
def test_sampled_tokens_follow_corrected_softmax(host_backend, temp):
    trials, vocab = 20000, 60
    base, _, head, hidden, _ = make_case("rnn", n=1, k=3, vocab=vocab, rank=4, d=3, seed=1, conf=False)
    base = base.expand(trials, -1, -1)
    hidden = hidden.expand(trials, -1, -1)
    anchors = torch.full((trials,), 7)
    out = dk.draft_block(base, anchors, head, hidden=hidden, temperature=temp, seed=123, return_logits=True)
    # position 0: one fixed distribution
    p0 = torch.softmax(out.logits[0, 0] / temp, -1)
    assert passes(counts(out.tokens[:, 0], vocab), p0 * trials)
    # later positions: E[1{x_k = v}] = E[softmax(logits_k / T)_v] over the prefixes actually drawn
    for k in (1, 2):
        expected = torch.softmax(out.logits[:, k] / temp, -1).sum(0).double()
        assert passes(counts(out.tokens[:, k], vocab), expected)
    # the check can fail: the greedy token's distribution is far from the softmax
    assert not passes(counts(out.logits[:, 0].argmax(-1), vocab), p0 * trials)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_python_zero_temperature_takes_the_greedy_only_path(backend):
    base, anchors, head, hidden, conf = make_case("rnn", n=4, vocab=40)
    a = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True, backend=backend)
    b = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True,
                       temperature=torch.zeros(4), backend=backend)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_per_request_temperature_and_determinism(host_backend):
    base, anchors, head, hidden, conf = make_case("vanilla", n=6, vocab=40)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.8, 0.0, 2.0])
    a = dk.draft_block(base, anchors, head, temperature=temps, seed=9, offset=2)
    b = dk.draft_block(base, anchors, head, temperature=temps, seed=torch.tensor(9), offset=torch.tensor([2]))
    greedy = dk.draft_block(base, anchors, head)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens[0::2], greedy.tokens[0::2])
    c = dk.draft_block(base[:1].expand(64, -1, -1), anchors[:1].expand(64), head, temperature=1.0, seed=9)
    assert len({tuple(t) for t in c.tokens.tolist()}) > 1   # requests draw independent noise


def test_nan_logits_and_tiny_shapes(host_backend):
    base, anchors, head, hidden, conf = make_case("vanilla")
    base[:] = float("nan")
    for t in (0.0, 1.0):
        out = dk.draft_block(base, anchors, head, temperature=t)
        assert ((out.tokens >= 0) & (out.tokens < base.shape[-1])).all()
    out = dk.draft_block(torch.zeros(0, 2, 5), torch.zeros(0, dtype=torch.int64),
                         dk.MarkovHead("vanilla", torch.zeros(5, 2), torch.zeros(5, 2)), temperature=1.0)
    assert out.tokens.shape == (0, 2)
    out = dk.draft_block(torch.zeros(2, 1, 1), torch.zeros(2, dtype=torch.int64),
                         dk.MarkovHead("vanilla", torch.zeros(1, 2), torch.zeros(1, 2)), temperature=1.0,
                         return_logits=True)
    assert out.tokens.tolist() == [[0], [0]] and out.logits.shape == (2, 1, 1)


def test_half_precision_inputs_compute_in_float32(host_backend):
    base, anchors, head, hidden, conf = make_case("gated")
    half = dk.MarkovHead("gated", head.w1.bfloat16(), head.w2.bfloat16(), head.wg.bfloat16(), head.bg.bfloat16())
    out = dk.draft_block(base.bfloat16(), anchors, half, hidden=hidden.bfloat16(), return_logits=True)
    ref_head = dk.MarkovHead("gated", *(w.bfloat16().float() for w in (head.w1, head.w2, head.wg, head.bg)))
    ref = dk.draft_block(base.bfloat16().float(), anchors, ref_head, hidden=hidden.bfloat16().float(),
                         return_logits=True)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logits, ref.logits)


def test_bad_input_names_the_argument(host_backend):
    base, anchors, head, hidden, conf = make_case("rnn")
    n, k, vocab = base.shape

    def call(**o):
        kw = dict(base_logits=base, anchor_tokens=anchors, head=head, hidden=hidden, confidence=conf)
        kw.update(o)
        return dk.draft_block(kw.pop("base_logits"), kw.pop("anchor_tokens"), kw.pop("head"), **kw)

    def with_head(**o):
        return dk.MarkovHead(**{**head.__dict__, **o})

    cases = [
        (dict(base_logits=base[0]), "base_logits"),
        (dict(base_logits=base.long()), "base_logits"),
        (dict(anchor_tokens=anchors.float()), "anchor_tokens"),
        (dict(anchor_tokens=anchors[:2]), "anchor_tokens"),
        (dict(head=with_head(kind="lstm")), "head.kind"),
        (dict(head=with_head(w1=head.w1[:, :3])), "head.w2"),
        (dict(head=with_head(w1=head.w1[:5])), "head.w1"),
        (dict(head=with_head(wj=head.wj[:, :4])), "head.wj"),
        (dict(head=with_head(bj=None)), "head.bj"),
        (dict(hidden=None), "hidden"),
        (dict(hidden=hidden[:, :2]), "hidden"),
        (dict(hidden=hidden.to("meta")), "hidden"),
        (dict(confidence=dk.ConfidenceHead(conf.weight[:3])), "confidence.weight"),
        (dict(confidence=dk.ConfidenceHead(conf.weight, torch.zeros(2))), "confidence.bias"),
        (dict(confidence=dk.ConfidenceHead(conf.weight, 0.0, torch.ones(k + 1))), "confidence.sts_temperatures"),
        (dict(temperature=torch.ones(n + 1)), "temperature"),
        (dict(seed="x"), "seed"),
        (dict(backend="nope"), "backend"),
    ]
    for override, name in cases:
        with pytest.raises((ValueError, TypeError), match=name.replace(".", r"\.")):
            call(**override)
    with pytest.raises(ValueError, match=r"base_logits .*V < 2\^31"):  # token ids are 32-bit in every kernel
        call(base_logits=base[:, :, :1].expand(n, k, 2 ** 31))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_opcheck(kind, backend):
    base, anchors, head, hidden, conf = make_case(kind, n=2, k=3, vocab=9)
    args = (base, anchors, kind, head.w1, head.w2, None, None, head.wg, head.bg, head.wj, head.bj, hidden, conf.weight,
            torch.tensor(0.3), conf.sts_temperatures, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), True, 0,
            backend)
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args)


# ---------------------------------------------------------------- Triton twin (interpreter on the CPU)
def make_triton_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=0):
    """Weights at the scale of a trained head (std 1/sqrt(fan_in)), in ``dtype``; out-of-range anchors at both ends.

    temps: "greedy" | "sampled" | "mixed" (per request, with a negative and a NaN entry, which count as greedy).
    conf: "none" | "conf" (no STS temperatures) | "sts".
    """
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    head = dk.MarkovHead(kind, r(vocab, rank), r(vocab, rank, scale=rank ** -0.5 * 2))
    if kind == "gated":
        head.wg, head.bg = r(rank, d + rank, scale=(d + rank) ** -0.5), r(rank)
    if kind == "rnn":
        head.wj, head.bj = r(3 * rank, 2 * rank + d, scale=(2 * rank + d) ** -0.5), r(3 * rank)
    confidence = None
    if conf != "none":
        sts = (torch.rand(k, generator=g) + 0.5).to(dtype) if conf == "sts" else None
        confidence = dk.ConfidenceHead(r(1, d + rank, scale=(d + rank) ** -0.5), r(1), sts)
    anchors = torch.randint(0, vocab, (n,), generator=g)
    anchors[0] = -3
    if n > 1:
        anchors[-1] = vocab + 2
    temperature = {"greedy": 0.0, "sampled": 1.0,
                   "mixed": torch.tensor([0.0, 1.0, 0.6, -1.0, 1.3, float("nan"), 0.0, 2.0] * n)[:n]}[temps]
    if temps == "sampled" and n > 1:
        temperature = torch.linspace(0.5, 1.5, n)
    return r(n, k, vocab, scale=2.0), anchors, head, r(n, k, d), confidence, temperature


def plain_torch_logits(base, anchors, head, hidden, tokens):
    """The corrected logits in the inputs' own dtype (plain PyTorch, teacher-forced on ``tokens``): the yardstick
    of flash-attention's tolerance rule for low-precision inputs."""
    n, k_len, vocab = base.shape
    prev, state, out = anchors, None, []
    for k in range(k_len):
        valid = (prev >= 0) & (prev < head.w1.shape[0])
        e = head.w1[torch.where(valid, prev, 0)] * valid.unsqueeze(-1).to(base.dtype)
        if head.kind == "vanilla":
            v = e
        elif head.kind == "gated":
            v = torch.sigmoid(torch.cat([hidden[:, k], e], -1) @ head.wg.T + head.bg) * e
        else:
            state = torch.zeros_like(e) if state is None else state
            gate, cand, o = (torch.cat([state, e, hidden[:, k]], -1) @ head.wj.T + head.bj).chunk(3, -1)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
            v = torch.tanh(o)
        w2 = head.w2 if head.w2_scale is None else head.w2.to(base.dtype) * head.w2_scale.to(base.dtype)[:, None]
        out.append(base[:, k] + v @ w2.T)
        prev = tokens[:, k]
    return torch.stack(out, 1)


def run_both(triton_device, base, anchors, head, hidden, confidence, temperature, return_logits, seed=7, offset=3,
             backend="triton", wrap=lambda fn: fn()):
    kw = dict(hidden=hidden if (head.kind != "vanilla" or confidence is not None) else None, confidence=confidence,
              temperature=temperature, seed=seed, offset=offset, return_logits=return_logits)
    ref = dk.draft_block(base, anchors, head, backend="reference", **kw)
    move = lambda x: x.to(triton_device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    dev_head = dk.MarkovHead(head.kind, *(move(w) for w in (head.w1, head.w2, head.wg, head.bg, head.wj, head.bj,
                                                              head.draft_to_target)), w2_scale=move(head.w2_scale))
    dev_conf = None if confidence is None else dk.ConfidenceHead(
        *(move(x) for x in (confidence.weight, confidence.bias, confidence.sts_temperatures)))
    out = wrap(lambda: dk.draft_block(move(base), move(anchors), dev_head, backend=backend,
                                      **{**kw, "hidden": move(kw["hidden"]), "confidence": dev_conf,
                                         "temperature": move(temperature)}))
    return ref, type(out)(*(None if t is None else t.cpu() for t in out))


def logprobs_from_logits(logits, tokens, temperature):
    """log_softmax(logits / T).gather(tokens), with T = 1 for greedy requests (T <= 0, NaN, or a Python 0)."""
    n = logits.shape[0]
    t = temperature if isinstance(temperature, torch.Tensor) else torch.full((n,), float(temperature))
    t = torch.where(t.float() > 0, t.float(), 1.0).to(logits.device)
    return torch.log_softmax(logits / t[:, None, None], -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draft_ids(tokens, draft_to_target):
    """The draft ids of drafted target ids (the tokens themselves without a map)."""
    if draft_to_target is None:
        return tokens
    return (tokens.unsqueeze(-1) == draft_to_target.to(tokens.device)).int().argmax(-1)


def assert_float_outputs_close(ref, out):
    """The float32 outputs within float32 rounding of a different summation order (absent in both or neither)."""
    for name in ("logits", "conf_logits", "survival", "draft_logprobs"):
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == torch.float32 and a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, equal_nan=True, msg=name)


def assert_matches(ref, out, base, anchors, head, hidden, temperature=None):
    assert out.tokens.dtype == torch.int64 and torch.equal(out.tokens, ref.tokens)
    if temperature is not None and out.logits is not None:  # the new output, from the returned logits
        drafted = draft_ids(out.tokens, head.draft_to_target)
        torch.testing.assert_close(out.draft_logprobs, logprobs_from_logits(out.logits, drafted, temperature),
                                   rtol=1e-5, atol=2e-5, equal_nan=True)
    assert_float_outputs_close(ref, out)
    if ref.logits is not None and base.dtype != torch.float32:
        # flash-attention's rule against the fp32 computation: at most 2x plain PyTorch's error in the input dtype
        plain = plain_torch_logits(base, anchors, head, hidden, ref.tokens).float()
        assert (out.logits - ref.logits).abs().max() <= 2 * (plain - ref.logits).abs().max()


TRITON_CASES = [  # head, N, K, V, r, d, dtype, temperatures, confidence, return_logits
    ("vanilla", 1, 1, 1, 3, 5, torch.float32, "greedy", "none", True),
    ("gated", 3, 5, 17, 5, 6, torch.bfloat16, "mixed", "sts", True),
    ("rnn", 3, 7, 1000, 70, 37, torch.float16, "sampled", "conf", False),
    ("rnn", 3, 16, 17, 7, 9, torch.float32, "mixed", "sts", True),
    ("vanilla", 3, 16, 17, 100, 5, torch.float32, "greedy", "conf", True),
    ("gated", 64, 1, 17, 12, 9, torch.float32, "mixed", "sts", True),
    ("vanilla", 64, 2, 23, 6, 3, torch.float16, "mixed", "none", False),
    ("vanilla", 2, 5, 1000, 257, 4, torch.bfloat16, "mixed", "sts", True),
    ("gated", 1, 3, 32003, 19, 4100, torch.bfloat16, "sampled", "none", True),
    ("vanilla", 2, 2, 32000, 67, 11, torch.float32, "mixed", "conf", False),
    ("rnn", 1, 5, 300, 33, 50, torch.bfloat16, "greedy", "none", True),
]


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf,with_logits", TRITON_CASES)
def test_triton_matches_reference(triton_device, kind, n, k, vocab, rank, d, dtype, temps, conf, with_logits):
    case = make_triton_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n * 1000 + k * 10 + vocab)
    base, anchors, head, hidden, confidence, temperature = case
    ref, out = run_both(triton_device, *case, with_logits)
    assert_matches(ref, out, base, anchors, head, hidden, temperature)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_triton_gpu_tiles_match_reference(triton_device, kind, monkeypatch):
    """The GPU's register-sized tiles (several V, r and d blocks per position) on the interpreter too."""
    from dspark_kernels.triton import draft_block as triton_draft_block
    monkeypatch.setattr(triton_draft_block, "_TILE_INTERPRET", triton_draft_block._TILE)
    case = make_triton_case(kind, 2, 3, 300, 70, 150, torch.float32, "mixed", "sts", seed=5)
    ref, out = run_both(triton_device, *case, True)
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs, on purpose
def test_triton_nan_and_inf_logits(triton_device):
    """NaN counts as -inf and infinities stay what they are (rng.argmax_nan_low); tokens in range always."""
    base, anchors, head, hidden, confidence, _ = make_triton_case("vanilla", 4, 4, 9, 3, 2, torch.float32,
                                                                  "greedy", "none")
    base[0] = float("nan")                                   # all NaN
    base[1, :, ::2] = float("nan")                           # NaN mixed with -inf and finite values
    base[1, :, 1] = float("-inf")
    base[2, :, 3] = float("inf")                             # +inf ties with +inf
    base[2, :, 6] = float("inf")
    base[3] = float("-inf")                                  # all -inf
    for temperature in (0.0, 1.0, torch.tensor([1.0, 0.0, 0.5, 2.0])):
        ref, out = run_both(triton_device, base, anchors, head, None, None, temperature, True)
        assert ((out.tokens >= 0) & (out.tokens < 9)).all()
        assert torch.equal(out.tokens, ref.tokens)
        torch.testing.assert_close(out.logits, ref.logits, equal_nan=True)
        torch.testing.assert_close(out.draft_logprobs, ref.draft_logprobs, equal_nan=True)
        torch.testing.assert_close(out.draft_logprobs, logprobs_from_logits(out.logits, out.tokens, temperature),
                                   equal_nan=True)


def test_triton_opcheck_and_distinct_outputs(triton_device):
    base, anchors, head, hidden, confidence, _ = make_triton_case("rnn", 2, 3, 9, 4, 5, torch.float32,
                                                                  "greedy", "none")
    dev = lambda x: x.to(triton_device)  # noqa: E731
    args = (dev(base), dev(anchors), "rnn", dev(head.w1), dev(head.w2), None, None, None, None, dev(head.wj),
            dev(head.bj), dev(hidden), None, None, None, dev(torch.tensor([0.0, 1.0])), dev(torch.tensor([1, 2])),
            False, 0, "triton")
    tokens, logits, conf, survival, logprobs, cands = torch.ops.dspark.draft_block.default(*args)
    assert tokens.shape == logprobs.shape == (2, 3) and logits.shape == conf.shape == survival.shape == (0,)
    assert cands.shape == (0,) and cands.dtype == torch.int64
    assert len({id(t) for t in (tokens, logits, conf, survival, logprobs, cands)}) == 6
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args)


# ---------------------------------------------------------------- draft_logprobs (reference)
@pytest.mark.parametrize("temperature", [0.0, 0.7, "mixed"])
def test_reference_logprobs_are_log_softmax_of_the_logits(temperature):
    case = make_triton_case("gated", 5, 4, 50, 6, 7, torch.float32, "mixed", "sts", seed=3)
    base, anchors, head, hidden, confidence, temps = case
    temperature = temps if temperature == "mixed" else temperature
    out = dk.draft_block(base, anchors, head, hidden=hidden, confidence=confidence, temperature=temperature,
                         seed=1, return_logits=True, backend="reference")
    assert out.draft_logprobs.dtype == torch.float32 and out.draft_logprobs.shape == (5, 4)
    torch.testing.assert_close(out.draft_logprobs, logprobs_from_logits(out.logits, out.tokens, temperature))
    assert (out.draft_logprobs <= 0).all()
    if isinstance(temperature, float) and temperature == 0.0:  # greedy rows: the draft model's log-probability at T = 1 (of its argmax)
        torch.testing.assert_close(out.draft_logprobs, torch.log_softmax(out.logits, -1).max(-1).values)


# ---------------------------------------------------------------- hand-written CUDA (SIMT harness on the CPU)
# Token equality rule: the bias W2 @ v is a float32 dot product summed in another order than torch's, so the
# logits agree to ~1e-6 relative, not bit for bit; with continuous random data an argmax (or race) near-tie
# within that is a ~1e-5 event per draw, so tokens must equal the reference's exactly (as the Triton tests do).
CUDA_CASES = [  # head, N, K, V, r, d, dtype, temperatures, confidence, return_logits
    ("vanilla", 1, 1, 1, 8, 5, torch.float32, "greedy", "none", True),
    ("gated", 3, 5, 17, 8, 7, torch.bfloat16, "mixed", "sts", True),
    ("rnn", 3, 7, 1000, 64, 37, torch.float16, "sampled", "conf", True),
    ("rnn", 3, 16, 17, 8, 9, torch.float32, "mixed", "sts", True),
    ("vanilla", 17, 5, 1000, 64, 5, torch.float32, "mixed", "conf", True),
    ("gated", 17, 1, 4099, 64, 33, torch.bfloat16, "mixed", "sts", True),
    ("vanilla", 3, 5, 1000, 13, 5, torch.float16, "mixed", "sts", True),    # rows not 16-byte aligned
    ("rnn", 1, 7, 4099, 256, 21, torch.float32, "greedy", "sts", True),
    ("gated", 3, 5, 1000, 256, 13, torch.float16, "sampled", "conf", True),
    ("gated", 3, 2, 300, 512, 301, torch.bfloat16, "mixed", "sts", True),    # r = 512
    pytest.param("vanilla", 1, 5, 32003, 64, 11, torch.bfloat16, "sampled", "none", False,  # V = 32003: slow leg
                 marks=pytest.mark.harness_slow),
    ("rnn", 10, 3, 257, 600, 7, torch.bfloat16, "mixed", "conf", True),     # tensor cores, r > 512 (v re-read)
    ("vanilla", 2, 2, 97, 2100, 3, torch.float16, "mixed", "none", True),   # r > 2048: 16-bit W2 on the FMA sweep
    ("vanilla", 80, 3, 4096, 32, 9, torch.bfloat16, "mixed", "sts", True),  # 2 request lanes x 32 slices
    ("gated", 70, 2, 2051, 32, 9, torch.float16, "sampled", "conf", True),   # 2 lanes, the gated phases
    ("gated", 5, 4, 1000, 128, 9, torch.bfloat16, "mixed", "sts", True),    # U staged, 2 chunks a tile: 2 slots
    ("vanilla", 9, 3, 2048, 192, 3, torch.float16, "sampled", "none", True),  # 3 chunks a tile: 1 U slot
]


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf,with_logits", CUDA_CASES)
def test_cuda_matches_reference(cuda_device, simt_check, kind, n, k, vocab, rank, d, dtype, temps, conf,
                                with_logits):
    case = make_triton_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n * 1000 + k * 10 + vocab)
    ref, out = run_both(cuda_device, *case, with_logits, backend="cuda", wrap=simt_check)
    assert_matches(ref, out, *case[:4], case[5])


def test_cuda_mixed_input_dtypes(cuda_device, simt_check):
    """Every float input may have its own dtype: U bf16, W2 fp32, W1 fp16, the gate in bf16 / fp32."""
    base, anchors, head, hidden, confidence, temperature = make_triton_case(
        "gated", 3, 4, 500, 24, 19, torch.float32, "mixed", "sts", seed=11)
    head = dk.MarkovHead("gated", head.w1.half(), head.w2, head.wg.bfloat16(), head.bg)
    confidence = dk.ConfidenceHead(confidence.weight.half(), confidence.bias, confidence.sts_temperatures.bfloat16())
    case = (base.bfloat16(), anchors.int(), head, hidden.half(), confidence, temperature)
    ref, out = run_both(cuda_device, *case, True, backend="cuda", wrap=simt_check)
    assert_matches(ref, out, base, anchors, head, hidden, temperature)  # (no plain-PyTorch yardstick: dtypes mix)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def check_nan_and_inf_logits(device, backend, wrap=lambda fn: fn()):
    """NaN rows, NaN / -inf / +inf entries, -inf rows: the reference's tokens, logits and log-probabilities."""
    base, anchors, head, hidden, confidence, _ = make_triton_case("vanilla", 4, 4, 9, 3, 2, torch.float32,
                                                                  "greedy", "none")
    base[0] = float("nan")
    base[1, :, ::2] = float("nan")
    base[1, :, 1] = float("-inf")
    base[2, :, 3] = float("inf")
    base[2, :, 6] = float("inf")
    base[3] = float("-inf")
    for temperature in (0.0, torch.tensor([1.0, 0.0, 0.5, 2.0])):
        ref, out = run_both(device, base, anchors, head, None, None, temperature, True, backend=backend, wrap=wrap)
        assert ((out.tokens >= 0) & (out.tokens < 9)).all()
        assert torch.equal(out.tokens, ref.tokens)
        torch.testing.assert_close(out.logits, ref.logits, equal_nan=True)
        torch.testing.assert_close(out.draft_logprobs, ref.draft_logprobs, equal_nan=True)


def test_cuda_nan_and_inf_logits(cuda_device, simt_check):
    check_nan_and_inf_logits(cuda_device, "cuda", simt_check)


def check_infinite_logits_at_infinite_temperature(device, backend, wrap=lambda fn: fn()):
    """T = inf: an infinite logit l gives l / T = NaN, so its row's log-probability is NaN (the reference's
    log_softmax). V = 40: the +inf sits in the first tile of a row that goes on with finite logits (the CPU kernel
    once dropped that tile from the row's statistics and gave a finite log-probability)."""
    base, anchors, head, hidden, confidence, _ = make_triton_case("vanilla", 3, 2, 40, 4, 2, torch.float32,
                                                                  "greedy", "none", seed=5)
    base[0, 0, 3] = float("inf")
    base[1, 1, 0] = float("-inf")
    base[2, 0, 30] = float("inf")
    for temperature in (float("inf"), torch.tensor([float("inf"), float("inf"), 1.0])):
        ref, out = run_both(device, base, anchors, head, None, None, temperature, True, backend=backend, wrap=wrap)
        assert ref.draft_logprobs[0, 0].isnan() and ref.draft_logprobs[1, 1].isnan()
        assert torch.equal(out.tokens, ref.tokens)
        torch.testing.assert_close(out.logits, ref.logits, equal_nan=True)
        torch.testing.assert_close(out.draft_logprobs, ref.draft_logprobs, equal_nan=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_infinite_logits_at_infinite_temperature(cuda_device, simt_check):
    check_infinite_logits_at_infinite_temperature(cuda_device, "cuda", simt_check)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("n,first", [(4, 0), (4, 3), (64, 0)])
def test_cuda_greedy_fold_specials_and_ties(cuda_device, simt_check, n, first):
    """The greedy fold of a staged bf16 U (fold_pieces_greedy: Part::add_greedy until a thread's maximum is above
    -inf, then Part::add_greedy_seeded, one test a piece of 8, the winner and the rescale only where a piece beats
    the maximum) on rows the reference decides by its rules: ties of the maximum within a piece, across its halves
    and across pieces (lowest index), NaN mixed with -inf and finite values, +inf entries, all NaN, all -inf. W2 = 0,
    so the logits are U's values exactly. N = 4: 32 threads a request (their pieces read with halves swapped: the
    rotated tie mask); N = 64: 4 (a 256-thread CTA; a lane's second piece is seeded: the select chain). The tokens
    and log-probabilities equal the reference's."""
    V, K, r = 64, 2, 32
    g = torch.Generator().manual_seed(n + first)
    base = torch.randn(n, K, V, generator=g)
    patterns = [lambda u: (u.__setitem__(13, 5.0), u.__setitem__(50, 5.0)),   # tie across pieces: 13
                lambda u: (u.__setitem__(42, 6.0), u.__setitem__(41, 6.0)),   # tie within a piece: 41
                lambda u: (u.__setitem__(44, 7.0), u.__setitem__(43, 7.0)),   # tie across a piece's halves: 43
                lambda u: (u.__setitem__(slice(0, None, 2), float("nan")), u.__setitem__(1, float("-inf"))),
                lambda u: (u.__setitem__(38, float("inf")), u.__setitem__(6, float("inf"))),
                lambda u: u.fill_(float("nan")),
                lambda u: u.fill_(float("-inf"))]
    for i in range(n):
        for k in range(K):
            patterns[(i + first + k) % len(patterns)](base[i, k])
    base = base.bfloat16()
    head = dk.MarkovHead("vanilla", torch.randn(V, r, generator=g).bfloat16(), torch.zeros(V, r).bfloat16())
    anchors = torch.randint(0, V, (n,), generator=g)
    ref, out = run_both(cuda_device, base, anchors, head, None, None, 0.0, False, backend="cuda", wrap=simt_check)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.draft_logprobs, ref.draft_logprobs, equal_nan=True)
    want = base.float().nan_to_num(nan=float("-inf")).argmax(-1)  # (NaN as -inf, the first maximum)
    assert torch.equal(ref.tokens, want)


def assert_sampled_tokens_follow_corrected_softmax(dev, run, backend, temp, trials=3000, kind="rnn", vocab=30,
                                                   fp8=False):
    """Chi-square through a kernel path: position 0 against softmax(logits / T), later positions against the
    mean of softmax(logits_k / T) over the prefixes actually drawn (the previous draft and the rnn state make them
    differ). ``fp8``: W2 quantized to e4m3 with per-row scales (the law is that of the logits the kernel returns)."""
    base, _, head, hidden, _ = make_case(kind, n=1, k=3, vocab=vocab, rank=4, d=3, seed=1, conf=False)
    base, hidden = base.expand(trials, -1, -1), hidden.expand(trials, -1, -1)
    anchors = torch.full((trials,), 7)
    if fp8:
        q, scale = dk.quantize_w2(head.w2)
        head = dataclasses.replace(head, w2=q, w2_scale=scale)
    to = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
    dev_head = dataclasses.replace(head, **{f.name: to(getattr(head, f.name)) for f in dataclasses.fields(head)})
    out = run(lambda: dk.draft_block(to(base), to(anchors), dev_head, hidden=to(hidden), temperature=temp,
                                     seed=123, return_logits=True, backend=backend))
    tokens, logits = out.tokens.cpu(), out.logits.cpu()
    p0 = torch.softmax(logits[0, 0] / temp, -1)
    assert passes(counts(tokens[:, 0], vocab), p0 * trials)
    for k in (1, 2):
        assert passes(counts(tokens[:, k], vocab), torch.softmax(logits[:, k] / temp, -1).sum(0).double())
    assert not passes(counts(logits[:, 0].argmax(-1), vocab), p0 * trials)  # the check can fail
    torch.testing.assert_close(out.draft_logprobs.cpu(), logprobs_from_logits(logits, tokens, temp),
                               rtol=1e-5, atol=2e-5)


@pytest.mark.harness_slow  # a statistical test through the SIMT harness: CI's slow leg (quick on a GPU)
@pytest.mark.parametrize("temp", [0.6, 1.3])
def test_cuda_sampled_tokens_follow_corrected_softmax(cuda_device, simt_check, temp):
    assert_sampled_tokens_follow_corrected_softmax(cuda_device, simt_check, "cuda", temp)


# Through the Triton interpreter the dense case takes minutes: it runs on a GPU (pytest -m gpu, bench/gpu_check.sh);
# the reduced, fp8 and top-k ones (fewer requests, smaller V) in CI's slow leg.
INTERPRETED = [pytest.mark.slow] if not torch.cuda.is_available() else []


@pytest.mark.gpu
@pytest.mark.parametrize("temp", [0.6, 1.3])
def test_triton_sampled_tokens_follow_corrected_softmax(triton_device, temp):
    """Null hypothesis: the Triton kernels' drafts follow softmax(logits_k / T) (position 0 exactly; later positions
    on average over the drawn prefixes); 3000 requests of one call."""
    assert_sampled_tokens_follow_corrected_softmax(triton_device, lambda fn: fn(), "triton", temp)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=INTERPRETED)])
def test_triton_reduced_vocabulary_samples_follow_the_draft_softmax(triton_device, backend):
    """Null hypothesis: the Triton kernels' drafts over a reduced vocabulary follow softmax(logits / T) over the
    draft ids, pushed through the map."""
    assert_reduced_samples_follow_the_draft_softmax(triton_device, lambda fn: fn(), backend)


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _bench_floors():
    """bench/floors.py (the benchmark's bytes floors)."""
    import importlib.util
    import os
    import sys
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "floors.py")
    if "dspark_bench_floors" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dspark_bench_floors", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dspark_bench_floors"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules["dspark_bench_floors"]


def _sweep_name(n, w2_dtype, rank=64):
    """The sweep draft_block runs: tensor cores past 4 requests with a 16-bit or fp8 W2 of rank <= 2048."""
    return "draft_sweep[mma]" if n > 4 and w2_dtype != torch.float32 and rank <= 2048 else "draft_sweep[gemv]"


@pytest.mark.parametrize("kind,n,dtype", [("vanilla", 1, torch.bfloat16), ("gated", 1, torch.bfloat16),
                                          ("rnn", 17, torch.float32), ("vanilla", 9, torch.float16)])
def test_cuda_launches_pdl_and_ctas(cuda_device, kind, n, dtype):
    """K + 2 launches with the vanilla head (draft_setup, a sweep a position, draft_finish), 2K + 2 with a gate / rnn
    (a draft_head before each sweep); none cooperative, no grid barrier; every launch after the first a programmatic
    dependent launch (the harness fails one that reads what the launch before it wrote, or writes global memory,
    before its grid_dependency_wait). The sweeps of N = 1 run at least 2 CTAs an SM of the harness's device."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    k, vocab, rank = 3, 32003 if n == 1 else 4099, 64  # (N = 1: enough rows for 2 CTAs an SM at 64 rows a CTA)
    base, anchors, head, hidden, confidence, temperature = make_triton_case(kind, n, k, vocab, rank, 40, dtype,
                                                                            "mixed", "sts", seed=2)
    kw = dict(hidden=hidden, confidence=confidence, temperature=temperature, seed=1)
    with simt.record() as rec:
        out = dk.draft_block(base, anchors, head, backend="cuda", **kw)
    assert torch.equal(out.tokens, dk.draft_block(base, anchors, head, backend="reference", **kw).tokens)
    sweep = _sweep_name(n, dtype)
    per_position = ([f"draft_head[{kind}]"] if kind != "vanilla" else []) + [sweep]
    assert rec.kernels() == ["draft_setup"] + per_position * k + ["draft_finish"]
    assert not any(r["cooperative"] or r["grid_barriers"] for r in rec.launches)
    assert [r["pdl"] for r in rec.launches] == [False] + [True] * (len(rec.launches) - 1)
    if n == 1:
        sms = simt.settings()["sm_count"]
        assert all(r["ctas"] >= 2 * sms for r in rec.launches if r["kernel"] == sweep), rec.launches


@pytest.mark.parametrize("n,vocab", [(1, 32003), (64, 4096), (256, 4096)])
def test_cuda_bytes_at_the_floor(cuda_device, n, vocab):
    """The whole op's estimated DRAM traffic (each launch's reads an L2 of 2 MB would not hold, plus its distinct
    bytes written) within 1.05x of bench/floors.py's floor (U once, W2 once per position, the W1 rows of the tokens,
    the tokens and their log-probabilities). Above the floor: the packed winners and each sweep CTA's statistics of its
    requests (16 bytes a request and CTA a position, written and read once). The harness's device has 132 V / 151936
    SMs here, so that slices stand to V as on a 132-SM GPU at V = 151936. At N = 256 one CTA a slice sweeps all 256
    requests (W2 streamed once per position; more than 48 KB of shared memory). Tokens equal the reference's."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    k, rank = 2, 64
    base, anchors, head, _, _, _ = make_triton_case("vanilla", n, k, vocab, rank, 1, torch.bfloat16, "greedy", "none",
                                                    seed=n)
    old = simt.configure(l2_bytes=2 << 20)
    try:
        with simt.record(dram=True, sm_count=max(1, 132 * vocab // 151936)) as rec:
            out = dk.draft_block(base, anchors, head, seed=1, backend="cuda")
    finally:
        simt.configure(**old)
    assert torch.equal(out.tokens, dk.draft_block(base, anchors, head, backend="reference").tokens)
    floor = _bench_floors().draft_block(n, k, vocab, rank).total  # the log-probabilities included
    assert rec.dram_bytes <= 1.05 * floor, (rec.dram_bytes, floor, rec.dram_bytes / floor)
    assert k * _nbytes(head.w2) + _nbytes(base) <= rec.bytes_read  # the counters see the streams
    sweeps = [r for r in rec.launches if r["kernel"] == _sweep_name(n, torch.bfloat16)]
    assert len(sweeps) == k
    if n == 256:
        assert all(r["grid"][0] == 1 and r["dynamic_smem"] > 48 * 1024 for r in sweeps), sweeps


ACCESS_CASES = [  # head, W2 dtype, N, K, V, confidence, temperatures, return_logits, fp8 W2
    ("vanilla", torch.float32, 1, 2, 1024, "none", "mixed", False, False),    # CUDA cores, fp32 W2
    ("vanilla", torch.bfloat16, 3, 2, 1024, "sts", "mixed", True, False),     # CUDA cores, logits, confidence
    ("vanilla", torch.bfloat16, 2, 2, 1024, "none", "mixed", False, True),    # CUDA cores, fp8 W2
    ("vanilla", torch.bfloat16, 64, 2, 1024, "none", "greedy", False, False),  # tensor cores, W1's rows as v
    ("rnn", torch.bfloat16, 40, 2, 1024, "sts", "mixed", True, False),        # tensor cores with lo rows
    ("gated", torch.float16, 9, 2, 1024, "conf", "mixed", False, True),       # tensor cores, fp8 W2 widened
    ("vanilla", torch.bfloat16, 256, 1, 256, "none", "mixed", False, False),  # 256 requests a CTA
]


@pytest.mark.parametrize("kind,dtype,n,k,vocab,conf,temps,logits,fp8", ACCESS_CASES)
def test_cuda_ideal_access(cuda_device, kind, dtype, n, k, vocab, conf, temps, logits, fp8):
    """Every launch (draft_setup, draft_head, the sweeps, draft_finish) at the access rule (python_tests/access.py):
    shared-memory wavefronts at the ideal (no bank conflict: the staged W2 chunks and v rows of ldmatrix, the fp8
    widening, the gate / rnn inputs, the partials' slots) and global sectors within 1.05x of the ideal, line by line.
    Tokens equal the reference's."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import ideal_access
    make = fp8_case if fp8 else make_triton_case
    base, anchors, head, hidden, confidence, temperature = make(kind, n, k, vocab, 64, 16, dtype, temps, conf,
                                                                seed=n + 3)
    kw = dict(hidden=hidden, confidence=confidence, temperature=temperature, seed=1, return_logits=logits)
    out, rec = ideal_access(lambda: dk.draft_block(base, anchors, head, backend="cuda", **kw))
    assert torch.equal(out.tokens, dk.draft_block(base, anchors, head, backend="reference", **kw).tokens)
    assert _sweep_name(n, dtype) in rec.kernels()


def test_cuda_opcheck(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("opchecks the SIMT build's op on CPU tensors")
    base, anchors, head, hidden, confidence, _ = make_triton_case("rnn", 2, 3, 9, 4, 5, torch.float32,
                                                                  "greedy", "sts")
    args = (base, anchors, "rnn", head.w1, head.w2, None, None, None, None, head.wj, head.bj, hidden,
            confidence.weight.view(-1),
            confidence.bias.view(()), confidence.sts_temperatures, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]),
            True, 0)
    torch.library.opcheck(torch.ops.dspark_simt.draft_block.default, args)
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args + ("cuda",))


@pytest.mark.parametrize("w2_dtype", [torch.bfloat16, torch.float16])
def test_cuda_tensor_core_bias_error(cuda_device, w2_dtype):
    """The tensor-core sweep splits the float32 v into hi + lo rows of W2's type (two MMAs): its biases W2 @ v
    (the logits with U = 0) against a float64 reference of the same W2 and v, next to plain PyTorch in W2's dtype
    (v rounded to it, W2 @ v in that dtype). The split must be far closer than plain PyTorch (16 or 22 significant
    bits of v instead of 8 or 11): at most 1/16 of its error, and within float32-level tolerance of the reference."""
    n, vocab, rank = 9, 700, 96
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(vocab, rank, generator=g) * torch.logspace(-3, 1, rank)  # float32 v rows, wide magnitudes
    w2 = torch.randn(vocab, rank, generator=g).to(w2_dtype)
    anchors = torch.randint(0, vocab, (n,), generator=g)
    base = torch.zeros(n, 1, vocab)
    dev = lambda x: x.to(cuda_device)  # noqa: E731
    run = lambda h: dk.draft_block(dev(base), dev(anchors), h, return_logits=True, backend="cuda")  # noqa: E731
    if cuda_device.type == "cpu":  # the harness names the sweep that ran
        from dspark_kernels import simt
        with simt.record() as rec:
            out = run(dk.MarkovHead("vanilla", dev(w1), dev(w2)))
        assert "draft_sweep[mma]" in rec.kernels(), rec.kernels()
        with simt.record() as rec:
            run(dk.MarkovHead("vanilla", dev(w1), dev(w2.float())))
        assert "draft_sweep[gemv]" in rec.kernels(), rec.kernels()
    else:
        out = run(dk.MarkovHead("vanilla", dev(w1), dev(w2)))
    v = w1[anchors].double()
    want = v @ w2.double().T
    err = (out.logits[:, 0].cpu().double() - want).abs().max().item()
    plain = (w1[anchors].to(w2_dtype) @ w2.T).double()
    err_plain = (plain - want).abs().max().item()
    scale = (v.abs() @ w2.double().abs().T).max().item()
    print(f"{w2_dtype}: split max abs err {err:.3g} ({err / scale:.3g} of sum|w v|), plain {err_plain:.3g}")
    assert err <= err_plain / 16, (err, err_plain)
    assert err <= (2 ** -14 if w2_dtype == torch.bfloat16 else 2 ** -19) * scale, (err, scale)


@pytest.mark.sass
def test_sass_sweeps_load_w2_in_16_bytes_and_keep_loops_out_of_local_memory():
    """sm_90a SASS (tools/check_cuda.py's report), one fact per design choice: the tensor-core sweeps stage W2 with
    cp.async (LDGSTS) and multiply with ldmatrix + mma.sync in a loop; the CUDA-core sweeps read W2 with 16-byte loads
    in a loop (8-byte ones for fp8) and use no tensor core; no instance spills or touches local memory in an innermost
    loop (the reduce-scatter's halves picked by mask, not by address)."""
    from sass_facts import sass_facts
    kernels = sass_facts("draft::sweep_")
    mma = [k for k in kernels if "sweep_mma_kernel" in k["demangled"]]
    gemv = [k for k in kernels if "sweep_gemv_kernel" in k["demangled"]]
    assert mma and gemv
    for k in kernels:
        assert k["spill_bytes"] == 0, k["demangled"]
        assert all(lp["LDL"] == 0 and lp["STL"] == 0 for lp in k["sass"]["loops"]), k["demangled"]
    for k in mma:
        assert k["sass"]["LDGSTS"] > 0, k["demangled"]
        assert any(lp["HMMA"] > 0 and lp["LDSM"] > 0 for lp in k["sass"]["loops"]), k["demangled"]
    for k in gemv:
        assert k["sass"]["HMMA"] == 0, k["demangled"]
        if "fp8" not in k["demangled"]:  # (8-byte loads of an fp8 row)
            assert any(lp["LDG.E.128"] > 0 for lp in k["sass"]["loops"]), k["demangled"]


# ---------------------------------------------------------------- a reduced draft vocabulary (draft_to_target)

def reduced_case(kind, n, k, vd, vt, rank, d, dtype, temps, conf, seed):
    """``make_triton_case`` over Vd draft ids, with W1 over Vt target ids, anchors that are target ids (out of range
    at both ends) and a shuffled map, so the tie rule and the random keys have to be the draft ids'."""
    base, _, head, hidden, confidence, temperature = make_triton_case(kind, n, k, vd, rank, d, dtype, temps, conf,
                                                                      seed)
    g = torch.Generator().manual_seed(seed + 1)
    d2t = torch.randperm(vt, generator=g)[:vd]
    anchors = torch.randint(0, vt, (n,), generator=g)
    anchors[0] = -3
    if n > 1:
        anchors[-1] = vt + 2
    head = dk.MarkovHead(kind, torch.randn(vt, rank, generator=g).to(dtype), head.w2, head.wg, head.bg, head.wj,
                         head.bj, draft_to_target=d2t)
    return base, anchors, head, hidden, confidence, temperature


def test_reduced_vocabulary_by_hand():
    """V = 5 target ids, Vd = 3 draft ids mapped to [4, 0, 2]; rank 1, W1[x] = x, W2 = [1, -1, 0]. Position 0 from
    anchor 2: logits [2, -2, 0], draft id 0, token 4. Position 1: U = [-10, 0, 0] plus 4 W2: [-6, -4, 0], draft id 2,
    token 2."""
    head = dk.MarkovHead("vanilla", torch.arange(5.0).reshape(5, 1), torch.tensor([[1.0], [-1.0], [0.0]]),
                         draft_to_target=torch.tensor([4, 0, 2], dtype=torch.int32))
    base = torch.tensor([[[0.0, 0.0, 0.0], [-10.0, 0.0, 0.0]]])
    out = dk.draft_block(base, torch.tensor([2]), head, return_logits=True, backend="reference")
    assert out.tokens.tolist() == [[4, 2]]
    logits = torch.tensor([[[2.0, -2.0, 0.0], [-6.0, -4.0, 0.0]]])
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.draft_logprobs[0], torch.log_softmax(logits[0], -1)[[0, 1], [0, 2]])


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_reduced_vocabulary_is_the_full_one_with_the_other_ids_masked(kind):
    """Greedy drafting over Vd ids equals drafting over all Vt ids with U = -inf and W2 = 0 off the map."""
    base, anchors, head, hidden, confidence, _ = reduced_case(kind, 3, 5, 13, 40, 6, 7, torch.float32, "greedy",
                                                              "sts", seed=5)
    d2t = head.draft_to_target
    full_base = torch.full((3, 5, 40), float("-inf"))
    full_base[..., d2t] = base
    full_w2 = torch.zeros(40, 6)
    full_w2[d2t] = head.w2
    full = dk.MarkovHead(kind, head.w1, full_w2, head.wg, head.bg, head.wj, head.bj)
    kw = dict(hidden=hidden, confidence=confidence, return_logits=True, backend="reference")
    red, ref = dk.draft_block(base, anchors, head, **kw), dk.draft_block(full_base, anchors, full, **kw)
    assert torch.equal(red.tokens, ref.tokens) and torch.isin(red.tokens, d2t).all()
    assert len(set(red.tokens.flatten().tolist())) > 3  # the walk goes somewhere
    torch.testing.assert_close(red.logits, ref.logits[..., d2t])
    for name in ("draft_logprobs", "conf_logits", "survival"):
        torch.testing.assert_close(getattr(red, name), getattr(ref, name), msg=name)


def assert_reduced_samples_follow_the_draft_softmax(dev, run, backend):
    """Chi-square of the tokens of position 0 against softmax(logits / T) over the draft ids, pushed through the map
    (the target ids off the map must never come out)."""
    trials, vd, vt, temp = 3000, 24, 50, 0.8
    base, _, head, _, _, _ = reduced_case("vanilla", 1, 2, vd, vt, 4, 3, torch.float32, "greedy", "none", seed=9)
    d2t = head.draft_to_target
    head = dk.MarkovHead("vanilla", head.w1.to(dev), head.w2.to(dev), draft_to_target=d2t.to(dev))
    out = run(lambda: dk.draft_block(base.expand(trials, -1, -1).to(dev), torch.full((trials,), 7, device=dev), head,
                                     temperature=temp, seed=4, return_logits=True, backend=backend))
    tokens, logits = out.tokens.cpu(), out.logits.cpu()
    expected = torch.zeros(vt, dtype=torch.float64)
    expected[d2t] = torch.softmax(logits[0, 0] / temp, -1).double() * trials
    observed = counts(tokens[:, 0], vt)
    assert observed[expected == 0].sum() == 0
    assert passes(observed[d2t], expected[d2t])
    assert not passes(observed[d2t].flip(0), expected[d2t])  # the check can fail
    torch.testing.assert_close(out.draft_logprobs.cpu(), logprobs_from_logits(logits, draft_ids(tokens, d2t), temp),
                               rtol=1e-5, atol=2e-5)


def test_reduced_vocabulary_samples_follow_the_draft_softmax():
    assert_reduced_samples_follow_the_draft_softmax(torch.device("cpu"), lambda fn: fn(), "reference")


@pytest.mark.harness_slow  # a statistical test through the SIMT harness: CI's slow leg (quick on a GPU)
def test_cuda_reduced_vocabulary_samples_follow_the_draft_softmax(cuda_device, simt_check):
    assert_reduced_samples_follow_the_draft_softmax(cuda_device, simt_check, "cuda")


REDUCED_CASES = [  # head, N, K, Vd, Vt, r, d, dtype, temperatures, confidence
    ("vanilla", 3, 4, 37, 100, 8, 5, torch.bfloat16, "mixed", "sts"),
    ("gated", 2, 3, 300, 1000, 16, 7, torch.float32, "sampled", "conf"),
    ("rnn", 3, 5, 17, 64, 8, 9, torch.float16, "greedy", "none"),
]


@pytest.mark.parametrize("kind,n,k,vd,vt,rank,d,dtype,temps,conf", REDUCED_CASES)
def test_triton_reduced_vocabulary_matches_reference(triton_device, kind, n, k, vd, vt, rank, d, dtype, temps, conf):
    case = reduced_case(kind, n, k, vd, vt, rank, d, dtype, temps, conf, seed=n + k + vd)
    ref, out = run_both(triton_device, *case, True)
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.parametrize("kind,n,k,vd,vt,rank,d,dtype,temps,conf", REDUCED_CASES)
def test_cuda_reduced_vocabulary_matches_reference(cuda_device, simt_check, kind, n, k, vd, vt, rank, d, dtype, temps,
                                                   conf):
    case = reduced_case(kind, n, k, vd, vt, rank, d, dtype, temps, conf, seed=n + k + vd)
    ref, out = run_both(cuda_device, *case, True, backend="cuda", wrap=simt_check)
    assert_matches(ref, out, *case[:4], case[5])


def test_reduced_vocabulary_opcheck():
    base, anchors, head, _, _, _ = reduced_case("vanilla", 2, 3, 9, 20, 4, 3, torch.float32, "greedy", "none", 1)
    args = (base, anchors, "vanilla", head.w1, head.w2, None, head.draft_to_target, None, None, None, None, None, None,
            None, None, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), True, 0, "reference")
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args)


def test_bad_draft_to_target_names_the_argument():
    w1, w2 = torch.zeros(10, 2), torch.zeros(4, 2)
    bad = ((torch.tensor([0, 3, 3, 1]), "distinct"), (torch.tensor([0, 10, 2, 1]), r"\[0, 10\)"),
           (torch.tensor([-1, 3, 2, 1]), r"\[0, 10\)"), (torch.tensor([0.0, 1, 2, 3]), "dtype"),
           (torch.tensor([[0, 1, 2, 3]]), "dimensions"), (torch.tensor([], dtype=torch.int64), "empty"))
    for table, message in bad:
        with pytest.raises(ValueError, match="draft_to_target") as e:
            dk.MarkovHead("vanilla", w1, w2, draft_to_target=table)
        assert e.match(message)
    head = dk.MarkovHead("vanilla", w1, w2, draft_to_target=torch.tensor([9, 0, 4]))  # a map of Vd = 3 ids
    with pytest.raises(ValueError, match=r"head\.draft_to_target"):
        dk.draft_block(torch.zeros(1, 2, 4), torch.tensor([0]), head)
    with pytest.raises(ValueError, match=r"head\.w2"):
        dk.draft_block(torch.zeros(1, 2, 3), torch.tensor([0]), head)


def test_draft_to_target_from_offsets():
    offsets = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    assert dk.draft_to_target_from_offsets(offsets).tolist() == [0, 5, 6, 13]


# ---------------------------------------------------------------------------------------------- fp8 (e4m3) W2
def fp8_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed):
    """make_triton_case with W2 quantized to e4m3 with per-row scales (dk.quantize_w2)."""
    base, anchors, head, hidden, confidence, temperature = make_triton_case(kind, n, k, vocab, rank, d, dtype, temps,
                                                                            conf, seed=seed)
    q, scale = dk.quantize_w2(head.w2)
    return base, anchors, dataclasses.replace(head, w2=q, w2_scale=scale), hidden, confidence, temperature


FP8_CASES = [  # head, N, K, V, r, d, dtype of the other inputs, temperatures, confidence
    ("vanilla", 3, 4, 1000, 64, 5, torch.bfloat16, "mixed", "sts"),
    ("gated", 17, 2, 4099, 32, 9, torch.float32, "sampled", "conf"),
    ("rnn", 2, 3, 300, 40, 7, torch.float16, "greedy", "none"),        # r = 40: W2 rows of 40 bytes (element copies)
    ("vanilla", 70, 2, 2051, 32, 3, torch.bfloat16, "mixed", "none"),  # two request lanes
    ("vanilla", 2, 2, 97, 2100, 3, torch.bfloat16, "mixed", "none"),   # r > 2048: the FMA sweep
]


def test_quantize_w2_by_hand():
    w2 = torch.tensor([[896.0, -1.0], [0.0, 0.0], [1.0, 0.5]])
    q, scale = dk.quantize_w2(w2)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == [2.0, 1.0, pytest.approx(1 / 448)]
    assert q.float().tolist() == [[448.0, -0.5], [0.0, 0.0], [448.0, 224.0]]


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_fp8_w2_is_the_scaled_products(kind):
    """The bias of an fp8 W2 is w2_scale[j] * (W2_j . v): drafting with it equals drafting with the float32 W2
    those products describe (q * scale, row by row), tokens exactly, logits to float32 rounding."""
    base, anchors, head, hidden, confidence, temperature = fp8_case(kind, 5, 3, 300, 16, 4, torch.float32, "mixed",
                                                                    "sts", seed=1)
    kw = dict(hidden=hidden, confidence=confidence, temperature=temperature, seed=3, return_logits=True)
    out = dk.draft_block(base, anchors, head, backend="reference", **kw)
    dense = dataclasses.replace(head, w2=head.w2.float() * head.w2_scale[:, None], w2_scale=None)
    want = dk.draft_block(base, anchors, dense, backend="reference", **kw)
    assert torch.equal(out.tokens, want.tokens)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    unscaled = dataclasses.replace(head, w2=head.w2.float(), w2_scale=None)  # the check can fail: scales matter
    assert not torch.allclose(dk.draft_block(base, anchors, unscaled, backend="reference", **kw).logits, out.logits)


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf", FP8_CASES)
def test_triton_fp8_w2_matches_reference(triton_device, kind, n, k, vocab, rank, d, dtype, temps, conf):
    case = fp8_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n + k + vocab)
    ref, out = run_both(triton_device, *case, True)
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf", FP8_CASES)
def test_cuda_fp8_w2_matches_reference(cuda_device, simt_check, kind, n, k, vocab, rank, d, dtype, temps, conf):
    case = fp8_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n + k + vocab)
    ref, out = run_both(cuda_device, *case, True, backend="cuda", wrap=simt_check)
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.harness_slow  # a statistical test through the SIMT harness: CI's slow leg (quick on a GPU)
def test_cuda_fp8_w2_samples_follow_the_draft_softmax(cuda_device, simt_check):
    """Chi-square of sampled drafts through the CUDA path with an fp8 W2 against softmax(logits / T) (position
    0; later positions against the mean over the prefixes drawn); the greedy token's law fails the same test."""
    assert_sampled_tokens_follow_corrected_softmax(cuda_device, simt_check, "cuda", 0.8, fp8=True)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=INTERPRETED)])
def test_triton_fp8_w2_samples_follow_the_draft_softmax(triton_device, backend):
    """Null hypothesis: the Triton kernels' drafts with an fp8 W2 follow softmax(logits_k / T) of the logits they
    return (position 0 exactly, later positions on average over the drawn prefixes); 300 requests of one call
    over V = 8 at T = 2, where a sampler at T = 1 or 4 fails the same test (a request costs ~20 ms in the
    interpreter)."""
    assert_sampled_tokens_follow_corrected_softmax(triton_device, lambda fn: fn(), backend, 2.0, trials=300,
                                                   kind="vanilla", vocab=8, fp8=True)


def test_cuda_fp8_w2_halves_the_w2_bytes(cuda_device):
    """The sweep reads the fp8 W2 itself (1 byte an element, plus 4 bytes of scale a row), once per position: with
    an L2 too small to keep W2 between positions, the harness's DRAM estimate stays within 1.05x of that floor."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    n, k, vocab, rank = 1, 2, 32003, 64
    base, anchors, head, _, _, temperature = fp8_case("vanilla", n, k, vocab, rank, 1, torch.bfloat16, "mixed",
                                                      "none", seed=4)
    old = simt.configure(l2_bytes=132 * 16 * 1024)
    try:
        with simt.record(dram=True) as rec:
            out = dk.draft_block(base, anchors, head, temperature=temperature, seed=1, backend="cuda")
    finally:
        simt.configure(**old)
    w2_bytes = _nbytes(head.w2, head.w2_scale)
    assert w2_bytes == vocab * (rank + 4)
    floor = (_nbytes(base, anchors) + k * w2_bytes + n * k * rank * head.w1.element_size()
             + _nbytes(out.tokens, out.draft_logprobs))
    assert k * w2_bytes <= rec.bytes_read and rec.dram_bytes <= 1.05 * floor, (rec.dram_bytes, floor)


def test_fp8_w2_opcheck():
    """opcheck with an fp8 W2. Its schema check compares inputs before and after with arithmetic that PyTorch does
    not implement for float8 on the CPU, so that one runs with W2's bytes viewed as the same fp8 data after the
    call (the op declares no mutation: W2 must come back bit for bit), and the other checks run as usual."""
    base, anchors, head, _, _, _ = fp8_case("vanilla", 2, 3, 9, 4, 3, torch.float32, "greedy", "none", seed=1)
    args = (base, anchors, "vanilla", head.w1, head.w2, head.w2_scale, None, None, None, None, None, None, None,
            None, None, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), True, 0, "reference")
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = head.w2.view(torch.uint8).clone()
    torch.ops.dspark.draft_block.default(*args)
    assert torch.equal(head.w2.view(torch.uint8), before)


def test_bad_w2_scale_names_the_argument():
    w1, w2 = torch.zeros(4, 2), torch.zeros(4, 2)
    q, scale = dk.quantize_w2(w2)
    with pytest.raises(ValueError, match=r"head\.w2_scale"):
        dk.MarkovHead("vanilla", w1, q)                       # fp8 without scales
    with pytest.raises(ValueError, match=r"head\.w2_scale"):
        dk.MarkovHead("vanilla", w1, w2, w2_scale=scale)      # scales for a float W2
    head = dk.MarkovHead("vanilla", w1, q, w2_scale=scale[:3])
    with pytest.raises(ValueError, match=r"head\.w2_scale"):
        dk.draft_block(torch.zeros(1, 2, 4), torch.tensor([0]), head)
    head = dk.MarkovHead("vanilla", w1, q, w2_scale=scale.double())
    with pytest.raises(ValueError, match=r"head\.w2_scale"):
        dk.draft_block(torch.zeros(1, 2, 4), torch.tensor([0]), head)


def test_triton_e4m3_decode_is_exact(triton_device):
    """The Triton twin decodes fp8 W2 bytes in integer arithmetic (so that sm_80 compiles it): all 256 codes equal
    PyTorch's float8_e4m3fn -> float32, the two NaN codes NaN."""
    from triton_probes import decode_e4m3 as decode
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(triton_device)
    out = torch.empty(256, device=triton_device)
    decode[(1,)](codes, out)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert int(nan.sum()) == 2 and torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])


# ---------------------------------------------------------------- CPU kernel (csrc/cpu)
CPU = torch.device("cpu")


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf,with_logits", CUDA_CASES)
def test_cpu_matches_reference(kind, n, k, vocab, rank, d, dtype, temps, conf, with_logits):
    case = make_triton_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n * 1000 + k * 10 + vocab)
    ref, out = run_both(CPU, *case, with_logits, backend="cpu")
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.parametrize("kind,n,vocab,dtype,temps", [("vanilla", 1, 49152, torch.bfloat16, "greedy"),
                                                      ("vanilla", 8, 49152, torch.float32, "sampled"),
                                                      ("gated", 4, 32000, torch.bfloat16, "mixed")])
def test_cpu_decode_shapes(kind, n, vocab, dtype, temps):
    """The decode loop's shapes (N = 1..8, K = 7, V = 49152, r = 32)."""
    case = make_triton_case(kind, n, 7, vocab, 32, 16, dtype, temps, "sts", seed=n + vocab)
    ref, out = run_both(CPU, *case, True, backend="cpu")
    assert_matches(ref, out, *case[:4], case[5])


def test_cpu_mixed_input_dtypes():
    base, anchors, head, hidden, confidence, temperature = make_triton_case(
        "gated", 3, 4, 500, 24, 19, torch.float32, "mixed", "sts", seed=11)
    head = dk.MarkovHead("gated", head.w1.half(), head.w2, head.wg.bfloat16(), head.bg)
    confidence = dk.ConfidenceHead(confidence.weight.half(), confidence.bias, confidence.sts_temperatures.bfloat16())
    case = (base.bfloat16(), anchors.int(), head, hidden.half(), confidence, temperature)
    ref, out = run_both(CPU, *case, True, backend="cpu")
    assert_matches(ref, out, base, anchors, head, hidden, temperature)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cpu_nan_and_inf_logits():
    check_nan_and_inf_logits(CPU, "cpu")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cpu_infinite_logits_at_infinite_temperature():
    check_infinite_logits_at_infinite_temperature(CPU, "cpu")


@pytest.mark.parametrize("kind,n,k,vd,vt,rank,d,dtype,temps,conf", REDUCED_CASES)
def test_cpu_reduced_vocabulary_matches_reference(kind, n, k, vd, vt, rank, d, dtype, temps, conf):
    case = reduced_case(kind, n, k, vd, vt, rank, d, dtype, temps, conf, seed=n + k + vd)
    ref, out = run_both(CPU, *case, True, backend="cpu")
    assert_matches(ref, out, *case[:4], case[5])


def test_cpu_reduced_vocabulary_samples_follow_the_draft_softmax():
    assert_reduced_samples_follow_the_draft_softmax(CPU, lambda fn: fn(), "cpu")


@pytest.mark.parametrize("kind,n,k,vocab,rank,d,dtype,temps,conf", FP8_CASES)
def test_cpu_fp8_w2_matches_reference(kind, n, k, vocab, rank, d, dtype, temps, conf):
    case = fp8_case(kind, n, k, vocab, rank, d, dtype, temps, conf, seed=n + k + vocab)
    ref, out = run_both(CPU, *case, True, backend="cpu")
    assert_matches(ref, out, *case[:4], case[5])


def test_cpu_top_k_runs_on_the_reference():
    """Top-k proposals have no CPU kernel: backend="cpu" gives the reference's result."""
    base, anchors, head, hidden, confidence, temperature = make_triton_case("vanilla", 3, 4, 300, 8, 5, torch.float32,
                                                                            "mixed", "sts")
    kw = dict(hidden=hidden, confidence=confidence, temperature=temperature, seed=2, return_logits=True, top_k=16)
    ref = dk.draft_block(base, anchors, head, backend="reference", **kw)
    out = dk.draft_block(base, anchors, head, backend="cpu", **kw)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_cpu_fp8_every_e4m3_code():
    """The CPU kernel's e4m3 decode: every finite code's value exactly (logits = W2[:, n] through a one-hot v), and
    NaN for the two NaN codes."""
    raw = torch.arange(256, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    codes = raw.view(torch.float8_e4m3fn)
    head = dk.MarkovHead("vanilla", torch.eye(256), codes.expand(256, 256).contiguous(), w2_scale=torch.ones(256))
    out = dk.draft_block(torch.zeros(256, 1, 256), torch.arange(256), head, backend="cpu", return_logits=True)
    assert torch.equal(out.logits[:, 0, 0], codes.float())
    nan_codes = torch.tensor([0x7F, 0xFF, 0x00, 0x38], dtype=torch.uint8).view(torch.float8_e4m3fn)
    w2 = torch.diag(nan_codes.float()).to(torch.float8_e4m3fn)   # row j holds code j only
    head = dk.MarkovHead("vanilla", torch.eye(4), w2, w2_scale=torch.ones(4))
    out = dk.draft_block(torch.zeros(4, 1, 4), torch.arange(4), head, backend="cpu", return_logits=True)
    assert out.logits[3, 0].isnan().tolist() == [True, True, False, False]   # a NaN code makes its row's bias NaN
    assert out.logits[3, 0, 3].item() == 1.0


# ---------------------------------------------------------------- production shapes (python_tests/near_ties.py)
def production_case(n: int, device: str, seed: int = 0):
    """K = 7, V = 151936, r = 256, bf16 U / W1 / W2 of a vanilla head (bias and U both of spread ~1-2)."""
    g = torch.Generator(device).manual_seed(seed)
    vocab, rank = 151936, 256
    base = (2 * torch.randn(n, 7, vocab, generator=g, device=device)).bfloat16()
    w1 = (0.25 * torch.randn(vocab, rank, generator=g, device=device)).bfloat16()
    w2 = (0.25 * torch.randn(vocab, rank, generator=g, device=device)).bfloat16()
    anchors = torch.randint(0, vocab, (n,), generator=g, device=device)
    return base, anchors, w1, w2


def check_production_tokens(n, sampled, backend, device, record_property):
    """The fast path's tokens (no logits asked for: the engine's call) against the reference's on the same device,
    each difference excused only at a near-tie within the stated bound (near_ties.py); returns the excused count."""
    from near_ties import draft_mismatches
    base, anchors, w1, w2 = production_case(n, device)
    head = dk.MarkovHead("vanilla", w1, w2)
    temperature = torch.ones(n, device=device) if sampled else None
    kw = dict(temperature=temperature if sampled else 0.0, seed=5, offset=9)
    ours = dk.draft_block(base, anchors, head, backend=backend, **kw).tokens
    ref = dk.draft_block(base, anchors, head, backend="reference", **kw).tokens
    bad, excused = draft_mismatches(ours, ref, base, anchors, w1, w2, temperature,
                                    make_rng_key(5, 9, device))
    record_property("excused_near_ties", excused)
    assert not bad, f"differences beyond the bound (request, position, gap, bound): {bad[:8]}"
    assert excused <= 2 + ours.numel() // 100, excused  # near-ties are rare: many excuses mean a biased kernel
    return excused


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_production_shape_tokens(n, sampled, backend, record_property):
    check_production_tokens(n, sampled, backend, "cuda", record_property)


@pytest.mark.parametrize("sampled", [False, True])
def test_cpu_production_shape_tokens_excuse_none(sampled, record_property):
    """The CPU kernel at the production shape (N = 2): the same check, and no difference excused."""
    assert check_production_tokens(2, sampled, "cpu", "cpu", record_property) == 0


def test_near_tie_rule_can_fail():
    """The rule's both sides: a token moved to the runner-up of a wide margin is reported; one moved across an
    exact tie (two ids with equal U and equal W2 rows) is excused; equal tokens are neither."""
    from near_ties import draft_mismatches
    g = torch.Generator().manual_seed(1)
    n, k, vocab, rank = 3, 4, 64, 8
    base, w1, w2 = torch.randn(n, k, vocab, generator=g), torch.randn(vocab, rank, generator=g), \
        torch.randn(vocab, rank, generator=g)
    anchors = torch.randint(0, vocab, (n,), generator=g)
    key = make_rng_key(0, 0, "cpu")
    ref = dk.draft_block(base, anchors, dk.MarkovHead("vanilla", w1, w2), backend="reference", return_logits=True)
    assert draft_mismatches(ref.tokens.clone(), ref.tokens, base, anchors, w1, w2, None, key) == ([], 0)
    wrong = ref.tokens.clone()
    wrong[1, 2] = ref.logits[1, 2].topk(2).indices[1]
    bad, excused = draft_mismatches(wrong, ref.tokens, base, anchors, w1, w2, None, key)
    assert [b[:2] for b in bad] == [(1, 2)] and excused == 0 and bad[0][2] > bad[0][3]
    tied_base, tied_w2 = base.clone(), w2.clone()
    t = int(ref.tokens[0, 0])
    other = (t + 1) % vocab
    tied_base[0, 0, other], tied_w2[other] = tied_base[0, 0, t], tied_w2[t]
    tied = dk.draft_block(tied_base, anchors, dk.MarkovHead("vanilla", w1, tied_w2), backend="reference").tokens
    moved = tied.clone()
    moved[0, 0] = other if int(tied[0, 0]) == t else t
    assert draft_mismatches(moved, tied, tied_base, anchors, w1, tied_w2, None, key) == ([], 1)


# ---------------------------------------------------------------- small temperatures, zero rank
LOW_T_TOL = dict(atol=1e-5, rtol=1e-5)  # |out - ref| <= 1e-5 + 1e-5 |ref|: float32 rounding, not ulp(logit / T)


def low_temperature_case(n, vocab=64, seed=0):
    """Logits within 7 ulps of 20 (the others 1 to 2 below): at T = 1e-5 / 2e-6 the scaled logits are ~2e6 / 1e7,
    whose ulp (0.25 / 1) is the size of their spread, so several tokens hold mass and a log-probability formed as
    x - (m + log s) would be a multiple of ulp(m). Greedy requests (T = 0, log-probabilities at T = 1) get the logits
    times 2^17, at the same scale. W2 = 0: the logits are U exactly on every path, so the tokens agree."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(0, 8, (n, 2, vocab), generator=g, dtype=torch.int32)
    near = (torch.tensor(20.0).view(torch.int32) + steps).view(torch.float32)
    far = torch.rand(n, 2, vocab, generator=g) + 18.0
    base = torch.where(torch.rand(n, 2, vocab, generator=g) < 0.3, near, far)
    temps = torch.tensor([1e-5, 2e-6, 0.0])[torch.arange(n) % 3]
    base = torch.where((temps == 0)[:, None, None], base * 2.0 ** 17, base)
    head = dk.MarkovHead("vanilla", torch.randn(vocab, 16, generator=g).bfloat16(), torch.zeros(vocab, 16).bfloat16())
    return base, torch.randint(0, vocab, (n,), generator=g), head, temps


def assert_low_temperature_logprobs(ref, out):
    """The reference's tokens; log-probabilities within LOW_T_TOL of the reference's, and never above 0 (q <= 1)."""
    assert torch.equal(out.tokens, ref.tokens)
    assert (ref.draft_logprobs < -0.01).any()  # the case holds draws that were not near-certain
    assert (out.draft_logprobs <= 0).all(), out.draft_logprobs
    torch.testing.assert_close(out.draft_logprobs, ref.draft_logprobs, **LOW_T_TOL)


@pytest.mark.parametrize("n", [4, 6])
def test_cuda_low_temperature_logprobs(cuda_device, simt_check, n):
    """N = 4: the CUDA-core sweep; N = 6: the tensor-core sweep (bf16 W2)."""
    base, anchors, head, temps = low_temperature_case(n, seed=n)
    run = lambda: run_both(cuda_device, base, anchors, head, None, None, temps, False, backend="cuda",  # noqa: E731
                           wrap=simt_check)
    if cuda_device.type == "cpu":
        from dspark_kernels import simt
        with simt.record() as rec:
            ref, out = run()
        assert _sweep_name(n, head.w2.dtype, 16) in rec.kernels(), rec.kernels()
    else:
        ref, out = run()
    assert_low_temperature_logprobs(ref, out)


def test_triton_low_temperature_logprobs(triton_device):
    base, anchors, head, temps = low_temperature_case(6, seed=1)
    assert_low_temperature_logprobs(*run_both(triton_device, base, anchors, head, None, None, temps, False))


def test_cpu_low_temperature_logprobs():
    base, anchors, head, temps = low_temperature_case(6, seed=2)
    assert_low_temperature_logprobs(*run_both("cpu", base, anchors, head, None, None, temps, False, backend="cpu"))


def zero_rank_case(kind, n, vocab=40, k=3, d=5):
    """A head of rank 0 (W1, W2 [V, 0]; Wg [0, d], Wj [0, d]): the bias is zero, so the logits are U."""
    g = torch.Generator().manual_seed(n)
    empty = torch.zeros(vocab, 0, dtype=torch.bfloat16)
    extra = {"gated": dict(wg=torch.zeros(0, d), bg=torch.zeros(0)),
             "rnn": dict(wj=torch.zeros(0, d), bj=torch.zeros(0))}.get(kind, {})
    head = dk.MarkovHead(kind, empty, empty, **extra)
    confidence = dk.ConfidenceHead(torch.randn(d, generator=g), 0.3)
    temps = torch.tensor([0.0, 0.8])[torch.arange(n) % 2]
    return (torch.randn(n, k, vocab, generator=g), torch.randint(0, vocab, (n,), generator=g), head,
            torch.randn(n, k, d, generator=g), confidence, temps)


def assert_zero_rank(ref, out, case):
    assert torch.equal(ref.logits, case[0])
    assert_matches(ref, out, *case[:4], case[5])


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("n", [2, 6])
def test_cuda_zero_rank(cuda_device, simt_check, kind, n):
    """Rank 0 for every head, on the CUDA-core (N = 2) and tensor-core (N = 6) sweeps: the reference's result."""
    case = zero_rank_case(kind, n)
    assert_zero_rank(*run_both(cuda_device, *case, True, backend="cuda", wrap=simt_check), case)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_zero_rank(kind, backend):
    case = zero_rank_case(kind, 3)
    dev = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    assert_zero_rank(*run_both(dev, *case, True, backend=backend), case)
