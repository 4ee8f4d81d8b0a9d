"""The CUDA kernel of ``dspark_dist::verify_residual`` (csrc/include/dspark/dist_verify_residual.cuh) against the
reference piece: the residual's mass and race winner and the race over p over one vocabulary shard for the planned
rows, through the SIMT harness on the CPU (or a GPU).

Winners (global ids) and the NEED-cleared slots equal exactly; masses and scores to 1e-5 (sums in another order). The
sharded verify_chain with this kernel on every rank is in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

import dspark_kernels.distributed as D
from dspark_kernels.distributed import layout as L
from dspark_kernels.rng import make_rng_key
from test_distributed import _packed, verify_inputs

VOCAB, N, K, START, SIZE = 700, 6, 3, 200, 301
SHARDS = torch.tensor([[0, 200], [200, 301], [501, 199]])


def planned_case(method, draft, packed, dtype, device, special=True):
    """The decide step's plan for one mode (every slot's NEED set but one, a row out of range), and the shard; with
    ``special`` a NaN target row and a draft row with +inf (so q is NaN there)."""
    inp = verify_inputs(N, K, VOCAB, seed=8)
    if special:
        inp["target"][2, 1, 250] = float("nan")
        inp["draft"][4, 0, 300] = float("inf")
    key = make_rng_key(2, 5, "cpu")
    target, cu = inp["target"].to(dtype), None
    if packed:
        target, cu = _packed(target, torch.arange(N) % (K + 1))
    dr = inp["draft"].to(dtype) if draft else None
    stats = torch.stack([D.ops.verify_stats(target[..., a:a + b], cu, inp["drafts"], None if dr is None else
                                            dr[..., a:a + b], inp["temps"], a, VOCAB, "reference")
                         for a, b in SHARDS.tolist()])
    plan = D.ops.verify_decide(stats, SHARDS, None, cu, target.shape[0] if packed else 0, inp["drafts"], None, None,
                               None, None, inp["temps"], key, None, method, draft, VOCAB, "reference")[3]
    plan[..., L.PLAN_NEED] = 1.0              # every slot, so the comparison covers every row ...
    plan[1, 0, L.PLAN_NEED] = 0.0             # ... but one
    plan[0, -1, L.PLAN_ROW] = K + 5.0         # a row past the end reads row K (clamped)
    sl = lambda x: None if x is None else x[..., START:START + SIZE].to(device)
    return (sl(target), None if cu is None else cu.to(device), inp["drafts"].to(device), sl(dr), plan.to(device),
            inp["temps"].to(device), key.to(device), START, VOCAB)


@pytest.mark.parametrize("method,draft,packed,dtype", [("token", True, False, torch.float32),
                                                       ("block", True, True, torch.bfloat16),
                                                       ("block", False, False, torch.float16),
                                                       ("token", False, True, torch.float32)])
def test_cuda_verify_residual_matches_reference(cuda_device, simt_check, method, draft, packed, dtype):
    args = planned_case(method, draft, packed, dtype, cuda_device)
    ref = D.ops.verify_residual(*args, "reference")
    out = simt_check(lambda: D.ops.verify_residual(*args, "cuda"))
    assert torch.equal(out[..., [L.RES_ID, L.RES_GID]], ref[..., [L.RES_ID, L.RES_GID]]), (method, draft, packed)
    assert out[1, 0].tolist() == [0.0, float("-inf"), float(L.EMPTY_ID), float("-inf"), float(L.EMPTY_ID)]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_cuda_verify_residual_by_hand(cuda_device):
    """Shard [10, 14) of V = 20, T = 1, one-hot draft 12 at rho = 1: p over the shard's 4 tokens from merged
    statistics (m = 0, s = 8), q = 1 at the draft, so w = p off the draft and 0 on it; mass = 3 / 8."""
    target = torch.zeros(1, 2, 4, device=cuda_device)
    plan = torch.zeros(1, 1, L.PLAN_WIDTH, device=cuda_device)
    plan[0, 0, L.PLAN_NEED], plan[0, 0, L.PLAN_RHO], plan[0, 0, L.PLAN_T_SUM] = 1.0, 1.0, 8.0
    args = (target, None, torch.tensor([[12]], device=cuda_device), None, plan, torch.ones(1, device=cuda_device),
            make_rng_key(7, 0, cuda_device), 10, 20)
    out = D.ops.verify_residual(*args, "cuda")
    assert out[0, 0, L.RES_MASS].item() == pytest.approx(3 / 8, rel=1e-6)
    assert out[0, 0, L.RES_ID].item() in (10.0, 11.0, 13.0)
    assert torch.equal(out, D.ops.verify_residual(*args, "reference"))


def test_cuda_verify_residual_reads_only_planned_rows(cuda_device):
    """One launch of (slot, chunk) CTAs; a slot not needed reads nothing; the bytes within 1.05x of the needed target
    and draft rows (the plan, the partials, the output); every line at the ideal sectors and wavefronts."""
    if cuda_device.type != "cpu":
        pytest.skip("counts come from the SIMT harness")
    from access import ideal_access
    n, k, local = 4, 3, 5000
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(n, k + 1, local, generator=g).bfloat16(), torch.randn(n, k, local, generator=g)
    plan = torch.zeros(n, k, L.PLAN_WIDTH)
    plan[..., L.PLAN_ROW] = torch.arange(k).float()
    plan[..., L.PLAN_RHO], plan[..., L.PLAN_T_SUM], plan[..., L.PLAN_Q_SUM] = 0.5, float(local), float(local)
    plan[:2, :, L.PLAN_NEED] = 1.0                       # requests 0 and 1 only
    args = (target, None, torch.zeros(n, k, dtype=torch.int64), draft, plan, torch.ones(n), make_rng_key(1, 1, "cpu"),
            0, local)
    out, rec = ideal_access(lambda: D.ops.verify_residual(*args, "cuda"))
    assert rec.kernels() == ["dist_verify_residual"]
    rows = 2 * k * local * (target.element_size() + draft.element_size())
    assert rows <= rec.bytes_read <= 1.05 * rows + 4 * plan.numel() * 4 + 64 * 1024, (rec.bytes_read, rows)
    ref = D.ops.verify_residual(*args, "reference")
    assert torch.equal(out[..., [L.RES_ID, L.RES_GID]], ref[..., [L.RES_ID, L.RES_GID]])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_cuda_verify_residual_opcheck_and_bad_input(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("the opcheck's inputs are CPU tensors: the SIMT harness")
    args = planned_case("block", True, False, torch.float32, cuda_device, special=False)   # opcheck: NaN != NaN
    torch.library.opcheck(torch.ops.dspark_dist.verify_residual.default, args + ("cuda",))
    bad = [((4, args[4][..., :8]), "plan must have shape"), ((5, args[5].double()), "temperature must be Float"),
           ((0, args[0][:, :2]), "target_shard must have shape"), ((8, 400), r"must lie in \[0, vocab_size = 400\)")]
    for (i, value), msg in bad:
        wrong = list(args)
        wrong[i] = value
        with pytest.raises(RuntimeError, match=msg):
            D.ops.verify_residual(*wrong, "cuda")
