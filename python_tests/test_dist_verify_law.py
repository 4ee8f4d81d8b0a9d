"""Chi-square of the vocabulary-parallel verify_chain (``dspark_kernels.distributed``) through each backend's pieces.

One call of 2000 requests (test_verify_chain.one_call_case: every request the same target and draft rows, half at a
finite temperature and half at T = inf, where p is uniform), sharded over two ranks in permuted vocabulary order: the
tokens equal the unsharded reference's, and, continued from the target, follow the target's law at every position
(test_verify_chain.check_one_call_law). Every draft form the sharded op takes (dense rows with and without
draft_logprobs, one-hot drafts) under both rules.

The ranks are threads of this process in lock step (``LockstepGroup``): one runs at a time and each collective hands
the turn on, so the pieces run on any device, a GPU included (the spawned gloo groups of test_distributed.py hold
CPU tensors), and the SIMT harness and the Triton interpreter never run two ranks at once.
"""

from __future__ import annotations

import threading

import pytest
import torch

import dspark_kernels.distributed as D
from dspark_kernels.distributed.testing import shard_spans
from test_verify_chain import INF, check_one_call_law

SPANS = shard_spans([5, 7], order=[1, 0])          # V = 12: rank 1 holds [0, 7), rank 0 [7, 12)
TEMPS = (0.7, INF)
CASES = [("token", "dense", True), ("block", "onehot", False), ("block", "dense", False), ("token", "onehot", False)]


class LockstepGroup:
    """A process group of ``world`` threads: ``run(fn)`` calls ``fn(rank, group)`` on each (with ``all_gather``
    patched to ``group.all_gather``, as ``lockstep`` does). One rank runs at a time: a rank gives the turn up only
    inside a collective, and takes it back once every rank has posted its part. A rank that raises breaks the
    barrier, so the others raise too instead of waiting."""

    def __init__(self, world: int, timeout_s: float = 600.0):
        self.world = world
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.posted: dict = {}                       # (collective number, rank) -> tensor
        self.calls = [0] * world
        self.local = threading.local()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        rank = self.local.rank
        call = self.calls[rank]
        self.calls[rank] += 1
        self.posted[call, rank] = t.contiguous().clone()
        self.turn.release()
        try:
            self.barrier.wait()
        finally:
            self.turn.acquire()
        return torch.stack([self.posted[call, r] for r in range(self.world)])

    def run(self, fn) -> list:
        results, errors = [None] * self.world, [None] * self.world

        def body(rank):
            self.local.rank = rank
            with self.turn:
                try:
                    results[rank] = fn(rank, self)
                except BaseException as e:  # noqa: BLE001  (re-raised below, on the caller's thread)
                    errors[rank] = e
                    self.barrier.abort()
        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        raised = [e for e in errors if e is not None]
        if raised:
            raise next((e for e in raised if not isinstance(e, threading.BrokenBarrierError)), raised[0])
        return results


def sharded_verify(target, drafts, *, draft_logits=None, **kw):
    """dk.verify_chain's call as ``D.verify_chain`` on the ranks of SPANS (a ``LockstepGroup``), each rank given its
    slice of the logits; every rank's output equal. Needs ``all_gather`` patched (the ``lockstep`` fixture)."""
    vocab = target.shape[-1]

    def rank(r, group):
        start, size = SPANS[r]
        shard = lambda x: None if x is None else x[..., start:start + size]  # noqa: E731
        return D.verify_chain(shard(target), drafts, vocab_start=start, vocab_size=vocab, group=group,
                              draft_logits_shard=shard(draft_logits), **kw)
    outs = LockstepGroup(len(SPANS)).run(rank)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))
    return outs[0]


@pytest.fixture
def lockstep(monkeypatch):
    """``sharded_verify``, with the collectives of ``D.verify_chain`` going through its ``LockstepGroup``."""
    monkeypatch.setattr(D.comm, "all_gather", lambda t, group: group.all_gather(t))
    return sharded_verify


def test_lockstep_group_gathers_in_rank_order_and_raises_a_ranks_error():
    group = LockstepGroup(3)
    out = group.run(lambda rank, g: (g.all_gather(torch.tensor([rank])), g.all_gather(torch.tensor([10 * rank]))))
    assert all(torch.equal(a, torch.tensor([[0], [1], [2]])) and torch.equal(b, torch.tensor([[0], [10], [20]]))
               for a, b in out)

    def fail_on_one(rank, g):
        if rank == 1:
            raise ValueError("rank 1")
        return g.all_gather(torch.tensor([rank]))
    with pytest.raises(ValueError, match="rank 1"):
        LockstepGroup(3, timeout_s=30).run(fail_on_one)


@pytest.mark.parametrize("method,layout,use_logprobs", CASES)
def test_sharded_one_call_is_lossless(lockstep, method, layout, use_logprobs):
    """Null hypothesis: the sharded op's emitted tokens through the reference pieces, continued from the target,
    follow the target's law at every position, per temperature (T = inf: uniform)."""
    check_one_call_law("reference", method, layout, use_logprobs, 2000, seed=60 + CASES.index(
        (method, layout, use_logprobs)), against_reference=True, temps=TEMPS, verify=lockstep)


# one-hot drafts: their CUDA pieces equal the reference pieces exactly (test_distributed.py, every mode), whose law
# the test above holds; their law through the harness (a minute each in CI's slow leg) runs on a GPU only
CUDA_CASES = [pytest.param(*c, marks=pytest.mark.gpu) if c[1] == "onehot" else c for c in CASES]


@pytest.mark.harness_slow   # the stats pass through the SIMT harness: a CTA per (row, chunk) of every rank
@pytest.mark.parametrize("method,layout,use_logprobs", CUDA_CASES)
def test_sharded_one_call_is_lossless_with_the_cuda_pieces(lockstep, cuda_device, method, layout, use_logprobs):
    """Null hypothesis: as test_sharded_one_call_is_lossless, each rank's stats, decide and residual pieces through
    the CUDA kernels."""
    check_one_call_law("cuda", method, layout, use_logprobs, 2000, device=cuda_device, seed=60 + CASES.index(
        (method, layout, use_logprobs)), against_reference=True, temps=TEMPS, verify=lockstep)


@pytest.mark.gpu            # the Triton interpreter takes minutes for one call of 2000 requests
@pytest.mark.parametrize("method,layout,use_logprobs", CASES)
def test_sharded_one_call_is_lossless_with_the_triton_pieces(lockstep, triton_device, method, layout, use_logprobs):
    """Null hypothesis: as test_sharded_one_call_is_lossless, each rank's pieces through the Triton kernels."""
    check_one_call_law("triton", method, layout, use_logprobs, 2000, device=triton_device, seed=60 + CASES.index(
        (method, layout, use_logprobs)), against_reference=True, temps=TEMPS, verify=lockstep)


def test_sharded_law_detects_a_biased_merge(lockstep, monkeypatch):
    """The check has the power to fail on the sharded path: with one shard's residual race scores scaled down by
    1e-3 (so the correction rarely comes from [7, 12)), the reference pieces fail it on a case they pass."""
    case = ("token", "onehot", False)
    check_one_call_law("reference", *case, 2000, seed=70, temps=TEMPS, verify=lockstep)
    residual = D.ops.verify_residual

    def biased(*args):
        out = residual(*args)
        if args[7] == SPANS[0][0]:
            out[..., D.layout.RES_SCORE] *= 1e-3
        return out
    monkeypatch.setattr(D.ops, "verify_residual", biased)
    with pytest.raises(AssertionError, match="token"):
        check_one_call_law("reference", *case, 2000, seed=70, temps=TEMPS, verify=lockstep)
