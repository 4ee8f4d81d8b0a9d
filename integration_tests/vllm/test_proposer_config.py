"""``speculative_config`` and the proposer's scheduling, without an engine."""

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
