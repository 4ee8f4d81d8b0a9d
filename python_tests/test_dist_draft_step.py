"""The CUDA kernel of ``dspark_dist::draft_step`` (csrc/include/dspark/dist_draft_step.cuh) against the reference
piece: one position of the Markov head on one vocabulary shard, through the SIMT harness on the CPU (or a GPU).

Winners (the global ids) equal exactly; the statistics and logits to 1e-5 (the dot products are summed in another
order). The sharded draft_block with this kernel on every rank is in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

import dspark_kernels.distributed as D
from dspark_kernels.distributed import layout as L
from dspark_kernels.distributed.local_draft import pack_key, unpack_id
from dspark_kernels.rng import make_rng_key

# (N, Vl, r, W2 dtype, vocab_start): one token, odd sizes, N above the 8-request tile, N above one 32-request tile
CASES = [(4, 1, 3, torch.float32, 0), (5, 300, 40, torch.bfloat16, 500), (3, 257, 7, torch.float16, 17),
         (12, 200, 16, torch.bfloat16, 1000), (37, 130, 9, torch.float32, 3)]


def step_inputs(n, local, r, dtype, seed):
    """U as a strided row of a [N, 2, Vl] tensor with a NaN, a +inf, a row of -inf and an argmax tied across the
    shard (the lowest id wins, across vocabulary chunks); v float32; W2 of ``dtype`` with a zero row at the tie."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, 2, local, generator=g) * 2).to(dtype)[:, 1]
    v, w2 = torch.randn(n, r, generator=g), torch.randn(local, r, generator=g).to(dtype)
    if local >= 3:
        base[0, local // 2] = float("nan")
        base[1, 1] = float("inf")
        w2[0] = w2[local - 1] = 0.0
        base[2 % n, 0] = base[2 % n, local - 1] = 40.0          # the tie: column 0 wins
    base[n - 1] = float("-inf")
    return base, v, w2


def assert_step_matches(out, ref, vocab_start, local):
    assert torch.equal(unpack_id(out[0]), unpack_id(ref[0]))
    ids = unpack_id(ref[0])
    assert bool(((ids >= vocab_start) & (ids < vocab_start + local)).all())
    assert torch.equal(L.slots_to_ids(out[1][:, L.DRAFT_ID]), ids)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-5, equal_nan=True)
    # the packed key is pack_key of the winner's key: its value to rounding, its id exactly
    value = lambda p: (p >> 32).to(torch.float64)
    assert torch.allclose(value(out[0]), value(ref[0]), rtol=0, atol=64), (out[0], ref[0])


@pytest.mark.parametrize("n,local,r,dtype,vocab_start", CASES)
def test_cuda_draft_step_matches_reference(cuda_device, simt_check, n, local, r, dtype, vocab_start):
    base, v, w2 = (t.to(cuda_device) for t in step_inputs(n, local, r, dtype, seed=local + n))
    key = make_rng_key(4, 9, cuda_device)
    temps = torch.tensor([0.0, 1.0, 0.6, 1.5] * n, device=cuda_device)[:n]
    for t, ret in ((None, True), (temps, True), (temps, False)):
        args = (base, v, w2, t, key, 3, vocab_start, ret)
        ref = D.ops.draft_step(*args, "reference")
        out = simt_check(lambda: D.ops.draft_step(*args, "cuda"))
        assert out[2].shape == ref[2].shape
        assert_step_matches(out, ref, vocab_start, local)


def test_cuda_draft_step_tie_and_special_rows_by_hand(cuda_device):
    """A shard of 5 tokens at vocab_start 10, v = 0 (logits = U): ties to the lowest id, NaN counts as -inf for the
    winner and sets BAD, +inf wins and sets BAD, an all -inf row picks its first id with (max, sum) = (-inf, 0)."""
    inf, nan = float("inf"), float("nan")
    base = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0],
                         [nan, 1.0, nan, 0.5, 1.0],
                         [0.0, inf, 1.0, 2.0, inf],
                         [-inf] * 5], device=cuda_device)
    v, w2 = torch.zeros(4, 2, device=cuda_device), torch.ones(5, 2, device=cuda_device)
    packed, stats, _ = D.ops.draft_step(base, v, w2, None, make_rng_key(0, 0, cuda_device), 0, 10, False, "cuda")
    assert unpack_id(packed).tolist() == [11, 11, 11, 10]
    assert stats[:, L.DRAFT_BAD].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert stats[:, L.DRAFT_MAX].tolist() == [3.0, 1.0, 2.0, -inf]
    torch.testing.assert_close(stats[0, L.DRAFT_SUM], torch.exp(base[0] - 3).sum())
    assert stats[3, L.DRAFT_SUM].item() == 0.0
    assert torch.equal(packed.cpu(), pack_key(torch.tensor([3.0, 1.0, inf, -inf]), torch.tensor([11, 11, 11, 10])))


def test_cuda_draft_step_reads_w2_once(cuda_device):
    """Two launches (sweep, merge). Every CTA reads its tile's v rows (N r 4 bytes, an L2 hit after the first); beyond
    that the traffic is within 1.1x of the floor (U, v and W2 once, the outputs), and the estimated DRAM traffic is
    too: at N = 40 (two 32-request tiles) the second tile's W2 reads come from L2."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    for n in (3, 40):
        base, v, w2 = step_inputs(n, 4099, 64, torch.bfloat16, seed=n)
        with simt.record(dram=True) as rec:
            out = D.ops.draft_step(base, v, w2, torch.ones(n), make_rng_key(1, 2, "cpu"), 0, 0, True, "cuda")
        assert [r["kernel"] for r in rec.launches] == ["dist_draft_step_sweep", "dist_draft_step_merge"]
        floor = nbytes(base, v, w2, *out)
        tiles, chunks = rec.launches[0]["grid"][:2]
        dram = sum(r["dram_bytes_read"] for r in rec.launches) + rec.bytes_written
        assert dram <= 1.1 * floor, (n, dram, floor, dram / floor)
        if tiles == 1:
            v_tiles = (chunks - 1) * nbytes(v)
            assert rec.bytes_read + rec.bytes_written <= 1.1 * floor + v_tiles, (n, rec.bytes_read, floor)


def test_cuda_draft_step_opcheck_and_bad_input(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("the opcheck's inputs are CPU tensors: the SIMT harness")
    key = make_rng_key(3, 1, "cpu")
    g = torch.Generator().manual_seed(0)
    base, v, w2 = torch.randn(3, 40, generator=g), torch.randn(3, 5, generator=g), torch.randn(40, 5, generator=g)
    for temps, ret in ((torch.tensor([0.0, 1.0, 0.5]), True), (None, False)):
        torch.library.opcheck(torch.ops.dspark_dist.draft_step.default, (base, v, w2, temps, key, 1, 7, ret, "cuda"))
    bad = [((base, v.double(), w2), "v must be Float"), ((base, v, w2[:39]), "w2_shard must have shape"),
           ((base.int(), v, w2), "base_logits_k must be float32"), ((base, v[:2], w2), r"v must have shape \[3, \*\]")]
    for (b, vv, ww), msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            D.ops.draft_step(b, vv, ww, None, key, 0, 0, False, "cuda")
    wide = torch.zeros(3, 8000)   # the shared v tile of 8 requests holds r <= (227 KB - the static part) / 32 B
    with pytest.raises(RuntimeError, match=r"v must have r in \[1, 71\d\d\] columns"):
        D.ops.draft_step(base, wide, torch.zeros(40, 8000), None, key, 0, 0, False, "cuda")
    with pytest.raises(RuntimeError, match=r"vocab_start \+ Vl\) = \[16777200, 16777240\)"):
        D.ops.draft_step(base, v, w2, None, key, 0, 2 ** 24 - 16, False, "cuda")
