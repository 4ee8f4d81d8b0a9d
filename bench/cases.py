"""Benchmark cases: for each op, the grid's shapes with their inputs, the call and the bytes floor; and the peers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

import dspark_kernels as dk
import floors

OPS = ["rng_uniform", "draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens",
       "dist_verify_stats", "dist_verify_decide", "dist_verify_residual", "dist_draft_step"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# verify_chain's sampled forms beyond the headline one ("token": token rule, dense float32 draft rows, draft_logprobs):
# the rule, the draft rows' layout and whether draft_logprobs are given. The forms other than "token" run at
# grid["form_shapes"] only (every shape when a grid has none).
VERIFY_FORMS = {
    "token": ("token", "dense", True),
    "token-rows": ("token", "dense", False),
    "block": ("block", "dense", True),
    "block-rows": ("block", "dense", False),
    "token-reduced": ("token", "reduced", True),
    "token-reduced-rows": ("token", "reduced", False),
    "token-topk": ("token", "topk", True),
    "token-topk-rows": ("token", "topk", False),
}
# a reduced draft vocabulary (DSpark drafters ship 32K; at most V / 2), top-k proposals (at most V)
REDUCED_VD, TOPK_K = 32768, 64


GRIDS = {
    # the headline grid; ops use the dimensions they have (scan: N, K; schedule: N, K; rng_uniform: N, K, V)
    "full": dict(N=[1, 8, 64, 256], K=[3, 7, 15], V=[32000, 151936], dtype=["bf16", "fp32"],
                 mode=["greedy", "sampled"], w2=["same", "fp8"], top_k=[0, 64], conf=[0, 1], forms=list(VERIFY_FORMS),
                 form_shapes=dict(K=7, V=151936, dtype="bf16")),
    "quick": dict(N=[1, 8, 64], K=[7], V=[32000], dtype=["fp32"], mode=["greedy", "sampled"], top_k=[0, 64],
                  conf=[0, 1], forms=list(VERIFY_FORMS)),
}
RANK, HIDDEN = 256, {"full": 4096, "quick": 256, "goals": 4096}
QWEN3_VOCAB = 151936

# The rows the open issues' goals are judged on (bench/goals.py), in the order they are timed: (ops, grid, backends),
# each case one that a goal reads. ``run.py --goals`` times them first, so that a short GPU session measures what
# decides an issue before the rest of the grid: the headline shapes (K = 7, V = 151936, bf16), fp8 W2 and top-k
# proposals at N = 1, draft_block at N = 256, K = 15.
_HEADLINE = dict(N=[1, 8, 64, 256], K=[7], V=[QWEN3_VOCAB], dtype=["bf16"], mode=["greedy", "sampled"])
_DRAFT = ["cuda", "triton", "cublas"]
GOALS = [
    (["draft_block"], dict(_HEADLINE, conf=[0, 1]), _DRAFT),
    (["verify_chain"], dict(_HEADLINE, forms=list(VERIFY_FORMS)), ["cuda", "triton", "flashinfer"]),
    (["schedule_verify_lens", "accept_prefix_scan"], _HEADLINE, ["cuda", "triton"]),
    (["draft_block"], dict(_HEADLINE, N=[1], mode=["greedy"], w2=["fp8"], conf=[0, 1]), ["cuda"]),
    (["draft_block"], dict(_HEADLINE, N=[1], mode=["greedy"], top_k=[64], conf=[0, 1]), ["cuda"]),
    (["draft_block"], dict(_HEADLINE, N=[256], K=[15], mode=["greedy"], conf=[0, 1]), _DRAFT),
    (["dist_draft_step"], _HEADLINE, ["cuda", "triton"]),
]


CASE_KEYS = ["N", "K", "V", "P", "dtype", "mode", "form", "w2", "top_k", "conf", "head", "sched", "active", "r",
             "d"]  # a case's name
SHARDS = 4   # the vocabulary-parallel rows: shard 1 of P = 4
BACKENDS = ["cuda", "triton", "cpu", "reference", "flashinfer", "cublas"]
PEERS = {"flashinfer": ["verify_chain"], "cublas": ["draft_block"]}   # external peers and the ops they have


@dataclass
class Case:
    op: str
    params: Dict[str, object]
    floor: floors.Floor
    inputs: Callable[[], dict]                  # builds the tensors (lazily, per case)
    run: Callable[[str, dict], object]          # (backend, inputs) -> result
    peers: Dict[str, Callable[[dict], object]] = field(default_factory=dict)  # peer name -> run(inputs)
    peer_notes: Dict[str, str] = field(default_factory=dict)  # peer name -> what it runs, or why it is missing


def _gen(seed: int = 0, dev="cpu") -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def _randn(shape, dev, dtype, g):
    """Random inputs made where they are used (the generator ``g`` lives on ``dev``): fast for GPU-sized cases."""
    return torch.randn(*shape, generator=g, device=dev).to(dtype)


def rng_uniform_cases(dev, grid):
    for n, k, v in itertools.product(grid["N"], grid["K"], grid["V"]):
        def inputs(n=n, k=k, v=v):
            return dict(out=torch.empty(n, k, v, device=dev))
        yield Case("rng_uniform", dict(N=n, K=k, V=v), floors.rng_uniform(n, k, v), inputs,
                   lambda b, x: dk.rng_uniform(x["out"], seed=1, offset=2, backend=b))


def draft_block_cases(dev, grid, d):
    """W2 of the grid's dtype ("same"), or fp8 e4m3 with per-row scales ("fp8": bf16 grids only; a w2 key); the full
    proposal (top_k 0) or top-k proposals (a top_k key; with W2 of the grid's dtype only); the kernel alone (conf 0)
    or with the confidence head over d-wide hidden states (conf 1); the vanilla head, or a grid's "head" (a head key).
    Greedy full-proposal rows of the vanilla kernel alone have the cuBLAS peer (cublas_draft_peer). Sampled rows
    draw by the exponential race and return what greedy rows do (tokens and their log-probabilities, which
    verify_chain's headline form reads), not the logits: the two differ by the cost of sampling alone."""
    for n, k, v, dt, mode, w2, top_k, conf, kind in itertools.product(
            grid["N"], grid["K"], grid["V"], grid["dtype"], grid["mode"], grid.get("w2", ["same"]),
            grid.get("top_k", [0]), grid.get("conf", [1]), grid.get("head", ["vanilla"])):
        if (w2 == "fp8" and dt != "bf16") or (w2 == "fp8" and top_k):
            continue
        dtype, sampled, fp8 = DTYPES[dt], mode == "sampled", w2 == "fp8"
        esize = torch.empty(0, dtype=dtype).element_size()
        hidden_d = d if conf or kind != "vanilla" else 0
        fl = floors.draft_block(n, k, v, RANK, d=hidden_d, head=kind, u_bytes=esize, w_bytes=esize,
                                confidence=bool(conf), w2_fp8=fp8, top_k=top_k)

        def inputs(n=n, k=k, v=v, dtype=dtype, fp8=fp8, conf=conf, kind=kind, hd=hidden_d):
            g = _gen(0, dev)
            w1, w2 = _randn((v, RANK), dev, dtype, g) * 0.05, _randn((v, RANK), dev, dtype, g) * 0.05
            extra = {}
            if kind == "gated":
                extra = dict(wg=_randn((RANK, hd + RANK), dev, dtype, g) * 0.02, bg=_randn((RANK,), dev, dtype, g))
            elif kind == "rnn":
                extra = dict(wj=_randn((3 * RANK, 2 * RANK + hd), dev, dtype, g) * 0.02,
                             bj=_randn((3 * RANK,), dev, dtype, g))
            if fp8:
                q, scale = dk.quantize_w2(w2)
                head = dk.MarkovHead(kind, w1, q, w2_scale=scale, **extra)
            else:
                head = dk.MarkovHead(kind, w1, w2, **extra)
            return dict(base=_randn((n, k, v), dev, dtype, g),
                        anchors=torch.randint(0, v, (n,), generator=g, device=dev), head=head,
                        hidden=_randn((n, k, hd), dev, dtype, g) if hd else None,
                        conf=dk.ConfidenceHead(_randn((hd + RANK,), dev, dtype, g) * 0.02, 0.0) if conf else None)

        params = dict(N=n, K=k, V=v, dtype=dt, mode=mode, r=RANK, d=hidden_d, conf=conf,
                      **({"w2": "fp8"} if fp8 else {}), **({"top_k": top_k} if top_k else {}),
                      **({"head": kind} if kind != "vanilla" else {}))
        peer = not sampled and not fp8 and not top_k and not conf and kind == "vanilla"
        yield Case("draft_block", params, fl, inputs,
                   lambda b, x, t=1.0 if sampled else 0.0, tk=top_k or None: dk.draft_block(
                       x["base"], x["anchors"], x["head"], hidden=x["hidden"], confidence=x["conf"], temperature=t,
                       seed=1, offset=0, top_k=tk, backend=b),
                   peers={"cublas": cublas_draft_peer} if peer else {},
                   peer_notes={"cublas": CUBLAS_NOTE if peer else
                               "no cuBLAS peer here (it has greedy full-proposal rows of the vanilla head alone)"})


CUBLAS_NOTE = ("per position W1 rows gathered, torch.addmm(U[:, k], W1[x], W2^T) and argmax; the K positions in one "
               "CUDA graph on a GPU (eager on the CPU)")


def _cublas_block(x) -> torch.Tensor:
    """The Markov head as a user would write it with cuBLAS: per position the N rows of W1 of the previous tokens
    times W2 transposed plus U[:, k] (one addmm in the inputs' dtype), then argmax; tokens int64 [N, K]."""
    base, head = x["base"], x["head"]
    tok, out = x["anchors"], []
    for k in range(base.shape[1]):
        tok = torch.addmm(base[:, k], head.w1[tok], head.w2.t()).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)


def cublas_draft_peer(x):
    """_cublas_block, captured once per inputs into a CUDA graph and replayed (a GPU), or run eagerly (the CPU)."""
    if x["base"].device.type != "cuda":
        return _cublas_block(x)
    if "_cublas_graph" not in x:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _cublas_block(x)  # warm-up outside the capture (cuBLAS handles, workspaces)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _cublas_block(x)
        x["_cublas_graph"] = (graph, out)
    graph, out = x["_cublas_graph"]
    graph.replay()
    return out


def _verify_forms(grid, k, v, dt):
    shape = grid.get("form_shapes")
    at_shape = shape is None or (k == shape["K"] and v == shape["V"] and dt == shape["dtype"])
    return [f for f in grid.get("forms", ["token"]) if f == "token" or at_shape]


def verify_chain_cases(dev, grid):
    """Greedy, and the sampled forms (VERIFY_FORMS); the draft logits come from draft_block: float32."""
    for n, k, v, dt, mode in itertools.product(grid["N"], grid["K"], grid["V"], grid["dtype"], grid["mode"]):
        for form in (_verify_forms(grid, k, v, dt) if mode == "sampled" else ["greedy"]):
            yield _verify_case(dev, n, k, v, dt, mode, form)


def _verify_case(dev, n, k, v, dt, mode, form):
    dtype, sampled = DTYPES[dt], mode == "sampled"
    rule, layout, lp = VERIFY_FORMS.get(form, ("token", "dense", False))
    width = {"dense": v, "reduced": min(REDUCED_VD, v // 2), "topk": min(TOPK_K, v)}[layout]
    esize = torch.empty(0, dtype=dtype).element_size()
    fl = floors.verify_chain_dense(n, k, v, target_bytes=esize, sampled=sampled,
                                   draft_logits_bytes=4 if sampled else None, draft_logprobs=sampled and lp,
                                   rule=rule,
                                   draft_width=width, map_bytes=4 if layout == "reduced" else 0,
                                   id_bytes=8 if layout == "topk" else 0)

    def inputs():
        g = _gen(1, dev)
        target = _randn((n, k + 1, v), dev, dtype, g)
        x = dict(target=target, draft_logits=None, layout=layout, rule=rule)
        # most drafts the draft's own argmax, the draft close to the target, so chains run a few positions deep
        dense = target[:, :k].float() + 0.5 * _randn((n, k, v), dev, torch.float32, g)
        if not sampled:
            keep = torch.rand(n, k, generator=g, device=dev) < 0.7
            x["drafts"] = torch.where(keep, target[:, :k].argmax(-1), torch.randint(0, v, (n, k), generator=g,
                                                                                      device=dev))
            return x
        if layout == "dense":
            rows, ids = dense, None
        elif layout == "reduced":
            ids = torch.randperm(v, generator=g, device=dev)[:width]
            rows = dense[..., ids]
            x["target_to_draft"] = dk.target_to_draft_map(ids, v)
        else:
            rows, ids = dense.topk(width, dim=-1)
            x["draft_candidates"] = ids
        col = torch.where(torch.rand(n, k, generator=g, device=dev) < 0.7, rows.argmax(-1),
                          torch.randint(0, width, (n, k), generator=g, device=dev))
        x["drafts"] = col if ids is None else (ids.expand(n, k, width) if ids.dim() == 1 else ids).gather(
            -1, col[..., None])[..., 0]
        x["draft_logits"] = rows
        if lp:
            x["draft_logprobs"] = torch.log_softmax(rows, -1).gather(-1, col[..., None])[..., 0]
        return x

    def run(b, x, t=1.0 if sampled else 0.0):
        kw = {key: x[key] for key in ("draft_logprobs", "target_to_draft", "draft_candidates") if key in x}
        return dk.verify_chain(x["target"], x["drafts"], draft_logits=x["draft_logits"], temperature=t, seed=1,
                               offset=0, method=x["rule"], backend=b, **kw)

    params = dict(N=n, K=k, V=v, dtype=dt, mode=mode, **({"form": form} if sampled and form != "token" else {}))
    return Case("verify_chain", params, fl, inputs, run)


def accept_prefix_scan_cases(dev, grid):
    for n, k in itertools.product(grid["N"], grid["K"]):
        def inputs(n=n, k=k):
            g = _gen(2)
            n_acc = torch.randint(0, k + 1, (n,), generator=g, dtype=torch.int32)
            tokens = torch.randint(0, 1000, (n, k + 1), generator=g)
            tokens[torch.arange(k + 1)[None, :] > n_acc[:, None].long()] = -1
            seq_lens = torch.randint(1, 4000, (n,), generator=g, dtype=torch.int32)
            cu = torch.nn.functional.pad((n_acc.long() * 0 + k + 1).cumsum(0), (1, 0)).int()
            table = torch.randperm(n * 256, generator=g).int().view(n, 256)
            return {key: t.to(dev) for key, t in dict(tokens=tokens, n_acc=n_acc, seq_lens=seq_lens, cu=cu,
                                                      table=table).items()}

        yield Case("accept_prefix_scan", dict(N=n, K=k), floors.accept_prefix_scan(n, k, block_size=16), inputs,
                   lambda b, x: dk.accept_prefix_scan(x["tokens"], x["seq_lens"], num_accepted=x["n_acc"],
                                                      verify_cu_seqlens=x["cu"], block_table=x["table"],
                                                      block_size=16, backend=b))


def schedule_verify_lens_cases(dev, grid):
    """Every request active, then with the ``active`` mask the decode step passes: a quarter of the batch inactive
    (finished requests, or an engine's padding to a graph size; at N = 1 the one request stays active)."""
    table = dk.CostTable([1, 64, 256, 1024], [10.0, 11.0, 14.0, 30.0])
    for n, k, frac, mode in itertools.product(grid["N"], grid["K"], [1.0, 0.75], ["exact", "argmax"]):
        def inputs(n=n, k=k, frac=frac):
            active = None if frac == 1.0 else torch.arange(n) < max(1, round(frac * n))
            return dict(survival=torch.rand(n, k, generator=_gen(3)).cumprod(-1).to(dev),
                        active=None if active is None else active.to(dev))
        params = dict(N=n, K=k, sched=mode) if frac == 1.0 else dict(N=n, K=k, sched=mode, active=frac)
        yield Case("schedule_verify_lens", params, floors.schedule_verify_lens(n, k, masked=frac != 1.0), inputs,
                   lambda b, x, m=mode: dk.schedule_verify_lens(x["survival"], cost_table=table, mode=m,
                                                                active=x["active"], backend=b))


def _shard_key(dev):
    from dspark_kernels.rng import make_rng_key
    return make_rng_key(1, 0, dev)


def dist_verify_stats_cases(dev, grid):
    """The first exchange of shard 1 of P: greedy (the argmax fields), sampled with float32 draft rows."""
    import dspark_kernels.distributed as D
    for n, k, v, dt, mode in itertools.product(grid["N"], grid["K"], grid["V"], grid["dtype"], grid["mode"]):
        dtype, sampled, vl = DTYPES[dt], mode == "sampled", v // SHARDS
        esize = torch.empty(0, dtype=dtype).element_size()
        fl = floors.dist_verify_stats(n, k, vl, target_bytes=esize, sampled=sampled,
                                      draft_logits_bytes=4 if sampled else None)

        def inputs(n=n, k=k, v=v, vl=vl, dtype=dtype, sampled=sampled):
            g = _gen(4, dev)
            return dict(target=_randn((n, k + 1, vl), dev, dtype, g), drafts=torch.randint(0, v, (n, k), device=dev,
                                                                                           generator=g),
                        draft=_randn((n, k, vl), dev, torch.float32, g) if sampled else None,
                        temps=torch.ones(n, device=dev) if sampled else None, v=v, vl=vl)

        yield Case("dist_verify_stats", dict(N=n, K=k, V=v, P=SHARDS, dtype=dt, mode=mode), fl, inputs,
                   lambda b, x: D.ops.verify_stats(x["target"], None, x["drafts"], x["draft"], x["temps"], x["vl"],
                                                   x["v"], b))


def dist_verify_decide_cases(dev, grid):
    """The decide step over P gathered statistics (token method; sampled with draft rows): its work is N K P,
    independent of V, so the statistics come from the reference pass over a 4000-token vocabulary."""
    import dspark_kernels.distributed as D
    for n, k, mode in itertools.product(grid["N"], grid["K"], grid["mode"]):
        sampled, v = mode == "sampled", 4000
        fl = floors.dist_verify_decide(n, k, SHARDS, sampled=sampled, draft=sampled)

        def inputs(n=n, k=k, sampled=sampled, v=v):
            g = _gen(5)
            target = torch.randn(n, k + 1, v, generator=g)
            drafts = torch.where(torch.rand(n, k, generator=g) < 0.7, target[:, :k].argmax(-1),
                                 torch.randint(0, v, (n, k), generator=g))
            draft = target[:, :k] + torch.randn(n, k, v, generator=g) if sampled else None
            temps = torch.ones(n) if sampled else None
            vl, key = v // SHARDS, _shard_key("cpu")
            stats = torch.stack([D.ops.verify_stats(target[..., a:a + vl], None, drafts, None if draft is None else
                                                    draft[..., a:a + vl], temps, a, v, "reference")
                                 for a in range(0, v, vl)])
            shards = torch.tensor([[a, vl] for a in range(0, v, vl)])
            return {name: t.to(dev) if t is not None else None for name, t in dict(
                stats=stats, shards=shards, drafts=drafts, temps=temps, key=key).items()} | dict(v=v, draft=sampled)

        yield Case("dist_verify_decide", dict(N=n, K=k, P=SHARDS, mode=mode), fl, inputs,
                   lambda b, x: D.ops.verify_decide(x["stats"], x["shards"], None, None, 0, x["drafts"], None, None,
                                                    None, None, x["temps"], x["key"], None, "token", x["draft"],
                                                    x["v"], b))


def dist_verify_residual_cases(dev, grid):
    """The residual pass of shard 1 of P: rows 0..K-1 of every request planned (each on its own draft row), float32
    draft rows."""
    import dspark_kernels.distributed as D
    from dspark_kernels.distributed import layout as L
    for n, k, v, dt in itertools.product(grid["N"], grid["K"], grid["V"], grid["dtype"]):
        dtype, vl = DTYPES[dt], v // SHARDS
        esize = torch.empty(0, dtype=dtype).element_size()
        fl = floors.dist_verify_residual(n, k, vl, target_bytes=esize, draft_logits_bytes=4)

        def inputs(n=n, k=k, v=v, vl=vl, dtype=dtype):
            g = _gen(6, dev)
            plan = torch.zeros(n, k, L.PLAN_WIDTH, device=dev)
            plan[..., L.PLAN_ROW] = torch.arange(k, device=dev).float()
            plan[..., L.PLAN_NEED], plan[..., L.PLAN_RHO] = 1.0, 0.5
            plan[..., L.PLAN_T_MAX], plan[..., L.PLAN_T_SUM] = 4.0, float(v)
            plan[..., L.PLAN_Q_MAX], plan[..., L.PLAN_Q_SUM] = 4.0, float(v)
            return dict(target=_randn((n, k + 1, vl), dev, dtype, g), draft=_randn((n, k, vl), dev, torch.float32, g),
                        drafts=torch.randint(0, v, (n, k), device=dev, generator=g), plan=plan,
                        temps=torch.ones(n, device=dev), key=_shard_key(dev), v=v, vl=vl)

        yield Case("dist_verify_residual", dict(N=n, K=k, V=v, P=SHARDS, dtype=dt, mode="sampled"), fl, inputs,
                   lambda b, x: D.ops.verify_residual(x["target"], None, x["drafts"], x["draft"], x["plan"],
                                                      x["temps"], x["key"], x["vl"], x["v"], b))


def dist_draft_step_cases(dev, grid):
    """One position of the Markov head on shard 1 of P (r = 256): greedy, or sampled with the shard's logits."""
    import dspark_kernels.distributed as D
    for n, v, dt, mode in itertools.product(grid["N"], grid["V"], grid["dtype"], grid["mode"]):
        dtype, sampled, vl = DTYPES[dt], mode == "sampled", v // SHARDS
        esize = torch.empty(0, dtype=dtype).element_size()
        fl = floors.dist_draft_step(n, vl, RANK, u_bytes=esize, w_bytes=esize, return_logits=sampled)

        def inputs(n=n, vl=vl, dtype=dtype, sampled=sampled):
            g = _gen(7, dev)
            return dict(base=_randn((n, vl), dev, dtype, g), v=_randn((n, RANK), dev, torch.float32, g),
                        w2=_randn((vl, RANK), dev, dtype, g) * 0.05, temps=torch.ones(n, device=dev) if sampled
                        else None, key=_shard_key(dev), vl=vl, ret=sampled)

        yield Case("dist_draft_step", dict(N=n, V=v, P=SHARDS, dtype=dt, mode=mode, r=RANK), fl, inputs,
                   lambda b, x: D.ops.draft_step(x["base"], x["v"], x["w2"], x["temps"], x["key"], 0, x["vl"],
                                                 x["ret"], b))


def cases_for(op, dev, grid, preset):
    return {"rng_uniform": lambda: rng_uniform_cases(dev, grid),
            "draft_block": lambda: draft_block_cases(dev, grid, HIDDEN[preset]),
            "verify_chain": lambda: verify_chain_cases(dev, grid),
            "accept_prefix_scan": lambda: accept_prefix_scan_cases(dev, grid),
            "schedule_verify_lens": lambda: schedule_verify_lens_cases(dev, grid),
            "dist_verify_stats": lambda: dist_verify_stats_cases(dev, grid),
            "dist_verify_decide": lambda: dist_verify_decide_cases(dev, grid),
            "dist_verify_residual": lambda: dist_verify_residual_cases(dev, grid),
            "dist_draft_step": lambda: dist_draft_step_cases(dev, grid)}[op]()


# ------------------------------------------------------------------------------------------------ peers

def flashinfer_runner():
    """A verify_chain runner with FlashInfer's chain_speculative_sampling (softmax of the logits included, as an
    engine holding logits would do), or the reason it is missing."""
    try:
        import flashinfer
        from flashinfer.sampling import chain_speculative_sampling
    except Exception as e:  # noqa: BLE001
        return None, f"flashinfer not importable ({type(e).__name__}: {str(e)[:80]})"

    def run(x):   # sampled cases only: FlashInfer takes probabilities, so the softmax is part of its time
        if x.get("layout", "dense") != "dense" or x.get("rule", "token") != "token":
            raise ValueError("FlashInfer's chain_speculative_sampling takes dense draft rows and the token rule")
        draft_probs = torch.softmax(x["draft_logits"].float(), -1)
        target_probs = torch.softmax(x["target"].float(), -1)
        return chain_speculative_sampling(draft_probs, x["drafts"].int(), target_probs)

    return run, f"flashinfer {getattr(flashinfer, '__version__', '?')}"



def backends_for(op: str, wanted: List[str]) -> List[str]:
    """The backends and peers of ``wanted`` that have ``op``."""
    return [b for b in wanted if b not in PEERS or op in PEERS[b]]
