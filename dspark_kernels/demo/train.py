"""Train the demo's tiny Qwen3-style target and its DSpark drafters on the Python standard library (CPU).

``python -m dspark_kernels.demo.train --out DIR`` (defaults reproduce the shipped assets). Stages, each timed:
corpus (the stdlib's .py files, sorted, split by file) -> BPE tokenizer -> target LM -> target continuations of
training prompts (greedy and T = 1: the drafter learns the target's own text) -> drafters against the frozen
target (DSpark vanilla / gated / rnn, a vanilla one over a reduced vocabulary of the ``draft_vocab`` most frequent
ids, and the no-Markov DFlash-style baseline, all in one loop over the same batches) -> STS fitted on held-out
prompts -> fp16 folders in the layout ``decode.checkpoint`` loads.
Deterministic given the seed (fixed step counts, seeded generators, one fixed thread count). ``--reduced-only``
trains just the reduced-vocabulary drafter against the target already in ``--out`` (how the shipped
``dspark_vanilla_vd1024`` was made, against the shipped fp16 target).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F

from ..decode.checkpoint import save_target
from ..decode.drafter import DrafterConfig, DSparkDrafter
from ..decode.model import ModelConfig, TargetModel

EOS, MASK = "<|endoftext|>", "<|mask|>"
HEADS = ("vanilla", "gated", "rnn", "none")  # "none": the DFlash-style baseline (no Markov head)


@dataclass
class TrainConfig:
    seed: int = 0
    vocab: int = 2048
    max_corpus_chars: int = 6_000_000        # training text used (the first files in sorted order)
    d: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    inter: int = 384
    target_steps: int = 800
    target_batch: int = 24
    seq_len: int = 128
    target_lr: float = 3e-3
    prompt_len: int = 64
    gen_len: int = 64
    n_sequences: int = 2048                  # target continuations used to train the drafters
    block: int = 15                          # K: the drafters' block size
    draft_layers: int = 1
    markov_rank: int = 32
    layer_ids: List[int] = field(default_factory=lambda: [0, 1, 2])
    draft_steps: int = 1200
    draft_batch: int = 16
    anchors: int = 8                         # blocks per sequence per step
    draft_lr: float = 2e-3
    heads_trained: List[str] = field(default_factory=lambda: list(HEADS))
    draft_vocab: int = 1024                  # Vd of the reduced-vocabulary vanilla drafter (0: none)
    calib_prompts: int = 24
    calib_tokens: int = 96


# -------------------------------------------------------------------------------------------------- corpus
def stdlib_files() -> List[str]:
    """The standard library's .py files (tests, site-packages and idlelib left out), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib",
                                                              "__pycache__") and not d.startswith("lib2to3"))
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


def split_files(files):
    """Held out by file: index % 10 == 3 -> validation (STS), == 7 -> test (demo prompts), else training."""
    return ([f for i, f in enumerate(files) if i % 10 not in (3, 7)], [f for i, f in enumerate(files) if i % 10 == 3],
            [f for i, f in enumerate(files) if i % 10 == 7])


def read_texts(files, max_chars=None) -> List[str]:
    out, total = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        out.append(t)
        total += len(t)
        if max_chars is not None and total >= max_chars:
            break
    return out


def train_tokenizer(texts, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_stream(tok, texts) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


# -------------------------------------------------------------------------------------------------- models
def target_config(c: TrainConfig) -> dict:
    return dict(model_type="qwen3", vocab_size=c.vocab, hidden_size=c.d, intermediate_size=c.inter,
                num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                head_dim=c.d // c.heads, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                eos_token_id=0, max_position_embeddings=1024)


def drafter_config(c: TrainConfig, head: str, draft_vocab: int = 0) -> DrafterConfig:
    cfg = dict(model_type="qwen3", vocab_size=c.vocab, hidden_size=c.d, intermediate_size=c.inter,
               num_hidden_layers=c.draft_layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
               head_dim=c.d // c.heads, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=c.block, mask_token_id=1,
               target_layer_ids=list(c.layer_ids), markov_rank=0 if head == "none" else c.markov_rank,
               markov_head_type="vanilla" if head == "none" else head, enable_confidence_head=True,
               confidence_head_with_markov=True, draft_vocab_size=draft_vocab)
    return DrafterConfig.from_hf(cfg)


def init_weights_(module, seed: int, n_layers: int) -> None:
    """GPT-style: N(0, 0.02) matrices (residual outputs / sqrt(2 L)), zero biases, unit norms, zero Markov W2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or "markov_w2" in name:
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def target_forward(model: TargetModel, ids: torch.Tensor, keep=()):
    """Causal full-sequence forward ``[B, T]`` with the model's own modules -> (logits, hidden cat of ``keep``)."""
    x = model.embed_tokens(ids)
    pos, inv = torch.arange(ids.shape[1]), model.rope(ids.device)
    hid = {-1: x} if -1 in keep else {}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        hx = layer.input_layernorm(x)
        q = a.project_q(hx, pos, inv).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in a.project_kv(hx, pos, inv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.d ** -0.5, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in keep:
            hid[i] = x
    logits = model.lm_head(model.norm(x))
    return logits, (torch.cat([hid[i] for i in keep], -1) if keep else None)


def drafter_forward(dr: DSparkDrafter, hidden, tokens, anchors):
    """Training twin of ``DSparkDrafter.forward_block`` for A blocks per sequence at once: hidden ``[B, T, n d]``,
    tokens ``[B, T]``, anchor positions ``[B, A]`` -> base logits ``[B, A, K, V]`` and h ``[B, A, K, d]``. Block
    a attends to the context positions < its anchor and to its own K rows (non-causal), as in decoding."""
    bsz, t_len = tokens.shape
    a_n, k_len, cfg = anchors.shape[1], dr.block_size, dr.config
    ctx = dr.hidden_norm(dr.fc(hidden))
    ids = torch.full((bsz, a_n, k_len), cfg.mask_token_id, dtype=torch.long)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = dr.embed_tokens(ids).flatten(1, 2)
    pos_b = (anchors.unsqueeze(-1) + torch.arange(k_len)).flatten(1)
    pos_c, inv = torch.arange(t_len), dr.rope(tokens.device)
    ctx_ok = (pos_c.view(1, 1, -1) < anchors.unsqueeze(-1)).repeat_interleave(k_len, 1)   # [B, A K, T]
    blk = torch.arange(a_n).repeat_interleave(k_len)
    blk_ok = (blk.view(-1, 1) == blk.view(1, -1)).expand(bsz, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], -1).unsqueeze(1)
    for layer in dr.layers:
        a = layer.self_attn
        hx = layer.input_layernorm(x)
        q = a.project_q(hx, pos_b, inv).transpose(1, 2)
        kb, vb = a.project_kv(hx, pos_b, inv)
        kc, vc = a.project_kv(ctx, pos_c, inv)
        k, v = torch.cat([kc, kb], 1).transpose(1, 2), torch.cat([vc, vb], 1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.d ** -0.5, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = dr.norm(x)
    u = h @ dr.draft_lm_head.T
    return u.view(bsz, a_n, k_len, -1), h.view(bsz, a_n, k_len, -1)


def markov_forward(dr: DSparkDrafter, u, h, prev):
    """Teacher-forced Markov head (``prev`` ``[B, A, K]``: the token before each position, x_0 = the anchor) ->
    corrected logits and the confidence head's features ``[h; e]`` (``[h]`` without a Markov head)."""
    m = dr.markov_head
    if m is None:
        return u, h
    e = m.markov_w1(prev)
    if m.kind == "vanilla":
        v = e
    elif m.kind == "gated":
        v = torch.sigmoid(m.gate_proj(torch.cat([h, e], -1))) * e
    else:
        s, vs = torch.zeros_like(e[:, :, 0]), []
        for k in range(e.shape[2]):
            g, c, o = m.joint_proj(torch.cat([s, e[:, :, k], h[:, :, k]], -1)).chunk(3, -1)
            s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
            vs.append(torch.tanh(o))
        v = torch.stack(vs, 2)
    return u + m.markov_w2(v), torch.cat([h, e], -1)


def cosine_lr(step, total, peak, warmup=50):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


# -------------------------------------------------------------------------------------------------- stages
def train_target(c: TrainConfig, stream: torch.Tensor, log) -> TargetModel:
    model = TargetModel(ModelConfig.from_hf(target_config(c)))
    init_weights_(model, c.seed, c.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=c.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(c.seed + 1)
    model.train()
    for step in range(c.target_steps):
        starts = torch.randint(0, stream.numel() - c.seq_len - 1, (c.target_batch,), generator=g)
        win = torch.stack([stream[s:s + c.seq_len + 1] for s in starts.tolist()])
        logits, _ = target_forward(model, win[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten())
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, c.target_steps, c.target_lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == c.target_steps - 1:
            log(f"target step {step:5d} loss {loss.item():.3f}")
    return model.eval()


@torch.no_grad()
def eval_loss(model, stream, c: TrainConfig, n=32) -> float:
    g = torch.Generator().manual_seed(c.seed + 2)
    starts = torch.randint(0, stream.numel() - c.seq_len - 1, (n,), generator=g)
    win = torch.stack([stream[s:s + c.seq_len + 1] for s in starts.tolist()])
    logits, _ = target_forward(model, win[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten()))


@torch.no_grad()
def continuations(model: TargetModel, prompts: torch.Tensor, gen: int, temperature: float, seed: int):
    """The target's own continuation of each prompt row (greedy, or sampled at ``temperature``) through its paged
    KV cache; returns ``[B, P + gen]``."""
    b, p = prompts.shape
    model.alloc_cache(b, p + gen + 1)
    g = torch.Generator().manual_seed(seed)
    cu = torch.arange(0, b * p + 1, p, dtype=torch.int32)
    pos = torch.arange(p).repeat(b)
    last = torch.arange(p - 1, b * p, p)
    logits = model(prompts.flatten(), pos, cu, p, p, logit_rows=last).logits
    seq, one = [prompts], torch.arange(b + 1, dtype=torch.int32)
    for s in range(gen):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=g)[:, 0]
        else:
            nxt = logits.argmax(-1)
        seq.append(nxt.view(b, 1))
        if s + 1 < gen:
            logits = model(nxt, torch.full((b,), p + s), one, 1, p + s + 1).logits
    return torch.cat(seq, 1)


def make_sequences(model, stream, c: TrainConfig, n, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - c.prompt_len, (n,), generator=g)
    prompts = torch.stack([stream[s:s + c.prompt_len] for s in starts.tolist()])
    out = []
    for i in range(0, n, 128):  # half greedy, half sampled at T = 1
        out.append(continuations(model, prompts[i:i + 128], c.gen_len, 0.0 if (i // 128) % 2 == 0 else 1.0, seed + i))
    return torch.cat(out)


def frequent_ids(seqs: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` most frequent ids of ``seqs`` (ties to the lower id), ascending: a reduced draft vocabulary."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab)
    return torch.argsort(-counts, stable=True)[:n].sort().values


def drafter_specs(c: TrainConfig, seqs: torch.Tensor) -> Dict[str, tuple]:
    """name -> (head, reduced vocabulary or None): the heads of ``heads_trained``, and "vanilla_vd" over the
    ``draft_vocab`` most frequent ids of the training sequences when ``draft_vocab`` > 0."""
    specs = {head: (head, None) for head in c.heads_trained}
    if c.draft_vocab:
        if not 0 < c.draft_vocab < c.vocab:
            raise ValueError(f"draft_vocab must lie in [1, vocab = {c.vocab}) (0: no reduced drafter), "
                             f"got {c.draft_vocab}")
        specs["vanilla_vd"] = ("vanilla", frequent_ids(seqs, c.draft_vocab, c.vocab))
    return specs


def _new_drafter(c: TrainConfig, target: TargetModel, head: str, ids) -> DSparkDrafter:
    dr = DSparkDrafter.for_target(drafter_config(c, head, 0 if ids is None else len(ids)), target)
    init_weights_(dr, c.seed + 10, c.draft_layers)  # backbone first: the same start for every head
    if ids is not None:  # the reduced LM head: the target's rows of the draft ids, frozen as the shared one is
        dr.set_draft_ids(ids)
        with torch.no_grad():
            dr.lm_head.weight.copy_(target.lm_head.weight[ids])
        dr.lm_head.weight.requires_grad_(False)
    return dr


def _draft_losses(logits, p_t, ids):
    """(soft cross-entropy against the target's distribution p_t, P(accept) at T = 1); with a reduced vocabulary
    q is zero off ``ids``, so the target's mass there is always rejected."""
    logq = torch.log_softmax(logits, -1)
    p = p_t if ids is None else p_t[..., ids]
    kl = -(p * logq).sum(-1)
    with torch.no_grad():
        soft = 1 - 0.5 * ((logq.exp() - p).abs().sum(-1) + (1 - p.sum(-1)))
    return kl, soft


def train_drafters(c: TrainConfig, target: TargetModel, seqs: torch.Tensor, log) -> Dict[str, DSparkDrafter]:
    for p in target.parameters():
        p.requires_grad_(False)
    drafters, opts, specs = {}, {}, drafter_specs(c, seqs)
    for name, (head, ids) in specs.items():
        dr = _new_drafter(c, target, head, ids)
        drafters[name] = dr.train()
        opts[name] = torch.optim.AdamW([p for p in dr.parameters() if p.requires_grad], lr=c.draft_lr,
                                       betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(c.seed + 3)
    k_len, t_len = c.block, seqs.shape[1]
    lo, hi = c.prompt_len - 1, t_len - k_len - 1  # anchors: last prompt token .. the last full block
    pos_w = torch.exp(-torch.arange(k_len) / 7.0)  # earlier positions matter more (DFlash's decay)
    pos_w = pos_w / pos_w.sum()
    for step in range(c.draft_steps):
        rows = torch.randint(0, seqs.shape[0], (c.draft_batch,), generator=g)
        toks = seqs[rows]
        anchors = torch.stack([torch.randperm(hi - lo + 1, generator=g)[:c.anchors] + lo
                               for _ in range(c.draft_batch)]).sort(1).values
        with torch.no_grad():
            logits_t, hidden = target_forward(target, toks, keep=c.layer_ids)
            idx = anchors.unsqueeze(-1) + torch.arange(k_len)               # rows a..a+K-1 predict a+1..a+K
            p_t = torch.softmax(logits_t.gather(1, idx.flatten(1).unsqueeze(-1).expand(-1, -1, c.vocab)), -1)
            p_t = p_t.view(c.draft_batch, c.anchors, k_len, -1)
            prev = toks.gather(1, idx.flatten(1)).view(c.draft_batch, c.anchors, k_len)
        msg = []
        for head, dr in drafters.items():
            u, h = drafter_forward(dr, hidden, toks, anchors)
            logits, feat = markov_forward(dr, u, h, prev)
            kl, soft = _draft_losses(logits, p_t, specs[head][1])           # soft CE = KL + const
            loss = (kl.mean((0, 1)) * pos_w).sum()
            conf = dr.confidence_head.proj(feat.detach()).squeeze(-1)
            loss_c = F.binary_cross_entropy_with_logits(conf, soft.clamp(0, 1))
            for grp in opts[head].param_groups:
                grp["lr"] = cosine_lr(step, c.draft_steps, c.draft_lr)
            opts[head].zero_grad(set_to_none=True)
            (loss + loss_c).backward()
            torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
            opts[head].step()
            msg.append(f"{head} {loss.item():.3f}/{loss_c.item():.3f}")
        if step % 50 == 0 or step == c.draft_steps - 1:
            log(f"drafter step {step:4d} (distill/conf) " + "  ".join(msg))
    return {h: d.eval() for h, d in drafters.items()}


# -------------------------------------------------------------------------------------------------- saving
def save_fp16_target(model: TargetModel, path, tok) -> None:
    half = TargetModel(model.config)
    half.load_state_dict(model.state_dict())
    save_target(half.half(), path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": 0}, fh)


def save_fp16_drafter(dr: DSparkDrafter, path, extra: dict) -> None:
    """DeepSpec layout without the shared embedding / LM head (the loader takes the target's)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {k: (v.detach().half() if v.is_floating_point() else v).contiguous() for k, v in dr.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({**dr.config.to_hf(), **extra}, fh, indent=2)


def held_out_prompts(tok, files, n, length, skips=(0,)) -> List[List[int]]:
    """Up to ``n`` prompts of ``length`` tokens from held-out files: the windows at ``skips`` tokens into each."""
    out = []
    for skip in skips:
        for text in read_texts(files):
            ids = tok.encode(text).ids[skip:skip + length]
            if len(ids) == length and len(out) < n:
                out.append(ids)
    return out


def write_prompts(tok, test_files, out_dir, n=96, length=32) -> None:
    """The demo's prompts (test split, never seen in training or calibration), stored so that every machine (every
    Python version's stdlib) runs the same demo."""
    ids = held_out_prompts(tok, test_files, n, length, skips=(64, 320, 640))
    with open(os.path.join(out_dir, "prompts.json"), "w") as fh:
        json.dump({"source": "python stdlib test split (file index % 10 == 7), 32-token windows", "prompts": ids}, fh)


def run(c: TrainConfig, out_dir: str, log=print) -> dict:
    from ..decode import load_target
    torch.manual_seed(c.seed)
    times, t0 = {}, time.perf_counter()

    def stage(name):
        nonlocal t0
        times[name] = round(time.perf_counter() - t0, 1)
        log(f"== stage {name}: {times[name]} s")
        t0 = time.perf_counter()

    train_f, val_f, test_f = split_files(stdlib_files())
    texts = read_texts(train_f, c.max_corpus_chars)
    stage("corpus")
    tok = train_tokenizer(texts, c.vocab)
    stream = encode_stream(tok, texts)
    log(f"corpus: {len(texts)} training files, {stream.numel()} tokens")
    stage("tokenizer")
    target = train_target(c, stream, log)
    log(f"target eval loss (training windows): {eval_loss(target, stream, c):.3f}")
    stage("target")
    seqs = make_sequences(target, stream, c, c.n_sequences, c.seed + 4)
    stage("continuations")
    drafters = train_drafters(c, target, seqs, log)
    stage("drafters")
    tdir = os.path.join(out_dir, "target")
    save_fp16_target(target, tdir, tok)
    target16 = load_target(tdir)  # calibrate what ships: the fp16 weights
    write_prompts(tok, test_f, out_dir)
    result = {"stage_seconds": times, "config": c.__dict__,
              "sts": save_and_calibrate(c, drafters, target16, held_out_prompts(tok, val_f, c.calib_prompts, 32),
                                        out_dir)}
    stage("calibrate")
    result["stage_seconds"] = times
    result["total_seconds"] = round(sum(times.values()), 1)
    with open(os.path.join(out_dir, "train_log.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    return result


def asset_name(c: TrainConfig, head: str) -> str:
    return {"none": "baseline", "vanilla_vd": f"dspark_vanilla_vd{c.draft_vocab}"}.get(head, f"dspark_{head}")


def save_and_calibrate(c: TrainConfig, drafters, target16, prompts, out_dir) -> dict:
    """Each drafter in fp16 under its asset name, with STS temperatures fitted (greedy and T = 1) on what ships."""
    from ..decode import SpeculativeDecoder, calibrate, load_drafter
    fitted = {}
    for head, dr in drafters.items():
        name = asset_name(c, head)
        save_fp16_drafter(dr, os.path.join(out_dir, name), {})
        dec = SpeculativeDecoder(target16, load_drafter(os.path.join(out_dir, name), target16), backend="reference")
        sts = {t: calibrate(dec, prompts, c.calib_tokens, temperature=temp)["sts_temperatures"]
               for t, temp in (("greedy", 0.0), ("t1", 1.0))}
        with open(os.path.join(out_dir, name, "sts.json"), "w") as fh:
            json.dump(sts, fh, indent=2)
        fitted[name] = sts
    return fitted


def run_reduced(c: TrainConfig, out_dir: str, log=print) -> dict:
    """Only the reduced-vocabulary drafter, against the target already in ``out_dir`` (its fp16 weights, its
    tokenizer): the corpus, the continuations, the training loop and the calibration of ``run``."""
    from tokenizers import Tokenizer

    from ..decode import load_target
    t0 = time.perf_counter()
    train_f, val_f, _ = split_files(stdlib_files())
    texts = read_texts(train_f, c.max_corpus_chars)
    tok = Tokenizer.from_file(os.path.join(out_dir, "target", "tokenizer.json"))
    target = load_target(os.path.join(out_dir, "target"))
    seqs = make_sequences(target, encode_stream(tok, texts), c, c.n_sequences, c.seed + 4)
    drafters = train_drafters(dataclasses.replace(c, heads_trained=[]), target, seqs, log)
    sts = save_and_calibrate(c, drafters, target, held_out_prompts(tok, val_f, c.calib_prompts, 32), out_dir)
    return {"seconds": round(time.perf_counter() - t0, 1), "sts": sts}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.demo.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "assets"), help="output folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it; on a shared 2-core "
                   "machine 1 thread ran 3-4x faster than 2)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override TrainConfig fields")
    p.add_argument("--reduced-only", action="store_true", help="train only the reduced-vocabulary drafter (Vd = "
                   "draft_vocab) against the target already in --out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    c = TrainConfig()
    for kv in args.set:
        k, v = kv.split("=", 1)
        cur = getattr(c, k)
        setattr(c, k, json.loads(v) if isinstance(cur, list) else type(cur)(v))
    if args.reduced_only:
        print(json.dumps(run_reduced(c, args.out)))
        return
    res = run(c, args.out)
    print(json.dumps(res["stage_seconds"]), "total", res["total_seconds"], "s")


if __name__ == "__main__":
    main()
