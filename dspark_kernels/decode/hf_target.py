"""Drive any transformers causal LM as the target, for a single request (hidden states + cache cropping).

Same interface as ``TargetModel`` (``alloc_cache``, ``forward``, ``vocab_size``, ``input_embeddings``,
``lm_head_weight``, ``num_layers``, ``hidden_layer_ids``). The KV cache is the model's own ``DynamicCache``,
cropped to the first row's position before each forward; reading that position is a host sync, so this adapter is
for checking and prototyping, not for the sync-free hot path.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .kv_cache import PagedKVCache
from .model import TargetOutput


class HFTarget:
    def __init__(self, model):
        self.model = model.eval()
        self.hidden_layer_ids = []
        self.cache: Optional[PagedKVCache] = None
        self.kv = None
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in recent transformers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def input_embeddings(self):
        return self.model.get_input_embeddings()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def alloc_cache(self, num_seqs: int, max_seq_len: int, *, block_size: int = 16, shuffle_seed=None):
        if num_seqs != 1:
            raise ValueError(f"HFTarget drives a single request, got a batch of {num_seqs}")
        from transformers import DynamicCache
        try:
            self.kv = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            self.kv = DynamicCache()
        w = self.input_embeddings.weight
        # no layers: only the block table / slot mapping, which the drafter's context cache shares
        self.cache = PagedKVCache(0, 1, 1, 1, max_seq_len, block_size=block_size, dtype=w.dtype, device=w.device)
        return self.cache

    @torch.no_grad()
    def __call__(self, tokens, positions, cu_seqlens, max_q, kv_len, logit_rows=None) -> TargetOutput:
        if tokens.numel() == 0:
            d = self.model.config.hidden_size
            return TargetOutput(self.lm_head_weight.new_zeros(0, self.vocab_size, dtype=torch.float32),
                                self.lm_head_weight.new_zeros(0, len(self.hidden_layer_ids) * d))
        drop = self.kv.get_seq_length() - int(positions[0])  # rejected drafts' KV (a host read)
        if drop > 0:
            self.kv.crop(-drop)  # negative = remove that many tokens (old and new transformers alike)
        out = self.model(input_ids=tokens[None], position_ids=positions[None].long(), **{self._cache_arg: self.kv},
                         use_cache=True, output_hidden_states=True)
        logits = out.logits[0].float()
        if logit_rows is not None:
            logits = logits.index_select(0, logit_rows)
        hs = out.hidden_states
        hidden = torch.cat([hs[i + 1][0] for i in self.hidden_layer_ids], -1) if self.hidden_layer_ids else None
        return TargetOutput(logits, hidden)
