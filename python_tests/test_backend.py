"""Backend choice: "auto", the DSPARK_BACKEND variable, and clear errors for backends that cannot run."""

import glob
import os
import re
import types

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels import _ext
from dspark_kernels.distributed.ops import KERNEL_PIECES, piece_backend
from dspark_kernels.ops._common import resolve_backend

CPU, GPU = torch.device("cpu"), torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_auto_on_the_cpu_is_the_cpu_kernels_where_they_build(monkeypatch):
    monkeypatch.setattr(_ext, "cpu_available", lambda: True)
    assert resolve_backend("auto", CPU, "verify_chain") == "cpu"
    assert resolve_backend(None, CPU, "rng_uniform_") == "cpu"
    monkeypatch.setattr(_ext, "cpu_available", lambda: False)   # no compiler, or the build failed
    assert resolve_backend("auto", CPU, "verify_chain") == "reference"
    assert resolve_backend("reference", CPU, "verify_chain") == "reference"
    with pytest.raises(ValueError, match="CPU tensors"):
        resolve_backend("cpu", GPU, "verify_chain")


def test_cpu_kernels_that_cannot_build(monkeypatch):
    """Where the CPU kernels cannot be built, "auto" runs the reference after one warning saying why, and
    backend="cpu" (named, or by DSPARK_BACKEND) raises with that reason instead of running something else."""
    monkeypatch.setattr(_ext, "_cpu_library", None)
    monkeypatch.setattr(_ext, "_cpu_error", None)
    monkeypatch.setenv("DSPARK_NO_JIT", "1")
    target, drafts = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 2))
    ref = dk.verify_chain(target, drafts, temperature=1.0, backend="reference")
    with pytest.warns(RuntimeWarning, match="reference implementation"):
        out = dk.verify_chain(target, drafts, temperature=1.0, backend="auto")
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.verify_chain(target, drafts, temperature=1.0)
        assert resolve_backend("auto", CPU, "verify_chain") == "reference"
        with pytest.raises(RuntimeError, match="backend='cpu': .*DSPARK_NO_JIT"):
            dk.verify_chain(target, drafts, temperature=1.0, backend="cpu")
        monkeypatch.setenv("DSPARK_BACKEND", "cpu")
        with pytest.raises(RuntimeError, match="backend='cpu'"):
            dk.accept_prefix_scan(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                  num_accepted=torch.ones(2, dtype=torch.long))


def _ops_the_launchers_register():
    """Op names the CUDA launchers register (``m.impl("name", ...)`` in csrc/torch/*.cpp), read from the sources."""
    found = set()
    for path in glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")):
        with open(path) as fh:
            found.update(re.findall(r'm\.impl\("(\w+)"', fh.read()))
    return found


def test_auto_on_a_gpu_picks_cuda_only_for_ops_with_a_cuda_kernel(monkeypatch):
    """Decided from the tensors' device and the extension's registered ops, never by probing for a GPU. The loaded
    library is stood in for by one holding what the launchers register, so nothing is built here (CI's compile
    check builds every unit; a GPU run loads the real library)."""
    ops = _ops_the_launchers_register()
    pieces = {"verify_stats", "verify_decide", "verify_residual", "draft_step"}   # dspark_kernels.distributed
    assert ops == {"rng_uniform_", "draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens"} | pieces
    assert set(KERNEL_PIECES) == pieces
    library = types.SimpleNamespace(**{op: object() for op in ops})
    monkeypatch.setattr(_ext, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "load", lambda: library)
    for op in ops:
        assert resolve_backend("auto", GPU, op) == "cuda"
    for piece in pieces:
        assert piece_backend("auto", GPU, piece) == "cuda" == piece_backend("cuda", GPU, piece)
    assert piece_backend("auto", GPU, "draft_logprobs") == "reference"
    assert resolve_backend("auto", GPU, "no_such_op") == "triton"
    with pytest.raises(ValueError, match="no no_such_op kernel"):
        resolve_backend("cuda", GPU, "no_such_op")
    monkeypatch.setattr(_ext, "is_available", lambda: False)  # no toolkit, or the build failed: Triton on a GPU
    assert resolve_backend("auto", GPU, "verify_chain") == "triton"


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


def _direct_calls():
    """Calls of ``torch.ops.dspark.<op>`` itself whose arguments disagree, and the argument each names (before, the
    CPU kernels read past the short tensor and returned what they found there)."""
    g = torch.Generator().manual_seed(0)
    ops, key = torch.ops.dspark, torch.tensor([1, 2])
    n, k, v, r = 4, 2, 50, 3
    tokens = torch.randint(0, v, (n, k + 1), generator=g)
    yield "seq_lens", lambda b: ops.accept_prefix_scan(tokens, torch.full((1,), 5), torch.ones(n, dtype=torch.int32),
                                                       None, None, None, 1, None, None, b)
    target, drafts = torch.randn(n, k + 1, v, generator=g), tokens[:, :k]
    yield "draft_logits", lambda b: ops.verify_chain(target, None, drafts, torch.randn(1, 1, 1), None, None, None,
                                                     None, None, None, torch.ones(n), key, None, "token", b)
    yield "rng_key", lambda b: ops.verify_chain(target, None, drafts, None, None, None, None, None, None, None, None,
                                                key[:1], None, "token", b)
    base, w1 = torch.randn(n, k, v, generator=g), torch.randn(v, r, generator=g)
    yield "w2", lambda b: ops.draft_block(base, tokens[:, 0], "vanilla", w1, torch.randn(8, r), None, None, None, None,
                                          None, None, None, None, None, None, None, key, False, 0, b)
    yield "top_k", lambda b: ops.draft_block(base, tokens[:, 0], "vanilla", w1, torch.randn(v, r), None, None, None,
                                             None, None, None, None, None, None, None, None, key, True, v + 1, b)
    survival = torch.rand(n, k, generator=g)
    yield "step_time_ms", lambda b: ops.schedule_verify_lens(survival, None, None, torch.tensor([1.0, 9.0]),
                                                             torch.tensor([5.0]), 0.0, 0, k, "exact", None, 0.0, None, b)
    yield "rng_key", lambda b: ops.rng_uniform_(torch.empty(n, k, v), key[:1], 0, b)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_direct_op_calls_check_their_arguments(backend):
    """``torch.ops.dspark.<op>`` checks its arguments on every backend whose launcher does not (the CUDA launchers
    check in C++): an error naming the argument, never a read out of bounds."""
    for name, call in _direct_calls():
        with pytest.raises(ValueError, match=name):
            call(backend)
