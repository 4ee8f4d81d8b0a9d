"""The CUDA kernel of ``dspark_dist::verify_stats`` (csrc/include/dspark/dist_verify_stats.cuh) against the reference
piece: one shard's part of the first exchange (StatsLayout), through the SIMT harness on the CPU (or a GPU).

Argmax values, every id and the candidates' order equal exactly; the other floats to rtol 1e-5, atol 1e-6 (sums in
another order, the log's rounding). The sharded verify_chain with this kernel on every rank is in
test_distributed.py."""

from __future__ import annotations

import pytest
import torch

import dspark_kernels.distributed as D
from dspark_kernels.distributed import layout as L
from dspark_kernels.rng import make_rng_key
from test_distributed import _packed, _stats_case_inputs

N, K = 4, 2
TEMPS = torch.tensor([0.0, 1.0, 0.7, 1.6])

# (Vl, vocab_start, V, dtype, packed, top_m): one token, fewer tokens than top_m, odd shards, a shard longer than two
# selection chunks (the buffer compacts), more candidates than threads
CASES = [(1, 999, 1000, torch.float32, False, 8), (5, 0, 1000, torch.bfloat16, True, 8),
         (333, 667, 1000, torch.float16, True, 8), (5000, 400, 5400, torch.float32, False, 8),
         (700, 100, 900, torch.bfloat16, False, 300)]


def assert_stats_match(out, ref, top_m, sampled, draft, case):
    lay = L.StatsLayout(sampled, draft, top_m)
    exact = [L.AMAX_VAL, L.AMAX_ID] + (list(range(lay.width))[lay.cand("id")] if lay.sampled else [])
    assert torch.equal(out[..., exact], ref[..., exact]), case
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{case}: {m}")


@pytest.mark.parametrize("local,start,vocab,dtype,packed,top_m", CASES)
def test_cuda_verify_stats_matches_reference(cuda_device, simt_check, local, start, vocab, dtype, packed, top_m):
    """Greedy, sampled (mixed greedy requests) with one-hot drafts and with draft rows; NaN, +inf, all -inf rows, a
    row of ties, drafts on and off the shard (_stats_case_inputs)."""
    target, draft, drafts = _stats_case_inputs(N, K, local, start, vocab, dtype, seed=local)
    cu = None
    if packed:
        target, cu = _packed(target, torch.tensor([K, 0, 1, K]))
    dev = lambda x: None if x is None else x.to(cuda_device)
    for t, d in ((None, None), (TEMPS, None), (TEMPS, draft)):
        args = (dev(target), dev(cu), dev(drafts), dev(d), dev(t), make_rng_key(6, 3, cuda_device), start, vocab,
                top_m)
        ref = D.ops.verify_stats(*args, "reference")
        out = simt_check(lambda: D.ops.verify_stats(*args, "cuda"))
        assert_stats_match(out, ref, top_m, t is not None, d is not None, (local, dtype, packed, t is not None))


def test_cuda_verify_stats_increasing_row(cuda_device):
    """A row in increasing order pushes a whole chunk into the selection buffer each time (a compaction per chunk):
    the candidates are still the last top_m ids, best first."""
    local, top_m = 6000, 16
    target = torch.arange(N * (K + 1) * local, dtype=torch.float32).view(N, K + 1, local).to(cuda_device) * 1e-3
    drafts = torch.zeros(N, K, dtype=torch.int64, device=cuda_device)
    args = (target, None, drafts, None, torch.full((N,), 1e-4, device=cuda_device),
            make_rng_key(1, 0, cuda_device), 0, local, top_m)
    ref, out = D.ops.verify_stats(*args, "reference"), D.ops.verify_stats(*args, "cuda")
    lay = L.StatsLayout(True, False, top_m)
    assert out[0, 0, lay.cand("id")].tolist() == list(range(local - 1, local - 1 - top_m, -1))
    assert_stats_match(out, ref, top_m, True, False, "increasing")


def test_cuda_verify_stats_reads_the_row_once(cuda_device):
    """One launch, one CTA per target row; the bytes within 1.05x of the rows (target and draft) plus the output."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    target, draft, drafts = _stats_case_inputs(N, K, 3000, 0, 3000, torch.bfloat16, seed=2)
    with simt.record() as rec:
        out = D.ops.verify_stats(target, None, drafts, draft, TEMPS, make_rng_key(0, 0, "cpu"), 0, 3000, 8, "cuda")
    assert len(rec.launches) == 1 and rec.launches[0]["ctas"] == N * (K + 1)
    floor = sum(x.numel() * x.element_size() for x in (target, draft, drafts, out))
    moved = rec.bytes_read + rec.bytes_written
    assert floor * 0.95 <= moved <= 1.05 * floor, (moved, floor)


def test_cuda_verify_stats_opcheck_and_bad_input(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("the opcheck's inputs are CPU tensors: the SIMT harness")
    g = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 100, (3, K), generator=g)
    clean = (torch.randn(3, K + 1, 40, generator=g), None, drafts, torch.randn(3, K, 40, generator=g), TEMPS[:3],
             make_rng_key(6, 3, "cpu"), 60, 100, 4, "cuda")             # opcheck compares NaN != NaN
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean)
    torch.library.opcheck(torch.ops.dspark_dist.verify_stats.default, clean[:4] + (None,) + clean[5:])
    for i, value, msg in ((8, 0, r"top_m must be in \[1, 2047\]"), (8, 2048, "top_m must be in"),
                          (3, clean[3][:, :1], "draft_logits_shard must have shape"),
                          (7, 90, r"must lie in \[0, vocab_size = 90\)"), (4, TEMPS[:2], "temperature must have")):
        wrong = list(clean[:-1])
        wrong[i] = value
        with pytest.raises(RuntimeError, match=msg):
            D.ops.verify_stats(*wrong, "cuda")
