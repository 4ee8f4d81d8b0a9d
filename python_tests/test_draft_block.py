import pytest
import torch

import dspark_kernels as dk
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
def test_greedy_matches_explicit_formulas(kind):
    base, anchors, head, hidden, conf = make_case(kind)
    out = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True)
    tokens, logits, z, survival = explicit(base, anchors, head, hidden, conf)
    assert out.tokens.tolist() == tokens.tolist()
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.conf_logits, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.survival, survival, rtol=1e-5, atol=1e-6)
    assert out.tokens.dtype == torch.int64 and out.logits.dtype == torch.float32


def test_markov_head_changes_the_draft():
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


def test_confidence_without_sts_and_no_confidence():
    base, anchors, head, hidden, conf = make_case("gated")
    out = dk.draft_block(base, anchors, head, hidden=hidden, confidence=dk.ConfidenceHead(conf.weight.view(1, -1),
                                                                                         torch.tensor([0.3])))
    torch.testing.assert_close(out.survival, torch.cumprod(torch.sigmoid(out.conf_logits), -1))
    out = dk.draft_block(base, anchors, head, hidden=hidden)
    assert out.conf_logits is None and out.survival is None and out.logits is None


@pytest.mark.parametrize("temp", [0.6, 1.0])
def test_sampled_tokens_follow_corrected_softmax(temp):
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


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_python_zero_temperature_takes_the_greedy_only_path(backend):
    base, anchors, head, hidden, conf = make_case("rnn", n=4, vocab=40)
    a = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True, backend=backend)
    b = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, return_logits=True,
                       temperature=torch.zeros(4), backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_per_request_temperature_and_determinism():
    base, anchors, head, hidden, conf = make_case("vanilla", n=6, vocab=40)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.8, 0.0, 2.0])
    a = dk.draft_block(base, anchors, head, temperature=temps, seed=9, offset=2)
    b = dk.draft_block(base, anchors, head, temperature=temps, seed=torch.tensor(9), offset=torch.tensor([2]))
    greedy = dk.draft_block(base, anchors, head)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens[0::2], greedy.tokens[0::2])
    c = dk.draft_block(base[:1].expand(64, -1, -1), anchors[:1].expand(64), head, temperature=1.0, seed=9)
    assert len({tuple(t) for t in c.tokens.tolist()}) > 1   # requests draw independent noise


def test_nan_logits_and_tiny_shapes():
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


def test_half_precision_inputs_compute_in_float32():
    base, anchors, head, hidden, conf = make_case("gated")
    half = dk.MarkovHead("gated", head.w1.bfloat16(), head.w2.bfloat16(), head.wg.bfloat16(), head.bg.bfloat16())
    out = dk.draft_block(base.bfloat16(), anchors, half, hidden=hidden.bfloat16(), return_logits=True)
    ref_head = dk.MarkovHead("gated", *(w.bfloat16().float() for w in (head.w1, head.w2, head.wg, head.bg)))
    ref = dk.draft_block(base.bfloat16().float(), anchors, ref_head, hidden=hidden.bfloat16().float(),
                         return_logits=True)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logits, ref.logits)


def test_bad_input_names_the_argument():
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


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_opcheck(kind):
    base, anchors, head, hidden, conf = make_case(kind, n=2, k=3, vocab=9)
    args = (base, anchors, kind, head.w1, head.w2, head.wg, head.bg, head.wj, head.bj, hidden, conf.weight,
            torch.tensor(0.3), conf.sts_temperatures, torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), True,
            "reference")
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
        valid = (prev >= 0) & (prev < vocab)
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
        out.append(base[:, k] + v @ head.w2.T)
        prev = tokens[:, k]
    return torch.stack(out, 1)


def run_both(triton_device, base, anchors, head, hidden, confidence, temperature, return_logits, seed=7, offset=3):
    kw = dict(hidden=hidden if (head.kind != "vanilla" or confidence is not None) else None, confidence=confidence,
              temperature=temperature, seed=seed, offset=offset, return_logits=return_logits)
    ref = dk.draft_block(base, anchors, head, backend="reference", **kw)
    move = lambda x: x.to(triton_device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    dev_head = dk.MarkovHead(head.kind, *(move(w) for w in (head.w1, head.w2, head.wg, head.bg, head.wj, head.bj)))
    dev_conf = None if confidence is None else dk.ConfidenceHead(
        *(move(x) for x in (confidence.weight, confidence.bias, confidence.sts_temperatures)))
    out = dk.draft_block(move(base), move(anchors), dev_head, backend="triton",
                         **{**kw, "hidden": move(kw["hidden"]), "confidence": dev_conf,
                            "temperature": move(temperature)})
    return ref, type(out)(*(None if t is None else t.cpu() for t in out))


def assert_matches(ref, out, base, anchors, head, hidden):
    assert out.tokens.dtype == torch.int64 and torch.equal(out.tokens, ref.tokens)
    for name in ("logits", "conf_logits", "survival"):
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == torch.float32 and a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
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
    assert_matches(ref, out, base, anchors, head, hidden)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_triton_gpu_tiles_match_reference(triton_device, kind, monkeypatch):
    """The GPU's register-sized tiles (several V, r and d blocks per position) on the interpreter too."""
    from dspark_kernels.triton import draft_block as triton_draft_block
    monkeypatch.setattr(triton_draft_block, "_TILE_INTERPRET", triton_draft_block._TILE)
    case = make_triton_case(kind, 2, 3, 300, 70, 150, torch.float32, "mixed", "sts", seed=5)
    ref, out = run_both(triton_device, *case, True)
    assert_matches(ref, out, *case[:4])


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


def test_triton_opcheck_and_distinct_outputs(triton_device):
    base, anchors, head, hidden, confidence, _ = make_triton_case("rnn", 2, 3, 9, 4, 5, torch.float32,
                                                                  "greedy", "none")
    dev = lambda x: x.to(triton_device)  # noqa: E731
    args = (dev(base), dev(anchors), "rnn", dev(head.w1), dev(head.w2), None, None, dev(head.wj), dev(head.bj),
            dev(hidden), None, None, None, dev(torch.tensor([0.0, 1.0])), dev(torch.tensor([1, 2])), False, "triton")
    tokens, logits, conf, survival = torch.ops.dspark.draft_block.default(*args)
    assert tokens.shape == (2, 3) and logits.shape == conf.shape == survival.shape == (0,)
    assert len({id(t) for t in (tokens, logits, conf, survival)}) == 4
    torch.library.opcheck(torch.ops.dspark.draft_block.default, args)
