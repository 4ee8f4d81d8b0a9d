"""Lossless sampling: the first generated tokens follow the target's own distribution (chi-square)."""

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels.decode.decoder import Scheduler, SpeculativeDecoder
from dspark_kernels.decode.testing import oracle_drafter, tiny_target
from stats import chi_square, passes


pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 6
PROMPT = [1, 2, 3, 0]


def last_logits(target, seq):
    target.alloc_cache(1, len(seq) + 1)
    toks = torch.tensor(seq)
    return target(toks, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32), len(seq),
                  len(seq)).logits[-1]


@pytest.mark.parametrize("temperature,k,method,reduced,top_k", [
    (1.0, 4, "token", False, None), (0.7, 2, "token", False, None), (1.0, 3, "block", False, None),
    (1.0, 3, "token", True, None), (0.8, 2, "block", True, None), (1.0, 3, "token", False, 3),
    (0.8, 2, "block", True, 2)])
def test_first_tokens_follow_target(temperature, k, method, reduced, top_k):
    """``reduced``: the drafter proposes over 4 of the 6 target ids (q is zero on the other two); ``top_k``: top-k
    Markov proposals (q is zero off each position's candidates)."""
    check_first_tokens(temperature, k, method, reduced, top_k)


def test_plain_steps_follow_target():
    """A drafting cost no draft can pay for, judged on every step: steps 0 and 1 draft (a flat cost table: every
    draft verified), the loss of step 0 is read at step 1, and step 2 runs the target alone for the requests still
    short of their three tokens. The joint law of tokens 2 and 3 is the target's."""
    target = tiny_target(seed=5, vocab=V, layers=3)
    with torch.no_grad():
        p1 = torch.softmax(last_logits(target, PROMPT), -1)
        p2 = torch.stack([torch.softmax(last_logits(target, PROMPT + [a]), -1) for a in range(V)])
        p3 = torch.stack([torch.stack([torch.softmax(last_logits(target, PROMPT + [a, b]), -1) for b in range(V)])
                          for a in range(V)])
    want = torch.einsum("a,ab,abc->bc", p1, p2, p3).reshape(-1).double()
    drafter = oracle_drafter(target, block_size=2, markov="gated", layer_ids=(0, 1), seed=7)
    drafter.set_reference([[int(p1.argmax())] * 16], wrong_every=1000, scale=2.5)
    n = 20000
    drafter.ref = drafter.ref.expand(n, -1)
    sched = Scheduler("exact", cost_table=dk.CostTable([1, 10 ** 6], [1.0, 1.0]), draft_cost=dk.CostTable([1], [1e6]),
                      draft_window=1)
    res = SpeculativeDecoder(target, drafter, seed=11).generate([PROMPT] * n, 3, temperature=1.0, scheduler=sched)
    assert res.stats.steps >= 3 and res.stats.draft_steps == 2  # step 2 and any after it: the target alone
    counts = torch.bincount(torch.tensor([t[1] * V + t[2] for t in res.tokens]), minlength=V * V).double()
    assert passes(counts, want * n), chi_square(counts, want * n)


def check_first_tokens(temperature, k, method, reduced, top_k, scheduler=None):
    target = tiny_target(seed=5, vocab=V, layers=3)
    with torch.no_grad():
        p1 = torch.softmax(last_logits(target, PROMPT) / temperature, -1)
        joint = torch.stack([p1[a] * torch.softmax(last_logits(target, PROMPT + [a]) / temperature, -1)
                             for a in range(V)]).reshape(-1)
    top = int(p1.argmax())
    ids = sorted([top] + [i for i in range(V) if i != top][1:4]) if reduced else None  # two ids left out
    # a drafter leaning towards one token (q far from p, many acceptances): a lossy verifier would show
    drafter = oracle_drafter(target, block_size=k, markov="gated", layer_ids=(0, 1), seed=7, draft_ids=ids)
    drafter.set_reference([[int(p1.argmax())] * 16], wrong_every=1000, scale=2.5)
    n = 20000
    drafter.ref = drafter.ref.expand(n, -1)
    dec = SpeculativeDecoder(target, drafter, seed=11, verify_method=method, draft_top_k=top_k)
    res = dec.generate([PROMPT] * n, 2, temperature=temperature, scheduler=scheduler)
    counts = torch.bincount(torch.tensor([t[0] * V + t[1] for t in res.tokens]), minlength=V * V).double()
    assert passes(counts, joint.double() * n), chi_square(counts, joint.double() * n)
    assert res.stats.acceptance_length > 1.2  # drafts do get accepted, so the rejection path is exercised
    # and a different seed gives different samples (the randomness is keyed by the seed)
    other = SpeculativeDecoder(target, drafter, seed=12, verify_method=method).generate([PROMPT] * 50, 2,
                                                                                         temperature=temperature)
    assert other.tokens != res.tokens[:50]
    return res.stats
