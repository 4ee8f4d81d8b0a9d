"""Batch-invariant CPU kernels for the decode loop's target and drafter (``csrc/cpu/row_linear.cpp``,
``row_attention.cpp``).

PyTorch's CPU GEMMs and attention pick their kernels, and so their accumulation order, by shape and thread count:
the same token can round differently in a 1-row decode forward and in an 8-row verify forward. With 16-bit weights
that flips greedy ties, and speculative output stops equalling the target's own. ``row_linear`` and
``row_attention`` compute every output element in one fixed order whatever the batch, so a target built on them
scores a token identically in every forward. They serve 16-bit tensors on the CPU (``RowLinear``,
``kv_cache.ragged_attention``); float32 and GPU tensors use PyTorch's kernels, as does everything when the extension
cannot be built (a warning says so once) or ``DSPARK_BATCH_INVARIANT=0``.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

_lock = threading.Lock()
_state = {"loaded": False, "error": None}
LIBRARY = "dspark_decode"  # csrc/cpu/row_linear.cpp, row_attention.cpp: built into the CPU kernels' library


def available() -> bool:
    """True when ``torch.ops.dspark_decode.row_linear`` / ``row_attention`` are loaded (the CPU kernels' library,
    built on its first use; ``dspark_kernels._ext.load_cpu``)."""
    with _lock:
        if _state["loaded"] or _state["error"] is not None:
            return _state["loaded"]
        from .. import _ext
        if _ext.load_cpu() is None or not hasattr(torch.ops, LIBRARY) or \
                not hasattr(getattr(torch.ops, LIBRARY), "row_linear"):
            _state["error"] = "the CPU kernels' library did not load"
            warnings.warn("dspark_kernels: the batch-invariant CPU kernels are not available; CPU targets use "
                          "PyTorch's, whose rounding depends on the batch shape", RuntimeWarning, stacklevel=2)
            return False
        torch.library.register_fake(f"{LIBRARY}::row_linear")(_fake_linear)
        torch.library.register_fake(f"{LIBRARY}::row_attention")(_fake_attention)
        _state["loaded"] = True
        return True


def _fake_linear(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_attention(q, k_cache, v_cache, kv_slots, row_req, row_pos, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in a fixed order per output element: x ``[..., K]`` (float32 / bf16 / fp16),
    weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's dtype (float32 accumulation)."""
    return torch.ops.dspark_decode.row_linear(x, weight, bias)


def row_attention(q, k_cache, v_cache, kv_slots, row_req, row_pos, scale: float) -> torch.Tensor:
    """Causal attention of row t (request ``row_req[t]`` at position ``row_pos[t]``) over exactly the keys at
    positions ``0..row_pos[t]`` of its request, in a fixed order: q ``[T, H, D]``, k_cache / v_cache ``[S, KV, D]``
    (one layer), kv_slots int64 ``[N, L]``, row_req / row_pos int64 ``[T]`` -> ``[T, H * D]`` in q's dtype."""
    return torch.ops.dspark_decode.row_attention(q, k_cache, v_cache, kv_slots, row_req, row_pos, scale)


def enabled_for(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the batch-invariant kernels serve these tensors: CPU, 16-bit, not switched off, built."""
    return (x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("DSPARK_BATCH_INVARIANT", "1") != "0" and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear``, through ``row_linear`` where :func:`enabled_for`. The drafter uses it too, for speed rather than
    invariance: PyTorch's CPU bf16 GEMM reads a decode step's few-row weights at a fraction of the memory rate."""
    if enabled_for(x, weight):
        return row_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class RowLinear(nn.Linear):
    """``nn.Linear`` whose CPU forward with 16-bit weights is batch-invariant (``row_linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
