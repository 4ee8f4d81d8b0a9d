"""dk.schedule_verify_lens: the paper's Appendix A case, Algorithm 1 against a loop, argmax/budget/min_gain by hand."""

import math
import os

import pytest
import torch

import dspark_kernels as dk

F32 = torch.float32

# The paper's Appendix A cost table: SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45
APPENDIX_TABLE = dk.CostTable([1, 2, 3], [1000.0, 2000.0, 1000.0 / 0.45])
# time(B) = 9 + B ms: SPS(B) = 1000 / (9 + B); admitting survival a raises Theta iff a > tau / (B + 9)
LINEAR_TABLE = dk.CostTable([1, 100], [10.0, 109.0])


def sched(survival, table=APPENDIX_TABLE, **kw):
    return dk.schedule_verify_lens(torch.tensor(survival, dtype=F32), cost_table=table, **kw)


# --- the paper's Appendix A -------------------------------------------------------------------------------------

@pytest.mark.parametrize("survival,exact_len,argmax_len,argmax_theta", [
    ([[0.8, 0.72]], 0, 2, 2.52 * 0.45),  # first draft A: second confidence 0.9
    ([[0.8, 0.0]], 0, 0, 1.0),           # first draft B: second confidence 0
])
def test_appendix_a(host_backend, survival, exact_len, argmax_len, argmax_theta):
    o = sched(survival, mode="exact")
    assert o.verify_lens.dtype == torch.int32 and o.cu_seqlens.dtype == torch.int32
    assert o.theta.dtype == F32 and o.theta.shape == ()
    assert o.verify_lens.tolist() == [exact_len]
    assert o.cu_seqlens.tolist() == [0, 1 + exact_len]
    assert o.theta.item() == pytest.approx(1.0)  # verify nothing: tau = 1, SPS(1) = 1
    o = sched(survival, mode="argmax")
    assert o.verify_lens.tolist() == [argmax_len]
    assert o.cu_seqlens.tolist() == [0, 1 + argmax_len]
    assert o.theta.item() == pytest.approx(argmax_theta, rel=1e-6)


def _first_token_counts(mode, n=20000, seed=1234):
    """Draft d1, d2 ~ (0.5, 0.5); the schedule sees survival [0.8, 0.72] after A = 0, [0.8, 0] after B = 1."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, 2, (n, 2), generator=g)
    lens = {}
    for tok, surv in ((0, [[0.8, 0.72]]), (1, [[0.8, 0.0]])):
        lens[tok] = sched(surv, mode=mode).verify_lens  # [1], one schedule per first-draft value
    verify_lens = torch.where(draft[:, 0] == 0, lens[0].expand(n), lens[1].expand(n))
    target = torch.log(torch.tensor([0.7, 0.3])).expand(n, 3, 2).contiguous()
    draft_logits = torch.log(torch.tensor([0.5, 0.5])).expand(n, 2, 2).contiguous()
    out = dk.verify_chain(target, draft, draft_logits=draft_logits, verify_lens=verify_lens, temperature=1.0,
                          seed=seed, method="token")
    first = out.tokens[:, 0]
    assert bool(((first == 0) | (first == 1)).all())
    return int((first == 0).sum()), n


@pytest.mark.parametrize("mode,p_a", [("exact", 0.7), ("argmax", 0.85)])
def test_appendix_a_monte_carlo(mode, p_a):
    """Exact mode is lossless (the first token follows the target, (0.7, 0.3)); argmax is not ((0.85, 0.15))."""
    count_a, n = _first_token_counts(mode)
    z = (count_a - n * p_a) / math.sqrt(n * p_a * (1 - p_a))
    assert abs(z) < 4.5, (mode, count_a / n, p_a, z)
    other = 0.85 if p_a == 0.7 else 0.7  # and the other distribution is clearly rejected
    z_other = (count_a - n * other) / math.sqrt(n * other * (1 - other))
    assert abs(z_other) > 10


# --- Algorithm 1 against a loop ---------------------------------------------------------------------------------

def brute_force(survival, table, min_len, max_len, mode):
    """Algorithm 1 (and the argmax form) written as plain loops over Python floats."""
    n = len(survival)
    a = []
    for row in survival:
        run, out = 1.0, []
        for x in row:
            x = 0.0 if math.isnan(x) else min(max(x, 0.0), 1.0)
            run = min(run, x)
            out.append(run)
        a.append(out)
    lens = [min_len] * n
    b = n * (1 + min_len)
    tau = sum(1.0 + sum(a[r][:min_len]) for r in range(n))
    cands = [(r, j) for r in range(n) for j in range(min_len + 1, max_len + 1)]
    cands.sort(key=lambda c: (-a[c[0]][c[1] - 1], c[0], c[1]))
    theta = tau * table.sps(b)
    if mode == "exact":
        for r, j in cands:
            new = (tau + a[r][j - 1]) * table.sps(b + 1)
            if not new > theta:
                break
            lens[r], b, tau, theta = j, b + 1, tau + a[r][j - 1], new
        return lens, theta
    thetas = [theta]
    for r, j in cands:
        b, tau = b + 1, tau + a[r][j - 1]
        thetas.append(tau * table.sps(b))
    best = max(range(len(thetas)), key=lambda m: (thetas[m], -m))
    for r, j in cands[:best]:
        lens[r] = max(lens[r], j)
    return lens, thetas[best]


TABLES = [
    dk.CostTable([1, 8, 32, 128], [10.0, 10.5, 14.0, 40.0]),
    dk.CostTable([1, 4, 16], [5.0, 9.0, 30.0], fixed_overhead_ms=3.0),
    LINEAR_TABLE,
    dk.CostTable([1], [10.0]),  # constant cost: zero-survival admissions tie (exact mode must not take them)
]


@pytest.mark.parametrize("mode", ["exact", "argmax"])
@pytest.mark.parametrize("seed", range(6))
def test_against_brute_force(host_backend, mode, seed):
    g = torch.Generator().manual_seed(seed)
    for n, k in ((1, 1), (3, 5), (7, 7), (13, 16)):
        for table in TABLES:
            for quantised in (False, True):
                conf = torch.rand(n, k, generator=g) * 0.8 + 0.2
                surv = torch.cumprod(conf, dim=1)
                if quantised:  # many exact ties: checks the (r, j) tie order
                    surv = (torch.rand(n, k, generator=g) * 4).round() / 4
                if seed % 2:  # a non-monotone, out-of-range survival with NaN
                    surv[0, -1] = float("nan")
                    surv[-1, 0] = 1.5
                min_len = int(torch.randint(0, k + 1, (1,), generator=g))
                max_len = int(torch.randint(min_len, k + 1, (1,), generator=g))
                o = dk.schedule_verify_lens(surv, cost_table=table, min_len=min_len, max_len=max_len, mode=mode)
                lens, theta = brute_force(surv.double().tolist(), table, min_len, max_len, mode)
                assert o.verify_lens.tolist() == lens, (n, k, min_len, max_len, quantised)
                assert o.theta.item() == pytest.approx(theta, rel=1e-5)
                cu = [0]
                for x in lens:
                    cu.append(cu[-1] + 1 + x)
                assert o.cu_seqlens.tolist() == cu


def test_exact_stops_at_first_non_improvement(host_backend):
    # LINEAR_TABLE, B0 = 2, tau0 = 2; order 1.0 (r1 j1), 1.0 (r1 j2), 0.05 (r0 j1), 0.05 (r0 j2):
    # Theta_m = 1000 * tau / (9 + B) = 2/11, 3/12, 4/13 (max), 4.05/14, 4.1/15
    # (the Appendix A case above is the one where the exact early stop and the argmax differ)
    o = sched([[0.05, 0.05], [1.0, 1.0]], table=LINEAR_TABLE, mode="exact")
    assert o.verify_lens.tolist() == [0, 2]
    assert o.theta.item() == pytest.approx(4000 / 13, rel=1e-6)
    o = sched([[0.05, 0.05], [1.0, 1.0]], table=LINEAR_TABLE, mode="argmax")
    assert o.verify_lens.tolist() == [0, 2]


def test_exact_needs_strict_improvement(host_backend):
    # constant cost: admitting 0.9 raises Theta, admitting 0.0 leaves it equal -> stop before it
    flat = dk.CostTable([1], [10.0])
    o = sched([[0.9, 0.0]], table=flat, mode="exact")
    assert o.verify_lens.tolist() == [1]
    assert o.theta.item() == pytest.approx(190.0, rel=1e-6)
    # argmax: the first maximum is also at 1 admission
    o = sched([[0.9, 0.0]], table=flat, mode="argmax")
    assert o.verify_lens.tolist() == [1]


def test_running_min_and_nan(host_backend):
    # [0.2, 0.9] behaves as [0.2, 0.2]; NaN behaves as 0
    a = sched([[0.2, 0.9], [float("nan"), 0.9]], table=LINEAR_TABLE, mode="argmax")
    b = sched([[0.2, 0.2], [0.0, 0.0]], table=LINEAR_TABLE, mode="argmax")
    assert torch.equal(a.verify_lens, b.verify_lens) and torch.equal(a.theta, b.theta)


def test_conf_logits_path(host_backend):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, 6, generator=g) * 2
    temps = torch.rand(6, generator=g) + 0.5
    a = dk.schedule_verify_lens(conf_logits=z, sts_temperatures=temps, cost_table=TABLES[0], mode="argmax")
    b = dk.schedule_verify_lens(dk.survival_from_conf(z, temps), cost_table=TABLES[0], mode="argmax")
    assert torch.equal(a.verify_lens, b.verify_lens) and torch.equal(a.theta, b.theta)
    c = dk.schedule_verify_lens(conf_logits=z, cost_table=TABLES[0], mode="argmax")
    d = dk.schedule_verify_lens(torch.sigmoid(z).cumprod(1), cost_table=TABLES[0], mode="argmax")
    assert torch.equal(c.verify_lens, d.verify_lens)


def test_min_max_len(host_backend):
    # everything admitted under a constant cost, but max_len caps and min_len floors
    flat = dk.CostTable([1], [10.0])
    o = sched([[0.9, 0.8, 0.7], [0.0, 0.0, 0.0]], table=flat, mode="argmax", min_len=1, max_len=2)
    assert o.verify_lens.tolist() == [2, 1]
    assert o.theta.item() == pytest.approx((1.9 + 1.8) * 100, rel=1e-6)
    o = sched([[0.9, 0.8, 0.7]], table=flat, mode="exact", min_len=3)
    assert o.verify_lens.tolist() == [3]


# --- argmax production form: budget_survival and min_gain, by hand ----------------------------------------------

CURRENT = [[0.5, 0.4], [0.9, 0.1], [0.3, 0.2]]
# LINEAR_TABLE, current: order 0.9 (r1), 0.5 (r0), 0.4 (r0), 0.3 (r2), 0.2 (r2), 0.1 (r1)
#   Theta_m = 1000 * tau / (9 + B): 3/12, 3.9/13, 4.4/14, 4.8/15 = 320 (max), 5.1/16, 5.3/17, 5.4/18 = 300 (all)


def test_argmax_by_hand(host_backend):
    o = sched(CURRENT, table=LINEAR_TABLE, mode="argmax")
    assert o.verify_lens.tolist() == [2, 1, 0]
    assert o.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert o.theta.item() == pytest.approx(320.0, rel=1e-6)
    o = sched(CURRENT, table=LINEAR_TABLE, mode="exact")
    assert o.verify_lens.tolist() == [2, 1, 0]


def test_budget_survival_other_n(host_backend):
    # budget: N' = 2, order 0.9, 0.8, 0.5, 0.05 -> Theta*(9+B)/1000 = 2/11, 2.9/12, 3.7/13, 4.2/14 (max), 4.25/15
    # -> budget 3, applied to the current order: r1 j1, r0 j1, r0 j2
    budget = torch.tensor([[0.9, 0.8], [0.5, 0.05]])
    o = sched(CURRENT, table=LINEAR_TABLE, mode="argmax", budget_survival=budget)
    assert o.verify_lens.tolist() == [2, 1, 0]
    assert o.theta.item() == pytest.approx(320.0, rel=1e-6)
    # a budget of 0 from a hopeless earlier step, N' = 1 and K' = 1
    o = sched(CURRENT, table=LINEAR_TABLE, mode="argmax", budget_survival=torch.tensor([[0.0]]))
    # Theta(0 admitted) = 250 < Theta(all) = 300 -> verify everything
    assert o.verify_lens.tolist() == [2, 2, 2]
    assert o.theta.item() == pytest.approx(300.0, rel=1e-6)


def test_budget_clamped_to_candidates(host_backend):
    # budget 3 (above) but the current step has only 2 candidates -> admit both
    o = sched([[0.6, 0.5]], table=LINEAR_TABLE, mode="argmax", budget_survival=torch.tensor([[0.9, 0.8], [0.5, 0.05]]))
    assert o.verify_lens.tolist() == [2]
    assert o.theta.item() == pytest.approx(2100 / 12, rel=1e-6)


def test_budget_appendix_a(host_backend):
    # budget from [0.8, 0] is 0; on [0.8, 0.72] Theta(0) = 1.0 < Theta(all) = 1.134 -> verify everything
    o = sched([[0.8, 0.72]], mode="argmax", budget_survival=torch.tensor([[0.8, 0.0]]))
    assert o.verify_lens.tolist() == [2]
    assert o.theta.item() == pytest.approx(1.134, rel=1e-6)
    # budget from [0.8, 0.72] is 2; applied to [0.8, 0]: Theta = 1.8 * 0.45 = 0.81 = Theta(all)
    o = sched([[0.8, 0.0]], mode="argmax", budget_survival=torch.tensor([[0.8, 0.72]]))
    assert o.verify_lens.tolist() == [2]
    assert o.theta.item() == pytest.approx(0.81, rel=1e-6)


@pytest.mark.parametrize("min_gain,lens,theta", [
    (0.0, [2, 1, 0], 320.0),
    (0.05, [2, 1, 0], 320.0),   # 320 >= 1.05 * 300 = 315
    (0.1, [2, 2, 2], 300.0),    # 320 < 1.10 * 300 = 330 -> verify everything
])
def test_min_gain(host_backend, min_gain, lens, theta):
    o = sched(CURRENT, table=LINEAR_TABLE, mode="argmax", min_gain=min_gain)
    assert o.verify_lens.tolist() == lens
    assert o.theta.item() == pytest.approx(theta, rel=1e-6)


def test_n_zero_and_k_one(host_backend):
    o = dk.schedule_verify_lens(torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="argmax")
    assert o.verify_lens.tolist() == [] and o.cu_seqlens.tolist() == [0] and o.theta.item() == 0.0
    o = dk.schedule_verify_lens(torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="exact")
    assert o.verify_lens.tolist() == [] and o.cu_seqlens.tolist() == [0]
    o = sched([[0.9], [0.01]], table=LINEAR_TABLE, mode="exact")
    # 2/11 -> +0.9: 2.9/12 rises -> +0.01: 2.91/13 falls
    assert o.verify_lens.tolist() == [1, 0]
    assert o.cu_seqlens.tolist() == [0, 2, 3]


def test_half_precision_inputs(host_backend):
    s = torch.tensor(CURRENT)
    for dtype in (torch.float16, torch.bfloat16):
        o = dk.schedule_verify_lens(s.to(dtype), cost_table=LINEAR_TABLE, mode="argmax")
        assert o.verify_lens.tolist() == [2, 1, 0]


# --- argument checks --------------------------------------------------------------------------------------------

META = torch.device("meta")


@pytest.mark.parametrize("kw,match", [
    (dict(survival=torch.rand(3)), "survival"),
    (dict(survival=torch.zeros(3, 2, dtype=torch.int64)), "survival"),
    (dict(survival=None, conf_logits=torch.rand(3)), "conf_logits"),
    (dict(survival=None, conf_logits=torch.zeros(3, 2, dtype=torch.int32)), "conf_logits"),
    (dict(survival=None, conf_logits=torch.rand(3, 2), sts_temperatures=torch.rand(3)), "sts_temperatures"),
    (dict(survival=None, conf_logits=torch.rand(3, 2), sts_temperatures=torch.zeros(2, dtype=torch.int64)),
     "sts_temperatures"),
    (dict(survival=None, conf_logits=torch.rand(3, 2), sts_temperatures=torch.rand(2, device=META)),
     "sts_temperatures"),
    (dict(sts_temperatures=torch.rand(2)), "sts_temperatures"),
    (dict(conf_logits=torch.rand(3, 2)), "survival and conf_logits"),
    (dict(survival=None), "survival and conf_logits"),
    (dict(mode="argmax", budget_survival=torch.rand(3)), "budget_survival"),
    (dict(mode="argmax", budget_survival=torch.zeros(3, 2, dtype=torch.int32)), "budget_survival"),
    (dict(mode="argmax", budget_survival=torch.rand(3, 2, device=META)), "budget_survival"),
    (dict(budget_survival=torch.rand(3, 2)), "budget_survival"),
    (dict(min_gain=0.1), "min_gain"),
    (dict(mode="argmax", min_gain=-0.1), "min_gain"),
    (dict(mode="argmax", min_gain=float("nan")), "min_gain"),
    (dict(mode="greedy"), "mode"),
    (dict(min_len=-1), "min_len"),
    (dict(min_len=2, max_len=1), "min_len"),
    (dict(max_len=3), "max_len"),
    (dict(max_len=1.5), "max_len"),
    (dict(active=torch.ones(3, dtype=torch.int32)), "active"),
    (dict(active=torch.ones(2, dtype=torch.bool)), "active"),
    (dict(active=torch.ones(3, dtype=torch.bool, device=META)), "active"),
    (dict(backend="nope"), "backend"),
])
def test_bad_arguments(kw, match):
    args = dict(survival=torch.rand(3, 2), cost_table=LINEAR_TABLE)
    args.update(kw)
    survival = args.pop("survival")
    with pytest.raises(ValueError, match=match):
        dk.schedule_verify_lens(survival, **args)


def test_bad_cost_table():
    with pytest.raises(TypeError, match="cost_table"):
        dk.schedule_verify_lens(torch.rand(3, 2), cost_table={"token_counts": [1], "step_time_ms": [1.0]})


def test_cost_table_tensors_cached():
    a = LINEAR_TABLE.tensors("cpu")
    b = LINEAR_TABLE.tensors(torch.device("cpu"))
    assert a[0] is b[0] and a[1] is b[1]


# --- torch.library ----------------------------------------------------------------------------------------------

def _opcheck_samples():
    """The op's flat arguments (without ``backend``) for torch.library.opcheck."""
    c, s = LINEAR_TABLE.tensors("cpu")
    c2, s2 = TABLES[1].tensors("cpu")
    g = torch.Generator().manual_seed(0)
    surv = torch.rand(5, 4, generator=g).cumprod(1)
    return [
        (surv, None, None, c, s, 0.0, 0, 4, "exact", None, 0.0, None),
        (surv, None, None, c2, s2, 3.0, 1, 3, "argmax", None, 0.1, None),
        (None, torch.randn(5, 4, generator=g), torch.rand(4, generator=g) + 0.5, c, s, 0.0, 0, 4, "argmax",
         torch.rand(2, 3, generator=g), 0.0, None),
        (torch.zeros(0, 3), None, None, c, s, 0.0, 0, 3, "exact", None, 0.0, None),
        (surv, None, None, c2, s2, 3.0, 1, 3, "argmax", None, 0.1, torch.tensor([True, False, True, False, False])),
    ]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_opcheck(backend):
    for args in _opcheck_samples():
        torch.library.opcheck(torch.ops.dspark.schedule_verify_lens.default, args + (backend,))


def test_torch_compile_fullgraph():
    def f(surv):
        o = dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, mode="argmax", backend="reference")
        return o.verify_lens, o.cu_seqlens, o.theta

    surv = torch.tensor(CURRENT)
    a = torch.compile(f, fullgraph=True, backend="eager")(surv)
    b = f(surv)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_reference_never_syncs(mode):
    """The reference runs on meta tensors, which have no data: any .item(), nonzero() or bool(tensor) would raise."""
    from dspark_kernels import reference
    m = torch.device("meta")
    c, s = TABLES[1].tensors(m)
    budget = torch.zeros(2, 3, device=m) if mode == "argmax" else None
    active = torch.ones(4, dtype=torch.bool, device=m)
    out = reference.schedule_verify_lens(torch.zeros(4, 5, device=m), None, None, c, s, 3.0, 1, 4, mode, budget, 0.1,
                                         active)
    assert [tuple(o.shape) for o in out] == [(4,), (5,), ()]
    out = reference.schedule_verify_lens(None, torch.zeros(4, 5, device=m), torch.ones(5, device=m), c, s, 0.0, 0, 5,
                                         mode, None, 0.0, None)
    assert all(o.device == m for o in out)


def _vs_reference(backend, device, survival=None, run=lambda f: f(), **kw):
    """Reference on the CPU vs ``backend`` on ``device`` (``run`` = simt_check or a plain call): identical integer
    outputs, Theta to float32 rounding (equal in practice: the CUDA kernel's sums are exact and its cost-table
    arithmetic is the reference's)."""
    ref = dk.schedule_verify_lens(survival, backend="reference", **kw)
    on_device = {key: val.to(device) if isinstance(val, torch.Tensor) else val for key, val in kw.items()}
    out = run(lambda: dk.schedule_verify_lens(survival.to(device) if survival is not None else None,
                                              backend=backend, **on_device))
    out = type(out)(*(x.cpu() for x in out))
    assert out.verify_lens.dtype == torch.int32 and out.cu_seqlens.dtype == torch.int32
    assert out.theta.dtype == F32 and out.theta.shape == ()
    assert out.verify_lens.tolist() == ref.verify_lens.tolist(), (out.verify_lens.tolist(), ref.verify_lens.tolist())
    assert out.cu_seqlens.tolist() == ref.cu_seqlens.tolist()
    assert out.theta.item() == pytest.approx(ref.theta.item(), rel=1e-6)
    return out


# ---------------------------------------------------------------- Triton twin (interpreter on the CPU)

def _triton_vs_reference(device, survival=None, **kw):
    return _vs_reference("triton", device, survival, **kw)


HAND_CASES = [
    ([[0.8, 0.72]], APPENDIX_TABLE, dict(mode="exact")),
    ([[0.8, 0.72]], APPENDIX_TABLE, dict(mode="argmax")),
    ([[0.8, 0.0]], APPENDIX_TABLE, dict(mode="argmax")),
    ([[0.8, 0.72]], APPENDIX_TABLE, dict(mode="argmax", budget_survival=torch.tensor([[0.8, 0.0]]))),
    ([[0.8, 0.0]], APPENDIX_TABLE, dict(mode="argmax", budget_survival=torch.tensor([[0.8, 0.72]]))),
    ([[0.05, 0.05], [1.0, 1.0]], LINEAR_TABLE, dict(mode="exact")),
    ([[0.9, 0.0]], dk.CostTable([1], [10.0]), dict(mode="exact")),      # a zero gain is not admitted
    ([[0.9, 0.0]], dk.CostTable([1], [10.0]), dict(mode="argmax")),     # the first maximum
    ([[0.2, 0.9], [float("nan"), 0.9]], LINEAR_TABLE, dict(mode="argmax")),
    ([[0.9, 0.8, 0.7], [0.0, 0.0, 0.0]], dk.CostTable([1], [10.0]), dict(mode="argmax", min_len=1, max_len=2)),
    ([[0.9, 0.8, 0.7]], dk.CostTable([1], [10.0]), dict(mode="exact", min_len=3)),
    (CURRENT, LINEAR_TABLE, dict(mode="exact")),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax")),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax", budget_survival=torch.tensor([[0.9, 0.8], [0.5, 0.05]]))),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax", budget_survival=torch.tensor([[0.0]]))),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax", budget_survival=torch.zeros(0, 3))),
    ([[0.6, 0.5]], LINEAR_TABLE, dict(mode="argmax", budget_survival=torch.tensor([[0.9, 0.8], [0.5, 0.05]]))),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax", min_gain=0.05)),
    (CURRENT, LINEAR_TABLE, dict(mode="argmax", min_gain=0.1)),
    ([[0.9], [0.01]], LINEAR_TABLE, dict(mode="exact")),
    ([[float("inf"), float("-inf")], [-0.0, 2.0]], LINEAR_TABLE, dict(mode="argmax")),
]


@pytest.mark.parametrize("survival,table,kw", HAND_CASES)
def test_triton_hand_cases(triton_device, survival, table, kw):
    _triton_vs_reference(triton_device, torch.tensor(survival, dtype=F32), cost_table=table, **kw)


def test_triton_cost_table_rules(triton_device):
    """Below the first point, between points, above the last (rising, and falling: slope clamped at 0)."""
    surv = torch.tensor([[0.99] * 8] * 6)
    for table in (dk.CostTable([20, 30, 40], [10.0, 30.0, 35.0]), dk.CostTable([2, 30, 40], [5.0, 30.0, 6.0]),
                  dk.CostTable([0, 4, 9, 40], [3.0, 4.0, 4.5, 50.0], fixed_overhead_ms=1.5)):
        for mode in ("exact", "argmax"):
            _triton_vs_reference(triton_device, surv * torch.linspace(1.0, 0.3, 6)[:, None], cost_table=table,
                                 mode=mode)


def test_triton_n_zero_and_k_zero(triton_device):
    o = _triton_vs_reference(triton_device, torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="argmax")
    assert o.cu_seqlens.tolist() == [0] and o.theta.item() == 0.0
    _triton_vs_reference(triton_device, torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="exact")
    _triton_vs_reference(triton_device, torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="exact")
    _triton_vs_reference(triton_device, torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="argmax",
                         budget_survival=torch.rand(2, 3), min_gain=0.2)


TRITON_SHAPES = [(1, 1), (1, 16), (3, 5), (3, 7), (64, 1), (64, 5), (64, 16), (1000, 7), (1000, 16)]


@pytest.mark.parametrize("n,k", TRITON_SHAPES)
@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_triton_random_against_reference(triton_device, n, k, mode):
    g = torch.Generator().manual_seed(n * 100 + k * 3 + (mode == "exact"))
    for case in range(3):
        table = TABLES[(case + n + k) % 3]
        if case == 0:    # calibrated-looking survival
            surv = torch.cumprod(torch.rand(n, k, generator=g) * 0.8 + 0.2, dim=1)
        elif case == 1:  # many exact ties: the (r, j) tie order
            surv = (torch.rand(n, k, generator=g) * 4).round() / 4
        else:            # non-monotone, out of range, NaN
            surv = torch.rand(n, k, generator=g) * 1.4 - 0.2
            surv[torch.rand(n, k, generator=g) < 0.1] = float("nan")
        min_len = int(torch.randint(0, k + 1, (1,), generator=g))
        max_len = int(torch.randint(min_len, k + 1, (1,), generator=g))
        kw = dict(cost_table=table, min_len=min_len, max_len=max_len, mode=mode)
        if mode == "argmax" and case == 1:
            kw["min_gain"] = 0.02
        if mode == "argmax" and case == 2:
            kw["budget_survival"] = torch.rand(max(1, n // 2), max(1, k - 1), generator=g).cumprod(1)
        _triton_vs_reference(triton_device, surv, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_and_conf_logits(triton_device, dtype):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 7, generator=g) * 2
    temps = torch.rand(7, generator=g) + 0.5
    for mode in ("exact", "argmax"):
        _triton_vs_reference(triton_device, None, conf_logits=z.to(dtype), sts_temperatures=temps.to(dtype),
                             cost_table=TABLES[0], mode=mode)
        _triton_vs_reference(triton_device, None, conf_logits=z, cost_table=TABLES[1], mode=mode, max_len=5)
        _triton_vs_reference(triton_device, torch.sigmoid(z).cumprod(1).to(dtype), cost_table=TABLES[0], mode=mode,
                             budget_survival=torch.rand(3, 9, generator=g).to(dtype) if mode == "argmax" else None)


def test_triton_size_limit(triton_device):
    from dspark_kernels.triton.schedule_verify_lens import MAX_ELEMENTS
    assert MAX_ELEMENTS >= 16384
    surv = torch.rand(MAX_ELEMENTS // 16 + 1, 16, device=triton_device)
    with pytest.raises(ValueError, match="N\\*K <= 16384"):
        dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, backend="triton")
    with pytest.raises(ValueError, match="budget_survival"):
        dk.schedule_verify_lens(surv[:4], cost_table=LINEAR_TABLE, mode="argmax", budget_survival=surv,
                                backend="triton")


# ---------------------------------------------------------------- CUDA kernel (SIMT harness on the CPU; GPU)

def _cuda_vs_reference(device, run, survival=None, **kw):
    return _vs_reference("cuda", device, survival, run=run, **kw)


CUDA_HAND_CASES = HAND_CASES + [
    ([[1e-30, 1e-42], [2.0 ** -60, 0.5]], dk.CostTable([1], [10.0]), dict(mode="exact")),   # tiny and denormal
    ([[1e-30, 1e-42], [2.0 ** -60, 0.5]], dk.CostTable([1], [10.0]), dict(mode="argmax")),
]


@pytest.mark.parametrize("survival,table,kw", CUDA_HAND_CASES)
def test_cuda_hand_cases(cuda_device, simt_check, survival, table, kw):
    _cuda_vs_reference(cuda_device, simt_check, torch.tensor(survival, dtype=F32), cost_table=table, **kw)


@pytest.mark.parametrize("survival,exact_len,argmax_len,argmax_theta", [
    ([[0.8, 0.72]], 0, 2, 2.52 * 0.45),
    ([[0.8, 0.0]], 0, 0, 1.0),
])
def test_cuda_appendix_a(cuda_device, simt_check, survival, exact_len, argmax_len, argmax_theta):
    """The paper's Appendix A through the kernel: exact mode verifies nothing, argmax verifies both drafts of A."""
    s = torch.tensor(survival, dtype=F32, device=cuda_device)
    o = simt_check(lambda: dk.schedule_verify_lens(s, cost_table=APPENDIX_TABLE, mode="exact", backend="cuda"))
    assert o.verify_lens.cpu().tolist() == [exact_len] and o.theta.item() == pytest.approx(1.0)
    o = simt_check(lambda: dk.schedule_verify_lens(s, cost_table=APPENDIX_TABLE, mode="argmax", backend="cuda"))
    assert o.verify_lens.cpu().tolist() == [argmax_len]
    assert o.theta.item() == pytest.approx(argmax_theta, rel=1e-6)


@pytest.mark.parametrize("mode,p_a", [("exact", 0.7), ("argmax", 0.85)])
def test_cuda_appendix_a_monte_carlo(cuda_device, mode, p_a):
    """The first committed token's distribution with the kernel's schedules: (0.7, 0.3) exact (lossless),
    (0.85, 0.15) argmax. The schedules come from the CUDA kernel; verification is the reference's."""
    n, seed = 20000, 1234
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, 2, (n, 2), generator=g)
    lens = {}
    for tok, surv in ((0, [[0.8, 0.72]]), (1, [[0.8, 0.0]])):
        s = torch.tensor(surv, dtype=F32, device=cuda_device)
        lens[tok] = dk.schedule_verify_lens(s, cost_table=APPENDIX_TABLE, mode=mode, backend="cuda").verify_lens.cpu()
    verify_lens = torch.where(draft[:, 0] == 0, lens[0].expand(n), lens[1].expand(n))
    target = torch.log(torch.tensor([0.7, 0.3])).expand(n, 3, 2).contiguous()
    draft_logits = torch.log(torch.tensor([0.5, 0.5])).expand(n, 2, 2).contiguous()
    out = dk.verify_chain(target, draft, draft_logits=draft_logits, verify_lens=verify_lens, temperature=1.0,
                          seed=seed, method="token", backend="reference")
    count_a = int((out.tokens[:, 0] == 0).sum())
    z = (count_a - n * p_a) / math.sqrt(n * p_a * (1 - p_a))
    assert abs(z) < 4.5, (mode, count_a / n, p_a, z)
    other = 0.85 if p_a == 0.7 else 0.7
    assert abs((count_a - n * other) / math.sqrt(n * other * (1 - other))) > 10


def _random_survival(g, n, k, kind):
    if kind == 0:    # calibrated-looking
        return torch.cumprod(torch.rand(n, k, generator=g) * 0.8 + 0.2, dim=1)
    if kind == 1:    # many exact ties: the (r, j) tie order
        return (torch.rand(n, k, generator=g) * 4).round() / 4
    if kind == 2:    # non-monotone, out of range, NaN, +-inf, -0
        s = torch.rand(n, k, generator=g) * 1.4 - 0.2
        u = torch.rand(n, k, generator=g)
        s[u < 0.08] = float("nan")
        s[(u >= 0.08) & (u < 0.12)] = float("inf")
        s[(u >= 0.12) & (u < 0.16)] = float("-inf")
        s[(u >= 0.16) & (u < 0.2)] = -0.0
        return s
    # deep cumprod: tiny survivals (down to ~1e-20), some ties with zero
    s = torch.cumprod(torch.rand(n, k, generator=g) ** 3, dim=1)
    s[torch.rand(n, k, generator=g) < 0.1] = 0.0
    return s


def _random_table(g):
    p = int(torch.randint(1, 65, (1,), generator=g))
    counts = torch.cumsum(torch.randint(1, 40, (p,), generator=g), 0) - int(torch.randint(1, 20, (1,), generator=g))
    counts = counts.clamp(min=0)
    counts = torch.unique(counts)  # strictly ascending, >= 0
    times = torch.rand(counts.numel(), generator=g) * 50 + 0.5
    if int(torch.randint(0, 2, (1,), generator=g)):
        times = torch.sort(times).values  # rising, as measured tables are
    overhead = float(torch.rand(1, generator=g)) * 5 if int(torch.randint(0, 2, (1,), generator=g)) else 0.0
    return dk.CostTable(counts.tolist(), times.tolist(), fixed_overhead_ms=overhead)


CUDA_SHAPES = [(1, 1), (1, 16), (3, 5), (3, 7), (17, 7), (64, 1), (64, 5), (64, 16), (256, 7), (1000, 7), (1000, 16)]


@pytest.mark.parametrize("n,k", CUDA_SHAPES)
@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_cuda_random_against_reference(cuda_device, simt_check, n, k, mode):
    g = torch.Generator().manual_seed(n * 100 + k * 3 + (mode == "exact") + 7)
    for case in range(4):
        table = TABLES[(case + n + k) % 4] if case < 2 else _random_table(g)
        surv = _random_survival(g, n, k, case)
        min_len = int(torch.randint(0, k + 1, (1,), generator=g))
        max_len = int(torch.randint(min_len, k + 1, (1,), generator=g))
        kw = dict(cost_table=table, min_len=min_len, max_len=max_len, mode=mode)
        if mode == "argmax" and case == 1:
            kw["min_gain"] = 0.02
        if mode == "argmax" and case >= 2:
            kw["budget_survival"] = torch.rand(max(1, n // 2), max(1, k - 1), generator=g).cumprod(1)
        _cuda_vs_reference(cuda_device, simt_check, surv, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_and_conf_logits(cuda_device, simt_check, dtype):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 7, generator=g) * 2
    temps = torch.rand(7, generator=g) + 0.5
    for mode in ("exact", "argmax"):
        _cuda_vs_reference(cuda_device, simt_check, None, conf_logits=z.to(dtype), sts_temperatures=temps.to(dtype),
                           cost_table=TABLES[0], mode=mode)
        _cuda_vs_reference(cuda_device, simt_check, None, conf_logits=z, cost_table=TABLES[1], mode=mode, max_len=5)
        _cuda_vs_reference(cuda_device, simt_check, torch.sigmoid(z).cumprod(1).to(dtype), cost_table=TABLES[0],
                           mode=mode,
                           budget_survival=torch.rand(3, 9, generator=g).to(dtype) if mode == "argmax" else None)


def test_cuda_kernel_conf_logits_path(cuda_device):
    """The kernel's own conf_logits path (what the C ABI uses; the torch op computes the survival with torch):
    the same schedule as the reference when no decision sits within an ulp of a tie."""
    if cuda_device.type != "cpu":
        pytest.skip("checked through the SIMT library here")
    op = torch.ops.dspark_simt.schedule_verify_lens
    c, s = TABLES[0].tensors("cpu")
    z = torch.tensor([[2.0, 1.0, -1.0, 0.25], [3.0, 3.0, 0.5, -2.0], [0.0, 1.5, 1.5, 1.0]])
    temps = torch.tensor([1.0, 2.0, 0.5, 1.5])
    for mode in ("exact", "argmax"):
        ref = dk.schedule_verify_lens(conf_logits=z, sts_temperatures=temps, cost_table=TABLES[0], mode=mode,
                                      backend="reference")
        lens, cu, theta = op(None, z, temps, c, s, 0.0, 0, 4, mode, None, 0.0, None)
        assert lens.tolist() == ref.verify_lens.tolist() and cu.tolist() == ref.cu_seqlens.tolist()
        assert theta.item() == pytest.approx(ref.theta.item(), rel=1e-6)


def test_cuda_n_zero_and_k_zero(cuda_device, simt_check):
    o = _cuda_vs_reference(cuda_device, simt_check, torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="argmax")
    assert o.cu_seqlens.tolist() == [0] and o.theta.item() == 0.0
    _cuda_vs_reference(cuda_device, simt_check, torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="exact")
    _cuda_vs_reference(cuda_device, simt_check, torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="exact")
    _cuda_vs_reference(cuda_device, simt_check, torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="argmax",
                       budget_survival=torch.rand(2, 3), min_gain=0.2)


def test_cuda_k_zero_many_requests(cuda_device, simt_check):
    """K = 0 for more requests than one CTA's shared memory holds a word of each (70000 x 4 bytes): no candidates,
    so no per-request admissions are kept; every length 0."""
    for mode in ("exact", "argmax"):
        o = _cuda_vs_reference(cuda_device, simt_check, torch.zeros(70000, 0), cost_table=LINEAR_TABLE, mode=mode)
        assert o.verify_lens.abs().sum() == 0 and o.cu_seqlens[-1] == 70000


# ---------------------------------------------------------------- CPU kernel (csrc/cpu)
CPU = torch.device("cpu")


def _cpu_vs_reference(survival=None, **kw):
    """The CPU kernel against the reference: every output equal, Theta to the bit."""
    out = _vs_reference("cpu", CPU, survival, **kw)
    ref = dk.schedule_verify_lens(survival, backend="reference", **kw)
    assert torch.equal(out.theta, ref.theta), (out.theta.item(), ref.theta.item())
    return out


@pytest.mark.parametrize("survival,table,kw", CUDA_HAND_CASES)
def test_cpu_hand_cases(survival, table, kw):
    _cpu_vs_reference(torch.tensor(survival, dtype=F32), cost_table=table, **kw)


@pytest.mark.parametrize("n,k", [(1, 1), (1, 16), (3, 7), (17, 7), (64, 5), (256, 7), (1000, 16)])
@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_cpu_random_against_reference(n, k, mode):
    g = torch.Generator().manual_seed(n * 100 + k * 3 + (mode == "exact") + 7)
    for case in range(4):
        table = TABLES[(case + n + k) % 4] if case < 2 else _random_table(g)
        kw = dict(cost_table=table, mode=mode, max_len=k)
        if mode == "argmax" and case == 1:
            kw["min_gain"] = 0.02
        if mode == "argmax" and case >= 2:
            kw["budget_survival"] = torch.rand(max(1, n // 2), max(1, k - 1), generator=g).cumprod(1)
        _cpu_vs_reference(_random_survival(g, n, k, case), **kw)
        _cpu_vs_reference(_random_survival(g, n, k, case), min_len=min(1, k), **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_half_and_conf_logits(dtype):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 7, generator=g) * 2
    temps = torch.rand(7, generator=g) + 0.5
    for mode in ("exact", "argmax"):
        _cpu_vs_reference(None, conf_logits=z.to(dtype), sts_temperatures=temps.to(dtype), cost_table=TABLES[0],
                          mode=mode)
        _cpu_vs_reference(torch.sigmoid(z).cumprod(1).to(dtype), cost_table=TABLES[0], mode=mode,
                          budget_survival=torch.rand(3, 9, generator=g).to(dtype) if mode == "argmax" else None)


def test_cpu_n_zero_and_k_zero():
    o = _cpu_vs_reference(torch.zeros(0, 4), cost_table=LINEAR_TABLE, mode="argmax")
    assert o.cu_seqlens.tolist() == [0] and o.theta.item() == 0.0
    _cpu_vs_reference(torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="exact")
    _cpu_vs_reference(torch.zeros(5, 0), cost_table=LINEAR_TABLE, mode="argmax", budget_survival=torch.rand(2, 3),
                      min_gain=0.2)


@pytest.mark.harness_slow
def test_cuda_no_size_cap(cuda_device):
    """N*K = 262144 (a production batch; the Triton twin stops at 16384): 128 tiles, the arrays in the workspace
    (the default run's several-tile cases are test_cuda_random_against_reference's N = 1000)."""
    g = torch.Generator().manual_seed(9)
    table = dk.CostTable([1, 8, 32, 128, 4096, 300000], [10.0, 10.5, 14.0, 40.0, 500.0, 30000.0])
    surv = torch.cumprod(torch.rand(16384, 16, generator=g) * 0.5 + 0.5, 1)
    surv[:, 3:5] = (surv[:, 3:5] * 8).round() / 8  # ties across requests
    budget = torch.rand(20000, 13, generator=g).cumprod(1)
    if cuda_device.type == "cpu":
        from dspark_kernels import simt
        with simt.record() as rec:
            o = _cuda_vs_reference(cuda_device, lambda f: f(), surv, cost_table=table, mode="argmax",
                                   budget_survival=budget)
        (launch,) = rec.launches
        assert launch["ctas"] == 1 and launch["kernel"].endswith("tiles>")
    else:
        o = _cuda_vs_reference(cuda_device, lambda f: f(), surv, cost_table=table, mode="argmax",
                               budget_survival=budget)
    assert 0 < int(o.verify_lens.sum()) < 16384 * 16


def test_cuda_bytes_and_launches(cuda_device):
    """N = 256, K = 7 (the decode case): one launch, one CTA of 512 threads (4 elements each), no grid barrier;
    reads = the survival + the cost table, writes = verify_lens + cu_seqlens + theta (the sort and the curve stay
    in registers and shared memory)."""
    if cuda_device.type != "cpu":
        pytest.skip("byte counters exist in the SIMT harness only")
    from dspark_kernels import simt
    g = torch.Generator().manual_seed(3)
    n, k = 256, 7
    surv = torch.rand(n, k, generator=g).cumprod(1)
    c, s = TABLES[0].tensors("cpu")
    for mode in ("exact", "argmax"):
        with simt.record() as rec:
            dk.schedule_verify_lens(surv, cost_table=TABLES[0], mode=mode, backend="cuda")
        (launch,) = rec.launches
        assert launch["ctas"] == 1 and launch["threads"] == 512
        assert launch["bytes_read"] == n * k * 4 + c.numel() * 8 == launch["unique_bytes_read"]
        assert launch["bytes_written"] == 4 * n + 4 * (n + 1) + 4
        assert launch["grid_barriers"] == 0


def test_cuda_opcheck(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("opcheck runs on the SIMT library here")
    for args in _opcheck_samples():
        torch.library.opcheck(torch.ops.dspark_simt.schedule_verify_lens.default, args)


def test_cuda_bad_arguments_named(cuda_device):
    if cuda_device.type != "cpu":
        pytest.skip("checked through the SIMT library here")
    op = torch.ops.dspark_simt.schedule_verify_lens
    c, s = LINEAR_TABLE.tensors("cpu")
    with pytest.raises(RuntimeError, match="survival"):
        op(torch.zeros(3, 2, dtype=torch.int32), None, None, c, s, 0.0, 0, 2, "exact", None, 0.0, None)
    with pytest.raises(RuntimeError, match="max_len"):
        op(torch.rand(3, 2), None, None, c, s, 0.0, 0, 3, "exact", None, 0.0, None)
    with pytest.raises(RuntimeError, match="mode"):
        op(torch.rand(3, 2), None, None, c, s, 0.0, 0, 2, "greedy", None, 0.0, None)
    with pytest.raises(RuntimeError, match="step_time_ms"):
        op(torch.rand(3, 2), None, None, c, s[:1], 0.0, 0, 2, "exact", None, 0.0, None)
    with pytest.raises(RuntimeError, match="budget_survival"):
        op(torch.rand(3, 2), None, None, c, s, 0.0, 0, 2, "exact", torch.rand(2, 2), 0.0, None)
    for active in (torch.ones(3, dtype=torch.uint8), torch.ones(2, dtype=torch.bool)):
        with pytest.raises(RuntimeError, match="active"):
            op(torch.rand(3, 2), None, None, c, s, 0.0, 0, 2, "exact", None, 0.0, active)


# 10,000 random cases (DSPARK_RANDOM_CASES changes the number); one op call each, small N and K.
RANDOM_CASES = int(os.environ.get("DSPARK_RANDOM_CASES", "10000"))
# The default run checks the first 1,000 (every case % k branch among them); CI's slow leg the rest, drawn from
# the same generator, so the two legs together run each case once.
RANDOM_SLICES = [pytest.param(0, 1000, id="first-1000"),
                 pytest.param(1000, None, id="rest", marks=pytest.mark.harness_slow)]


@pytest.mark.parametrize("first,stop", RANDOM_SLICES)
def test_cuda_random_cases(cuda_device, first, stop):
    """Random N (0..24), K (0..16), min/max lengths, modes, survival kinds (calibrated, ties, NaN / +-inf / -0 /
    out of range, tiny), dtypes (fp32 / bf16 / fp16), cost tables of 1 to 64 points, budgets of any shape,
    min_gain: every integer output equals the reference."""
    g = torch.Generator().manual_seed(31337)
    dtypes = (torch.float32, torch.float32, torch.bfloat16, torch.float16)
    for case in range(RANDOM_CASES if stop is None else min(stop, RANDOM_CASES)):
        n = int(torch.randint(0, 25, (1,), generator=g))
        k = int(torch.randint(0, 17, (1,), generator=g))
        surv = _random_survival(g, n, k, case % 4).to(dtypes[int(torch.randint(0, 4, (1,), generator=g))])
        min_len = int(torch.randint(0, k + 1, (1,), generator=g))
        max_len = int(torch.randint(min_len, k + 1, (1,), generator=g))
        mode = "exact" if case % 2 == 0 else "argmax"
        kw = dict(cost_table=_random_table(g), min_len=min_len, max_len=max_len, mode=mode)
        if mode == "argmax":
            if case % 3 == 0:
                kw["min_gain"] = float(torch.rand(1, generator=g)) * 0.3
            if case % 5 == 1:
                nb, kb = int(torch.randint(0, 20, (1,), generator=g)), int(torch.randint(0, 17, (1,), generator=g))
                kw["budget_survival"] = _random_survival(g, nb, kb, case % 4)
        if case % 7 == 3:
            kw["active"] = torch.rand(n, generator=g) < 0.6
        if case >= first:
            _cuda_vs_reference(cuda_device, lambda f: f(), surv, **kw)


def test_cuda_rounding_adversarial(cuda_device):
    """Flat Theta (a one-point cost table, or every B below the first point) with survivals spread over 2^-70..1:
    admissions far below an ulp of tau tie in Theta, so the schedule hinges on the reference's exact float64
    rounding (n + sum, then its sequential cumsum). The kernel must agree bit for bit, Theta included."""
    g = torch.Generator().manual_seed(7)
    for case in range(600):
        n = int(torch.randint(1, 20, (1,), generator=g))
        k = int(torch.randint(1, 17, (1,), generator=g))
        s = torch.rand(n, k, generator=g) * torch.pow(2.0, torch.randint(-70, 1, (n, k), generator=g).float())
        s = torch.cummin(s, 1).values
        if case % 3 == 0:
            s[torch.rand(n, k, generator=g) < 0.3] = 0.0
        min_len = int(torch.randint(0, k + 1, (1,), generator=g))
        max_len = int(torch.randint(min_len, k + 1, (1,), generator=g))
        table = (dk.CostTable([1], [float(torch.rand(1, generator=g)) * 20 + 1]) if case % 2 else
                 dk.CostTable([10000, 20000], [5.0, 9.0], fixed_overhead_ms=1.0))
        for mode in ("exact", "argmax"):
            kw = dict(cost_table=table, min_len=min_len, max_len=max_len, mode=mode)
            ref = dk.schedule_verify_lens(s, backend="reference", **kw)
            out = dk.schedule_verify_lens(s.to(cuda_device), backend="cuda", **kw)
            assert out.verify_lens.cpu().tolist() == ref.verify_lens.tolist(), (case, mode)
            assert out.theta.item() == ref.theta.item(), (case, mode)


def test_auto_never_picks_a_capped_backend(monkeypatch):
    """Where "auto" would pick the Triton twin (a GPU without the CUDA extension) for a batch above its one-program
    cap, it runs the reference instead of failing; an explicit backend="triton" still raises."""
    import sys
    mod = sys.modules["dspark_kernels.ops.schedule_verify_lens"]  # the module (the package exports the function)
    from dspark_kernels.triton.schedule_verify_lens import MAX_ELEMENTS
    monkeypatch.setattr(mod, "resolve_backend",
                        lambda backend, device, op: {"auto": "triton"}.get(mod.requested_backend(backend),
                                                                           mod.requested_backend(backend)))
    surv = torch.rand(MAX_ELEMENTS + 1, 1, generator=torch.Generator().manual_seed(0))
    o = dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, mode="argmax")
    ref = dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, mode="argmax", backend="reference")
    assert torch.equal(o.verify_lens, ref.verify_lens) and torch.equal(o.theta, ref.theta)
    with pytest.raises(ValueError, match="N\\*K <= 16384"):
        dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, mode="argmax", backend="triton")
    monkeypatch.setenv("DSPARK_BACKEND", "triton")  # asked for by name through the environment: raises too
    with pytest.raises(ValueError, match="N\\*K <= 16384"):
        dk.schedule_verify_lens(surv, cost_table=LINEAR_TABLE, mode="argmax")


@pytest.mark.parametrize("n,k", [(128, 15), (256, 8)])
@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_cuda_over_48k_of_shared_memory_with_static(cuda_device, n, k, mode):
    """Dynamic shared memory under 48 KB that passes it with the 512-thread kernel's static part (the cost table
    and the scratch): a GPU refuses such a launch unless the kernel opted in to more; the harness enforces that
    rule."""
    from dspark_kernels import simt
    g = torch.Generator().manual_seed(n * k)
    s = torch.cumprod(torch.rand(n, k, generator=g) * 0.8 + 0.2, dim=1)
    if cuda_device.type != "cpu":
        _cuda_vs_reference(cuda_device, lambda f: f(), s, cost_table=LINEAR_TABLE, mode=mode)
        return
    with simt.record() as rec:
        _cuda_vs_reference(cuda_device, lambda f: f(), s, cost_table=LINEAR_TABLE, mode=mode)
    (r,) = rec.launches
    assert r["threads"] == 512 and r["dynamic_smem"] < 48 * 1024 < r["dynamic_smem"] + r["static_smem"]


# a measured-looking cost table (flat to 64 tokens, then rising), as profile_cost_table writes one
PROFILE_TABLE = dk.CostTable([1, 8, 16, 32, 64, 128, 256, 512], [5.0, 5.1, 5.2, 5.4, 5.9, 7.2, 10.5, 18.0])


@pytest.mark.parametrize("n,k", [(1, 7), (8, 7), (256, 7), (64, 16)])
@pytest.mark.parametrize("mode", ["exact", "argmax", "budget", "masked"])
def test_cuda_access_is_ideal(cuda_device, n, k, mode):
    """The harness's access rule (python_tests/access.py) on the decode shapes: every warp reads 32 consecutive
    survivals (and active flags) per load, no shared-memory access of the sort, the curve, the cost table or the
    admissions has a bank conflict; one launch, one CTA, no grid barrier, the survival (and the budget) and the
    cost table read once, the mask's bytes fetched once, only the outputs written. "masked": the last quarter of
    the requests inactive (an engine's padding to a graph size) and every third one finished."""
    if cuda_device.type != "cpu":
        pytest.skip("the harness's counters")
    from access import ideal_access
    g = torch.Generator().manual_seed(n * k)
    surv = torch.cumprod(torch.rand(n, k, generator=g) * 0.3 + 0.7, dim=1)
    kw = dict(cost_table=PROFILE_TABLE, mode="argmax" if mode in ("argmax", "budget") else "exact")
    budget = torch.cumprod(torch.rand(n, k, generator=g) * 0.3 + 0.7, dim=1) if mode == "budget" else None
    if budget is not None:
        kw.update(budget_survival=budget, min_gain=0.05)
    active = None
    if mode == "masked":
        active = (torch.arange(n) < max(1, 3 * n // 4)) & (torch.arange(n) % 3 != 2)
        kw.update(active=active)
    out, rec = ideal_access(lambda: dk.schedule_verify_lens(surv, backend="cuda", **kw))
    ref = dk.schedule_verify_lens(surv, backend="reference", **kw)
    assert torch.equal(out.verify_lens, ref.verify_lens) and torch.equal(out.cu_seqlens, ref.cu_seqlens)
    (launch,) = rec.launches
    assert launch["ctas"] == 1 and launch["grid_barriers"] == 0
    # barriers: load 1, bitonic 10 at 512 threads (none in one warp), curve 1, pick 1, admissions 2; a budget's
    # curve adds its own 13 (3 in one warp), a mask 2 (the count of active requests published, and the block
    # scan of cu_seqlens)
    one_warp = launch["threads"] == 32
    assert launch["barriers"] == (5 if one_warp else 15) + (0 if budget is None else (3 if one_warp else 13)) + \
        (0 if active is None else 2)
    inputs = surv.numel() * 4 * (2 if budget is not None else 1) + len(PROFILE_TABLE.token_counts) * 8 + \
        (0 if active is None else n)
    # an active flag is read once per element of its row (the keys), once to count the active rows and once for
    # cu_seqlens, each time by a warp over consecutive bytes: the unique bytes, DRAM's share, stay the inputs
    rereads = 0 if active is None else (k + 1) * n
    assert launch["unique_bytes_read"] == inputs and launch["bytes_read"] == inputs + rereads
    assert launch["bytes_written"] == 4 * n + 4 * (n + 1) + 4


# ---------------------------------------------------------------- inactive requests (the ``active`` mask)

def _alone(survival, active, **kw):
    """The reference's schedule of the active rows alone, spread back over the batch (0 and no rows elsewhere)."""
    sub = dk.schedule_verify_lens(survival[active], backend="reference", **kw)
    lens = torch.zeros(survival.shape[0], dtype=torch.int32)
    lens[active] = sub.verify_lens
    cu = torch.nn.functional.pad(torch.where(active, lens + 1, 0).cumsum(0), (1, 0)).int()
    return lens, cu, sub.theta


def _masks(g, n):
    yield torch.ones(n, dtype=torch.bool)
    yield torch.zeros(n, dtype=torch.bool)
    yield torch.rand(n, generator=g) < 0.5
    yield torch.arange(n) >= n // 2  # padding rows at the front


def test_inactive_requests_by_hand(host_backend):
    """Seven finished requests beside one running: the running one is scheduled as if alone. Counted, the others'
    anchors (7 rows, and 7 expected tokens) would make its last draft look too dear to verify."""
    table = dk.CostTable([1, 8, 16, 64], [10.0, 10.5, 11.0, 20.0])
    surv = torch.zeros(8, 5)
    surv[7] = torch.tensor([0.9, 0.85, 0.8, 0.7, 0.05])
    active = torch.arange(8) == 7
    o = dk.schedule_verify_lens(surv, cost_table=table, active=active, backend=host_backend)
    assert o.verify_lens.tolist() == [0] * 7 + [5]
    assert o.cu_seqlens.tolist() == [0] * 8 + [6]
    step_ms = 10.0 + (6 - 1) * (10.5 - 10.0) / (8 - 1)  # B = 6 rows, between the table's points 1 and 8
    assert o.theta.item() == pytest.approx((1 + 0.9 + 0.85 + 0.8 + 0.7 + 0.05) * 1000 / step_ms, rel=1e-6)
    counted = dk.schedule_verify_lens(surv, cost_table=table, backend=host_backend)
    assert counted.verify_lens.tolist() == [0] * 7 + [4]


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_inactive_requests_equal_the_active_rows_alone(host_backend, mode):
    g = torch.Generator().manual_seed(11 + (mode == "exact"))
    for n, k in ((1, 3), (6, 4), (40, 7)):
        for case, active in enumerate(_masks(g, n)):
            kw = dict(cost_table=TABLES[case % 4], mode=mode, min_len=case % 2, max_len=k)
            if mode == "argmax":
                kw.update(min_gain=0.02 * case, budget_survival=torch.rand(3, k, generator=g).cumprod(1))
            surv = _random_survival(g, n, k, case)
            o = dk.schedule_verify_lens(surv, active=active, backend=host_backend, **kw)
            lens, cu, theta = _alone(surv, active, **kw)
            assert o.verify_lens.tolist() == lens.tolist() and o.cu_seqlens.tolist() == cu.tolist()
            assert o.theta.item() == pytest.approx(theta.item(), rel=1e-6)
            if case == 0:  # every request active: as without the mask, to the bit
                plain = dk.schedule_verify_lens(surv, backend=host_backend, **kw)
                assert all(torch.equal(a, b) for a, b in zip(o, plain))


def _mask_cases(g, shapes):
    for n, k in shapes:
        for case, active in enumerate(_masks(g, n)):
            kw = dict(cost_table=TABLES[case % 4] if case < 3 else _random_table(g), min_len=case % 2 if k else 0)
            yield _random_survival(g, n, k, case), active, kw


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_triton_inactive_requests(triton_device, mode):
    g = torch.Generator().manual_seed(21)
    for surv, active, kw in _mask_cases(g, [(1, 3), (5, 4), (60, 7), (9, 0)]):
        if mode == "argmax":
            kw["budget_survival"] = torch.rand(2, 5, generator=g)
        _triton_vs_reference(triton_device, surv, active=active, mode=mode, **kw)


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_cuda_inactive_requests(cuda_device, simt_check, mode):
    """One tile of 32 and of 512 threads, several tiles (1000 x 7), K = 0."""
    g = torch.Generator().manual_seed(31)
    for surv, active, kw in _mask_cases(g, [(3, 5), (300, 6), (1000, 7), (9, 0)]):
        if mode == "argmax":
            kw["budget_survival"] = torch.rand(2, 5, generator=g)
        _cuda_vs_reference(cuda_device, simt_check, surv, active=active, mode=mode, **kw)


def test_cpu_inactive_requests():
    g = torch.Generator().manual_seed(41)
    for mode in ("exact", "argmax"):
        for surv, active, kw in _mask_cases(g, [(1, 3), (17, 7), (9, 0)]):
            _cpu_vs_reference(surv, active=active, mode=mode, **kw)
