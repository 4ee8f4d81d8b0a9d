"""Shared test setup.

* Tests marked ``@pytest.mark.gpu`` are skipped on machines without a CUDA device.
* Tests marked ``@pytest.mark.sanitized`` need the AddressSanitizer build of the SIMT harness: they are deselected
  unless ``DSPARK_SIMT_SANITIZE=1``, i.e. they run in CI's sanitizer leg (``.ci/run``), against the build that leg
  makes anyway, not in the default run (where that build alone would cost minutes).
* Tests marked ``@pytest.mark.slow`` (large shapes through the SIMT harness, repeated matrices, statistical tests
  through the harness) are deselected unless ``DSPARK_SLOW=1`` (CI's slow leg sets it). ``@pytest.mark.harness_slow``
  marks only a test's SIMT run slow (its ``cuda_device`` is ``"simt"``): on a GPU the same test is quick and runs with
  the other GPU tests. docs/DESIGN.md (Testing) lists what runs in which leg.
* Tests marked ``@pytest.mark.sass`` read the SASS report of ``tools/check_cuda.py --json`` (minutes of nvcc):
  they are deselected unless the report exists (``build/check_cuda.json`` or ``DSPARK_SASS_REPORT``); CI writes it
  from its wheel's build logs and library before the tests run.
  When the report exists, the SIMT harness also takes every kernel's registers from it (``DSPARK_SIMT_REGISTERS``),
  so its occupancy queries and cooperative grids are those of the GPU build.
* Tests marked ``@pytest.mark.gpu_build`` load the GPU extension at ``build/dspark_C.so`` (or the file
  ``DSPARK_GPU_BUILD`` names): deselected unless it exists; CI copies its wheel's library there
  (``tools/check_wheel.py --extract``; ``tools/check_cuda.py --link`` links one too).
* Every run ends with the 20 slowest tests (setup + call + teardown), so a test that starts to cost minutes shows
  up in the run that added it; CI's ``.ci/run`` also fails when the README's test command takes over 8 minutes.
* Under ``pytest -n`` (pytest-xdist; the README's command) each worker gets its share of the cores as torch
  threads; the workers share one SIMT build (the first builds it, the others wait on its lock).
* ``host_backend`` runs a test once with the reference and once with the CPU kernels as the ops' default backend.
* Without a GPU, Triton kernels run in the interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set here (before
  any kernel is defined) so the Triton tests run on every machine; ``triton_device`` says where their tensors go.
* CUDA kernels run on the CPU through the SIMT harness (``dspark_kernels.simt``): a test that takes the
  ``cuda_device`` fixture runs once on the CPU with ``DSPARK_SIMT=1`` (marked ``simt``, so CI can rerun those tests
  under AddressSanitizer) and once on the GPU (marked ``gpu``, skipped without one). Tensors go to ``cuda_device``
  and ops get ``backend="cuda"``; ``simt_check(fn)`` runs ``fn`` under several thread schedules and shared-memory
  poisons on the CPU (once on a GPU) and requires identical results.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _sass_report() -> str:
    from sass_facts import report_path
    return report_path()


if os.path.isfile(_sass_report()):  # the harness sizes grids with the GPU build's registers (CI writes the report)
    os.environ.setdefault("DSPARK_SIMT_REGISTERS", _sass_report())
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n: the workers share the cores, and so do their children
    # (a subprocess of torch's default thread count, beside a busy worker, ran four times slower)
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


def gpu_build_path() -> str:
    """The GPU extension library the ``gpu_build`` tests load (CI: its wheel's, copied to build/dspark_C.so)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("DSPARK_GPU_BUILD") or os.path.join(root, "build", "dspark_C.so")


def _deselect(config, items, marker):
    deselected = [item for item in items if marker in item.keywords]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if marker not in item.keywords]


def _on_simt(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("cuda_device") == "simt"


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m / -k selection, which sees the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "harness_slow" in item.keywords and _on_simt(item):
            item.add_marker(pytest.mark.slow)
        if _on_simt(item):
            item.add_marker(pytest.mark.simt)
    for marker, variable in (("sanitized", "DSPARK_SIMT_SANITIZE"), ("slow", "DSPARK_SLOW")):
        if os.environ.get(variable) != "1":
            _deselect(config, items, marker)
    if not os.path.isfile(_sass_report()):
        _deselect(config, items, "sass")
    if not os.path.isfile(gpu_build_path()):
        _deselect(config, items, "gpu_build")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not HAS_GPU and "gpu" in item.keywords:
            item.add_marker(skip)


SLOWEST_REPORTED = 20
_durations: dict = {}  # test id -> seconds of its setup, call and teardown (on the controller under pytest -n)


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not _durations:  # an xdist worker: the controller reports
        return
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:SLOWEST_REPORTED]
    terminalreporter.write_sep("=", f"{len(slowest)} slowest tests (setup + call + teardown; "
                                    f"{sum(_durations.values()):.0f} s over {len(_durations)} tests)")
    for nodeid, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.2f}s  {nodeid}")


@pytest.fixture(params=["simt", pytest.param("gpu", marks=pytest.mark.gpu)])
def cuda_device(request, monkeypatch) -> torch.device:
    """Where the CUDA kernels run: the CPU through the SIMT harness (``DSPARK_SIMT=1``), or the GPU."""
    if request.param == "gpu":
        return torch.device("cuda")
    monkeypatch.setenv("DSPARK_SIMT", "1")
    from dspark_kernels import simt
    simt.module()  # a build failure fails the test, never skips it
    return torch.device("cpu")


@pytest.fixture
def simt_check(cuda_device):
    """``simt_check(fn)``: ``fn()`` under every SIMT schedule (identical results required), or once on a GPU."""
    from dspark_kernels import simt

    def run(fn):
        return simt.check(fn) if cuda_device.type == "cpu" else fn()
    return run


@pytest.fixture(params=["reference", "cpu"])
def host_backend(request, monkeypatch) -> str:
    """The ops' default backend on CPU tensors for a test (``DSPARK_BACKEND``): the reference, then the CPU kernels
    (``csrc/cpu``), so hand-checked and statistical tests run on both."""
    monkeypatch.setenv("DSPARK_BACKEND", request.param)
    return request.param


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
