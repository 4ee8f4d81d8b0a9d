"""dk.CostTable, dk.survival_from_conf, dk.expected_calibration_error, dk.fit_sts."""

import json

import numpy as np
import pytest
import torch

import dspark_kernels as dk
from dspark_kernels.calibration import default_sts_grid


# --- CostTable --------------------------------------------------------------------------------------------------

def test_cost_table_json_round_trip(tmp_path):
    ct = dk.CostTable([1, 16, 64], [8.0, 9.5, 21.25], fixed_overhead_ms=0.75)
    path = tmp_path / "cost.json"
    ct.to_json(path)
    raw = json.loads(path.read_text())
    assert raw == {"token_counts": [1, 16, 64], "step_time_ms": [8.0, 9.5, 21.25], "fixed_overhead_ms": 0.75}
    back = dk.CostTable.from_json(path)
    assert back == ct
    assert back.sps(30) == ct.sps(30)


def test_cost_table_json_without_overhead(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text('{"token_counts": [1, 2], "step_time_ms": [4, 5]}')
    ct = dk.CostTable.from_json(path)
    assert ct.fixed_overhead_ms == 0.0
    assert ct.token_counts == (1, 2) and ct.step_time_ms == (4.0, 5.0)


def test_interpolation_by_hand():
    ct = dk.CostTable([1, 3, 7], [10.0, 14.0, 22.0], fixed_overhead_ms=2.0)
    expect = {0: 10.0, 1: 10.0, 2: 12.0, 3: 14.0, 5: 18.0, 7: 22.0, 9: 26.0, 2.5: 13.0}
    for b, ms in expect.items():
        assert ct.time_ms(b) == pytest.approx(ms)
        assert ct.sps(b) == pytest.approx(1000.0 / (ms + 2.0))
    b = torch.tensor(list(expect), dtype=torch.float32)
    assert torch.allclose(ct.time_ms(b), torch.tensor(list(expect.values()), dtype=torch.float64))
    assert ct.sps(b).shape == (len(expect),)


def test_single_point_is_constant():
    ct = dk.CostTable([8], [5.0])
    for b in (0, 1, 8, 100):
        assert ct.time_ms(b) == 5.0
        assert ct.sps(b) == pytest.approx(200.0)


def test_falling_last_segment_does_not_extrapolate_down():
    ct = dk.CostTable([1, 2], [10.0, 8.0])
    assert ct.time_ms(1.5) == pytest.approx(9.0)
    assert ct.time_ms(100) == pytest.approx(8.0)  # slope clamped at 0 above the last point


def test_appendix_sps():
    ct = dk.CostTable([1, 2, 3], [1000.0, 2000.0, 1000.0 / 0.45])
    assert [ct.sps(b) for b in (1, 2, 3)] == pytest.approx([1.0, 0.5, 0.45])


@pytest.mark.parametrize("args,match", [
    (([1, 2], [1.0]), "same length"),
    (([], []), "at least one"),
    (([2, 1], [1.0, 2.0]), "strictly ascending"),
    (([1, 1], [1.0, 2.0]), "strictly ascending"),
    (([1, 2.5], [1.0, 2.0]), "integers"),
    (([-1, 2], [1.0, 2.0]), "integers"),
    (([1, float("inf")], [1.0, 2.0]), "token_counts"),
    (([1, float("nan")], [1.0, 2.0]), "token_counts"),
    (([1, 2], [1.0, 0.0]), "positive"),
    (([1, 2], [1.0, -3.0]), "positive"),
    (([1, 2], [1.0, float("nan")]), "positive"),
    (([1, 2], [1.0, float("inf")]), "positive"),
    (([1, 2], [1.0, 2.0], -1.0), "fixed_overhead_ms"),
    (([1, 2], [1.0, 2.0], float("nan")), "fixed_overhead_ms"),
    (([1, 2], [1.0, 2.0], "x"), "fixed_overhead_ms"),
    (([1, "a"], [1.0, 2.0]), "token_counts"),
    ((5, [1.0]), "token_counts"),
    (("14", [1.0, 2.0]), "token_counts"),                 # a string is not the sequence 1, 4
    (([1, "4"], [1.0, 2.0]), "token_counts"),
    (([1, 2], [True, 2.0]), "step_time_ms"),
    (([1, 2], "12"), "step_time_ms"),
    ((torch.tensor([True, False]), [1.0, 2.0]), "token_counts"),
    (([1, 2], [1.0, 2.0], "1.5"), "fixed_overhead_ms"),
    (([1, 2], [1.0, 2.0], True), "fixed_overhead_ms"),
])
def test_cost_table_validation(args, match):
    with pytest.raises(ValueError, match=match):
        dk.CostTable(*args)


def test_from_dict_validation():
    with pytest.raises(ValueError, match="step_time_ms"):
        dk.CostTable.from_dict({"token_counts": [1]})
    with pytest.raises(ValueError, match="unknown"):
        dk.CostTable.from_dict({"token_counts": [1], "step_time_ms": [1.0], "typo": 1})
    with pytest.raises(ValueError, match="object"):
        dk.CostTable.from_dict([1, 2])


def test_cost_table_accepts_tensors_and_is_hashable():
    ct = dk.CostTable(torch.tensor([1, 4]), torch.tensor([2.0, 3.0]))
    assert ct.token_counts == (1, 4) and ct.step_time_ms == (2.0, 3.0)
    assert hash(ct) == hash(dk.CostTable([1, 4], [2.0, 3.0]))
    numpy = dk.CostTable(np.array([1, 4]), [np.float32(2.0), 3.0], np.float64(0.5))
    assert numpy == dk.CostTable([1, 4], [2.0, 3.0], 0.5)


# --- survival and ECE -------------------------------------------------------------------------------------------

def test_survival_from_conf():
    z = torch.tensor([[0.0, 2.0, -1.0]])
    a = dk.survival_from_conf(z)
    s = torch.sigmoid(z[0])
    assert a.dtype == torch.float32 and a.shape == (1, 3)
    assert torch.allclose(a[0], torch.stack([s[0], s[0] * s[1], s[0] * s[1] * s[2]]))
    temps = torch.tensor([1.0, 2.0, 0.5])
    a = dk.survival_from_conf(z.to(torch.bfloat16), temps)
    s = torch.sigmoid(torch.tensor([0.0, 1.0, -2.0]))
    assert torch.allclose(a[0], torch.cumprod(s, 0))


def test_ece_by_hand():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    label = torch.tensor([0, 1, 1, 1])
    # bin 1: |0.1 - 0.5| * 2/4 = 0.2; bin 9: |0.9 - 1| * 2/4 = 0.05
    assert dk.expected_calibration_error(pred, label, n_bins=10) == pytest.approx(0.25)
    # one bin: |mean pred - mean label| = |0.5 - 0.75|
    assert dk.expected_calibration_error(pred, label, n_bins=1) == pytest.approx(0.25)
    # pred = 1.0 falls in the last bin
    assert dk.expected_calibration_error(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 15) == \
        pytest.approx(0.5)
    assert dk.expected_calibration_error(torch.tensor([]), torch.tensor([])) == 0.0
    with pytest.raises(ValueError, match="n_bins"):
        dk.expected_calibration_error(pred, label, n_bins=0)
    for n_bins in (1.5, float("nan")):
        with pytest.raises(ValueError, match="n_bins"):
            dk.expected_calibration_error(pred, label, n_bins=n_bins)
    with pytest.raises(ValueError, match="same number"):
        dk.expected_calibration_error(pred, label[:3])


def test_default_grid():
    g = default_sts_grid()
    assert g.numel() in (61, 62)
    assert (g[1:] > g[:-1]).all()
    assert g[0] == pytest.approx(10 ** -1.5) and g[-1] == pytest.approx(10 ** 1.5)
    assert (g == 1.0).any()


# --- fit_sts ----------------------------------------------------------------------------------------------------

def _synthetic(m=20000, k=4, true_t=2.5, seed=0, with_verify=False):
    """Drafter logits z; the true per-position acceptance is sigmoid(z / true_t) (overconfident drafter)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, k, generator=g) * 3.0 + 1.0
    accept = torch.rand(m, k, generator=g) < torch.sigmoid(z / true_t)
    accepted = torch.cumprod(accept.long(), dim=1).sum(1)
    verify = None
    if with_verify:
        verify = torch.randint(0, k + 1, (m,), generator=g)
        accepted = torch.minimum(accepted, verify)
    return z, accepted, verify


def _eces(z, accepted, temps, verify=None):
    surv = dk.survival_from_conf(z, temps)
    out = []
    for k in range(z.shape[1]):
        rows = torch.ones(len(z), dtype=torch.bool) if verify is None else verify >= k + 1
        out.append(dk.expected_calibration_error(surv[rows, k], accepted[rows] >= k + 1))
    return out


@pytest.mark.parametrize("with_verify", [False, True])
def test_fit_sts_recovers_temperature_and_lowers_ece(with_verify):
    z, accepted, verify = _synthetic(with_verify=with_verify)
    temps = dk.fit_sts(z, accepted, verify_lens=verify)
    assert temps.dtype == torch.float32 and temps.shape == (4,)
    # the first positions have the most evidence; later ones (fewer eligible rows, positives) are noisier
    assert ((temps[:2] > 1.8) & (temps[:2] < 3.5)).all(), temps
    assert ((temps > 1.5) & (temps < 5.0)).all(), temps
    before = _eces(z, accepted, None, verify)
    after = _eces(z, accepted, temps, verify)
    for b, a in zip(before, after):
        assert a < 0.5 * b and a < 0.03, (before, after)


def test_fit_sts_calibrated_data_stays_near_one():
    z, accepted, _ = _synthetic(true_t=1.0, seed=1)
    temps = dk.fit_sts(z, accepted)
    assert ((temps > 0.75) & (temps < 1.35)).all(), temps


def test_fit_sts_no_rows_gives_one_and_custom_grid():
    z, accepted, _ = _synthetic(m=500, k=3, seed=2)
    verify = torch.zeros(500, dtype=torch.int64)  # nothing verified: no evidence anywhere
    assert dk.fit_sts(z, accepted, verify_lens=verify).tolist() == [1.0, 1.0, 1.0]
    temps = dk.fit_sts(z, accepted, grid=[0.5, 2.5, 4.0])
    assert set(temps.tolist()) <= {0.5, 2.5, 4.0}
    with pytest.raises(ValueError, match="grid"):
        dk.fit_sts(z, accepted, grid=[1.0, -1.0])


def test_fit_sts_bad_arguments():
    z = torch.randn(10, 3)
    with pytest.raises(ValueError, match="conf_logits"):
        dk.fit_sts(torch.randn(10), torch.zeros(10))
    with pytest.raises(ValueError, match="accepted_lens"):
        dk.fit_sts(z, torch.zeros(9))
    with pytest.raises(ValueError, match="verify_lens"):
        dk.fit_sts(z, torch.zeros(10), verify_lens=torch.zeros(3))
