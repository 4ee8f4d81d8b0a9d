"""The C ABI's test vectors (python_tests/data/capi_vectors.json, read by csrc/capi/test_capi_vectors.cpp under
ctest) are the reference's current outputs: regenerating them must reproduce the checked-in file byte for byte.
After a deliberate change of the reference, rerun ``python python_tests/data/make_capi_vectors.py``."""

import importlib.util
import os

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _generator():
    spec = importlib.util.spec_from_file_location("make_capi_vectors", os.path.join(DATA, "make_capi_vectors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_vectors_match_the_reference():
    gen = _generator()
    with open(os.path.join(DATA, "capi_vectors.json")) as fh:
        checked_in = fh.read()
    fresh = gen.dumps(gen.make_vectors())
    assert fresh == checked_in, ("python_tests/data/capi_vectors.json is stale: the reference's outputs changed; "
                                 "rerun python python_tests/data/make_capi_vectors.py")


def test_vectors_cover_the_ops():
    import json
    with open(os.path.join(DATA, "capi_vectors.json")) as fh:
        v = json.load(fh)
    assert len(v["scan"]) >= 10 and len(v["schedule"]) >= 20
    assert {c["mode"] for c in v["schedule"]} == {"exact", "argmax"}
    assert any(c["conf_logits"] is not None for c in v["schedule"])
    assert any(c["budget_survival"] is not None for c in v["schedule"])
    assert {c["survival"]["dtype"] for c in v["schedule"] if c["survival"]} >= {"f32", "bf16", "f16"}
    assert any(c["accept_mask"] is not None for c in v["scan"]) and any(c["block_table"] for c in v["scan"])


def test_vectors_cover_draft_block_and_verify_chain():
    import json
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
