"""dspark/mma_sync.cuh in the SIMT harness: ldmatrix (x1 / x2 / x4, .trans) and mma.sync m16n8k16 (bf16, fp16).

The lane layouts are checked bit for bit against the fragment tables of the PTX ISA, written out here from its
description (g = lane // 4, t = lane % 4), and the arithmetic against a float64 matrix product."""
import numpy as np
import pytest
import torch

from dspark_kernels import simt


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.setenv("DSPARK_SIMT", "1")
    return simt.module()


def run(m, name, words, variant, out_words=128):
    """One warp of self-test `name` on raw 32-bit input words; returns its output words (uint32)."""
    x = torch.from_numpy(np.ascontiguousarray(words, dtype=np.uint32).view(np.int32)).view(torch.float32)
    y = torch.zeros(max(out_words, 32))
    m.selftest(name, x, y, torch.zeros(8), 1, 32, variant)
    return y.view(torch.int32).numpy().view(np.uint32)


def bits16(t):
    """The 16-bit patterns of a bf16 / fp16 tensor, as uint32."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def pack(lo, hi):
    return (lo | (hi << 16)).astype(np.uint32)


# ------------------------------------------------------------------------------------------------ ldmatrix
def ldmatrix_table(rows, perm, num, trans):
    """What lane l holds in register i after ldmatrix (PTX ISA, "Matrix fragments for ldmatrix"): lane 8i + j
    supplies row j of matrix i; without .trans lane l gets elements (g, 2t) and (g, 2t + 1) of matrix i, with
    .trans elements (2t, g) and (2t + 1, g). rows: [32, 8] 16-bit patterns as staged; perm: staged row per lane."""
    want = np.zeros((32, 4), dtype=np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(num):
            mat = rows[perm[8 * i: 8 * i + 8]]  # matrix i, row j = the row lane 8i + j addressed
            want[lane, i] = pack(mat[2 * t, g], mat[2 * t + 1, g]) if trans else pack(mat[g, 2 * t], mat[g, 2 * t + 1])
    return want


def ldmatrix_input(seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 1 << 16, size=(32, 8), dtype=np.uint32)  # every element distinct with high probability
    perm = rng.permutation(32).astype(np.uint32)
    words = pack(rows[:, 0::2], rows[:, 1::2])  # [32, 4]: element 2q low, 2q + 1 high
    return rows, perm, np.concatenate([perm, words.reshape(-1)])


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_lane_layout_matches_the_isa_table(harness, num, trans):
    rows, perm, words = ldmatrix_input(seed=num * 2 + trans)
    got = run(harness, "ldmatrix", words, num | (8 if trans else 0)).reshape(32, 4)
    want = ldmatrix_table(rows, perm, num, trans)
    np.testing.assert_array_equal(got[:, :num], want[:, :num])
    assert not np.any(got[:, num:])  # nothing written beyond the count


def test_ldmatrix_table_can_fail(harness):
    """The check discriminates: .trans and plain differ, and a wrong row permutation is caught."""
    rows, perm, words = ldmatrix_input(seed=11)
    got = run(harness, "ldmatrix", words, 4).reshape(32, 4)
    assert not np.array_equal(got, ldmatrix_table(rows, perm, 4, True))
    assert not np.array_equal(got, ldmatrix_table(rows, np.roll(perm, 1), 4, False))


def test_ldmatrix_faults_on_misalignment_and_a_missing_lane(harness):
    _, _, words = ldmatrix_input(seed=3)
    with pytest.raises(RuntimeError, match=r"ldmatrix_kernel.*16-byte aligned"):
        run(harness, "ldmatrix", words, 4 | 16)
    with pytest.raises(RuntimeError, match=r"ldmatrix_kernel.*16-byte aligned"):
        run(harness, "ldmatrix", words, 1 | 16)  # lane 5 supplies a row in x1 too
    with pytest.raises(RuntimeError, match=r"ldmatrix_kernel.*lane"):
        run(harness, "ldmatrix", words, 2 | 32)


# ------------------------------------------------------------------------------------------------ mma.sync
def fragments(a, b, c):
    """Per-lane registers of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16" with 16-bit A / B and
    float32 C): a [16, 16] and b [16, 8] 16-bit tensors, c [16, 8] float32."""
    ab, bb = bits16(a), bits16(b)
    fa, fb, fc = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for q, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            fa[lane, q] = pack(ab[r, k], ab[r, k + 1])
        for q, k in enumerate([2 * t, 2 * t + 8]):
            fb[lane, q] = pack(bb[k, g], bb[k + 1, g])
        for q, (r, col) in enumerate(c_positions(lane)):
            fc[lane, q] = c[r, col]
    return np.concatenate([fa.reshape(-1), fb.reshape(-1), fc.reshape(-1).view(np.uint32)])


def c_positions(lane):
    """(row, column) of registers d[0..3] of lane `lane`: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)."""
    g, t = lane // 4, lane % 4
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def unfragment(words):
    d = words.view(np.float32).reshape(32, 4)
    out = np.full((16, 8), np.nan, dtype=np.float32)
    for lane in range(32):
        for q, (r, col) in enumerate(c_positions(lane)):
            out[r, col] = d[lane, q]
    return torch.from_numpy(out)


@pytest.mark.parametrize("dtype,variant", [(torch.bfloat16, 0), (torch.float16, 1)])
def test_mma_sync_fragments_match_the_isa_table(harness, dtype, variant):
    g = torch.Generator().manual_seed(variant)
    a, b = torch.randn(16, 16, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)
    c = torch.randn(16, 8, generator=g)
    d = unfragment(run(harness, "mma_sync", fragments(a, b, c), variant))
    want = a.double() @ b.double() + c.double()
    torch.testing.assert_close(d.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # small integers: every partial sum is exact in float32, so the result is too
    a, b = torch.randint(-8, 9, (16, 16), generator=g).to(dtype), torch.randint(-8, 9, (16, 8), generator=g).to(dtype)
    c = torch.randint(-100, 101, (16, 8), generator=g).float()
    d = unfragment(run(harness, "mma_sync", fragments(a, b, c), variant))
    assert torch.equal(d, (a.float() @ b.float() + c))
    # the table can fail: A's fragment read as its transpose gives another product
    d_t = unfragment(run(harness, "mma_sync", fragments(a.T.contiguous(), b, c), variant))
    assert not torch.equal(d_t, d)


def test_mma_sync_faults_on_a_missing_lane(harness):
    a, b, c = torch.ones(16, 16, dtype=torch.bfloat16), torch.ones(16, 8, dtype=torch.bfloat16), torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match=r"mma_sync_kernel.*lane"):
        run(harness, "mma_sync", fragments(a, b, c), 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("k", [16, 48])
def test_ldmatrix_then_mma_from_shared_memory(harness, dtype, b_trans, k):
    """A kernel's use: A row-major through ldmatrix x4, B as [n][k] rows (x2) or [k][n] rows (x2 .trans)."""
    g = torch.Generator().manual_seed(k + b_trans)
    a, b = torch.randn(16, k, generator=g).to(dtype).float(), torch.randn(k, 8, generator=g).to(dtype).float()
    x = torch.cat([torch.tensor([float(k)]), a.reshape(-1), b.reshape(-1)])
    variant = (1 if dtype == torch.float16 else 0) + (2 if b_trans else 0)
    with simt.record() as rec:
        words = run(harness, "mma_tile", x.numpy().view(np.uint32), variant)
    assert rec.launches[0]["mma"] == k // 16  # the harness counts one per warp-wide MMA
    d = torch.from_numpy(words[:128].view(np.float32).copy()).view(16, 8)
    want = a.double() @ b.double()
    torch.testing.assert_close(d.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
