"""``dspark_kernels.integrations.flashinfer.chain_speculative_sampling``: FlashInfer's signature and output contract
on dk.verify_chain (no FlashInfer installed): exact cases by hand, the counters, keys, errors, and a chi-square test
of the lossless property."""

import pytest
import torch

from dspark_kernels.decode.testing import chi_square, passes
from dspark_kernels.integrations.flashinfer import chain_speculative_sampling

V = 6


def one_hot_probs(tokens, sharp=1.0):
    """float32 ``[len, V]``: all mass on each token (``sharp`` = 1), or ``sharp`` on it and the rest spread."""
    p = torch.full((len(tokens), V), (1 - sharp) / (V - 1))
    p[torch.arange(len(tokens)), torch.tensor(tokens)] = sharp
    return p


def test_all_accepted_then_bonus():
    target = one_hot_probs([2, 4, 1]).unsqueeze(0)
    draft = one_hot_probs([2, 4], sharp=0.5).unsqueeze(0)
    out, acc, emitted = chain_speculative_sampling(draft, torch.tensor([[2, 4]], dtype=torch.int32), target, seed=3,
                                                   offset=0)
    assert out.dtype == torch.int32 and out.tolist() == [[2, 4, 1]]
    assert acc.tolist() == [2] and emitted.tolist() == [2]


def test_rejection_emits_from_the_residual_and_pads():
    # d_0 = 3 has no target mass: rejected, the correction is the target's only token 5; d_1 would pass on its own
    target = one_hot_probs([5, 0, 1]).unsqueeze(0)
    draft = one_hot_probs([3, 0], sharp=0.9).unsqueeze(0)
    out, acc, emitted = chain_speculative_sampling(draft, torch.tensor([[3, 0]]), target, seed=1, offset=2)
    assert out.tolist() == [[5, -1, -1]]
    assert emitted.tolist() == [0]
    assert acc.tolist() == [1]  # counted independently: d_1 passes its own test


def test_counters_accumulate_in_place():
    target = one_hot_probs([2, 4, 1]).repeat(3, 1, 1)
    draft = one_hot_probs([2, 4]).repeat(3, 1, 1)
    acc = torch.tensor([10, 0, 5], dtype=torch.int32)
    emitted = torch.tensor([1, 1, 1], dtype=torch.int32)
    _, a, e = chain_speculative_sampling(draft, torch.tensor([[2, 4]] * 3), target, acc, emitted, seed=0, offset=0)
    assert a is acc and e is emitted
    assert acc.tolist() == [12, 2, 7] and emitted.tolist() == [3, 3, 3]


def test_key_determinism_and_generator():
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(64, 4, V, generator=gen), -1)
    draft = torch.softmax(torch.randn(64, 3, V, generator=gen), -1)
    tokens = torch.multinomial(draft.view(-1, V), 1, generator=gen).view(64, 3)
    a = chain_speculative_sampling(draft, tokens, target, seed=7, offset=3)[0]
    assert torch.equal(a, chain_speculative_sampling(draft, tokens, target, seed=7, offset=3)[0])
    assert not torch.equal(a, chain_speculative_sampling(draft, tokens, target, seed=8, offset=3)[0])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(chain_speculative_sampling(draft, tokens, target, generator=g1)[0],
                       chain_speculative_sampling(draft, tokens, target, generator=g2)[0])


def test_bad_input_names_the_argument():
    draft, target = torch.rand(2, 3, V), torch.rand(2, 4, V)
    with pytest.raises(ValueError, match="target_probs"):
        chain_speculative_sampling(draft, torch.zeros(2, 3, dtype=torch.int32), torch.rand(2, 3, V))
    with pytest.raises(ValueError, match="draft_probs"):
        chain_speculative_sampling(torch.rand(2, 2, V), torch.zeros(2, 3, dtype=torch.int32), target)
    with pytest.raises(ValueError, match="seed"):
        chain_speculative_sampling(draft, torch.zeros(2, 3, dtype=torch.int32), target,
                                   seed=torch.tensor([1, 2]), offset=0)


def test_chi_square_lossless():
    """First output ~ target row 0; the output after an accepted first draft ~ target row 1."""
    gen = torch.Generator().manual_seed(21)
    n = 6000
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.3, -1)
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.3, -1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(2)], 1)
    out, acc, emitted = chain_speculative_sampling(q.expand(n, 2, V), drafts, p.expand(n, 3, V), seed=11, offset=0)
    first = torch.bincount(out[:, 0].long(), minlength=V).double()
    assert passes(first, p[0].double() * n), chi_square(first, p[0].double() * n)
    assert not passes(first, q[0].double() * n)  # the draft distribution is far from the target's
    kept = emitted >= 1
    second = torch.bincount(out[kept, 1].long(), minlength=V).double()
    m = second.sum()
    assert m > 300 and passes(second, p[1].double() * m), chi_square(second, p[1].double() * m)
    assert bool((acc >= emitted).all()) and bool((emitted <= 2).all())
    # expected acceptance of the first draft: sum_x min(p, q)
    rate = (emitted >= 1).double().mean().item()
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 5 * (0.25 / n) ** 0.5
