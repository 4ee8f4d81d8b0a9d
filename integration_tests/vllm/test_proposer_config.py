"""``speculative_config`` and the proposer's scheduling, without an engine."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels.demo.demo import ASSETS, gpu_like_table
from dspark_kernels.integrations.vllm import proposer, speculative_config

DRAFTER = os.path.join(ASSETS, "dspark_vanilla")


def build(cfg):
    """The proposer class vLLM's custom_class loader resolves from ``cfg["model"]``, instantiated."""
    module, name = cfg["model"].rsplit(".", 1)
    assert module == proposer.__name__ and all(part.isidentifier() for part in cfg["model"].split("."))
    cls = getattr(proposer, name)
    spec = SimpleNamespace(num_speculative_tokens=cfg["num_speculative_tokens"])
    return cls(SimpleNamespace(speculative_config=spec))


def test_config_round_trip():
    table = gpu_like_table()
    cfg = speculative_config(DRAFTER, num_speculative_tokens=5, scheduler="exact", cost_table=table)
    assert cfg["method"] == "custom_class" and cfg["num_speculative_tokens"] == 5
    p = build(cfg)
    assert p.k == 5 and p.opts["scheduler"] == "exact" and p.opts["drafter_dir"] == os.path.abspath(DRAFTER)
    assert p.cost_table.token_counts == table.token_counts


def test_config_errors():
    with pytest.raises(ValueError, match="scheduler"):
        speculative_config(DRAFTER, scheduler="sometimes")
    with pytest.raises(ValueError, match="cost_table"):
        speculative_config(DRAFTER, scheduler="argmax")
    with pytest.raises(ValueError, match="config.json"):
        speculative_config(os.path.join(ASSETS, "nowhere"))


@pytest.mark.parametrize("mode", ["exact", "argmax"])
def test_scheduled_lengths_are_ragged_and_bounded(mode):
    """Under a GPU-like cost table at batch 64, confident requests verify more drafts than unsure ones."""
    p = build(speculative_config(DRAFTER, num_speculative_tokens=7, scheduler=mode, cost_table=gpu_like_table()))
    n, k = 64, 15
    conf = torch.linspace(0.05, 0.99, n).view(n, 1).expand(n, k)
    d = SimpleNamespace(survival=conf.cumprod(1).contiguous())
    lens = p._verify_lens(d, n, torch.device("cpu"))
    assert lens.shape == (n,) and int(lens.min()) >= 0 and int(lens.max()) <= 7
    assert int(lens[-1]) > int(lens[0])  # ragged: the schedule follows the survival
    fixed = build(speculative_config(DRAFTER, num_speculative_tokens=7))
    assert fixed._verify_lens(d, n, torch.device("cpu")).tolist() == [7] * n
    ref = dk.schedule_verify_lens(d.survival[:, :7], cost_table=gpu_like_table(), max_len=7, mode=mode).verify_lens
    assert torch.equal(lens, ref)


def proposer_for(name, target, k=7):
    """The proposer of drafter ``name`` loaded onto the package's target (what ``load_model`` reads of vLLM's
    model: ``model.embed_tokens``, ``model.layers``, ``lm_head``; the layer hooks never fire here)."""
    p = build(speculative_config(os.path.join(ASSETS, name), num_speculative_tokens=k))
    p.load_model(SimpleNamespace(model=SimpleNamespace(embed_tokens=target.embed_tokens, layers=target.layers),
                                 lm_head=target.lm_head))
    return p


@pytest.mark.parametrize("name", ["dspark_vanilla", "dspark_rnn", "baseline", "dspark_vanilla_vd1024"])
def test_drafts_equal_the_package_loop(name):
    """For the same committed tokens (context = the target's hidden rows of positions 0..S-2 at the drafter's
    layers), the proposer drafts what the package's loop drafts: every shipped drafter, the one over a reduced
    vocabulary (draft_vocab_size 1024: its Markov head needs the draft-to-target map) and the one without a
    Markov head included. Sampled, its draft distributions are over the target's vocabulary."""
    import numpy as np

    from dspark_kernels.decode import load_target
    from dspark_kernels.demo.train import target_forward

    from .acceptance import TARGET_DIR, package_drafts
    target = load_target(TARGET_DIR, dtype=torch.float32)
    p, k = proposer_for(name, target), 7
    with open(os.path.join(ASSETS, "prompts.json")) as fh:
        states = [s[:n] for s, n in zip(json.load(fh)["prompts"][:4], (32, 20, 27, 9))]
    ids = p.drafter.config.target_layer_ids
    with torch.no_grad():
        p.contexts = {i: (np.array(s[:-1]), target_forward(target, torch.tensor([s[:-1]]), keep=ids)[1][0])
                      for i, s in enumerate(states)}
    rows = np.zeros((len(states), 40), dtype=np.int64)
    for i, s in enumerate(states):
        rows[i, :len(s)] = s
    lens = np.array([len(s) for s in states])
    drafts, probs = p._draft(list(range(len(states))), rows, lens)
    assert probs is None  # greedy
    assert drafts == [d[:k] for d in package_drafts(os.path.join(ASSETS, name), states, k)]
    p.temperature = torch.ones(len(states))
    drafts, probs = p._draft(list(range(len(states))), rows, lens)
    vocab = target.vocab_size
    assert probs.shape == (len(states), k, vocab)
    assert torch.allclose(probs.sum(-1), torch.ones(len(states), k), atol=1e-5)
    picked = probs.gather(2, torch.tensor(drafts).unsqueeze(-1)).squeeze(-1)
    assert bool((picked > 0).all())  # each draft has mass where the verifier looks it up (a target id)
    d2t = p.head.draft_to_target
    if d2t is not None:
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[d2t.long()] = False
        assert float(probs[:, :, outside].abs().max()) == 0.0


def test_seeded_requests_draft_from_their_own_generator():
    """A sampled request with its own generator (``SamplingParams(seed=...)``) drafts the same tokens for the same
    committed tokens and seed, whatever its row, its batch neighbours or the engine's step count."""
    import numpy as np

    from dspark_kernels.decode import load_target
    from dspark_kernels.demo.train import target_forward

    from .acceptance import TARGET_DIR
    target = load_target(TARGET_DIR, dtype=torch.float32)
    p = proposer_for("dspark_vanilla", target)
    with open(os.path.join(ASSETS, "prompts.json")) as fh:
        states = [s[:n] for s, n in zip(json.load(fh)["prompts"][:4], (32, 20, 27, 9))]
    ids = p.drafter.config.target_layer_ids
    with torch.no_grad():
        contexts = [(np.array(s[:-1]), target_forward(target, torch.tensor([s[:-1]]), keep=ids)[1][0]) for s in states]

    def seeded_drafts(order, mine):
        """Drafts of request 0 (seed 3) placed at row ``mine`` among the requests ``order``."""
        rows = np.zeros((len(order), 40), dtype=np.int64)
        for row, i in enumerate(order):
            rows[row, :len(states[i])] = states[i]
        p.contexts = {row: contexts[i] for row, i in enumerate(order)}
        meta = SimpleNamespace(all_greedy=False, temperature=torch.ones(len(order)),
                               generators={mine: torch.Generator().manual_seed(3)})
        p.observe_sampling_metadata(meta)
        p.step += 1
        drafts, _ = p._draft(list(range(len(order))), rows, np.array([len(states[i]) for i in order]))
        return drafts[mine]

    alone = seeded_drafts([0], 0)
    assert all(seeded_drafts(order, order.index(0)) == alone for order in ([1, 0, 2], [3, 2, 1, 0], [0, 3]))


class _VllmStyleLayer(torch.nn.Module):
    """A package target layer behind vLLM's decoder-layer interface: ``(positions, hidden, residual) ->
    (hidden, residual)`` whose sum is the stream after the layer; like vLLM's fused add it adds into the tensor it
    was given (layer 0: the embeddings) in place."""

    def __init__(self, block, inv_freq):
        super().__init__()
        self.block, self.inv_freq = block, inv_freq

    def forward(self, positions, hidden, residual):
        x = hidden if residual is None else hidden + residual
        a, pos = self.block.self_attn, positions
        hx = self.block.input_layernorm(x).unsqueeze(0)
        q = a.project_q(hx, pos, self.inv_freq).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in a.project_kv(hx, pos, self.inv_freq))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.d ** -0.5,
                                                             enable_gqa=True)
        stream = x.unsqueeze(0) + a.o_proj(o.transpose(1, 2).flatten(2))
        out = self.block.mlp(self.block.post_attention_layernorm(stream))[0]
        stream = stream[0]
        x.copy_(stream)  # in place, as a fused add into the residual
        return out, x


@pytest.mark.parametrize("ids", [[-1, 1, 2], [0, 2]])
def test_capture_takes_the_drafter_layers(monkeypatch, ids):
    """The hooks keep, per forward, the stream after each of the drafter's layers (id -1: the embeddings, not the
    last layer), as the package's target gives them, and the forward's positions and batch layout."""
    import vllm.forward_context as fc

    from dspark_kernels.decode import load_target
    from dspark_kernels.demo.train import target_forward

    from .acceptance import TARGET_DIR
    target = load_target(TARGET_DIR, dtype=torch.float32)
    layers = torch.nn.ModuleList(_VllmStyleLayer(b, target.rope(torch.device("cpu"))) for b in target.layers)
    cap = proposer._Capture(layers, ids)
    tokens = torch.tensor([626, 19, 487, 20, 15, 856, 393, 15, 856])
    n, pad = tokens.numel(), 3
    md = SimpleNamespace(num_actual_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"layers.0": md}))
    positions = torch.arange(n + pad)  # vLLM pads the batch; rows past num_actual_tokens are not kept
    with torch.no_grad():
        h, r = target.embed_tokens(torch.cat([tokens, tokens[:pad]])), None
        for layer in layers:
            h, r = layer(positions, h, r)
        rows, pos, qsl = cap.take()
        want = target_forward(target, tokens.view(1, -1), keep=ids)[1][0]
    assert rows.shape == want.shape and torch.allclose(rows, want, atol=1e-5), (rows - want).abs().max()
    assert pos.tolist() == list(range(n)) and qsl.tolist() == [0, n]
    assert cap.take() is None  # taken once per forward
