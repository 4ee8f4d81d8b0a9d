"""The CUDA kernel of ``dspark_dist::draft_step`` (csrc/include/dspark/dist_draft_step.cuh) against the reference
piece: one position of the Markov head on one vocabulary shard, through the SIMT harness on the CPU (or a GPU).

Winners (the global ids) equal exactly; the statistics and logits to 1e-5, or with a 16-bit W2 on the tensor-core path
(N > 4) to 2^-15 of max sum |W2| |v| (the float32 v rows are split into hi + lo rows of W2's type: 16 significant bits
of v with bf16, 22 with fp16). The sharded draft_block with this kernel on every rank is in test_distributed.py."""

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


def bias_tolerance(v, w2):
    """The stated bound on the bias W2 v: 1e-5, or on the tensor-core path (N > 4, 16-bit W2) 2^-15 of the largest
    sum |W2| |v| (the split of v into hi + lo rows of W2's type)."""
    if v.shape[0] <= 4 or w2.dtype == torch.float32:
        return 1e-5
    return max(1e-5, 2.0 ** -15 * float((v.abs().float() @ w2.float().abs().T).max()))


def assert_step_matches(out, ref, vocab_start, local, atol=1e-5):
    assert torch.equal(unpack_id(out[0]), unpack_id(ref[0]))
    ids = unpack_id(ref[0])
    assert bool(((ids >= vocab_start) & (ids < vocab_start + local)).all())
    assert torch.equal(L.slots_to_ids(out[1][:, L.DRAFT_ID]), ids)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=atol, equal_nan=True)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=atol, equal_nan=True)
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
        assert_step_matches(out, ref, vocab_start, local, bias_tolerance(v.cpu(), w2.cpu()))


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


@pytest.mark.parametrize("n", [3, 40])
def test_cuda_draft_step_reads_w2_once(cuda_device, n):
    """Two launches (the draft_block position sweep on CUDA cores at N = 3 or tensor cores at N = 40, one CTA a slice
    for all 40 requests, then the merge), and the estimated DRAM traffic within 1.05x of the floor: U, v and W2 once,
    the outputs, and the per-(CTA, request) partials (24 bytes each, written and read once). The harness's device has
    4 SMs here, so that the slices stand to Vl about as on a 132-SM GPU at Vl = 151936 / 4."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from dspark_kernels import simt
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    base, v, w2 = step_inputs(n, 4099, 64, torch.bfloat16, seed=n)
    with simt.record(dram=True, sm_count=4) as rec:
        out = D.ops.draft_step(base, v, w2, torch.ones(n), make_rng_key(1, 2, "cpu"), 0, 0, True, "cuda")
    sweep = "dist_draft_step_sweep[mma]" if n > 4 else "dist_draft_step_sweep[gemv]"
    assert [r["kernel"] for r in rec.launches] == [sweep, "dist_draft_step_merge"]
    assert [r["pdl"] for r in rec.launches] == [False, True]
    lanes, slices = rec.launches[0]["grid"][:2]
    assert lanes == 1
    floor = nbytes(base, v, w2, *out) + 2 * 24 * n * slices
    assert rec.dram_bytes <= 1.05 * floor, (n, rec.dram_bytes, floor, rec.dram_bytes / floor)


@pytest.mark.parametrize("n,dtype", [(3, torch.float32), (5, torch.bfloat16), (40, torch.float16)])
def test_cuda_draft_step_ideal_access(cuda_device, n, dtype):
    """Both launches at the access rule (python_tests/access.py): no shared-memory bank conflict (the v rows held
    in registers on CUDA cores, no shared v tile to read across requests), global sectors within 1.05x of the ideal
    line by line (U and the logits staged a request row at a time, the partials as [slice][request] records)."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import ideal_access
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, 1024, generator=g).to(dtype)
    v, w2 = torch.randn(n, 64, generator=g), torch.randn(1024, 64, generator=g).to(dtype)
    temps = torch.tensor([0.0, 1.0, 0.6, 1.5] * n)[:n]
    out, rec = ideal_access(lambda: D.ops.draft_step(base, v, w2, temps, make_rng_key(1, 2, "cpu"), 2, 1024, True,
                                                     "cuda"))
    ref = D.ops.draft_step(base, v, w2, temps, make_rng_key(1, 2, "cpu"), 2, 1024, True, "reference")
    assert_step_matches(out, ref, 1024, 1024, bias_tolerance(v, w2))
    assert len(rec.launches) == 2


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
    wide = torch.zeros(1, 2 ** 20 + 1)   # the rank is at most 2^20
    with pytest.raises(RuntimeError, match=r"v must have r in \[1, 1048576\] columns"):
        D.ops.draft_step(torch.zeros(1, 1), wide, torch.zeros(1, 2 ** 20 + 1), None, key, 0, 0, False, "cuda")
    with pytest.raises(RuntimeError, match=r"vocab_start \+ Vl\) = \[16777200, 16777240\)"):
        D.ops.draft_step(base, v, w2, None, key, 0, 2 ** 24 - 16, False, "cuda")
