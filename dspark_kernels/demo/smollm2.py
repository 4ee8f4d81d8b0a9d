"""A DSpark drafter for SmolLM2-135M-Instruct (bf16), trained on this CPU against the target's own text.

``python -m dspark_kernels.demo.smollm2 --out DIR`` (defaults reproduce the shipped ``assets/smollm2``). Stages:
chat prompts (instruction templates x topics; topics split into train / held-out) -> the target's continuations
(greedy and T = 1, batched through its paged KV cache), keeping for every row the hidden states of the drafter's
layers and the target's top-16 next-token distribution -> one drafter (vanilla Markov head, confidence head, a
reduced draft vocabulary of the most frequent ids) trained on those cached features, so the 135M target never runs
inside the training loop -> STS fitted on held-out prompts -> an fp16 drafter folder ``decode.load_drafter`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..decode.drafter import DSparkDrafter
from ..decode.gguf_target import find_smollm2, load_gguf_target
from .train import TrainConfig, cosine_lr, drafter_config, drafter_forward, init_weights_, markov_forward

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EOS_ID, MASK_ID, TOP = 2, 0, 16
TEMPLATES = (
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "Give me three practical tips about {}.",
    "Describe {} in a few paragraphs.", "Write a short poem about {}.", "What are the pros and cons of {}?",
    "Write a blog post introduction about {}.", "Summarize the history of {}.", "Write a letter to a friend about {}.",
    "List five interesting facts about {}.", "How would you teach someone about {}?", "Write a dialogue about {}.",
)
TOPICS = (
    "a lighthouse keeper", "the ocean", "learning to cook", "a robot that paints", "climate change", "the moon",
    "gardening in spring", "a lost dog", "volcanoes", "saving money", "the internet", "a rainy day in London",
    "honey bees", "public libraries", "running a marathon", "ancient Rome", "a small bakery", "electric cars",
    "the water cycle", "friendship", "mountain climbing", "chess", "a haunted house", "photosynthesis",
    "recycling", "a trip to Japan", "jazz music", "dinosaurs", "sleep", "a city at night", "the printing press",
    "coffee", "a school science fair", "the solar system", "writing a novel", "winter holidays", "trees",
    "a detective in Paris", "video games", "healthy breakfast ideas", "the human heart", "bridges", "a desert",
    "time management", "owls", "the first airplane", "a farmer's market", "kindness", "rivers", "mathematics",
    "a space station", "painting with watercolors", "the Olympic games", "birds migrating", "a new job",
    "earthquakes", "tea", "a snowstorm", "learning a language", "pirates", "the brain", "musical instruments",
    "a forest fire", "camping", "electricity", "the Great Wall of China", "a birthday party", "whales",
    "renewable energy", "a talking cat", "bicycles", "the stock market", "a wise old teacher", "rain forests",
)

# training-only topics (every one of them): more of the target's text for the drafter, the held-out split unchanged
EXTRA_TOPICS = (
    "a lighthouse in a storm", "baking bread", "a busy train station", "octopuses", "the Roman army", "knitting",
    "a first day at school", "glaciers", "a jazz club", "origami", "a family road trip", "the Amazon river",
    "solar panels", "a bookshop cat", "the French Revolution", "yoga", "a broken clock", "penguins", "submarines",
    "a village fair", "the periodic table", "a street musician", "hot air balloons", "a thunderstorm", "democracy",
    "volunteering", "the Renaissance", "a treasure map", "wolves", "architecture", "a midnight train", "fossils",
    "a science museum", "kites", "the Silk Road", "a vegetable garden", "artificial intelligence", "lightning",
    "a retired astronaut", "the Arctic", "soap making", "a country fair", "coral reefs", "the telephone",
    "a lost key", "a marathon runner", "castles", "tornadoes", "the human skeleton", "a family recipe",
    "clouds", "a magic shop", "the Industrial Revolution", "pottery", "sunflowers", "the speed of light",
    "a quiet village", "smartphones", "a friendly dragon", "the Nile", "public speaking", "butterflies",
    "a night market", "the immune system", "sailing", "a mysterious letter", "honesty", "the Eiffel Tower",
    "a talking tree", "cheese making", "first aid", "a mountain village", "black holes", "elephants",
    "a school play", "the Vikings", "meditation", "a clockmaker", "deserts at night", "climbing a tree",
    "vaccines", "a carnival", "a shy giraffe", "teamwork", "the Pacific Ocean", "a toy robot",
    "ice skating", "the pyramids of Egypt", "a new neighbour", "composting", "a hidden garden", "comets",
    "democracy in ancient Athens", "a bakery at dawn", "recycling plastic", "a lighthouse cat",
    "a road trip across America", "the history of chocolate", "wind turbines", "a lonely robot", "the rainforest",
    "a football match", "a poet's notebook", "ants", "the microscope", "a fishing village", "bees and flowers",
    "the northern lights", "a bicycle repair shop", "moving to a new city", "a good night's sleep", "sharks",
    "the theory of evolution", "a music festival", "paper airplanes", "a snowman", "the ocean floor",
    "a wise owl", "learning to swim", "dragons", "the history of money",
    "a summer camp", "the first computer", "a garden snail", "the stars", "a grandmother's kitchen",
    "saving the bees", "a quiet library", "the steam engine", "a lighthouse keeper's daughter", "mushrooms",
    "the water in our bodies", "a race car", "the history of tea", "a forest at dawn", "a cooking competition",
    "the seasons", "a map of the world", "a jellyfish", "robots in factories", "a hiking trail", "the sun",
)


def chat_prompt(instruction: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{instruction}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def prompts(split: str) -> List[str]:
    """Instructions of the ``split`` ("train" or "test"): held out by topic (every 6th topic is a test topic);
    ``"extra"``: the training-only topics."""
    if split == "extra":
        return [t.format(topic) for topic in EXTRA_TOPICS for t in TEMPLATES]
    keep = (lambda i: i % 6 == 5) if split == "test" else (lambda i: i % 6 != 5)
    return [t.format(topic) for i, topic in enumerate(TOPICS) if keep(i) for t in TEMPLATES]


def test_prompts(n: int = 8) -> List[str]:
    """``n`` held-out instructions, one template each, spread over the test topics."""
    out = prompts("test")
    return [out[(i * (len(TEMPLATES) + 1)) % len(out)] for i in range(n)]


@dataclass
class SmolConfig:
    seed: int = 0
    layer_ids: List[int] = field(default_factory=lambda: [2, 15, 28])
    block: int = 7
    draft_layers: int = 1
    markov_rank: int = 64
    draft_vocab: int = 8192
    gen_len: int = 144
    gen_batch: int = 48
    n_prompts: int = 720
    n_extra: int = 1704            # instructions of the training-only topics (all of them), after n_prompts
    greedy_share: float = 0.6
    steps: int = 1500
    batch: int = 12
    anchors: int = 12
    lr: float = 2e-3
    save_every: int = 250


# ----------------------------------------------------------------------------------------------------- data
@torch.no_grad()
def continue_batch(target, prompt_ids: List[List[int]], gen: int, temperature: float, seed: int):
    """Each prompt continued by the target (greedy or sampled) for ``gen`` tokens. Returns per sequence: tokens
    ``[P + gen]`` int64, hidden ``[P + gen, n d]`` bf16 (the layers of ``target.hidden_layer_ids``), top-16 ids
    int32 and probabilities fp16 ``[gen, 16]`` of the target's distribution at rows ``P - 1 .. P + gen - 2``."""
    n, lens = len(prompt_ids), [len(p) for p in prompt_ids]
    target.alloc_cache(n, max(lens) + gen + 1)
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lens).cumsum(0).int()
    pos = torch.cat([torch.arange(p) for p in lens])
    out = target(torch.tensor([t for p in prompt_ids for t in p]), pos, cu, max(lens), max(lens),
                 logit_rows=cu[1:].long() - 1)
    hid = [[out.hidden[cu[i]:cu[i + 1]]] for i in range(n)]
    toks, tops = [[torch.tensor(p)] for p in prompt_ids], [[] for _ in range(n)]
    one, cur = torch.arange(n + 1, dtype=torch.int32), torch.tensor(lens)
    for s in range(gen):
        logits = out.logits.float()
        probs = torch.softmax(logits / (temperature or 1.0), -1)
        top_p, top_i = torch.softmax(logits, -1).topk(TOP, -1)
        nxt = torch.multinomial(probs, 1, generator=g)[:, 0] if temperature > 0 else logits.argmax(-1)
        for i in range(n):
            toks[i].append(nxt[i:i + 1])
            tops[i].append((top_i[i].int(), top_p[i].half()))
        if s + 1 < gen:
            out = target(nxt, cur + s, one, 1, int(max(lens)) + s + 1)
            for i in range(n):
                hid[i].append(out.hidden[i:i + 1])
    seqs = []
    for i in range(n):
        ids = torch.cat(toks[i])
        seqs.append(dict(tokens=ids, hidden=torch.cat(hid[i]).to(torch.bfloat16),
                         top_ids=torch.stack([t[0] for t in tops[i]]), top_p=torch.stack([t[1] for t in tops[i]]),
                         prompt_len=lens[i]))
    return seqs


def data_instructions(c: SmolConfig) -> List[Tuple[str, float]]:
    """(instruction, temperature) of every sequence: ``n_prompts`` shuffled training instructions, then ``n_extra``
    shuffled training-only ones; within each group the first ``greedy_share`` greedy, the rest at T = 1."""
    out = []
    for split, n, seed in (("train", c.n_prompts, c.seed), ("extra", c.n_extra, c.seed + 1)):
        insts = prompts(split)
        order = torch.randperm(len(insts), generator=torch.Generator().manual_seed(seed)).tolist()
        group = [insts[i] for i in order][:n]
        greedy = math.ceil(c.greedy_share * len(group) / c.gen_batch) * c.gen_batch  # whole generation batches
        out += [(s, 0.0 if i < greedy else 1.0) for i, s in enumerate(group)]
    return out


def make_data(target, tok, c: SmolConfig, log, data: Optional[list] = None) -> list:
    """The target's continuations of :func:`data_instructions`; ``data``: sequences already made (a cache), kept
    and continued from."""
    from ..decode.decoder import _hidden_layers
    todo = data_instructions(c)
    data = list(data or [])
    with _hidden_layers(target, c.layer_ids):
        b = len(data)
        while b < len(todo):
            temp = todo[b][1]
            batch = [s for s, t in todo[b:b + c.gen_batch] if t == temp]
            ids = [tok.encode(chat_prompt(s)).ids for s in batch]
            t0 = time.perf_counter()
            data += continue_batch(target, ids, c.gen_len, temp, c.seed + b)
            b += len(batch)
            log(f"data: {len(data)}/{len(todo)} sequences (T = {temp}) {time.perf_counter() - t0:.1f} s")
    return data


def valid_anchor_range(seq: dict, k: int) -> Tuple[int, int]:
    """Anchors ``a`` whose block rows ``a..a+k-1`` all have a stored target distribution and lie before the first
    end-of-turn token: ``[P - 1, min(end, P + gen) - k]``."""
    p, toks = seq["prompt_len"], seq["tokens"]
    ends = (toks[p:] == EOS_ID).nonzero()
    stop = p + (int(ends[0]) if ends.numel() else toks.numel() - p)
    return p - 1, min(stop, toks.numel() - 1) - k


# ----------------------------------------------------------------------------------------------------- training
def frequent_ids(data, n: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in data:
        counts += torch.bincount(s["tokens"][s["prompt_len"]:], minlength=vocab)
        counts += torch.bincount(s["top_ids"][:, :4].reshape(-1).long(), minlength=vocab)
    counts[EOS_ID] += 1 << 40  # the end-of-turn token is always draftable
    return torch.argsort(-counts, stable=True)[:n].sort().values


def _batch(data, c: SmolConfig, t2d: torch.Tensor, g: torch.Generator):
    """A padded batch: tokens [B, T], hidden [B, T, n d], anchors [B, A], block targets p [B, A, K, Vd], prev."""
    picks, k = [], c.block
    while len(picks) < c.batch:
        s = data[int(torch.randint(len(data), (1,), generator=g))]
        lo, hi = valid_anchor_range(s, k)
        if hi - lo + 1 >= c.anchors:
            picks.append(s)
    t_len = max(s["tokens"].numel() for s in picks)
    vd = int((t2d >= 0).sum())
    toks = torch.full((c.batch, t_len), EOS_ID, dtype=torch.long)
    hid = torch.zeros(c.batch, t_len, picks[0]["hidden"].shape[1], dtype=torch.bfloat16)
    anchors = torch.zeros(c.batch, c.anchors, dtype=torch.long)
    p = torch.zeros(c.batch, c.anchors, k, vd)
    for b, s in enumerate(picks):
        n = s["tokens"].numel()
        toks[b, :n] = s["tokens"]
        hid[b, :s["hidden"].shape[0]] = s["hidden"]  # the last token never ran through the target
        lo, hi = valid_anchor_range(s, k)
        a = (torch.randperm(hi - lo + 1, generator=g)[:c.anchors] + lo).sort().values
        anchors[b] = a
        rows = (a.view(-1, 1) + torch.arange(k)) - (s["prompt_len"] - 1)  # index into the stored top-16 rows
        ids, pr = t2d[s["top_ids"][rows].long()], s["top_p"][rows].float()
        p[b].scatter_add_(-1, ids.clamp(min=0), torch.where(ids >= 0, pr, 0.0))
    idx = anchors.unsqueeze(-1) + torch.arange(k)
    prev = toks.gather(1, idx.flatten(1)).view(c.batch, c.anchors, k)
    return toks, hid.float(), anchors, p, prev


def train_drafter(target, data, c: SmolConfig, log, checkpoint=None, init: Optional[str] = None) -> DSparkDrafter:
    """The drafter against cached target features; ``checkpoint(drafter, step)`` runs every ``c.save_every``
    steps (a long run on a busy machine keeps what it has learnt); ``init``: a saved drafter folder to continue
    from (a new learning-rate schedule)."""
    tc = TrainConfig(vocab=target.vocab_size, d=target.config.hidden_size, heads=target.config.num_attention_heads,
                     kv_heads=target.config.num_key_value_heads, inter=target.config.intermediate_size,
                     block=c.block, draft_layers=c.draft_layers, markov_rank=c.markov_rank, layer_ids=c.layer_ids)
    cfg = drafter_config(tc, "vanilla", c.draft_vocab)
    cfg.mask_token_id = MASK_ID
    cfg.backbone.rope_theta = target.config.rope_theta
    f32 = _float_view(target)
    if init is not None:
        from ..decode import load_drafter
        dr = load_drafter(init, f32, dtype=torch.float32)
        ids = dr.draft_to_target()
    else:
        dr = DSparkDrafter.for_target(cfg, f32)
        init_weights_(dr, c.seed + 10, c.draft_layers)
        ids = frequent_ids(data, c.draft_vocab, target.vocab_size)
        dr.set_draft_ids(ids)
    with torch.no_grad():
        dr.lm_head.weight.copy_(f32.lm_head_weight[ids])
    dr.lm_head.weight.requires_grad_(False)
    t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(ids.numel())
    opt = torch.optim.AdamW([p for p in dr.parameters() if p.requires_grad], lr=c.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    g = torch.Generator().manual_seed(c.seed + 3)
    pos_w = torch.exp(-torch.arange(c.block) / 7.0)
    pos_w = pos_w / pos_w.sum()
    dr.train()
    t0 = time.perf_counter()
    for step in range(c.steps):
        toks, hid, anchors, p, prev = _batch(data, c, t2d, g)
        u, h = drafter_forward(dr, hid, toks, anchors)
        logits, feat = markov_forward(dr, u, h, prev)
        logq = torch.log_softmax(logits, -1)
        kl = -(p * logq).sum(-1)
        with torch.no_grad():
            soft = 1 - 0.5 * ((logq.exp() - p).abs().sum(-1) + (1 - p.sum(-1)))
        loss = (kl.mean((0, 1)) * pos_w).sum()
        loss_c = F.binary_cross_entropy_with_logits(dr.confidence_head.proj(feat.detach()).squeeze(-1),
                                                    soft.clamp(0, 1))
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, c.steps, c.lr)
        opt.zero_grad(set_to_none=True)
        (loss + loss_c).backward()
        torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == c.steps - 1:
            with torch.no_grad():
                top1 = (logits.argmax(-1) == p.argmax(-1)).float().mean((0, 1))
            log(f"drafter step {step:5d} loss {loss.item():.3f}/{loss_c.item():.3f} top1 by position "
                f"{[round(x, 2) for x in top1.tolist()]} ({time.perf_counter() - t0:.0f} s)")
        if checkpoint is not None and (step + 1) % c.save_every == 0:
            checkpoint(dr.eval(), step + 1)
            dr.train()
    return dr.eval()


class _float_view:
    """The target's embedding and LM head in float32 for training (the drafter shares them)."""

    def __init__(self, target):
        emb = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
        self.input_embeddings, self.lm_head_weight = emb, emb.weight
        self.num_layers, self.vocab_size = target.num_layers, target.vocab_size


def save(dr: DSparkDrafter, out: str, c: SmolConfig, extra: dict) -> None:
    from .train import save_fp16_drafter
    save_fp16_drafter(dr, out, {})
    with open(os.path.join(out, "train_log.json"), "w") as fh:
        json.dump({"config": asdict(c), **extra}, fh, indent=2)


def calibration_prompts(c: SmolConfig) -> List[str]:
    """The training-split instructions left out of the data (the same shuffle as ``make_data``)."""
    insts = prompts("train")
    order = torch.randperm(len(insts), generator=torch.Generator().manual_seed(c.seed)).tolist()
    return [insts[i] for i in order][c.n_prompts:]


def fit_sts(target, tok, out: str, c: SmolConfig, n_new: int = 96) -> dict:
    """STS temperatures (greedy and T = 1) of the saved fp16 drafter against the bf16 target, on held-out prompts."""
    from ..decode import SpeculativeDecoder, calibrate, load_drafter
    dec = SpeculativeDecoder(target, load_drafter(out, target, dtype=torch.bfloat16), seed=c.seed)
    ids = [tok.encode(chat_prompt(s)).ids for s in calibration_prompts(c)]
    sts = {name: calibrate(dec, ids, n_new, temperature=temp)["sts_temperatures"]
           for name, temp in (("greedy", 0.0), ("t1", 1.0))}
    with open(os.path.join(out, "sts.json"), "w") as fh:
        json.dump(sts, fh, indent=2)
    return sts


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.demo.smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "assets", "smollm2", "dspark_vanilla"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=None, help="cache the generated continuations in this .pt file")
    p.add_argument("--init", default=None, help="continue training the drafter saved in this folder")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override SmolConfig fields")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    c = SmolConfig()
    for kv in args.set:
        k, v = kv.split("=", 1)
        cur = getattr(c, k)
        setattr(c, k, json.loads(v) if isinstance(cur, list) else type(cur)(v))
    torch.manual_seed(c.seed)
    target, tok = load_gguf_target(find_smollm2(), torch.bfloat16)
    times, t0 = {}, time.perf_counter()
    cached = torch.load(args.data) if args.data and os.path.exists(args.data) else []
    data = make_data(target, tok, c, print, cached)
    if args.data and len(data) > len(cached):
        torch.save(data, args.data)
    times["data"] = round(time.perf_counter() - t0, 1)
    dr = train_drafter(target, data, c, print, checkpoint=lambda d, step: save(d, args.out, c, {"step": step}),
                       init=args.init)
    times["train"] = round(time.perf_counter() - t0 - times["data"], 1)
    save(dr, args.out, c, {"stage_seconds": times, "sequences": len(data)})
    print("sts", fit_sts(target, tok, args.out, c))
    times["calibrate"] = round(time.perf_counter() - t0 - times["data"] - times["train"], 1)
    save(dr, args.out, c, {"stage_seconds": times, "sequences": len(data)})
    print(json.dumps(times))


if __name__ == "__main__":
    main()
