"""The CUDA kernel of ``dspark_dist::verify_stats`` (csrc/include/dspark/dist_verify_stats.cuh) against the reference
piece: one shard's part of the first exchange (StatsLayout), through the SIMT harness on the CPU (or a GPU).

Argmax values and ids equal exactly; the other floats to rtol 1e-5, atol 1e-6 (sums in another order). The sharded
verify_chain with this kernel on every rank is in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

import dspark_kernels.distributed as D
from dspark_kernels.distributed import layout as L
from test_distributed import _packed, _stats_case_inputs

N, K = 4, 2
TEMPS = torch.tensor([0.0, 1.0, 0.7, 1.6])

# (Vl, vocab_start, V, dtype, packed): one token, a few, odd shards, a shard of several vocabulary chunks
CASES = [(1, 999, 1000, torch.float32, False), (5, 0, 1000, torch.bfloat16, True),
         (333, 667, 1000, torch.float16, True), (5000, 400, 5400, torch.float32, False)]


def assert_stats_match(out, ref, case):
    exact = [L.AMAX_VAL, L.AMAX_ID]
    assert torch.equal(out[..., exact], ref[..., exact]), case
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{case}: {m}")


@pytest.mark.parametrize("local,start,vocab,dtype,packed", CASES)
def test_cuda_verify_stats_matches_reference(cuda_device, simt_check, local, start, vocab, dtype, packed):
    """Greedy, sampled (mixed greedy requests) with one-hot drafts and with draft rows; NaN, +inf, all -inf rows, a
    row of ties, drafts on and off the shard (_stats_case_inputs)."""
    target, draft, drafts = _stats_case_inputs(N, K, local, start, vocab, dtype, seed=local)
    cu = None
    if packed:
        target, cu = _packed(target, torch.tensor([K, 0, 1, K]))
    dev = lambda x: None if x is None else x.to(cuda_device)  # noqa: E731
    for t, d in ((None, None), (TEMPS, None), (TEMPS, draft)):
        args = (dev(target), dev(cu), dev(drafts), dev(d), dev(t), start, vocab)
        ref = D.ops.verify_stats(*args, "reference")
        out = simt_check(lambda: D.ops.verify_stats(*args, "cuda"))
        assert_stats_match(out, ref, (local, dtype, packed, t is not None))


@pytest.mark.parametrize("local,start,vocab,dtype,packed", CASES)
def test_cuda_verify_stats_infinite_temperature(cuda_device, simt_check, local, start, vocab, dtype, packed):
    """T = inf beside T = 1 and greedy rows, finite logits (each scaled logit 0: p uniform over the row), shards whose
    rows end inside a batch of vector loads: the loads past a row's end take no part in the sums."""
    target, draft, drafts = _stats_case_inputs(N, K, local, start, vocab, dtype, seed=local)
    target, draft = (torch.nan_to_num(x.float(), nan=0.5, posinf=3.0, neginf=-3.0).to(dtype) for x in (target, draft))
    cu = None
    if packed:
        target, cu = _packed(target, torch.tensor([K, 0, 1, K]))
    temps = torch.tensor([float("inf"), 1.0, float("inf"), 0.0])
    dev = lambda x: None if x is None else x.to(cuda_device)  # noqa: E731
    for d in (None, draft):
        args = (dev(target), dev(cu), dev(drafts), dev(d), dev(temps), start, vocab)
        ref = D.ops.verify_stats(*args, "reference")
        out = simt_check(lambda: D.ops.verify_stats(*args, "cuda"))
        assert_stats_match(out, ref, (local, dtype, packed, d is not None))


def test_cuda_verify_stats_reads_the_row_once(cuda_device):
    """One launch of (row, chunk) CTAs, at N = 1 a CTA for every multiprocessor; the bytes within 1.05x of
    bench/floors.py's floor (the rows once, the drafts, the temperatures, the output); every line at the ideal
    sectors and shared-memory wavefronts."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import ideal_access
    from test_verify_chain import SMS, _floors
    g = torch.Generator().manual_seed(3)
    n, local = 1, 46000
    one = (torch.randn(n, K + 1, local, generator=g).bfloat16(), None, torch.randint(0, local, (n, K), generator=g),
           torch.randn(n, K, local, generator=g), torch.ones(n))
    target, draft, drafts = _stats_case_inputs(N, K, 3000, 0, 3000, torch.bfloat16, seed=2)
    for args in (one, (target, None, drafts, draft, TEMPS.clone().fill_(1.0))):
        n, local = args[0].shape[0], args[0].shape[-1]
        out, rec = ideal_access(lambda: D.ops.verify_stats(*args, 0, local, "cuda"))
        assert_stats_match(out, D.ops.verify_stats(*args, 0, local, "reference"), n)
        assert rec.kernels() == ["dist_verify_stats"]
        if n == 1:
            assert rec.ctas >= SMS, rec.ctas
        floor = _floors().dist_verify_stats(n, K, local, target_bytes=2, sampled=True,
                                            draft_logits_bytes=args[3].element_size()).total
        assert floor <= rec.bytes <= 1.05 * floor, (rec.bytes, floor)


def test_cuda_verify_stats_opcheck_and_bad_input(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("the opcheck's inputs are CPU tensors: the SIMT harness")
    g = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 100, (3, K), generator=g)
    clean = (torch.randn(3, K + 1, 40, generator=g), None, drafts, torch.randn(3, K, 40, generator=g), TEMPS[:3], 60,
             100, "cuda")                                                    # opcheck compares NaN != NaN
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean)
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean[:4] + (None,) + clean[5:])
    for i, value, msg in ((3, clean[3][:, :1], "draft_logits_shard must have shape"),
                          (6, 90, r"must lie in \[0, vocab_size = 90\)"), (4, TEMPS[:2], "temperature must have")):
        wrong = list(clean[:-1])
        wrong[i] = value
        with pytest.raises(RuntimeError, match=msg):
            D.ops.verify_stats(*wrong, "cuda")
