"""``dk.draft_block``: the sequential Markov head over a parallel drafter's block, a launch per block position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from .. import reference
from ..rng import make_rng_key
from ._common import FLOAT_DTYPES, INT_DTYPES, check_rng_key, check_tensor, resolve_backend, temperature_tensor
from ._registry import CpuKernel, CudaKernel, TritonKernel, define_op

HEAD_KINDS = ("vanilla", "gated", "rnn")
W2_FP8 = torch.float8_e4m3fn  # the quantized W2 dtype (with a per-row float32 scale)
MAX_TOP_K = 1024  # top-k proposals keep at most this many candidates (the CUDA kernel's shared buffer)


@dataclass
class MarkovHead:
    """Weights of the sequential Markov head (layouts of the DeepSpec checkpoints; any float dtype).

    kind: "vanilla" | "gated" | "rnn".
    w1: ``[V, r]`` embedding of the previous token (a target id). w2: ``[Vd, r]`` (an ``nn.Linear(r, Vd)`` weight),
    any float dtype, or float8_e4m3fn with ``w2_scale``: float32 ``[Vd]``, one scale per row (the bias is then
    ``w2_scale[j] * (W2[j] . v)``; ``quantize_w2`` makes both from a float W2). Only an fp8 W2 takes a scale.
    wg ``[r, d + r]``, bg ``[r]``: the gate (gated only). wj ``[3r, 2r + d]``, bj ``[3r]``: the joint map (rnn only).
    draft_to_target: int32/int64 ``[Vd]``, the target id of each draft id, for a drafter over a reduced vocabulary
    (``draft_to_target_from_offsets`` converts the offset form ``target = d + d2t[d]``); None: Vd = V, the identity.
    Its entries must be distinct and in [0, V); that is checked here, once (it reads the table on the host).
    """

    kind: str
    w1: torch.Tensor
    w2: torch.Tensor
    wg: Optional[torch.Tensor] = None
    bg: Optional[torch.Tensor] = None
    wj: Optional[torch.Tensor] = None
    bj: Optional[torch.Tensor] = None
    draft_to_target: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        if (self.w2.dtype == W2_FP8) != (self.w2_scale is not None):
            raise ValueError("head.w2_scale (float32 [Vd], one scale per row) must be given with a float8_e4m3fn "
                             f"head.w2 and only then; got w2 {self.w2.dtype} and w2_scale "
                             f"{'None' if self.w2_scale is None else self.w2_scale.dtype}")
        if self.draft_to_target is not None:
            check_draft_to_target(self.draft_to_target, self.w1.shape[0])


def check_draft_to_target(table: torch.Tensor, target_vocab: int) -> None:
    """Raise a ValueError naming ``draft_to_target`` unless it is a 1-D int table of distinct ids in
    [0, target_vocab). Reads the table (a device synchronisation): call it when a head is built, not per step."""
    check_tensor("draft_to_target", table, ndim=1, dtypes=INT_DTYPES)
    if table.numel() == 0:
        raise ValueError("draft_to_target must map at least one draft id, got an empty table")
    lo, hi = int(table.min()), int(table.max())
    if lo < 0 or hi >= target_vocab:
        raise ValueError(f"draft_to_target entries must lie in [0, {target_vocab}) (W1's rows), got [{lo}, {hi}]")
    if int(torch.unique(table).numel()) != table.numel():
        raise ValueError("draft_to_target must map draft ids to distinct target ids, got duplicates")


def quantize_w2(w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn ``[Vd, r]``, float32 ``[Vd]``): W2 with one scale per row, ``max |W2[j]| / 448`` (e4m3's
    largest finite value), so each row uses e4m3's whole range; a zero row gets scale 1."""
    check_tensor("w2", w2, ndim=2, dtypes=FLOAT_DTYPES)
    amax = w2.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.finfo(W2_FP8).max, 1.0)
    return (w2.float() / scale[:, None]).to(W2_FP8), scale


def draft_to_target_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """The target ids of a speculators-style ``d2t`` offset table (``target = d + d2t[d]``), int64 ``[Vd]``."""
    check_tensor("d2t", offsets, ndim=1, dtypes=INT_DTYPES)
    return torch.arange(offsets.numel(), device=offsets.device) + offsets.to(torch.int64)


@dataclass
class ConfidenceHead:
    """Confidence head ``z_k = weight . [h_k; W1[x_{k-1}]] + bias`` and its per-position STS temperatures.

    weight: ``[d + r]`` or ``[1, d + r]`` (an ``nn.Linear(d + r, 1)``); bias: a float or a one-element tensor;
    sts_temperatures: float ``[K]`` or None (all 1): ``c_k = sigmoid(z_k / T_k)``.
    """

    weight: torch.Tensor
    bias: Union[float, torch.Tensor] = 0.0
    sts_temperatures: Optional[torch.Tensor] = None


class DraftBlockOutput(NamedTuple):
    tokens: torch.Tensor                   # int64 [N, K]
    logits: Optional[torch.Tensor]         # float32 [N, K, V], or [N, K, top_k] (return_logits=True)
    conf_logits: Optional[torch.Tensor]    # float32 [N, K] (with a confidence head)
    survival: Optional[torch.Tensor]       # float32 [N, K] (with a confidence head)
    draft_logprobs: Optional[torch.Tensor] = None  # float32 [N, K]: log q(token) under softmax(logits / T)
    candidates: Optional[torch.Tensor] = None      # int64 [N, K, top_k]: target ids of the logits' columns (top_k)


def _fake(base_logits, anchor_tokens, head_kind, w1, w2, w2_scale, draft_to_target, wg, bg, wj, bj, hidden, conf_weight,
          conf_bias, sts_temperatures, temperature, rng_key, return_logits, top_k):
    n, k, v = base_logits.shape
    new = base_logits.new_empty
    conf_shape = (n, k) if conf_weight is not None else (0,)
    width = top_k if top_k > 0 else v
    return (new((n, k), dtype=torch.int64), new((n, k, width) if return_logits else (0,), dtype=torch.float32),
            new(conf_shape, dtype=torch.float32), new(conf_shape, dtype=torch.float32),
            new((n, k), dtype=torch.float32),
            new((n, k, top_k) if return_logits and top_k > 0 else (0,), dtype=torch.int64))


def _cpu_supports(*args) -> bool:
    """The CPU kernel drafts full-vocabulary proposals; top-k proposals (``top_k > 0``) run on the reference."""
    return args[-1] == 0


_WRAPPER_NAMES = {"head_kind": "head.kind", "w1": "head.w1", "w2": "head.w2", "w2_scale": "head.w2_scale",
                  "draft_to_target": "head.draft_to_target", "wg": "head.wg", "bg": "head.bg", "wj": "head.wj",
                  "bj": "head.bj", "conf_weight": "confidence.weight", "conf_bias": "confidence.bias",
                  "sts_temperatures": "confidence.sts_temperatures"}  # what dk.draft_block calls the flat arguments


def _check_args(base_logits, anchor_tokens, head_kind, w1, w2, w2_scale, draft_to_target, wg, bg, wj, bj, hidden,
                conf_weight, conf_bias, sts_temperatures, temperature, rng_key, return_logits, top_k, names=None):
    """The op's arguments (``names``: what the caller calls them)."""
    def name(param):
        return (names or {}).get(param, param)
    check_tensor("base_logits", base_logits, ndim=3, dtypes=FLOAT_DTYPES)
    n, k_len, vocab = base_logits.shape
    dev = base_logits.device
    if k_len < 1 or vocab < 1 or vocab >= 2 ** 31:
        raise ValueError(f"base_logits must have K >= 1 and 1 <= V < 2^31 (32-bit token ids), got shape "
                         f"{tuple(base_logits.shape)}")
    check_tensor("anchor_tokens", anchor_tokens, shape=(n,), dtypes=INT_DTYPES, device=dev)
    if head_kind not in HEAD_KINDS:
        raise ValueError(f"{name('head_kind')} must be one of {HEAD_KINDS}, got {head_kind!r}")
    check_tensor(name("draft_to_target"), draft_to_target, shape=(vocab,), dtypes=INT_DTYPES, device=dev,
                 optional=True)
    check_tensor(name("w1"), w1, shape=(None if draft_to_target is not None else vocab, None), dtypes=FLOAT_DTYPES,
                 device=dev)
    rank = w1.shape[1]
    check_tensor(name("w2"), w2, shape=(vocab, rank), dtypes=FLOAT_DTYPES + (W2_FP8,), device=dev)
    check_tensor(name("w2_scale"), w2_scale, shape=(vocab,), dtypes=(torch.float32,), device=dev,
                 optional=w2.dtype != W2_FP8)
    if w2_scale is not None and w2.dtype != W2_FP8:
        raise ValueError(f"{name('w2_scale')} goes with a float8_e4m3fn {name('w2')} only, got {w2.dtype}")
    d = _check_hidden(hidden, head_kind, conf_weight is not None, n, k_len, dev)
    if head_kind == "gated":
        check_tensor(name("wg"), wg, shape=(rank, d + rank), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor(name("bg"), bg, shape=(rank,), dtypes=FLOAT_DTYPES, device=dev)
    elif head_kind == "rnn":
        check_tensor(name("wj"), wj, shape=(3 * rank, 2 * rank + d), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor(name("bj"), bj, shape=(3 * rank,), dtypes=FLOAT_DTYPES, device=dev)
    if conf_weight is not None:
        check_tensor(name("conf_weight"), conf_weight, shape=(d + rank,), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor(name("conf_bias"), conf_bias, shape=(), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor(name("sts_temperatures"), sts_temperatures, shape=(k_len,), dtypes=FLOAT_DTYPES, device=dev,
                     optional=True)
    check_tensor("temperature", temperature, shape=(n,), dtypes=(torch.float32,), device=dev, optional=True)
    check_rng_key(rng_key, dev)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"top_k must be an int in [0, min(V, {MAX_TOP_K})] (V = {vocab}; 0: the full proposal), "
                         f"got {top_k!r}")


def _check_hidden(hidden, head_kind: str, confidence: bool, n: int, k_len: int, dev) -> int:
    """d, the width of the checked hidden states (0 without them)."""
    if (head_kind != "vanilla" or confidence) and hidden is None:
        raise ValueError(f"hidden [N, K, d] is required by the {head_kind} head"
                         + (" and the confidence head" if confidence else ""))
    check_tensor("hidden", hidden, shape=(n, k_len, None), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    return hidden.shape[2] if hidden is not None else 0


DRAFT_BLOCK = define_op(
    "draft_block",
    "(Tensor base_logits, Tensor anchor_tokens, str head_kind, Tensor w1, Tensor w2, Tensor? w2_scale, "
    "Tensor? draft_to_target, "
    "Tensor? wg, Tensor? bg, Tensor? wj, Tensor? bj, Tensor? hidden, Tensor? conf_weight, Tensor? conf_bias, "
    "Tensor? sts_temperatures, Tensor? temperature, Tensor rng_key, bool return_logits, int top_k) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fake,
    {"reference": reference.draft_block, "cpu": CpuKernel("draft_block", reference.draft_block, _cpu_supports),
     "triton": TritonKernel("draft_block", "draft_block"),
     "cuda": CudaKernel("draft_block")},
    _check_args,
)


def draft_block(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    head: MarkovHead,
    *,
    hidden: Optional[torch.Tensor] = None,
    confidence: Optional[ConfidenceHead] = None,
    temperature: Union[float, torch.Tensor] = 0.0,
    seed=0,
    offset=0,
    return_logits: bool = False,
    top_k: Optional[int] = None,
    backend: Optional[str] = "auto",
) -> DraftBlockOutput:
    """Draft a block of K tokens per request with the Markov head, plus confidence logits and survival.

    Args:
        base_logits: float32/bf16/fp16 ``[N, K, V]``, the parallel backbone's logits ``U`` for the K block positions
            (``[N, K, Vd]`` over the draft vocabulary of a head with ``draft_to_target``).
        anchor_tokens: int32/int64 ``[N]``, the last committed token of each request (``x_0``, a target id).
        head: a ``MarkovHead`` (vanilla / gated / rnn weights, see its docstring).
        hidden: float ``[N, K, d]``, the backbone's hidden states; required by the gated and rnn heads and by the
            confidence head.
        confidence: a ``ConfidenceHead`` or None.
        temperature: a float, or float ``[N]`` per request; 0 means greedy (argmax, ties to the lowest index).
            Negative or NaN entries of a tensor count as greedy.
        seed, offset: the random key (Python ints or one-element int tensors, device tensors allowed).
        return_logits: also return the corrected logits, which ``verify_chain`` needs for lossless sampling.
        top_k: None for the full proposal, or an int in [1, min(V, 1024)]: top-k Markov proposals. Per position
            only the top_k largest entries of U (ranked by value, NaN lowest, ties to the lower id:
            ``reference.topk_candidates``) get a bias ``W2 v``, so W2 is read for top_k rows per request and
            position instead of V; the proposal q is the softmax of ``logits / T`` over those candidates (zero
            elsewhere), which drafts, log-probabilities and the returned logits describe. ``logits`` is then sparse: float32 ``[N, K, top_k]`` over the
            candidates in increasing draft-id order, with ``candidates`` int64 ``[N, K, top_k]`` their target ids
            (pass both to ``verify_chain`` as ``draft_logits`` / ``draft_candidates``).
        backend: "auto" | "cpu" | "cuda" | "triton" | "reference" ("auto": CUDA or Triton on a GPU, the CPU
            kernel on CPU tensors where it builds, else the reference; ``DSPARK_BACKEND`` sets the default). The CPU
            kernel drafts full-vocabulary proposals; with ``top_k`` "cpu" runs the reference.

    Returns:
        ``DraftBlockOutput(tokens int64 [N, K], logits float32 [N, K, V] | None, conf_logits float32 [N, K] | None,
        survival float32 [N, K] | None, draft_logprobs float32 [N, K], candidates int64 [N, K, top_k] | None)``.
        ``logits_k = U_k + B(x_{k-1})`` in float32 (sampling used exactly these; over the draft vocabulary with ``draft_to_target``, whose map takes
        the drafted id to the target id in ``tokens``); ``conf_logits`` are the raw ``z_k``;
        ``survival_k = prod_{i<=k} sigmoid(z_i / T_i)``. An anchor outside W1's rows reads a zero Markov embedding;
        NaN logits never yield a token outside the (draft) vocabulary.
        ``draft_logprobs[n, k] = log_softmax(logits_k / T_n)[j]`` (j the drafted id): log q of each drafted token
        under the distribution it was drawn from (``verify_chain`` uses ``q(d) = exp(draft_logprobs)``); greedy requests
        (T <= 0) report it at T = 1 (the draft model's own log-probability; the verifier does not read it for
        them). NaN when the row holds a NaN or +inf logit or only -inf, as ``torch.log_softmax`` gives.
        Non-finite weights: an infinite W2 entry gives an infinite bias (NaN where it meets a zero entry of v, as in
        the reference), except on the CUDA tensor-core sweep (more than 4 requests, a 16-bit or fp8 W2 of rank
        <= 2048), which multiplies W2 by v split into two 16-bit rows (hi + lo) and so may give NaN for that logit
        (``inf * 0`` or ``inf - inf`` between the rows); the row's token then follows the NaN rule and its
        log-probability is NaN. Finite weights are the supported input.
    """
    check_tensor("base_logits", base_logits, ndim=3, dtypes=FLOAT_DTYPES)
    n, dev = base_logits.shape[0], base_logits.device
    if not isinstance(head, MarkovHead):
        raise TypeError(f"head must be a dk.MarkovHead, got {type(head).__name__}")
    gated, rnn = head.kind == "gated", head.kind == "rnn"
    conf_weight = conf_bias = sts = None
    if confidence is not None:  # the op's flat form: weight [d + r], bias []
        conf_weight, conf_bias, sts = confidence.weight, confidence.bias, confidence.sts_temperatures
        if isinstance(conf_weight, torch.Tensor) and conf_weight.dim() == 2 and conf_weight.shape[0] == 1:
            conf_weight = conf_weight.reshape(-1)
        if isinstance(conf_bias, torch.Tensor):
            conf_bias = conf_bias.reshape(()) if conf_bias.numel() == 1 else conf_bias
        else:
            conf_bias = torch.full((), float(conf_bias), dtype=torch.float32, device=dev)
    vocab = base_logits.shape[2]
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not 1 <= top_k <= min(vocab, MAX_TOP_K)):
        raise ValueError(f"top_k must be None or an int in [1, min(V, {MAX_TOP_K})] (V = {vocab}), got {top_k!r}")
    temps = temperature_tensor(temperature, n, dev)
    rng_key = make_rng_key(seed, offset, dev)
    args = (base_logits, anchor_tokens, head.kind, head.w1, head.w2, head.w2_scale, head.draft_to_target,
            head.wg if gated else None, head.bg if gated else None, head.wj if rnn else None,
            head.bj if rnn else None, hidden, conf_weight, conf_bias, sts, temps, rng_key, bool(return_logits),
            top_k or 0)
    _check_args(*args, names=_WRAPPER_NAMES)
    tokens, logits, conf, survival, logprobs, candidates = DRAFT_BLOCK(
        *args, backend=resolve_backend(backend, dev, DRAFT_BLOCK.name))
    has_conf = confidence is not None
    return DraftBlockOutput(tokens, logits if return_logits else None, conf if has_conf else None,
                            survival if has_conf else None, logprobs,
                            candidates if return_logits and top_k else None)
