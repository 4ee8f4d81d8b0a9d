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
