"""``dspark_kernels.integrations.vllm.gpu_mrv2``: Model Runner v2's verification and DSpark Markov stage on dk,
called with the inputs MRv2 hands over (no vLLM needed: MRv2's own kernels are GPU-only)."""

from types import SimpleNamespace

import pytest
import torch

from dspark_kernels.decode.testing import chi_square, passes
from dspark_kernels.integrations.vllm import gpu_mrv2

V = 6


def mrv2_batch(target_rows, draft_logits, drafts, temperature, gen):
    """MRv2's ``rejection_sample`` arguments for requests with one draft each: rows ``[anchor, d_1]`` per request,
    request r in request state ``R - 1 - r``; ``target_rows`` float ``[R, 2, V]``, ``draft_logits`` ``[R, 1, V]``
    (by request) or None, ``drafts`` int ``[R]``, ``temperature`` float ``[R]`` (by request)."""
    r = target_rows.shape[0]
    state = torch.arange(r - 1, -1, -1)
    sampled = torch.zeros(r, 2, dtype=torch.int64)
    sampled[:, 1] = drafts
    by_state = torch.empty_like(temperature)
    by_state[state] = temperature
    cached = None
    if draft_logits is not None:
        cached = torch.empty_like(draft_logits)
        cached[state] = draft_logits
    return dict(target_logits=target_rows.reshape(2 * r, V), draft_logits=cached, draft_sampled=sampled.view(-1),
                cu_num_logits=torch.arange(0, 2 * r + 1, 2, dtype=torch.int32),
                pos=torch.arange(2 * r, dtype=torch.int64) + 10, idx_mapping=state.to(torch.int32),
                expanded_idx_mapping=state.repeat_interleave(2).to(torch.int32),
                expanded_local_pos=torch.arange(2).repeat(r).to(torch.int32), temperature=by_state,
                seed=torch.randint(0, 2 ** 62, (r,), generator=gen), num_speculative_steps=1)


def test_rejection_sample_reads_target_logits_after_temperature():
    """MRv2's target logits arrive divided by the temperature and its draft logits before it: the first token of a
    sampled request is distributed as softmax(target row), the draft drawn from softmax(draft row / T); greedy
    requests emit the target's argmax."""
    gen = torch.Generator().manual_seed(3)
    n, temp = 4000, 0.5
    z = torch.randn(2, V, generator=gen) * 1.5
    y = torch.randn(1, V, generator=gen) * 1.5
    p = torch.softmax(z[0] / temp, -1).double()
    q = torch.softmax(y[0] / temp, -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    temps = torch.full((n,), temp)
    temps[:100] = 0.0
    batch = mrv2_batch((z / torch.where(temps > 0, temps, 1.0).view(n, 1, 1)).expand(n, 2, V).contiguous(),
                       y.expand(n, 1, V).contiguous(), drafts, temps, gen)
    sampled, num_sampled = gpu_mrv2.rejection_sample(**batch)
    assert sampled.shape == (n, 2) and num_sampled.dtype == torch.int32
    greedy_first = torch.where(drafts[:100] == z[0].argmax(), drafts[:100], z[0].argmax())
    assert torch.equal(sampled[:100, 0], greedy_first)
    first = torch.bincount(sampled[100:, 0], minlength=V).double()
    expected = p * (n - 100)
    assert passes(first, expected), chi_square(first, expected)
    assert not passes(first, torch.softmax(z[0] / temp ** 2, -1).double() * (n - 100))


def test_rejection_sample_without_speculative_steps_emits_one_column():
    """With no speculative steps (one target row per request) the output is MRv2's ``[R, 1]``: each request's
    target sample (greedy: the argmax), one token each."""
    gen = torch.Generator().manual_seed(5)
    r = 3
    z = torch.randn(r, V, generator=gen)
    batch = mrv2_batch(torch.randn(r, 2, V, generator=gen), None, torch.zeros(r, dtype=torch.int64),
                       torch.zeros(r), gen)
    batch.update(target_logits=z, draft_sampled=torch.zeros(r, dtype=torch.int64), num_speculative_steps=0,
                 cu_num_logits=torch.arange(r + 1, dtype=torch.int32), pos=torch.arange(r, dtype=torch.int64),
                 expanded_idx_mapping=batch["idx_mapping"], expanded_local_pos=torch.zeros(r, dtype=torch.int32))
    sampled, num_sampled = gpu_mrv2.rejection_sample(**batch)
    assert sampled.shape == (r, 1)
    assert torch.equal(sampled[:, 0], z.argmax(-1)) and torch.equal(num_sampled, torch.ones(r, dtype=torch.int32))


def fake_speculator(gen, num_reqs=3, n_spec=4, d=5, rank=2, **overrides):
    """The parts of vLLM's ``DSparkSpeculator`` its ``_sample_sequential`` reads (greedy, full vocabulary)."""
    lm = torch.randn(V, d, generator=gen)
    markov = SimpleNamespace(markov_w1=SimpleNamespace(weight=torch.randn(V, rank, generator=gen)),
                             markov_w2=SimpleNamespace(weight=torch.randn(V, rank, generator=gen)))
    model = SimpleNamespace(compute_draft_logits=lambda h: h @ lm.T, draft_id_to_target_id=None,
                            logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
                            model=SimpleNamespace(markov_head=markov))
    spec = SimpleNamespace(model=model, _draft_topk=None, draft_logits=None, acceptance_estimator=None,
                           num_speculative_steps=n_spec, sample_indices=torch.arange(num_reqs * n_spec),
                           input_buffers=SimpleNamespace(input_ids=torch.randint(0, V, (num_reqs,), generator=gen)),
                           _anchor_idx=torch.arange(num_reqs), use_confidence_head=False,
                           draft_tokens=torch.full((num_reqs, n_spec), -7, dtype=torch.int64))
    for name, value in overrides.items():
        setattr(spec, name, value)
    return spec


@pytest.mark.parametrize("with_markov", [False, True])
def test_sample_sequential_is_vllms_greedy_markov_loop(with_markov):
    """Drafts: argmax of the base logits plus W2 W1[previous token]; confidence: sigmoid of the head over the hidden
    state (and the Markov embedding when ``with_markov``)."""
    gen = torch.Generator().manual_seed(4)
    spec = fake_speculator(gen, use_confidence_head=True, draft_token_confidence_probs=torch.zeros(3, 4))
    w, b = torch.randn(1, 5 + 2 * with_markov, generator=gen), torch.randn(1, generator=gen)
    spec.model.model.confidence_head = SimpleNamespace(proj=SimpleNamespace(weight=w, bias=b), with_markov=with_markov)
    hidden = torch.randn(12, 5, generator=gen)
    gpu_mrv2._sample_sequential(spec, 3, hidden)
    base = spec.model.compute_draft_logits(hidden).view(3, 4, V)
    markov = spec.model.model.markov_head
    prev = spec.input_buffers.input_ids
    for i in range(4):
        embed = markov.markov_w1.weight[prev]
        features = torch.cat([hidden.view(3, 4, 5)[:, i], embed], -1) if with_markov else hidden.view(3, 4, 5)[:, i]
        assert torch.allclose(spec.draft_token_confidence_probs[:, i], torch.sigmoid(features @ w[0] + b), atol=1e-5)
        prev = (base[:, i] + embed @ markov.markov_w2.weight.T).argmax(-1)
        assert torch.equal(spec.draft_tokens[:, i], prev)


def test_sample_sequential_leaves_what_it_does_not_model_to_vllm(monkeypatch):
    """Adaptive verification's acceptance estimator and a soft-capping logits processor: vLLM's own loop runs."""
    calls = []
    monkeypatch.setitem(gpu_mrv2._original, "_sample_sequential", lambda self, n, h: calls.append(n))
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 5, generator=gen)
    gpu_mrv2._sample_sequential(fake_speculator(gen, acceptance_estimator=object()), 3, hidden)
    capped = fake_speculator(gen)
    capped.model.logits_processor.soft_cap = 30.0
    gpu_mrv2._sample_sequential(capped, 3, hidden)
    assert calls == [3, 3]
    assert bool((capped.draft_tokens == -7).all())
