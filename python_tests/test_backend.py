"""Backend choice: "auto", the DSPARK_BACKEND variable, and clear errors for backends that cannot run."""

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels import _ext
from dspark_kernels.ops._common import resolve_backend

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_auto_on_the_cpu_is_the_reference():
    assert resolve_backend("auto", CPU, "verify_chain") == "reference"
    assert resolve_backend(None, CPU, "rng_uniform_") == "reference"


def test_auto_on_a_gpu_picks_cuda_only_for_ops_with_a_cuda_kernel():
    """Decided from the tensors' device and the extension's registered ops, never by probing for a GPU."""
    if _ext.cuda_home() is None:
        assert resolve_backend("auto", GPU, "rng_uniform_") == "triton"
        return
    for op in ("rng_uniform_", "draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens"):
        assert resolve_backend("auto", GPU, op) == "cuda"
    assert resolve_backend("auto", GPU, "no_such_op") == "triton"
    with pytest.raises(ValueError, match="no no_such_op kernel"):
        resolve_backend("cuda", GPU, "no_such_op")


def test_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("DSPARK_BACKEND", "reference")
    assert resolve_backend("auto", GPU, "rng_uniform_") == "reference"
    monkeypatch.setenv("DSPARK_BACKEND", "triton")
    assert resolve_backend(None, GPU, "verify_chain") == "triton"
    assert resolve_backend("reference", GPU, "verify_chain") == "reference"   # an explicit choice wins
    monkeypatch.setenv("DSPARK_BACKEND", "fpga")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend(None, CPU, "verify_chain")


def test_backends_that_cannot_run_raise(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("tpu", CPU, "verify_chain")
    with pytest.raises(ValueError, match="CUDA device"):
        dk.verify_chain(torch.zeros(1, 2, 3), torch.zeros(1, 1, dtype=torch.int64), backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", CPU, "verify_chain")
