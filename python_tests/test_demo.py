"""The demo: shipped weights, ``python -m dspark_kernels.demo --quick`` end to end, greedy losslessness on the trained
pair, and the training script's pieces on a tiny corpus."""

import json
import os

import pytest
import torch

from dspark_kernels.decode import Scheduler, SpeculativeDecoder, greedy_reference, load_drafter, load_target
from dspark_kernels.decode.checkpoint import read_config, read_tensors
from dspark_kernels.demo import demo, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_shipped_weights_load_and_match_their_configs():
    target, tok, drafters, sts, prompts = demo.load_demo()
    tcfg = read_config(os.path.join(demo.ASSETS, "target"))
    assert target.vocab_size == tcfg["vocab_size"] == tok.get_vocab_size()
    assert target.num_layers == tcfg["num_hidden_layers"] == len(target.layers)
    assert target.embed_tokens.weight.shape == (tcfg["vocab_size"], tcfg["hidden_size"])
    assert set(drafters) == set(demo.DRAFTERS)
    total = 0
    for name in ("target",) + demo.DRAFTERS:
        folder = os.path.join(demo.ASSETS, name)
        tensors = read_tensors(folder)
        assert all(t.dtype == torch.float16 for t in tensors.values() if t.is_floating_point()), name  # fp16
        assert all(t.is_floating_point() or k == "d2t" for k, t in tensors.items()), name
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert total < 12e6, total
    for name, dr in drafters.items():
        cfg = read_config(os.path.join(demo.ASSETS, name))
        assert dr.block_size == cfg["block_size"] == 15
        assert cfg["mask_token_id"] == tok.token_to_id(train.MASK)
        assert (dr.markov_head is None) == (name == "baseline")
        if dr.markov_head is not None:
            assert dr.markov_head.kind == cfg["markov_head_type"] == name.split("_")[1]
            assert dr.markov_head.markov_w1.weight.shape == (tcfg["vocab_size"], cfg["markov_rank"])
        assert dr.confidence_head is not None
        assert all(len(sts[name][t]) == 15 and min(sts[name][t]) > 0 for t in ("greedy", "t1"))
    assert len(prompts) >= 64 and all(len(p) == 32 and max(p) < target.vocab_size for p in prompts)


@pytest.mark.parametrize("name", ["dspark_vanilla", "dspark_vanilla_vd1024"])
def test_greedy_equals_the_targets_own_greedy(name):
    """The trained pair (and the drafter over a reduced vocabulary of 1024 of the 2048 ids) is lossless and its
    drafts are accepted."""
    target, _, drafters, sts, prompts = demo.load_demo(names=(name,))
    ps = prompts[:3]
    ref = greedy_reference(target, ps, 24)
    dec = SpeculativeDecoder(target, drafters[name], backend="reference")
    res = dec.generate(ps, 24, scheduler=Scheduler("fixed"))
    assert res.tokens == ref
    assert res.stats.acceptance_length > 1.5  # the trained drafter's drafts do get accepted
    if name.endswith("vd1024"):
        assert drafters[name].draft_to_target().numel() == 1024 < target.vocab_size


def batch_of(row):
    return row["batch"]  # a step verifies at least the anchor row of every request


@pytest.mark.slow  # the whole demo: a minute on 2 cores; its pieces (weights, greedy equality) run by default
def test_quick_demo_end_to_end(tmp_path):
    assert demo.main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "demo.json").read_text())
    assert os.path.getsize(tmp_path / "demo.png") > 10_000
    assert set(res["acceptance"]) == set(demo.ROWS)
    for row in res["acceptance"].values():
        for t in ("greedy", "t1"):
            assert all(1.0 <= row[f"{t}_K{k}"]["acceptance_length"] <= k + 1 for k in demo.KS)
            r = row[f"{t}_K15"]
            assert len(r["conditional_acceptance"]) == 15 and len(r["ece_raw"]) == 15 and len(r["ece_sts"]) == 15
    modes = {r["mode"].split()[0] for r in res["scheduling"]}
    assert modes == {"fixed", "threshold", "exact", "argmax"}
    assert {r["batch"] for r in res["scheduling"]} == {1, 16, 64}
    for r in res["scheduling"]:
        assert r["measured_tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 and r["target_rows_per_step"] >= batch_of(r)
    assert res["cost_tables"]["cpu"]["token_counts"][-1] >= 64 * 16
    assert res["greedy_check"]["equal"] is True and res["greedy_check"]["runs"] == len(demo.ROWS) * len(demo.KS)
    assert res["sampling_test"]["passes"] is True and res["sampling_test"]["df"] >= 1


def _tiny_config():
    return train.TrainConfig(vocab=300, max_corpus_chars=40_000, d=32, layers=3, heads=4, kv_heads=2, inter=64,
                             target_steps=3, target_batch=4, seq_len=32, prompt_len=16, gen_len=24, n_sequences=8,
                             block=5, markov_rank=8, layer_ids=[0, 1], draft_steps=2, draft_batch=2, anchors=2,
                             calib_prompts=2, calib_tokens=8, draft_vocab=100)


@pytest.mark.slow  # two whole training runs (the determinism check)
def test_training_pieces_on_a_tiny_corpus(tmp_path):
    c = _tiny_config()
    res = train.run(c, str(tmp_path), log=lambda s: None)
    assert set(res["stage_seconds"]) == {"corpus", "tokenizer", "target", "continuations", "drafters", "calibrate"}
    target = load_target(tmp_path / "target")
    assert target.vocab_size == 300 and target.num_layers == 3
    toks = torch.randint(2, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hidden = train.target_forward(target, toks, keep=c.layer_ids)
    for name in ("dspark_vanilla", "dspark_gated", "dspark_rnn", "baseline", "dspark_vanilla_vd100"):
        dr = load_drafter(tmp_path / name, target)
        assert (dr.markov_head is None) == (name == "baseline")
        if name.endswith("vd100"):  # the 100 most frequent ids of the training sequences, the target's LM rows
            ids = dr.draft_to_target()
            assert ids.shape == (100,) and torch.equal(ids, ids.sort().values) and int(ids[-1]) < 300
            torch.testing.assert_close(dr.draft_lm_head, target.lm_head_weight[ids])
        # the training forward is the decode loop's forward_block: same logits from the paged-cache path
        a = 12
        target.hidden_layer_ids = c.layer_ids
        cache = target.alloc_cache(1, 40)
        dr.alloc_cache(cache)
        with torch.no_grad():
            out = target(toks[0, :a], torch.arange(a), torch.tensor([0, a], dtype=torch.int32), a, a)
            dr.write_context(out.hidden, torch.arange(a), cache.slots(torch.zeros(a, dtype=torch.long),
                                                                      torch.arange(a)))
            u_dec, h_dec = dr.forward_block(toks[0, a:a + 1], torch.tensor([a]), a)
            u_tr, h_tr = train.drafter_forward(dr, hidden, toks, torch.tensor([[a]]))
        torch.testing.assert_close(u_tr[0, 0], u_dec[0], atol=1e-4, rtol=1e-4)
        assert json.loads((tmp_path / name / "sts.json").read_text())["greedy"].__len__() == 5
    # deterministic given the seed: a second run writes the same weights
    again = tmp_path / "again"
    train.run(c, str(again), log=lambda s: None)
    for name in ("target", "dspark_rnn"):
        a, b = read_tensors(tmp_path / name), read_tensors(again / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
