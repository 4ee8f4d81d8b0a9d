"""The prebuilt CUDA extension of a wheel: architectures (DSPARK_CUDA_ARCHS), its build record and the loader's rule
for loading it (dspark_kernels/_prebuilt.py, _ext.load), dk.build_info(), the build backend's requirements, and
tools/check_cuda.py reading a wheel build's logs. No nvcc, no GPU: fake records and logs."""

import importlib.util
import json
import os
import sys

import pytest
import torch

import dspark_kernels as dk
from dspark_kernels import _build, _ext, _prebuilt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_TORCH = dict(torch="2.14.1+cu130", torch_cuda="13.0", cxx11_abi=True, gpus=[], sources=None)


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"dspark_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(**changes):
    rec = _prebuilt.record(package="0.1.0", torch_version="2.14.1", torch_cuda="13.0", cxx11_abi=True, nvcc="13.0",
                           python="cpython-311-x86_64-linux-gnu", sass=["sm_80", "sm_90a", "sm_100a"],
                           ptx=["compute_100"], ops=["verify_chain", "rng_uniform_"], sources="abc")
    rec.update(changes)
    return rec


# ------------------------------------------------------------------------------------------------ architectures

def test_default_architectures_and_their_gencode_flags(monkeypatch):
    monkeypatch.delenv("DSPARK_CUDA_ARCHS", raising=False)
    monkeypatch.delenv("DSPARK_CUDA_PTX", raising=False)
    archs = _build.cuda_archs()
    assert archs == [(8, 0, ""), (9, 0, "a"), (10, 0, "a")]
    assert _build.arch_targets(archs) == (["sm_80", "sm_90a", "sm_100a"], ["compute_100"])
    assert _build.gencode_flags(archs) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100a,code=sm_100a", "-gencode=arch=compute_100,code=compute_100"]
    monkeypatch.setenv("DSPARK_CUDA_ARCHS", "9.0 8.0")   # a plain highest one: its SASS and PTX from one pass
    assert _build.gencode_flags(_build.cuda_archs()) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=[sm_90,compute_90]"]
    assert any("sm_90" in f for f in _build.nvcc_flags())
    monkeypatch.setenv("DSPARK_CUDA_PTX", "0")   # no PTX: SASS only, whatever the highest one
    assert _build.gencode_flags(_build.cuda_archs()) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    assert _build.gencode_flags(_build.cuda_archs("8.0;9.0a")) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]
    assert _build.arch_targets(_build.cuda_archs("8.0;9.0a")) == (["sm_80", "sm_90a"], [])
    monkeypatch.setenv("DSPARK_CUDA_PTX", "yes")
    with pytest.raises(ValueError, match="DSPARK_CUDA_PTX must be 0 or 1"):
        _build.gencode_flags(archs)


def test_units_compile_largest_first_and_report_in_the_order_given(tmp_path):
    """One job at a time: the units run in order of the bytes they include (a header counted once, wherever it is
    included from), largest first; the results come back in the order the units were given."""
    (tmp_path / "big.cuh").write_text("x" * 5000)
    (tmp_path / "mid.cuh").write_text('#include "big.cuh"\n' + "y" * 500)
    (tmp_path / "a.cu").write_text('#include "big.cuh"\n#include "mid.cuh"\n')  # 5000 + 500 and a bit
    (tmp_path / "b.cu").write_text("z" * 100)
    (tmp_path / "c.cu").write_text("w" * 3000)
    order = tmp_path / "order.txt"
    units = [(name, [sys.executable, "-c", f"open({str(order)!r}, 'a').write({name!r} + ' ')"])
             for name in ("b.cu", "a.cu", "c.cu")]
    results = _build.compile_units(units, str(tmp_path / "logs"), 1, str(tmp_path))
    assert [(r[0], r[1]) for r in results] == [("b.cu", 0), ("a.cu", 0), ("c.cu", 0)]
    assert order.read_text().split() == ["a.cu", "c.cu", "b.cu"]
    assert 5500 < _build.included_bytes(str(tmp_path / "a.cu")) < 5600


@pytest.mark.parametrize("spec,match", [("9.0b", "'9.0b' is not an architecture"), ("sm_90", "not an architecture"),
                                        ("7.5", "below 8.0"), (" ; ", "names no architecture")])
def test_bad_architectures_name_the_variable(spec, match):
    with pytest.raises(ValueError, match=f"DSPARK_CUDA_ARCHS.*{match}"):
        _build.cuda_archs(spec)


@pytest.mark.parametrize("target,capability,runs", [
    ("sm_80", (8, 0), True), ("sm_80", (8, 9), True), ("sm_80", (9, 0), False), ("sm_86", (8, 0), False),
    ("sm_90a", (9, 0), True), ("sm_100a", (10, 3), False), ("sm_100f", (10, 3), True), ("sm_100f", (12, 0), False),
    ("compute_100", (10, 3), True), ("compute_100", (12, 0), True), ("compute_100", (9, 0), False)])
def test_which_gpus_a_target_runs_on(target, capability, runs):
    assert _prebuilt.runs_on(target, capability) is runs


# ------------------------------------------------------------------------------------------------ compatibility

def test_the_same_torch_minor_release_loads_another_is_refused_naming_both():
    rec = _record()
    assert _prebuilt.problem(rec, dict(THIS_TORCH, torch="2.14.0")) is None
    why = _prebuilt.problem(rec, dict(THIS_TORCH, torch="2.13.0+cu128", torch_cuda="12.8"))
    assert "torch 2.14.1 with CUDA 13.0" in why and "torch 2.13.0+cu128 with CUDA 12.8" in why
    assert "Install torch 2.14 built for CUDA 13" in why and "pip wheel --no-build-isolation ." in why


def test_another_cuda_major_a_cpu_torch_and_another_abi_are_refused():
    rec = _record()
    assert "CUDA 12.4" in _prebuilt.problem(rec, dict(THIS_TORCH, torch_cuda="12.4"))
    assert "a CPU-only build" in _prebuilt.problem(rec, dict(THIS_TORCH, torch_cuda=None))
    assert _prebuilt.problem(rec, dict(THIS_TORCH, torch_cuda="13.2")) is None
    why = _prebuilt.problem(rec, dict(THIS_TORCH, cxx11_abi=False))
    assert "_GLIBCXX_USE_CXX11_ABI=1" in why and "_GLIBCXX_USE_CXX11_ABI=0" in why


def test_a_gpu_outside_the_architectures_is_refused_with_the_way_out():
    rec = _record()
    assert _prebuilt.problem(rec, dict(THIS_TORCH, gpus=[("H200", (9, 0)), ("RTX 5090", (12, 0))])) is None
    why = _prebuilt.problem(_record(sass=["sm_80"], ptx=["compute_80"]), dict(THIS_TORCH, gpus=[("L4", (8, 9))]))
    assert why is None  # sm_80 SASS runs on 8.9
    why = _prebuilt.problem(_record(sass=["sm_90a"], ptx=["compute_90"]), dict(THIS_TORCH, gpus=[("A100", (8, 0))]))
    assert "A100, compute capability 8.0" in why and "sm_90a; PTX compute_90" in why
    assert "DSPARK_CUDA_ARCHS=8.0 pip wheel" in why
    why = _prebuilt.problem(rec, dict(THIS_TORCH, gpus=[("T4", (7, 5))]))
    assert "T4, compute capability 7.5" in why and "need compute capability 8.0" in why


def test_a_build_from_other_sources_is_refused():
    why = _prebuilt.problem(_record(), dict(THIS_TORCH, sources="def"))
    assert "other sources" in why and "abc" in why and "def" in why
    digest = _prebuilt.sources_digest(_build.csrc_dir())
    assert len(digest) == 16 and digest == _prebuilt.sources_digest(_build.csrc_dir())


def test_the_record_round_trips_and_a_bad_one_names_its_file(tmp_path):
    path = str(tmp_path / _prebuilt.RECORD)
    _prebuilt.write(path, _record())
    assert _prebuilt.read(path) == _record()
    (tmp_path / _prebuilt.RECORD).write_text('{"format": 0}')
    with pytest.raises(ValueError, match=f"{path} is not of format"):
        _prebuilt.read(path)
    with pytest.raises(ValueError, match="absent.json cannot be read"):
        _prebuilt.read(str(tmp_path / "absent.json"))


# ------------------------------------------------------------------------------------------------ the loader

@pytest.fixture
def fresh_loader(monkeypatch):
    """_ext with nothing loaded or checked yet, the CPU kernels included (restored afterwards): earlier tests in the
    same process may have loaded them."""
    for name, value in (("_ops", None), ("_error", None), ("_loaded_from", None), ("_prebuilt_checked", None),
                        ("_cpu_library", None), ("_cpu_error", None)):
        monkeypatch.setattr(_ext, name, value)
    return monkeypatch


def _fake_prebuilt(tmp_path, monkeypatch, **changes):
    """A prebuilt library file (never imported) with a record of this torch unless ``changes`` say otherwise."""
    so = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"")
    rec = _record(torch=torch.__version__, torch_cuda=torch.version.cuda or "13.0",
                  sources=_prebuilt.sources_digest(_build.csrc_dir()))
    rec.update(changes)
    _prebuilt.write(_prebuilt.record_path(str(so)), rec)
    monkeypatch.setattr(_prebuilt, "module_file", lambda: str(so))
    monkeypatch.setattr(_prebuilt, "gpus", lambda: [])
    return str(so)


def test_the_loader_refuses_a_wheel_of_another_torch_naming_both_versions(tmp_path, fresh_loader):
    so = _fake_prebuilt(tmp_path, fresh_loader, torch="2.13.0")
    fresh_loader.setenv("DSPARK_NO_JIT", "1")
    with pytest.warns(RuntimeWarning, match="prebuilt CUDA extension .* is not loaded"):
        with pytest.raises(RuntimeError) as err:
            _ext.load()
    msg = str(err.value)
    assert so in msg and "torch 2.13.0" in msg and f"this is torch {torch.__version__}" in msg
    assert "DSPARK_NO_JIT=1 forbids the just-in-time build" in msg
    assert _ext._loaded_from is None and not _ext.is_available()


def test_the_loader_imports_a_matching_prebuilt_and_says_why_when_that_fails(tmp_path, fresh_loader):
    _fake_prebuilt(tmp_path, fresh_loader)
    fresh_loader.setenv("DSPARK_NO_JIT", "1")
    assert _ext.prebuilt_status()[2] is None
    with pytest.warns(RuntimeWarning, match="failed to import"), pytest.raises(RuntimeError, match="failed to import"):
        _ext.load()   # the record matches; the import fails (the package has no dspark_kernels._C here)


def test_no_prebuilt_and_no_jit_says_so(fresh_loader):
    fresh_loader.setattr(_prebuilt, "module_file", lambda: None)
    fresh_loader.setenv("DSPARK_NO_JIT", "1")
    with pytest.raises(RuntimeError, match="no prebuilt CUDA extension; DSPARK_NO_JIT=1"):
        _ext.load()


# ------------------------------------------------------------------------------------------------ build_info

def test_build_info_names_versions_architectures_and_each_ops_backend(tmp_path, fresh_loader):
    _fake_prebuilt(tmp_path, fresh_loader)
    fresh_loader.setattr(_prebuilt, "gpus", lambda: [("NVIDIA H200", (9, 0))])
    fresh_loader.delenv("DSPARK_BACKEND", raising=False)
    info = dk.build_info()
    assert info["package"] == dk.__version__ and info["torch"] == torch.__version__
    assert info["gpus"] == [dict(name="NVIDIA H200", capability="9.0")]
    pre = info["prebuilt"]
    assert pre["sass"] == ["sm_80", "sm_90a", "sm_100a"] and pre["ptx"] == ["compute_100"] and pre["loads"]
    assert set(info["ops"]) == set(_build.registered_ops())
    assert info["ops"]["verify_chain"]["gpu"]["backend"] == "cuda"
    assert "prebuilt extension" in info["ops"]["verify_chain"]["gpu"]["why"]
    assert info["ops"]["draft_block"]["gpu"] == dict(backend="triton",
                                                     why="the CUDA extension has no draft_block kernel")
    assert info["ops"]["draft_step"]["cpu"]["backend"] == "reference"
    json.dumps(info)
    fresh_loader.setattr(_ext, "_cpu_library", object())   # the CPU kernels loaded
    ops = dk.build_info()["ops"]
    assert ops["verify_chain"]["cpu"] == dict(backend="cpu", why="the CPU kernels are loaded")
    assert ops["draft_step"]["cpu"]["backend"] == "reference"


def test_build_info_says_why_a_refused_prebuilt_is_not_used(tmp_path, fresh_loader):
    _fake_prebuilt(tmp_path, fresh_loader, torch_cuda="12.8")
    fresh_loader.setattr(_prebuilt, "gpus", lambda: [("NVIDIA H200", (9, 0))])
    fresh_loader.setenv("DSPARK_NO_JIT", "1")
    fresh_loader.delenv("DSPARK_BACKEND", raising=False)
    info = dk.build_info()
    assert not info["prebuilt"]["loads"] and "CUDA 12.8" in info["prebuilt"]["why_not"]
    route = info["ops"]["verify_chain"]["gpu"]
    assert route["backend"] == "triton" and "CUDA 12.8" in route["why"] and "DSPARK_NO_JIT=1" in route["why"]
    assert info["ops"]["verify_chain"]["cpu"]["backend"] == "reference"   # DSPARK_NO_JIT: no CPU kernels either
    fresh_loader.setenv("DSPARK_BACKEND", "triton")
    assert dk.build_info()["ops"]["verify_chain"]["cpu"] == dict(backend="triton", why="DSPARK_BACKEND")


def test_build_info_of_a_source_install_with_and_without_a_toolkit(fresh_loader):
    fresh_loader.setattr(_prebuilt, "module_file", lambda: None)
    fresh_loader.setattr(_prebuilt, "gpus", lambda: [("NVIDIA H200", (9, 0))])
    for name in ("DSPARK_BACKEND", "DSPARK_NO_JIT"):
        fresh_loader.delenv(name, raising=False)
    fresh_loader.setattr(_build, "cuda_home", lambda: "/opt/cuda")
    fresh_loader.setattr(_build, "is_toolkit", lambda home: home == "/opt/cuda")
    route = dk.build_info()["ops"]["accept_prefix_scan"]["gpu"]
    assert route["backend"] == "cuda" and "just-in-time build (CUDA_HOME=/opt/cuda)" in route["why"]
    fresh_loader.setattr(_build, "cuda_home", lambda: None)
    info = dk.build_info()
    assert info["prebuilt"] is None
    route = info["ops"]["accept_prefix_scan"]["gpu"]
    assert route["backend"] == "triton" and "no prebuilt CUDA extension; no CUDA toolkit" in route["why"]


# ------------------------------------------------------------------------------------------------ building

def test_the_build_backend_adds_torch_only_to_a_build_that_compiles_cuda(monkeypatch):
    backend = _tool("build_backend")
    assert backend.torch_requirement().startswith("torch>=")
    monkeypatch.setattr(backend._setuptools, "get_requires_for_build_wheel", lambda config_settings=None: ["wheel"])
    monkeypatch.setenv("DSPARK_BUILD_CUDA", "1")
    assert backend.get_requires_for_build_wheel() == ["wheel", backend.torch_requirement()]
    monkeypatch.setenv("DSPARK_BUILD_CUDA", "0")
    assert backend.get_requires_for_build_wheel() == ["wheel"]


def test_the_ops_registered_are_the_m_impl_list():
    ops = _build.registered_ops()
    assert "verify_chain" in ops and "rng_uniform_" in ops and "verify_stats" in ops
    assert "row_linear" in _build.registered_ops("cpu") and "row_linear" not in ops


def test_check_cuda_reads_a_wheel_builds_logs_and_fails_on_a_spill(tmp_path):
    check = _tool("check_cuda")
    log = ("nvcc -c x.cu\nptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z1kv\n    8 bytes stack frame, 4 bytes spill stores, "
           "4 bytes spill loads\nptxas info    : Used 40 registers, used 1 barriers, 96 bytes smem\n")
    (tmp_path / "csrc_torch_x.cu.log").write_text(log)
    (tmp_path / "units.json").write_text(json.dumps(dict(units=[dict(unit="csrc/torch/x.cu",
                                                                      log="csrc_torch_x.cu.log", seconds=3)])))
    results = check._from_build(str(tmp_path))
    assert [r[:2] for r in results] == [("csrc/torch/x.cu", 0)]
    failed, spills, rows, smem = check._parse(results)
    assert not failed and rows == [["csrc/torch/x.cu", "sm_90a", "_Z1kv", 40, 8, 8]]
    assert spills == ["csrc/torch/x.cu sm_90a _Z1kv: 4 bytes spill stores, 4 bytes spill loads"]
    assert smem == {("csrc/torch/x.cu", "sm_90a", "_Z1kv"): 96}
    with pytest.raises(SystemExit, match="DSPARK_BUILD_LOGS="):
        check._from_build(str(tmp_path / "absent"))
    (tmp_path / "cmake.log").write_text("[ 50%] Building CUDA object dspark_capi.cu.o\n" + log.split("\n", 1)[1])
    (unit, rc, text, _), = check._from_logs([f"csrc/capi/x.cu={tmp_path / 'cmake.log'}"])
    assert (unit, rc) == ("csrc/capi/x.cu", 0) and check._parse([(unit, rc, text, 0)])[2][0][3] == 40
    (tmp_path / "quiet.log").write_text("[100%] Built target dspark_capi\n")
    with pytest.raises(SystemExit, match="no ptxas output"):
        check._from_logs([f"csrc/capi/x.cu={tmp_path / 'quiet.log'}"])
