"""The target model against transformers (fp32, tight), ragged paged batches, the HF adapter, checkpoints."""

import dataclasses

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_kernels.decode.checkpoint import load_target, save_target
from dspark_kernels.decode.decoder import SpeculativeDecoder
from dspark_kernels.decode.hf_target import HFTarget
from dspark_kernels.decode.model import ModelConfig, TargetModel, greedy_reference
from dspark_kernels.decode.kv_cache import sdpa_gqa
from dspark_kernels.decode.testing import OracleDrafter, tiny_drafter, tiny_drafter_config, tiny_hf_config, tiny_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")




def hf_twin(target):
    c = target.config
    qwen = c.qk_norm
    cfg_cls = transformers.Qwen3Config if qwen else transformers.LlamaConfig
    lm_cls = transformers.Qwen3ForCausalLM if qwen else transformers.LlamaForCausalLM
    cfg = cfg_cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  **({"rope_parameters": {**c.rope_scaling, "rope_theta": c.rope_theta}} if c.rope_scaling else {}))
    hf = lm_cls(cfg).eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in target.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    return hf


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@pytest.mark.parametrize("model_type,extra", [("qwen3", {}), ("llama", {}), ("qwen3", {"attention_bias": True}),
                                              ("llama", {"rope_scaling": LLAMA3_ROPE})])
def test_logits_match_transformers_ragged_paged(model_type, extra):
    target = tiny_target(seed=2, model_type=model_type, **extra)
    target.hidden_layer_ids = [-1, 1]
    hf = hf_twin(target)
    seqs = [torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 1, 9)]
    target.alloc_cache(3, 32, block_size=4, shuffle_seed=0)
    # prefill the first tokens of each sequence, then continue with ragged chunks at per-request positions
    split = [3, 0, 4]
    chunks = [(s[:c], torch.arange(c)) for s, c in zip(seqs, split)]
    rest = [(s[c:], torch.arange(c, len(s))) for s, c in zip(seqs, split)]
    outs = []
    for part in (chunks, rest):
        lens = [len(t) for t, _ in part]
        cu = torch.tensor([0] + lens).cumsum(0).int()
        out = target(torch.cat([t for t, _ in part]), torch.cat([p for _, p in part]), cu, max(lens), 9)
        outs.append((out, cu))
    with torch.no_grad():
        for r, s in enumerate(seqs):
            ref = hf(s[None], output_hidden_states=True)
            got = torch.cat([o.logits[cu[r]:cu[r + 1]] for o, cu in outs])
            hid = torch.cat([o.hidden[cu[r]:cu[r + 1]] for o, cu in outs])
            torch.testing.assert_close(got, ref.logits[0], rtol=1e-5, atol=1e-5)
            want_hidden = torch.cat([ref.hidden_states[0][0], ref.hidden_states[2][0]], -1)
            torch.testing.assert_close(hid, want_hidden, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_and_checkpoint_round_trip(tmp_path):
    for tied in (False, True):
        target = tiny_target(seed=4, model_type="llama", tie_word_embeddings=tied)
        save_target(target, tmp_path / f"t{tied}")
        loaded = load_target(tmp_path / f"t{tied}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"t{tied}").eval()
        seq = torch.arange(1, 12)
        loaded.alloc_cache(1, 16)
        got = loaded(seq, torch.arange(11), torch.tensor([0, 11], dtype=torch.int32), 11, 11).logits
        with torch.no_grad():
            torch.testing.assert_close(got, hf(seq[None]).logits[0], rtol=1e-5, atol=1e-5)
        assert greedy_reference(loaded, [[1, 2, 3]], 6) == greedy_reference(target, [[1, 2, 3]], 6)


def test_hf_adapter_as_target():
    target = tiny_target(seed=6)
    hf = hf_twin(target)
    prompt = [4, 8, 15, 16, 23]
    want = greedy_reference(target, [prompt], 12)
    adapter = HFTarget(hf)
    drafter = OracleDrafter(tiny_drafter_config(target, block_size=4), adapter.input_embeddings,
                            adapter.lm_head_weight).init_random(1)
    drafter.set_reference([prompt + want[0]])
    dec = SpeculativeDecoder(adapter, drafter)
    res = dec.generate([prompt], 12)
    assert res.tokens == want
    assert res.stats.acceptance_length > 1.5
    with pytest.raises(ValueError, match="single request"):
        dec.generate([prompt, prompt], 4)


def _block_over_concatenated_keys(dr, anchor, anchor_pos, kv_len):
    """The drafter's block forward with each layer's keys ``[context (positions < kv_len); block]`` concatenated,
    the context masked at ``anchor_pos``: the meaning ``forward_block`` computes over its cache in place."""
    n, k_len = anchor.shape[0], dr.block_size
    ids = torch.full((n, k_len), dr.config.mask_token_id)
    ids[:, 0] = anchor
    x = dr.embed_tokens(ids)
    pos = anchor_pos.view(n, 1) + torch.arange(k_len)
    slots = dr.cache.slots(torch.arange(n).view(n, 1).expand(n, kv_len), torch.arange(kv_len).expand(n, kv_len))
    ctx = torch.arange(kv_len).view(1, -1) < anchor_pos.view(n, 1)
    mask = torch.cat([ctx, ctx.new_ones(n, k_len)], 1).view(n, 1, 1, -1)
    inv_freq = dr.rope(x.device)
    for i, layer in enumerate(dr.layers):
        attn, hx = layer.self_attn, layer.input_layernorm(x)
        q = attn.project_q(hx, pos, inv_freq).transpose(1, 2)
        kb, vb = attn.project_kv(hx, pos, inv_freq)
        kc, vc = dr.cache.gather(i, slots)
        o = sdpa_gqa(q, torch.cat([kc, kb.transpose(1, 2)], 2), torch.cat([vc, vb.transpose(1, 2)], 2), mask,
                     attn.d ** -0.5)
        x = x + attn.o_proj(o.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = dr.norm(x)
    return h @ dr.draft_lm_head.t(), h


class _Copies(TorchDispatchMode):
    """The largest output of an op that copies (cat, index_select, clone, dtype conversion)."""
    COPIES = ("aten::cat", "aten::index_select", "aten::clone", "aten::_to_copy", "aten::gather")

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.name() in self.COPIES:
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize("shuffle", [None, 2])
def test_drafter_block_attends_over_its_cache_in_place(shuffle):
    """forward_block writes the block's K/V at the block's positions and attends over the cache: the same logits as
    keys [context; block] concatenated (ragged anchors, a loose host bound), the context untouched, the block's
    rows written; on a contiguous cache no op copies anything near the context's size."""
    target = tiny_target(seed=0)
    dr = tiny_drafter(target, block_size=4)
    cache = target.alloc_cache(3, 64, block_size=4, shuffle_seed=shuffle)
    dr.alloc_cache(cache)
    g = torch.Generator().manual_seed(0)
    dr.cache.k.normal_(generator=g)
    dr.cache.v.normal_(generator=g)
    anchor, anchor_pos, kv_len = torch.tensor([5, 9, 30]), torch.tensor([40, 7, 52]), 56
    want_u, want_h = _block_over_concatenated_keys(dr, anchor, anchor_pos, kv_len)
    before = dr.cache.k.clone()
    copies = _Copies()
    with torch.no_grad(), copies:
        u, h = dr.forward_block(anchor, anchor_pos, kv_len)
    torch.testing.assert_close(u, want_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    for r, p in enumerate(anchor_pos.tolist()):
        ctx = dr.cache.slots(torch.full((p,), r), torch.arange(p))
        block = dr.cache.slots(torch.full((4,), r), torch.arange(p, p + 4))
        assert torch.equal(dr.cache.k[:, ctx], before[:, ctx]) and not torch.equal(dr.cache.k[:, block],
                                                                                    before[:, block])
    b = dr.config.backbone
    context = 3 * b.num_key_value_heads * b.head_dim * kv_len
    assert copies.largest < context / 4 if shuffle is None else copies.largest >= context
    with pytest.raises(ValueError, match="exceeds the drafter cache"):
        dr.forward_block(anchor, anchor_pos, 61)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_unsupported_hidden_act_is_refused(model_type, act):
    """transformers applies ACT2FN[hidden_act] in the MLP; ours is SiLU-gated, so any other activation is refused
    (before: accepted silently, logits off by ~1 against transformers)."""
    with pytest.raises(ValueError, match="hidden_act"):
        tiny_target(model_type=model_type, hidden_act=act)
    for ok in ("silu", "swish"):  # the same function under both names (ACT2FN)
        tiny_target(model_type=model_type, hidden_act=ok)


@pytest.mark.parametrize("extra", [dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
                                   dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
                                   dict(layer_types=["full_attention", "sliding_attention", "full_attention"])])
def test_qwen3_sliding_window_is_refused(extra):
    """transformers' Qwen3 attends over a sliding window in the layers from max_window_layers on (or those
    layer_types names "sliding_attention"); ours attends over every key, so such a config is refused (before:
    accepted silently, logits differed from transformers' past the window)."""
    with pytest.raises(ValueError, match="sliding"):
        tiny_target(model_type="qwen3", **extra)
    # no sliding layer: accepted (the window off, or every layer below max_window_layers, or a Llama, which has none)
    tiny_target(model_type="qwen3", use_sliding_window=False, sliding_window=4, max_window_layers=0)
    tiny_target(model_type="qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=3)
    tiny_target(model_type="qwen3", layer_types=["full_attention"] * 3)
    tiny_target(model_type="llama", sliding_window=4)


@pytest.mark.parametrize("kv", [3, 8, 0, None])
def test_kv_heads_must_divide_heads(kv):
    """GQA maps query head h to KV head h // (heads / kv heads): kv heads not dividing the heads are refused when
    the config is read (before: a reshape error deep in the first forward, naming no field), and so is a count of
    0 (before: read as one KV head per query head)."""
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_target(model_type="llama", num_key_value_heads=kv) if kv is not None else tiny_target(
            model_type="llama", num_attention_heads=0)


def test_qwen3_mlp_has_no_bias_whatever_mlp_bias_says(tmp_path):
    """transformers' Qwen3 MLP has no bias whatever ``mlp_bias`` says (only Llama honours it): a Qwen3 checkpoint
    whose config.json carries ``mlp_bias: true`` loads and matches transformers (before: our model asked for
    MLP biases the checkpoint does not have, and the load failed)."""
    cfg = transformers.Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, mlp_bias=True,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert __import__("json").loads((tmp_path / "config.json").read_text())["mlp_bias"] is True
    loaded = load_target(tmp_path)
    assert not any(k.endswith("mlp.gate_proj.bias") for k in loaded.state_dict())
    seq = torch.arange(1, 10)
    loaded.alloc_cache(1, 16)
    got = loaded(seq, torch.arange(9), torch.tensor([0, 9], dtype=torch.int32), 9, 9).logits
    with torch.no_grad():
        torch.testing.assert_close(got, hf(seq[None]).logits[0], rtol=1e-5, atol=1e-5)
    assert any(k.endswith("mlp.gate_proj.bias") for k in tiny_target(model_type="llama", mlp_bias=True).state_dict())


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_head_dim_default_is_transformers(model_type):
    """A config.json without head_dim: transformers' Qwen3Config defaults it to 128, LlamaConfig to hidden / heads
    (before: hidden / heads for both, so a Qwen3 model without head_dim had other shapes than transformers')."""
    d = {k: v for k, v in tiny_hf_config(model_type).items() if k not in ("head_dim", "model_type")}
    cfg_cls = transformers.Qwen3Config if model_type == "qwen3" else transformers.LlamaConfig
    want = cfg_cls(**d).head_dim
    assert want == (128 if model_type == "qwen3" else 8)
    target = TargetModel(ModelConfig.from_hf({"model_type": model_type, **d})).init_random(1).eval()
    assert target.config.head_dim == want
    hf = hf_twin(target)
    seq = torch.arange(1, 8)
    target.alloc_cache(1, 8)
    got = target(seq, torch.arange(7), torch.tensor([0, 7], dtype=torch.int32), 7, 7).logits
    with torch.no_grad():
        torch.testing.assert_close(got, hf(seq[None]).logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_kv_heads_default_is_transformers(model_type):
    """``num_key_value_heads`` as transformers reads it: absent, Qwen3Config's 32 and LlamaConfig's one per query
    head; null, one per query head for both (before: one per query head whenever absent, so a Qwen3 config of 32
    heads without the field built an attention other than transformers')."""
    base = {k: v for k, v in tiny_hf_config(model_type).items() if k not in ("num_key_value_heads", "model_type")}
    cfg_cls = transformers.Qwen3Config if model_type == "qwen3" else transformers.LlamaConfig
    for heads, null in ((32, False), (32, True), (64, False)):
        d = dict(base, num_attention_heads=heads, hidden_size=4 * heads, head_dim=4,
                 **({"num_key_value_heads": None} if null else {}))
        got = ModelConfig.from_hf({"model_type": model_type, **d}).num_key_value_heads
        assert got == cfg_cls(**d).num_key_value_heads == (32 if model_type == "qwen3" and not null else heads)
    if model_type == "qwen3":   # 16 heads over Qwen3's default 32 KV heads: refused, the default named
        with pytest.raises(ValueError, match="num_key_value_heads.*default"):
            ModelConfig.from_hf({"model_type": model_type, **dict(base, num_attention_heads=16)})


def test_llama3_rope_fields_as_transformers():
    """llama3 RoPE: original_max_position_embeddings falls back to max_position_embeddings (as transformers
    standardises it; before: a KeyError); factor / low_freq_factor / high_freq_factor are required (transformers
    refuses without them; before: defaults were taken); a partial_rotary_factor below 1 is refused (transformers
    cannot run it; before: ignored)."""
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    d = tiny_hf_config("llama", max_position_embeddings=16, rope_scaling=rope)
    target = TargetModel(ModelConfig.from_hf(dict(d))).init_random(5).eval()
    assert target.config.rope_scaling["original_max_position_embeddings"] == 16
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"}))
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in target.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    seq = torch.randint(0, 48, (40,), generator=torch.Generator().manual_seed(1))
    target.alloc_cache(1, 40)
    got = target(seq, torch.arange(40), torch.tensor([0, 40], dtype=torch.int32), 40, 40).logits
    with torch.no_grad():
        torch.testing.assert_close(got, hf.eval()(seq[None]).logits[0], rtol=1e-5, atol=1e-5)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        with pytest.raises(ValueError, match=key):
            tiny_target(model_type="llama", rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != key})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        tiny_target(model_type="llama", rope_scaling=LLAMA3_ROPE, partial_rotary_factor=0.5)
    tiny_target(model_type="llama", partial_rotary_factor=0.5)  # default RoPE: transformers ignores it, as we do


def test_rope_scaling_takes_precedence_over_rope_parameters():
    """A config.json with both ``rope_scaling`` and ``rope_parameters`` (an old-style field added to a new config):
    transformers reads rope_scaling (its rope_theta from the top level), so do we (before: rope_parameters won, and
    the llama3 scaling and the top-level rope_theta were ignored silently)."""
    both = dict(rope_parameters={"rope_type": "default", "rope_theta": 50.0}, rope_scaling=dict(LLAMA3_ROPE),
                rope_theta=77.0)
    c = ModelConfig.from_hf(tiny_hf_config("llama", **both))
    want = transformers.LlamaConfig(**{k: v for k, v in tiny_hf_config("llama", **both).items()
                                       if k != "model_type"}).rope_parameters
    assert want["rope_type"] == "llama3" and want["rope_theta"] == 77.0
    assert c.rope_theta == 77.0 and c.rope_scaling is not None and c.rope_scaling["factor"] == LLAMA3_ROPE["factor"]


@pytest.mark.parametrize("archs,want", [(["LlamaForCausalLM"], "llama"), (["Qwen3ForCausalLM"], "qwen3"),
                                        (None, None), ([], None), (["MistralForCausalLM"], None),
                                        (["LlamaForCausalLM", "Qwen3ForCausalLM"], None)])
def test_model_type_from_architectures(archs, want):
    """A config.json without model_type is read as the model its architectures name when they name one supported
    model, and refused naming the field otherwise (before: read as qwen3 whatever it was, so a Llama checkpoint got
    Qwen3's q/k norms and head_dim default)."""
    d = {k: v for k, v in tiny_hf_config("llama").items() if k not in ("model_type", "head_dim")}
    if archs is not None:
        d["architectures"] = archs
    if want is None:
        with pytest.raises(ValueError, match="model_type"):
            ModelConfig.from_hf(d)
        return
    got, ref = ModelConfig.from_hf(d), ModelConfig.from_hf({**d, "model_type": want})
    assert got.qk_norm == (want == "qwen3")
    assert dataclasses.replace(got, extra={}) == dataclasses.replace(ref, extra={})
