"""Shared test setup.

* Tests marked ``@pytest.mark.gpu`` are skipped on machines without a CUDA device.
* Without a GPU, Triton kernels run in the interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set here (before
  any kernel is defined) so the Triton tests run on every machine; ``triton_device`` says where their tensors go.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device() -> torch.device:
    """Where Triton kernels run: the GPU, else the CPU under the interpreter."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run faster on one intra-op thread, and far faster on a shared, busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
