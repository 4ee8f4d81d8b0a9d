"""End to end in vLLM's V1 engine with the demo target (fp32): the plugin on, ``ngram`` speculation, greedy output
equal to vLLM without speculation; the plugin's counters read in the engine prove its sampler did the verifying."""

import pytest

from dspark_kernels.integrations import vllm as dkv

from .engines import N_NEW, PROMPTS, greedy, make_llm


@pytest.fixture(scope="module")
def ngram_llm():
    return make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2})


def test_ngram_greedy_equals_no_speculation(ngram_llm, plain_outputs):
    before = ngram_llm.collective_rpc(dkv.worker_stats)[0]
    out = greedy(ngram_llm, PROMPTS, N_NEW)
    after = ngram_llm.collective_rpc(dkv.worker_stats)[0]
    assert out == plain_outputs
    assert after["rejection_sample_calls"] > before["rejection_sample_calls"]
    assert after["draft_tokens"] > before["draft_tokens"]  # ngram found drafts on the looping demo target
    assert "rejection_sample" in ngram_llm.collective_rpc(lambda worker: dkv.installed())[0]
