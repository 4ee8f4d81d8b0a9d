"""DSpark drafting inside vLLM's V1 engine (the ``custom_class`` proposer) with the demo pair, fp32, K = 7.

Greedy: vLLM's output equals vLLM without speculation and the package's own ``SpeculativeDecoder``; the acceptance
length from vLLM's spec-decode metrics is at least 3.0 (the package's loop: 3.67 on these prompts and lengths).
Sampled (T = 1): acceptance above 1.5, and the first two tokens of many samples of one prompt (the second comes out
of a verification step) pass the project's chi-square test against the target's exact joint distribution.
"""

import os

import pytest
import torch

from dspark_kernels.decode.testing import chi_square, passes
from dspark_kernels.demo.demo import ASSETS
from dspark_kernels.integrations import vllm as dkv
from dspark_kernels.integrations.vllm import proposer

from .engines import N_NEW, PROMPTS, generate, greedy, make_llm

DRAFTER = os.path.join(ASSETS, "dspark_vanilla")
K = 7


@pytest.fixture(scope="module")
def dspark_llm():
    return make_llm(speculative_config=dkv.speculative_config(DRAFTER, num_speculative_tokens=K))


def spec_counters(llm):
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_accepted_tokens"].value


def acceptance_length(llm, run):
    """vLLM's mean acceptance length over ``run()``: 1 + accepted drafts / verification steps (request-steps)."""
    d0, a0 = spec_counters(llm)
    out = run()
    d1, a1 = spec_counters(llm)
    assert d1 > d0
    return out, 1 + (a1 - a0) / (d1 - d0)


def engine_stats(llm):
    return llm.collective_rpc(dkv.worker_stats)[0], llm.collective_rpc(proposer.stats)[0]


def test_greedy_equals_no_speculation_and_the_package(dspark_llm, plain_outputs):
    from dspark_kernels.decode import Scheduler, SpeculativeDecoder, load_drafter, load_target
    before = engine_stats(dspark_llm)
    out, acc = acceptance_length(dspark_llm, lambda: greedy(dspark_llm, PROMPTS, N_NEW))
    after = engine_stats(dspark_llm)
    assert out == plain_outputs
    target = load_target(os.path.join(ASSETS, "target"), dtype=torch.float32)
    dec = SpeculativeDecoder(target, load_drafter(DRAFTER, target), backend="reference")
    ref = dec.generate(PROMPTS, N_NEW, scheduler=Scheduler("fixed", verify_len=K))
    assert out == ref.tokens
    print(f"greedy K={K}: vLLM acceptance length {acc:.3f}, package {ref.stats.acceptance_length:.3f}")
    assert acc >= 3.0
    assert after[0]["rejection_sample_calls"] > before[0]["rejection_sample_calls"]  # the plugin verified
    assert after[1]["proposed_tokens"] > before[1]["proposed_tokens"]  # the DSpark proposer drafted
    assert after[1]["no_context"] == before[1]["no_context"]


def expected_first_two(prompt, n):
    """The target's exact joint of the first two tokens after ``prompt`` (first tokens outside the top 99.9% of
    the mass pooled into one bin), scaled to ``n`` samples; and each first token's bin row."""
    from dspark_kernels.decode import load_target
    from dspark_kernels.demo.train import target_forward
    target = load_target(os.path.join(ASSETS, "target"), dtype=torch.float32)
    with torch.no_grad():
        p1 = torch.softmax(target_forward(target, torch.tensor([prompt]))[0][0, -1].double(), -1)
        order = p1.argsort(descending=True)
        top = order[:int((p1[order].cumsum(0) < 0.999).sum()) + 1][:128]
        p2 = torch.softmax(target_forward(target, torch.tensor([prompt + [int(a)] for a in top]))[0][:, -1].double(),
                           -1)
    joint = torch.cat([(p1[top].unsqueeze(1) * p2).flatten(), (1 - p1[top].sum()).clamp(min=0).view(1)])
    slot = torch.full((p1.numel(),), -1, dtype=torch.long)
    slot[top] = torch.arange(top.numel())
    return joint * n / joint.sum(), slot, p1.numel()


def test_sampled_acceptance_and_chi_square(dspark_llm):
    before = engine_stats(dspark_llm)
    _, acc = acceptance_length(dspark_llm, lambda: generate(dspark_llm, PROMPTS, 64, temperature=1.0))
    print(f"T=1 K={K}: vLLM acceptance length {acc:.3f}")
    assert acc > 1.5
    prompt, n = PROMPTS[0], 1000
    samples = generate(dspark_llm, [prompt] * n, 2, temperature=1.0)
    expected, slot, vocab = expected_first_two(prompt, n)
    observed = torch.zeros_like(expected)
    for a, b in samples:
        i = int(slot[a])
        observed[i * vocab + b if i >= 0 else -1] += 1
    stat, df = chi_square(observed, expected)
    print(f"first two tokens, {n} samples: chi2 {stat:.1f}, df {df}")
    assert passes(observed, expected), (stat, df)
    after = engine_stats(dspark_llm)
    assert after[0]["rejection_sample_calls"] > before[0]["rejection_sample_calls"]
    assert after[1]["proposed_tokens"] > before[1]["proposed_tokens"]
