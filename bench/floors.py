"""Bytes floors: the bytes each op must move between memory and the chip, from its shapes alone.

A floor counts every input the op has to read (read once) and every output it writes (written once). Achieved
bandwidth = floor / time; "% of copy" = that against the machine's measured device-to-device copy bandwidth. These
are the formulas of DESIGN.md ("Parallel structure and the bytes floor"); each function
returns a ``Floor`` whose ``terms`` name every part, so a reader (and ``python_tests/test_bench.py``) can check the
arithmetic by hand. Sizes are in bytes; ``*_bytes`` arguments are element sizes (bf16 = 2, fp32 = 4).

Headline, DESIGN.md (N = 64, K = 7, V = 151936, r = 256, bf16): verify greedy 155.6 MB, verify sampling with
draft_logprobs 175.0 MB (bf16 draft rows) to 194.5 MB (fp32 draft rows), draft_block 680.7 MB (W2 streamed once
per position; 214.0 MB with W2 kept on chip across positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

I64, I32, F32, BOOL = 8, 4, 4, 1


@dataclass
class Floor:
    op: str
    terms: Dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()))

    def add(self, name: str, nbytes: int) -> "Floor":
        if nbytes:
            self.terms[name] = self.terms.get(name, 0) + int(nbytes)
        return self


def rng_uniform(n: int, k: int, v: int) -> Floor:
    """float32 ``out [N, K, V]`` written once; nothing read (the key is 16 bytes)."""
    return Floor("rng_uniform").add("out", n * k * v * F32).add("rng_key", 2 * I64)


def draft_block(n: int, k: int, v: int, r: int, *, d: int = 0, head: str = "vanilla", u_bytes: int = 2,
                w_bytes: int = 2, hidden_bytes: Optional[int] = None, confidence: bool = False,
                return_logits: bool = False, w2_on_chip: bool = False, w2_fp8: bool = False, top_k: int = 0) -> Floor:
    """U once, W2 once per position (or once per block with ``w2_on_chip``), the per-position head weights once per
    position, the Markov rows of W1 actually used, hidden states once, and the outputs: tokens (int64) and their
    float32 log-probabilities (always), the float32 logits only when asked (``return_logits``), the float32
    confidence logits and survival with a confidence head.
    ``w2_fp8``: W2 is e4m3 (1 byte an element) with a float32 scale per row. ``top_k``: top-k proposals read only
    the candidates' rows of W2, per request and position, and return sparse logits (float32 values + int64 ids).
    """
    hb = w_bytes if hidden_bytes is None else hidden_bytes
    f = Floor("draft_block")
    f.add("U", n * k * v * u_bytes)
    w2_row = r + F32 if w2_fp8 else r * w_bytes
    if top_k:
        f.add("W2 rows", n * k * top_k * w2_row)
    else:
        f.add("W2", (1 if w2_on_chip else k) * v * w2_row)
    f.add("W1 rows", n * k * r * w_bytes)            # the embedding row of each position's previous token
    f.add("anchors", n * I64)
    if head == "gated":
        f.add("Wg", k * r * (d + r) * w_bytes).add("bg", k * r * w_bytes)
    elif head == "rnn":
        f.add("Wj", k * 3 * r * (2 * r + d) * w_bytes).add("bj", k * 3 * r * w_bytes)
    elif head != "vanilla":
        raise ValueError(f"head must be vanilla, gated or rnn, got {head!r}")
    if head != "vanilla" or confidence:
        f.add("hidden", n * k * d * hb)
    if confidence:
        f.add("confidence weight", (d + r) * w_bytes)
        f.add("conf_logits + survival", 2 * n * k * F32)
    f.add("tokens", n * k * I64)
    f.add("draft_logprobs", n * k * F32)   # always written (DraftBlockOutput.draft_logprobs)
    if return_logits:
        f.add("logits", n * k * (top_k * (F32 + I64) if top_k else v * F32))
    return f


def verify_chain(verify_lens: Sequence[int], k: int, v: int, *, target_bytes: int = 2, sampled: bool = False,
                 draft_logits_bytes: Optional[int] = None, draft_logprobs: bool = False, rule: str = "token",
                 draft_width: Optional[int] = None, map_bytes: int = 0, id_bytes: int = 0) -> Floor:
    """Greedy: the verified target rows once (``L_r + 1`` rows of request r). Sampling: the same, plus
    - with ``draft_logprobs`` (log q of each drafted token given): one draft row per request (the rejected one, for
      the residual), and the logprobs themselves; block verification (``rule="block"``) also reads draft rows
      1..L-1 (``h_i`` needs the residual mass of row i against ``q_{i+1}``);
    - with draft logits but no logprobs: every verified draft row (``q(d_j)`` needs row j's normaliser);
    - without draft logits (one-hot q): nothing more.
    Draft rows have ``draft_width`` columns (V when None; Vd of a reduced vocabulary, k of top-k rows), with
    ``id_bytes`` of candidate id per column (top-k rows), and a reduced vocabulary's target -> draft table (V entries
    of ``map_bytes``) is read once. Plus the drafted tokens and the outputs (tokens int64 [N, K+1], num_accepted
    int32, accept_mask bool)."""
    n = len(verify_lens)
    lens = [max(0, min(int(x), k)) for x in verify_lens]
    width = v if draft_width is None else draft_width
    f = Floor("verify_chain")
    f.add("target rows", sum(x + 1 for x in lens) * v * target_bytes)
    if sampled and draft_logits_bytes is not None:
        if rule not in ("token", "block"):
            raise ValueError(f"rule must be token or block, got {rule!r}")
        rows = (n + (sum(max(x - 1, 0) for x in lens) if rule == "block" else 0)) if draft_logprobs else sum(lens)
        f.add("draft rows", rows * width * (draft_logits_bytes + id_bytes))
        if draft_logprobs:
            f.add("draft_logprobs", n * k * F32)
        f.add("target_to_draft", v * map_bytes)
    f.add("draft tokens", n * k * I64)
    if sampled:
        f.add("temperature", n * F32)
    f.add("tokens", n * (k + 1) * I64).add("num_accepted", n * I32).add("accept_mask", n * k * BOOL)
    return f


def verify_chain_dense(n: int, k: int, v: int, **kw) -> Floor:
    """``verify_chain`` with every request verifying all K drafts (dense ``[N, K+1, V]`` target logits)."""
    return verify_chain([k] * n, k, v, **kw)


def accept_prefix_scan(n: int, k: int, *, block_table: bool = True, block_size: int = 16, verify_cu: bool = True,
                       max_seq_lens: bool = False) -> Floor:
    """Inputs once (tokens [N, K+1] int64, seq_lens, num_accepted, verify cu_seqlens, the block-table entries that
    cover the K+1 kept positions, max_seq_lens) and the outputs once (cu_out, packed out_tokens / hidden_rows /
    kv_slots of N*(K+1) slots each, new_seq_lens, next_anchor, finished)."""
    f = Floor("accept_prefix_scan")
    f.add("tokens", n * (k + 1) * I64).add("seq_lens", n * I32).add("num_accepted", n * I32)
    if verify_cu:
        f.add("verify_cu_seqlens", (n + 1) * I32)
    if block_table:
        f.add("block_table entries", n * (-(-(k + 1) // block_size) + 1) * I32)
    if max_seq_lens:
        f.add("max_seq_lens", n * I32)
    f.add("cu_out", (n + 1) * I32).add("out_tokens", n * (k + 1) * I64).add("new_seq_lens", n * I32)
    f.add("next_anchor", n * I64).add("hidden_rows", n * (k + 1) * I32).add("finished", n * BOOL)
    if block_table:
        f.add("kv_slots", n * (k + 1) * I64)
    return f


def schedule_verify_lens(n: int, k: int, *, table_points: int = 4, from_conf: bool = False,
                         budget: Optional[Sequence[int]] = None, masked: bool = False) -> Floor:
    """The survival (or conf_logits + STS temperatures) [N, K] float32 once, the active mask bool [N] when given,
    the cost table, an optional budget survival [N', K'], and the outputs (verify_lens int32 [N], cu_seqlens int32
    [N+1], Theta float32)."""
    f = Floor("schedule_verify_lens")
    f.add("conf_logits" if from_conf else "survival", n * k * F32)
    if masked:
        f.add("active", n * BOOL)
    if from_conf:
        f.add("sts_temperatures", k * F32)
    f.add("cost table", 2 * table_points * I64)
    if budget is not None:
        f.add("budget_survival", int(budget[0]) * int(budget[1]) * F32)
    f.add("verify_lens", n * I32).add("cu_seqlens", (n + 1) * I32).add("theta", F32)
    return f


# ------------------------------------------------------------------------------------------------ vocabulary shards
# The local pieces of dspark_kernels.distributed on one shard of Vl = V / P tokens (layout.py's buffers).

def stats_width(sampled: bool, draft: bool) -> int:
    """Floats per (request, row) of the first exchange (layout.StatsLayout.width)."""
    return (10 if draft else 6) if sampled else 2


def dist_verify_stats(n: int, k: int, vl: int, *, target_bytes: int = 2, sampled: bool = False,
                      draft_logits_bytes: Optional[int] = None) -> Floor:
    """The shard's target rows [N, K+1, Vl] once, its draft rows [N, K, Vl] (with draft logits), the drafts, the
    temperatures, and the send buffer float32 [N, K+1, width]."""
    draft = sampled and draft_logits_bytes is not None
    f = Floor("dist_verify_stats").add("target rows", n * (k + 1) * vl * target_bytes)
    if draft:
        f.add("draft rows", n * k * vl * draft_logits_bytes)
    f.add("draft tokens", n * k * I64)
    if sampled:
        f.add("temperature", n * F32)
    return f.add("stats", n * (k + 1) * stats_width(sampled, draft) * F32)


def dist_verify_decide(n: int, k: int, p: int, *, sampled: bool = False, draft: bool = False,
                       method: str = "token") -> Floor:
    """What the decide step must read of every shard's statistics [P, N, K+1, width]: the argmax pair of each row
    (greedy), every slot of each row (sampling). Then the shard table, the drafts and temperatures, and the outputs
    (tokens, num_accepted, accept_mask, the plan float32 [N, R, 9]: R = 1 token, K+1 block). Every row counted: the
    kernel stops reading a request's rows at its first rejection, so it can move less than this (data-dependent)."""
    rows = p * n * (k + 1)
    f = Floor("dist_verify_decide").add("stats", rows * stats_width(sampled, draft) * F32)
    f.add("shards", p * 2 * I64).add("draft tokens", n * k * I64)
    if sampled:
        f.add("temperature", n * F32).add("plan", n * (1 if method == "token" else k + 1) * 9 * F32)
    return f.add("tokens", n * (k + 1) * I64).add("num_accepted", n * I32).add("accept_mask", n * k * BOOL)


def dist_verify_residual(n: int, slots: int, vl: int, *, target_bytes: int = 2,
                         draft_logits_bytes: Optional[int] = None) -> Floor:
    """The planned slots' target rows (and draft rows; one-hot drafts: the draft tokens) of the shard once, the plan,
    the temperatures, the second exchange's buffer float32 [N, R, 5] (every slot needed, each on its own draft
    row)."""
    f = Floor("dist_verify_residual").add("target rows", n * slots * vl * target_bytes)
    if draft_logits_bytes is not None:
        f.add("draft rows", n * slots * vl * draft_logits_bytes)
    else:
        f.add("draft tokens", n * slots * I64)
    f.add("plan", n * slots * 9 * F32).add("temperature", n * F32)
    return f.add("residual", n * slots * 5 * F32)


def dist_draft_step(n: int, vl: int, r: int, *, u_bytes: int = 2, w_bytes: int = 2,
                    return_logits: bool = False) -> Floor:
    """One position on one shard: U_k [N, Vl], v float32 [N, r], the W2 shard [Vl, r] once, the packed winners, the
    statistics float32 [N, 5] and, when asked, the shard's float32 logits."""
    f = Floor("dist_draft_step").add("U", n * vl * u_bytes).add("v", n * r * F32).add("W2 shard", vl * r * w_bytes)
    f.add("packed", n * I64).add("stats", n * 5 * F32)
    if return_logits:
        f.add("logits", n * vl * F32)
    return f
