"""Draft checkpoints in the published (DeepSpec) layout round-trip; bad input gets clear errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark_kernels as dk
from dspark_kernels.decode.checkpoint import load_drafter, load_target, save_drafter, save_target
from dspark_kernels.decode.decoder import Scheduler, SpeculativeDecoder
from dspark_kernels.decode.testing import tiny_drafter, tiny_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3], [7], [9, 9, 9, 9, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.mark.parametrize("markov,confidence,rank", [("vanilla", True, 8), ("gated", True, 8), ("rnn", False, 8),
                                                     ("vanilla", True, 0)])
def test_drafter_round_trip(tmp_path, target, markov, confidence, rank):
    drafter = tiny_drafter(target, block_size=5, markov=markov, confidence=confidence, rank=rank)
    save_drafter(drafter, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "embed_tokens.weight", "lm_head.weight"} <= names
    if rank:
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names
        assert ("markov_head.gate_proj.weight" in names) == (markov == "gated")
        assert ("markov_head.joint_proj.weight" in names) == (markov == "rnn")
    assert ("confidence_head.proj.weight" in names) == confidence
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 5
    assert cfg["target_layer_ids"] == [0, 1] and cfg["markov_rank"] == rank
    loaded = load_drafter(tmp_path, target)
    assert loaded.embed_tokens is target.embed_tokens  # shared, not copied
    sched = Scheduler("exact" if confidence else "fixed", cost_table=__import__("dspark_kernels").CostTable([1, 64],
                                                                                                            [1.0, 3.0]))
    a = SpeculativeDecoder(target, drafter, seed=3).generate(PROMPTS, 9, temperature=0.8, scheduler=sched)
    b = SpeculativeDecoder(target, loaded, seed=3).generate(PROMPTS, 9, temperature=0.8, scheduler=sched)
    assert a.tokens == b.tokens and a.stats.verified_tokens_per_step == b.stats.verified_tokens_per_step


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
def test_own_copy_that_differs_is_used(tmp_path, target, name, monkeypatch):
    """A drafter storing its own embedding or LM head that differs from the target's uses it, as vLLM loads such a
    drafter; the other one stays the target's (before: the target's were used whatever the checkpoint held, so
    the drafts differed from vLLM's). The copy's values decide the drafts: those of a greedy generation differ
    from the sharing drafter's and equal those of a drafter built on the changed weight."""
    drafter = tiny_drafter(target, block_size=3, markov="gated")
    changed = {}

    def perturb(sd, cfg):
        changed[name] = sd[name] = sd[name].flip(0).contiguous()   # rows permuted: the same shape and dtype
    _corrupt(tmp_path, target, perturb)
    loaded = load_drafter(tmp_path, target)
    own, other = ((loaded.embed_tokens.weight, loaded.lm_head_weight) if name == "embed_tokens.weight"
                  else (loaded.lm_head_weight, loaded.embed_tokens.weight))
    assert torch.equal(own, changed[name].to(own.dtype))
    assert other is (target.lm_head_weight if name == "embed_tokens.weight" else target.embed_tokens.weight)
    twin = tiny_drafter(target, block_size=3, markov="gated")
    twin.load_state_dict(drafter.state_dict())
    if name == "embed_tokens.weight":
        twin.__dict__["embed_tokens"] = torch.nn.Embedding.from_pretrained(changed[name].clone())
    else:
        twin.__dict__["lm_head_weight"] = changed[name].clone()
    draft_block = dk.draft_block

    def drafts(d):
        seen = []
        monkeypatch.setattr(dk, "draft_block", lambda *a, **kw: seen.append(draft_block(*a, **kw)) or seen[-1])
        SpeculativeDecoder(target, d, seed=3).generate(PROMPTS, 9)
        return [o.tokens.tolist() for o in seen]
    assert drafts(loaded) == drafts(twin) != drafts(drafter)


def test_load_in_the_dtype_asked(tmp_path, target):
    """``dtype`` is the dtype of every floating tensor of the loaded module (not just of the values copied into
    float32 parameters); integer buffers (a reduced drafter's d2t) stay integer."""
    drafter = tiny_drafter(target, block_size=4, draft_vocab_size=16)
    save_drafter(drafter, tmp_path / "d")
    save_target(target, tmp_path / "t")
    for dtype in (torch.bfloat16, torch.float16):
        loaded = load_drafter(tmp_path / "d", target, dtype=dtype)
        assert {t.dtype for t in loaded.parameters()} == {dtype} and loaded.d2t.dtype == torch.int64
        assert {t.dtype for t in load_target(tmp_path / "t", dtype=dtype).parameters()} == {dtype}


@pytest.mark.parametrize("markov,rank", [("vanilla", 8), ("rnn", 8), ("vanilla", 0)])
def test_reduced_vocabulary_drafter_round_trip(tmp_path, target, markov, rank):
    """A drafter over 20 of the 48 target ids in the speculators layout: ``draft_vocab_size`` in the config, its own
    ``lm_head.weight [Vd, d]``, the ``d2t`` offsets (int64, kept so when loaded in fp16) and W2 ``[Vd, r]``; a
    ``t2d`` table beside them (speculators writes one) is ignored. Loading gives the same map and generation."""
    ids = list(range(3, 46, 2))[:20]
    drafter = tiny_drafter(target, block_size=4, markov=markov, rank=rank, draft_ids=ids)
    save_drafter(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["lm_head.weight"].shape == (20, target.config.hidden_size)
    assert tensors["d2t"].dtype == torch.int64 and (tensors["d2t"] + torch.arange(20)).tolist() == ids
    if rank:
        assert tensors["markov_head.markov_w2.weight"].shape == (20, rank)
        assert tensors["markov_head.markov_w1.weight"].shape == (target.vocab_size, rank)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 20
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    save_file({**tensors, "t2d": t2d}, tmp_path / "model.safetensors")
    loaded = load_drafter(tmp_path, target, dtype=torch.float16).float()
    assert loaded.draft_to_target().tolist() == ids and loaded.d2t.dtype == torch.int64
    a = SpeculativeDecoder(target, drafter, seed=3).generate(PROMPTS, 9, temperature=0.8)
    b = SpeculativeDecoder(target, loaded, seed=3).generate(PROMPTS, 9, temperature=0.8)
    assert a.tokens == b.tokens


def test_reduced_vocabulary_bad_map_is_an_error(tmp_path, target):
    drafter = tiny_drafter(target, block_size=4, draft_ids=[5, 6, 7, 8])
    drafter.d2t[1] = -1  # draft id 1 -> target id 0 ... and id 2 -> 9: still distinct; then a duplicate
    drafter.d2t[2] = 3   # draft id 2 -> target id 5, as draft id 0
    with pytest.raises(ValueError, match="draft_to_target"):
        SpeculativeDecoder(target, drafter)


def test_sharded_target_and_draft_prefix(tmp_path, target):
    save_target(target, tmp_path / "t")
    sd = load_file(tmp_path / "t" / "model.safetensors")
    keys = sorted(sd)
    (tmp_path / "t" / "model.safetensors").unlink()
    save_file({k: sd[k] for k in keys[::2]}, tmp_path / "t" / "a.safetensors")
    save_file({k: sd[k] for k in keys[1::2]}, tmp_path / "t" / "b.safetensors")
    (tmp_path / "t" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: ("a" if i % 2 == 0 else "b") + ".safetensors" for i, k in enumerate(keys)}}))
    loaded = load_target(tmp_path / "t")
    for k, v in target.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def _corrupt(tmp_path, target, edit):
    drafter = tiny_drafter(target, block_size=3, markov="gated")
    save_drafter(drafter, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(sd, cfg)
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def _set_layer_ids(cfg, ids):
    cfg["target_layer_ids"] = cfg["dflash_config"]["target_layer_ids"] = ids


@pytest.mark.parametrize("edit,match", [
    (lambda sd, cfg: sd.pop("markov_head.gate_proj.weight"), "missing.*markov_head.gate_proj.weight"),
    (lambda sd, cfg: sd.__setitem__("fc.weight", torch.zeros(32, 7)), "ill-shaped.*fc.weight"),
    (lambda sd, cfg: cfg.__setitem__("vocab_size", 50), "vocab"),
    (lambda sd, cfg: sd.__setitem__("lm_head.weight", torch.zeros(50, 32)), "mismatched vocabularies"),
    (lambda sd, cfg: _set_layer_ids(cfg, [0, 3]), "target_layer_ids"),
    (lambda sd, cfg: _set_layer_ids(cfg, [0, 2]), "final layer"),
    # before: read from the top level silently, where vLLM reads dflash_config
    (lambda sd, cfg: cfg["dflash_config"].__setitem__("target_layer_ids", [-1, 0]),
     r"\['target_layer_ids'\].*dflash_config"),
    (lambda sd, cfg: cfg["dflash_config"].__setitem__("mask_token_id", 3), r"\['mask_token_id'\].*dflash_config"),
    # before: converted silently into the float parameter
    (lambda sd, cfg: sd.__setitem__("fc.weight", sd["fc.weight"].to(torch.int8)), "fc.weight: torch.int8"),
    (lambda sd, cfg: cfg.pop("block_size"), "block_size"),
    (lambda sd, cfg: cfg.__setitem__("markov_head_type", "lstm"), "Markov head"),
    # weights the config leaves no place for were dropped silently (a gated head loaded as vanilla, no head at all)
    (lambda sd, cfg: cfg.pop("markov_head_type"), "no place for.*markov_head.gate_proj.bias"),
    (lambda sd, cfg: cfg.__setitem__("markov_rank", 0), "no place for.*markov_head.markov_w1.weight"),
    (lambda sd, cfg: cfg.__setitem__("enable_confidence_head", False), "no place for.*confidence_head.proj"),
    (lambda sd, cfg: sd.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in sd.items()
                                if k.startswith("layers.0.")}), "no place for.*layers.1."),
    (lambda sd, cfg: cfg.__setitem__("block_size", 0), "block_size .* must be an int >= 1"),
])
def test_bad_draft_checkpoints(tmp_path, target, edit, match):
    _corrupt(tmp_path, target, edit)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path, target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())  # nothing written


@pytest.mark.parametrize("where", ["dflash_config", "top level"])
def test_draft_ids_read_where_vllm_reads_them(tmp_path, target, where):
    """``mask_token_id`` and ``target_layer_ids`` given in one place only (``dflash_config``, where vLLM reads them,
    or the top level) load the same drafter (before: a config with them only in ``dflash_config`` was refused as
    not a draft)."""
    drafter = tiny_drafter(target, block_size=3, markov="gated")

    def keep_one(sd, cfg):
        inner = cfg["dflash_config"]
        for k in ("mask_token_id", "target_layer_ids"):
            (cfg if where == "dflash_config" else inner).pop(k)
    _corrupt(tmp_path, target, keep_one)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config.mask_token_id == drafter.config.mask_token_id
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids


def test_bad_target_checkpoint(tmp_path, target):
    save_target(target, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="k_norm"):
        load_target(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        load_target(tmp_path / "nowhere")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn, None])
def test_quantized_checkpoints_are_refused(tmp_path, target, dtype):
    """A tensor of an integer, boolean or 8-bit float dtype for a float parameter (quantized storage), and a
    config.json with a quantization_config, are refused naming the tensor and its dtype, or the quantization
    (before: the tensor was converted silently, the quantization_config ignored)."""
    save_target(target, tmp_path)
    if dtype is None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    else:
        sd = load_file(tmp_path / "model.safetensors")
        sd["model.layers.1.mlp.up_proj.weight"] = torch.ones(64, 32).to(dtype)
        save_file(sd, tmp_path / "model.safetensors")
    match = "quantized checkpoints are not supported"
    with pytest.raises(ValueError, match=f"{match}.*fp8" if dtype is None else
                       rf"layers.1.mlp.up_proj.weight: {dtype}.*{match}"):
        load_target(tmp_path)


def test_float_draft_to_target_offsets_are_refused(tmp_path, target):
    """A reduced drafter's ``d2t`` stored as floats is refused naming it (before: truncated into the int64 buffer,
    so 2.5 read as 2)."""
    drafter = tiny_drafter(target, block_size=4, draft_ids=[5, 6, 7, 8])
    save_drafter(drafter, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    save_file({**sd, "d2t": sd["d2t"] + 0.5}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="d2t: torch.float32"):
        load_drafter(tmp_path, target)


def test_tied_checkpoint_lm_head(tmp_path, target):
    """tie_word_embeddings: a checkpoint whose lm_head.weight differs from its embed_tokens.weight is refused
    (before: the stored LM head was dropped silently, where transformers keeps it); one that stores the LM head
    alone loads with it as the embedding too, as transformers ties them (before: refused as ill-shaped)."""
    save_target(target, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings.*lm_head.weight differs"):
        load_target(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.embed_tokens.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    loaded = load_target(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(loaded.embed_tokens.weight, target.lm_head.weight)


def test_tensor_in_two_files_is_refused(tmp_path, target):
    """A tensor stored in two .safetensors files of the folder is refused naming it (before: one file's copy was
    taken silently)."""
    save_target(target, tmp_path)
    save_file({"model.norm.weight": torch.zeros(32)}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"\['model.norm.weight'\] are stored in"):
        load_target(tmp_path)


def test_saved_config_names_the_saved_dtype(tmp_path, target):
    """save_target / save_drafter write the torch_dtype of the tensors they save (before: the dtype left from the
    config read, and transformers loads weights in the dtype the config names: float32 weights of a model read
    from a bfloat16 checkpoint came back as bfloat16)."""
    save_target(tiny_target(seed=0, model_type="llama", dtype="bfloat16").half(), tmp_path / "t")
    save_drafter(tiny_drafter(target, torch_dtype="bfloat16"), tmp_path / "d")
    for folder, want in (("t", "float16"), ("d", "float32")):
        cfg = json.loads((tmp_path / folder / "config.json").read_text())
        assert cfg["torch_dtype"] == want and "dtype" not in cfg


def test_bad_generate_input(target):
    drafter = tiny_drafter(target, block_size=4)
    dec = SpeculativeDecoder(target, drafter, max_seq_len=40)
    good = dec.generate(PROMPTS, 6).tokens
    cache = target.cache
    cases = [([], 4, None, "prompts is empty"), ([[1], []], 4, None, "prompt 1 is empty"),
             ([[1, 48]], 4, None, "outside"), ([list(range(30))], 8, None, "max_seq_len=40"),
             (PROMPTS, 0, None, "max_new_tokens"), (PROMPTS, 4, Scheduler("fastest"), "scheduler.mode"),
             (PROMPTS, 4, Scheduler("exact"), "cost_table"), (PROMPTS, 4, Scheduler("threshold"), "thresholds"),
             # before: a negative verify_len gave its requests no verify row, and generate never returned; a
             # threshold min_len past K read drafts past the block (IndexError on the CPU, out of bounds on a GPU)
             (PROMPTS, 4, Scheduler("fixed", verify_len=-1), "verify_len must be an int >= 0"),
             (PROMPTS, 4, Scheduler("fixed", verify_len=1.5), "verify_len must be an int >= 0"),
             (PROMPTS, 4, Scheduler("threshold", thresholds=[0.5] * 4, min_len=5), r"min_len must be an int in \[0"),
             (PROMPTS, 4, Scheduler("threshold", thresholds=[0.5] * 4, min_len=-1), "min_len must be an int"),
             # before: float token ids were truncated silently (1.7 -> 1)
             ([[1.7, 2.0]], 4, None, "prompt 0 has a token that is not an integer id"),
             ([[1], torch.tensor([2.0, 3.0])], 4, None, "prompt 1 has a token that is not an integer id"),
             ([[True, 3]], 4, None, "prompt 0 has a token that is not an integer id")]
    for prompts, max_new, sched, match in cases:
        with pytest.raises(ValueError, match=match):
            dec.generate(prompts, max_new, scheduler=sched)
        assert target.cache is cache  # rejected before anything was allocated or written
    for stops, match in (([2 ** 70], "stop_token_ids has a token outside int64"),
                         ([3.0], "stop_token_ids has a token that is not an integer id")):
        with pytest.raises(ValueError, match=match):  # before: an unclear overflow error, or 3.0 taken as 3
            dec.generate(PROMPTS, 4, stop_token_ids=stops)
        assert target.cache is cache  # rejected before anything was allocated or written
    assert dec.generate(PROMPTS, 6).tokens == good
    as_ints = [torch.tensor(PROMPTS[0]), [np.int64(t) for t in PROMPTS[1]]] + PROMPTS[2:]  # integer ids of any kind
    assert dec.generate(as_ints, 6).tokens == good
    with pytest.raises(ValueError, match="block_size"):
        tiny_drafter(target, block_size=0)  # K = 0: before, an IndexError inside the drafter's first forward
    no_conf = tiny_drafter(target, block_size=4, confidence=False)
    with pytest.raises(ValueError, match="confidence head"):
        SpeculativeDecoder(target, no_conf).generate(PROMPTS, 4, scheduler=Scheduler("argmax"))
    other = tiny_target(seed=1, vocab=40)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder(other, drafter)


@pytest.mark.parametrize("ids,bad", [((0, 5), [5]), ((-2, 0, 1), [-2]), ((0, 2), [2])])
def test_layer_ids_checked_at_creation(tmp_path, target, ids, bad):
    """A drafter whose target_layer_ids do not fit the target fails where it is created against the target
    (valid ids: [-1, L-1) for L target layers), naming the field, the bad ids and the target's layer count."""
    from dspark_kernels.decode import DSparkDrafter
    from dspark_kernels.decode.testing import tiny_drafter_config
    match = rf"target_layer_ids .*{bad[0]}.*\b{target.num_layers} layers"
    with pytest.raises(ValueError, match=match) as err:
        tiny_drafter(target, layer_ids=ids)
    assert str(bad) in str(err.value)
    cfg = tiny_drafter_config(target, layer_ids=ids)
    with pytest.raises(ValueError, match=match):
        DSparkDrafter.for_target(cfg, target)
    with pytest.raises(ValueError, match=match):
        DSparkDrafter(cfg, target.input_embeddings, target.lm_head_weight, num_target_layers=target.num_layers)
    # a drafter made against the target and edited afterwards is checked again when saved
    drafter = tiny_drafter(target)
    drafter.config.target_layer_ids = list(ids)
    with pytest.raises(ValueError, match=match):
        save_drafter(drafter, tmp_path / "d")
    assert not (tmp_path / "d" / "model.safetensors").exists()


def test_drafter_round_trip_keeps_llama3_rope(tmp_path, target):
    """A drafter whose backbone has llama3 RoPE scaling saves it (before: ``to_hf`` wrote rope_theta alone, so the
    loaded drafter rotated with plain RoPE and drafted other tokens)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    drafter = tiny_drafter(target, block_size=4, rope_scaling=rope)
    assert drafter.config.backbone.rope_scaling is not None
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config.backbone.rope_scaling == drafter.config.backbone.rope_scaling
    torch.testing.assert_close(loaded.rope.cpu, drafter.rope.cpu, rtol=0, atol=0)
