"""The C ABI's test vectors (python_tests/data/capi_vectors.json, read by csrc/capi/test_capi_vectors.cpp under
ctest) are the reference's current outputs: regenerating them on any CPU must reproduce the checked-in file, its
integers exactly and its floats within the C ABI test's tolerance. After a deliberate change of the reference, rerun
``python python_tests/data/make_capi_vectors.py``."""

import importlib.util
import json
import math
import os

import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# The C ABI test's tolerances (csrc/capi/test_capi_vectors.cpp): theta relative, other floats relative + absolute.
THETA_RTOL = 1e-6
RTOL, ATOL = 1e-5, 1e-6


def _generator():
    spec = importlib.util.spec_from_file_location("make_capi_vectors", os.path.join(DATA, "make_capi_vectors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mismatch(fresh, kept, path="$"):
    """Where ``fresh`` departs from ``kept`` under DESIGN's contract, or None: structure, strings, booleans,
    integers and the positions of NaN / inf exactly; finite floats within the C ABI test's tolerance. Float
    bits differ between CPUs (PyTorch's AVX2 and AVX-512 paths round differently), integers never do."""
    if type(fresh) is not type(kept):
        return f"{path}: {type(fresh).__name__} {fresh!r} where the file has {type(kept).__name__} {kept!r}"
    if isinstance(kept, dict):
        if fresh.keys() != kept.keys():
            return f"{path}: keys {sorted(fresh)} where the file has {sorted(kept)}"
        return next((m for k in kept if (m := _mismatch(fresh[k], kept[k], f"{path}.{k}"))), None)
    if isinstance(kept, list):
        if len(fresh) != len(kept):
            return f"{path}: {len(fresh)} items where the file has {len(kept)}"
        return next((m for i, (a, b) in enumerate(zip(fresh, kept)) if (m := _mismatch(a, b, f"{path}[{i}]"))), None)
    if isinstance(kept, float):
        if math.isnan(kept) or math.isinf(kept) or math.isnan(fresh) or math.isinf(fresh):
            same = (math.isnan(fresh) and math.isnan(kept)) or fresh == kept
        else:
            rtol, atol = (THETA_RTOL, 0.0) if path.endswith(".theta") else (RTOL, ATOL)
            same = abs(fresh - kept) <= rtol * abs(kept) + atol
        return None if same else f"{path}: {fresh!r} where the file has {kept!r}"
    return None if fresh == kept else f"{path}: {fresh!r} where the file has {kept!r}"


def test_checked_in_vectors_match_the_reference():
    """Regenerating the vectors on this CPU reproduces the file: integers exactly, floats within tolerance."""
    gen = _generator()
    with open(os.path.join(DATA, "capi_vectors.json")) as fh:
        checked_in = json.load(fh)
    fresh = json.loads(gen.dumps(gen.make_vectors()))
    where = _mismatch(fresh, checked_in)
    assert where is None, (f"python_tests/data/capi_vectors.json is stale at {where}: the reference's outputs "
                           "changed; rerun python python_tests/data/make_capi_vectors.py")


@pytest.mark.parametrize("fresh, kept, ok", [
    ({"a": [1, 2.0]}, {"a": [1, 2.0]}, True),
    ({"a": [1, 2.0 * (1 + 2e-7)]}, {"a": [1, 2.0]}, True),           # one float32 ulp or two: another CPU
    ({"a": [1, 2.001]}, {"a": [1, 2.0]}, False),                     # a real change of a float
    ({"a": [2, 2.0]}, {"a": [1, 2.0]}, False),                       # any change of an integer
    ({"a": [1, 2.0]}, {"a": [1.0, 2.0]}, False),                     # an integer where a float was
    ({"a": [1]}, {"a": [1, 2.0]}, False),
    ({"b": 1}, {"a": 1}, False),
    ({"s": [float("nan"), float("inf")]}, {"s": [float("nan"), float("inf")]}, True),
    ({"s": [0.0]}, {"s": [float("nan")]}, False),                    # NaN positions are exact
    ({"s": [float("-inf")]}, {"s": [float("inf")]}, False),
    ({"s": [1e30]}, {"s": [float("inf")]}, False),
    ({"x": {"theta": 1.0 + 2e-6}}, {"x": {"theta": 1.0}}, False),     # theta is held to 1e-6 relative
    ({"x": {"theta": 1.0 + 5e-7}}, {"x": {"theta": 1.0}}, True),
    ({"m": "exact"}, {"m": "argmax"}, False),
    ({"v": None}, {"v": [1]}, False),
    ({"f": True}, {"f": 1}, False),
])
def test_vector_comparison_rule(fresh, kept, ok):
    assert (_mismatch(fresh, kept) is None) == ok


def test_vectors_cover_the_ops():
    with open(os.path.join(DATA, "capi_vectors.json")) as fh:
        v = json.load(fh)
    assert len(v["scan"]) >= 10 and len(v["schedule"]) >= 20
    assert {c["mode"] for c in v["schedule"]} == {"exact", "argmax"}
    assert any(c["conf_logits"] is not None for c in v["schedule"])
    assert any(c["budget_survival"] is not None for c in v["schedule"])
    assert {c["survival"]["dtype"] for c in v["schedule"] if c["survival"]} >= {"f32", "bf16", "f16"}
    assert any(c["accept_mask"] is not None for c in v["scan"]) and any(c["block_table"] for c in v["scan"])


def test_vectors_cover_draft_block_and_verify_chain():
    with open(os.path.join(DATA, "capi_vectors.json")) as fh:
        v = json.load(fh)
    draft, verify = v["draft"], v["verify"]
    assert {c["head"] for c in draft} == {"vanilla", "gated", "rnn"}
    for head in ("vanilla", "gated", "rnn"):  # greedy and sampled for every head
        assert {c["temperature"] is None for c in draft if c["head"] == head} == {True, False}
    assert any(c["conf_weight"] is not None and c["sts_temperatures"] is not None for c in draft)
    assert any(c["return_logits"] for c in draft)
    assert any(c["base_logits"]["dtype"] == "f32" for c in draft)
    assert {c["method"] for c in verify if c["temperature"] is not None} == {"token", "block"}
    assert any(c["temperature"] is None for c in verify)
    assert any(c["draft_logprobs"] is not None for c in verify if c["method"] == "token")
    assert any(c["cu_seqlens"] is not None for c in verify) and any(c["cu_seqlens"] is None for c in verify)
    assert any(c["stop_token_ids"] is not None for c in verify)
    assert any(c["verify_lens"] is not None for c in verify)
    assert any(c["survival"] is not None for c in verify)
    # the vectors must exercise acceptance: some partial, some full, some none
    n_acc = [a for c in verify for a in c["expect"]["num_accepted"]]
    assert 0 in n_acc and any(0 < a < 4 for a in n_acc) and 4 in n_acc


def test_vectors_stay_small():
    assert os.path.getsize(os.path.join(DATA, "capi_vectors.json")) < 300_000
