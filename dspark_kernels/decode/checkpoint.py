"""Checkpoint folders (config.json + safetensors, single file or sharded) for the target and the DSpark drafter.

Target: Hugging Face Qwen3ForCausalLM / LlamaForCausalLM layout (``model.layers.0.self_attn.q_proj.weight``, ...,
``lm_head.weight`` unless tied). Drafter: DeepSpec's ``Qwen3DSparkModel`` layout (no prefix: ``layers.*``, ``fc``,
``hidden_norm``, ``norm``, ``markov_head.markov_w1/markov_w2/gate_proj/joint_proj``, ``confidence_head.proj``;
``embed_tokens`` / ``lm_head`` are optional there: the target's are used, unless the drafter stores copies that
differ from them, as vLLM reads such a drafter). Every tensor is checked (names, shapes, dtypes: quantized storage
is refused) before anything is copied: a bad folder raises ``ValueError`` and leaves nothing half-built.
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch
import torch.nn as nn

from .drafter import DrafterConfig, DSparkDrafter, check_layer_ids
from .model import ModelConfig, TargetModel

_IGNORED = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_config(path) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"{path!r} has no config.json")
    with open(f) as fh:
        return json.load(fh)


def read_tensors(path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path!r} has no .safetensors files")
    out = {}
    for f in files:
        part = load_file(os.path.join(path, f))
        twice = sorted(set(part) & set(out))
        if twice:
            raise ValueError(f"{path!r}: tensors {twice[:8]} are stored in {f} and in another .safetensors file")
        out.update(part)
    return out


def _unreadable_dtype(t: torch.Tensor, want: torch.dtype) -> bool:
    """Whether copying ``t`` into a tensor of dtype ``want`` would change what it means: integers, booleans or 8-bit
    floats (quantized storage) into a float parameter, a float into an integer buffer."""
    if want.is_floating_point:
        return t.dtype not in _FLOAT_DTYPES
    return t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool


def _check_tensors(expected: Dict[str, torch.Tensor], tensors: Dict[str, torch.Tensor], what: str) -> None:
    missing = [k for k in expected if k not in tensors]
    bad = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
           if k in tensors and tensors[k].shape != v.shape]
    if missing or bad:
        raise ValueError(f"{what} checkpoint does not match its config: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; ill-shaped {bad[:8]}")
    odd = [f"{k}: {tensors[k].dtype}" for k, v in expected.items() if _unreadable_dtype(tensors[k], v.dtype)]
    if odd:
        raise ValueError(f"{what} checkpoint has tensors of a dtype its parameters cannot take: {odd[:8]} (floating "
                         f"parameters take float16 / bfloat16 / float32 / float64; quantized checkpoints are not "
                         f"supported)")


def _load_checked(module: nn.Module, tensors: Dict[str, torch.Tensor], what: str, dtype) -> None:
    expected = module.state_dict()
    _check_tensors(expected, tensors, what)
    module.to(dtype)  # load_state_dict copies into the module's tensors, keeping their dtype
    module.load_state_dict({k: tensors[k].to(dtype) if tensors[k].is_floating_point() else tensors[k]
                            for k in expected}, strict=True)


def load_target(path, *, dtype=torch.float32, device="cpu") -> TargetModel:
    cfg = ModelConfig.from_hf(read_config(path))
    raw = read_tensors(path)
    tensors = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()}
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED)}
    if cfg.tie_word_embeddings:
        _tie(tensors)
    model = TargetModel(cfg)
    extra = sorted(set(tensors) - set(model.state_dict()))
    if extra:
        raise ValueError(f"target checkpoint has tensors this model does not use: {extra[:8]}")
    _load_checked(model, tensors, "target", dtype)
    return model.to(device).eval()


def _tie(tensors: Dict[str, torch.Tensor]) -> None:
    """tie_word_embeddings: ``lm_head.weight`` is ``embed_tokens.weight``. A checkpoint that stores the LM head
    alone gives both (transformers ties them so); one whose LM head differs from its embedding is refused
    (transformers unties them then, against the config)."""
    head, emb = tensors.pop("lm_head.weight", None), tensors.get("embed_tokens.weight")
    if head is not None and emb is None:
        tensors["embed_tokens.weight"] = emb = head
    elif head is not None and (head.dtype != emb.dtype or head.shape != emb.shape or not torch.equal(head, emb)):
        raise ValueError("config.json sets tie_word_embeddings but the checkpoint's lm_head.weight differs from its "
                         "embed_tokens.weight: set tie_word_embeddings to false to use both as stored")
    if emb is not None:
        tensors["lm_head.weight"] = emb


def save_target(model: TargetModel, path) -> None:
    """Hugging Face layout (for tests and tools)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    c = model.config
    cfg = {**c.extra, "model_type": "qwen3" if c.qk_norm else "llama", "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
           "tie_word_embeddings": c.tie_word_embeddings}
    cfg.pop("rope_parameters", None)
    if c.rope_scaling:
        cfg["rope_scaling"] = c.rope_scaling
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous()
          for k, v in model.state_dict().items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(_with_dtype(cfg, sd), fh, indent=2)


def _with_dtype(cfg: dict, tensors: Dict[str, torch.Tensor]) -> dict:
    """``cfg`` whose ``torch_dtype`` is the saved floating tensors' (transformers loads them in the dtype the config
    names: one left from the config read would load float32 weights as bfloat16)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(floats) == 1:
        cfg["torch_dtype"] = str(floats.pop()).removeprefix("torch.")
    return cfg


def load_drafter(path, target, *, dtype=None, device=None) -> DSparkDrafter:
    """``target``: a TargetModel or HFTarget (supplies the shared embedding / LM head and the layer count)."""
    cfg = DrafterConfig.from_hf(read_config(path))
    emb = target.input_embeddings
    dtype = dtype or emb.weight.dtype
    if cfg.backbone.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocab_size {cfg.backbone.vocab_size} != target vocab_size {target.vocab_size}")
    check_layer_ids(cfg.target_layer_ids, target.num_layers)
    tensors = read_tensors(path)
    if tensors and all(k.startswith("model.") for k in tensors):
        tensors = {k[len("model."):]: v for k, v in tensors.items()}
    shared = [("embed_tokens.weight", emb.weight)]
    if not cfg.draft_vocab_size:  # a reduced drafter's lm_head is its own (over the draft ids)
        shared.append(("lm_head.weight", target.lm_head_weight))
    own = _own_copies(tensors, shared, dtype)
    head = own.get("lm_head.weight", target.lm_head_weight)
    if "embed_tokens.weight" in own:
        emb = nn.Embedding.from_pretrained(own["embed_tokens.weight"], freeze=True)
    drafter = DSparkDrafter(cfg, emb, head, num_target_layers=target.num_layers)
    # a tensor the config leaves no place for (a layer past num_hidden_layers, a Markov head of another kind or
    # rank 0, a confidence head it does not enable) is a config that does not match its weights: refused, as the
    # target's loader does, rather than dropped
    used = set(drafter.state_dict()) | {name for name, _ in shared} | {"t2d"}
    extra = sorted(k for k in tensors if k not in used and not k.endswith(_IGNORED))
    if extra:
        raise ValueError(f"draft checkpoint has tensors its config.json leaves no place for: {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''} (markov_rank, markov_head_type, "
                         f"enable_confidence_head or num_hidden_layers do not match the weights?)")
    _load_checked(drafter, tensors, "draft", dtype)
    return drafter.to(device or emb.weight.device).eval()


def _own_copies(tensors: dict, shared: list, dtype) -> dict:
    """The drafter's stored copies of the target's embedding or LM head that differ from the target's (in the
    target's dtype), in ``dtype`` on the target's device: the drafter uses those, as vLLM does; an equal copy, or
    none, shares the target's. A copy of another shape is refused."""
    own = {}
    for name, ref in shared:
        t = tensors.get(name)
        if t is None:
            continue
        if t.shape != ref.shape:
            raise ValueError(f"draft {name} has shape {tuple(t.shape)} but the target's is {tuple(ref.shape)} "
                             f"(mismatched vocabularies)")
        if _unreadable_dtype(t, ref.dtype):
            raise ValueError(f"draft {name}: {t.dtype} for a {ref.dtype} weight (quantized checkpoints are not "
                             f"supported)")
        if not torch.equal(t.to(ref.device, ref.dtype), ref.detach()):
            own[name] = t.to(ref.device, dtype)
    return own


def save_drafter(drafter: DSparkDrafter, path) -> None:
    """The published layout, embedding and LM head included (as DeepSpec's save_pretrained writes them).
    ``target_layer_ids`` are checked again when the drafter knows its target's layer count (``num_target_layers``,
    set by ``DSparkDrafter.for_target`` / ``load_drafter``); a drafter built without it saves unchecked."""
    from safetensors.torch import save_file
    if getattr(drafter, "num_target_layers", None) is not None:
        check_layer_ids(drafter.config.target_layer_ids, drafter.num_target_layers)
    os.makedirs(path, exist_ok=True)
    sd = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    sd["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().contiguous()
    sd["lm_head.weight"] = drafter.draft_lm_head.detach().contiguous()
    if sd["lm_head.weight"].data_ptr() == sd["embed_tokens.weight"].data_ptr():
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(_with_dtype(drafter.config.to_hf(), sd), fh, indent=2)
