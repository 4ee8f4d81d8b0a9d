"""The SIMT harness: CUDA kernels on the CPU, as ``TRITON_INTERPRET=1`` runs Triton kernels there.

With ``DSPARK_SIMT=1``, ``backend="cuda"`` accepts CPU tensors and runs the hand-written CUDA kernels of ``csrc/``
through a CPU build of the extension (``csrc/simt``: every CUDA thread a fiber, real barriers and warp collectives,
per-block shared memory, a grid barrier for cooperative launches). The same launch code as on the GPU decides grid,
block, shared memory and workspace, so a CPU test runs the real launch configuration.

What it checks: a ``__syncthreads`` in divergent code and a warp collective whose mask names a lane that does not
arrive fail the launch with an error naming the kernel; :func:`check` runs a call under three thread schedules and
shared-memory poison bytes (:data:`CHECK_SCHEDULES`) and requires identical results, which exposes missing barriers and reads of unwritten
shared memory; the sanitized build (``DSPARK_SIMT_SANITIZE=1`` with the ASan runtime preloaded) reports out-of-bounds
global and shared accesses. What it counts, per launch (:func:`record`): grid, block, shared memory, CTAs,
barriers, warp collectives, global bytes read and written, and (``record(access=True)``, which runs the body on the
counting build) the warp access model's instructions, shared-memory wavefronts and global sectors, in total and
``by_line``; it also enforces the GPU's shared-memory, register and cooperative-grid launch rules and emulates
``cp.async``.

Two builds of one source: the plain one (no instrumentation), which runs everything by default, and the counting one
(every load and store of kernel code calls a hook: the access model's counts, and the check that no thread touches
a ``cp.async`` destination before its wait), which :func:`module` ``(counting=True)`` loads and ``record(access=True)``
runs its body on. :func:`configure` sets both alike. What it cannot see: timing, memory ordering beyond
its synchronisation points, warp-synchronous code without ``__syncwarp``, fast-math numerics (``__expf`` is ``expf``
here), and Hopper-only instructions.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from . import _ext

__all__ = ["available", "enabled", "module", "configure", "settings", "record", "schedule", "check",
           "default_schedules", "Recording", "H200_SMS", "access_model_available", "ACCESS_KEYS", "load_registers",
           "registers_from_report"]

H200_SMS = 132  # what the harness reports as the device's multiprocessor count unless told otherwise


def enabled() -> bool:
    """True when ``DSPARK_SIMT=1`` (``backend="cuda"`` then runs on CPU tensors)."""
    return _ext.simt_enabled()


_registers_env_done = False


def module(counting: bool = False):
    """The SIMT build's Python module (built on first use): the plain build, or with ``counting`` the counting build
    (the access model's hooks; under ``DSPARK_SIMT_SANITIZE=1`` the one sanitized build, which has no model). A
    build loaded after the other takes its settings (:func:`configure`). On first use, when
    ``DSPARK_SIMT_REGISTERS`` names a ``tools/check_cuda.py --json`` report, the harness takes its kernels' registers
    from it (:func:`load_registers`)."""
    global _registers_env_done
    plain = _ext.load_simt()
    if not _registers_env_done:
        _registers_env_done = True
        path = os.environ.get("DSPARK_SIMT_REGISTERS")
        if path:
            load_registers(path)
    if not counting:
        return plain
    first = len(_ext.loaded_simt()) == 1
    m = _ext.load_simt(counting=True)
    if first and m is not plain:
        _apply(m, dict(plain.settings()))
    return m


def _apply(m, s: Dict[str, Any]) -> None:
    m.configure(s["order"], int(s["seed"]), int(s["poison"]), int(s["sm_count"]), bool(s["record"]),
                bool(s["access"]), int(s["arch"]), int(s["l2_bytes"]), bool(s["dram"]))
    m.set_registers([(str(k), int(r)) for k, r in s["registers"]])


def available() -> bool:
    """True when ``DSPARK_SIMT=1`` and the SIMT build loads."""
    if not enabled():
        return False
    try:
        module()
    except RuntimeError:
        return False
    return True


def settings() -> Dict[str, Any]:
    return dict(module().settings())


def configure(*, order: Optional[str] = None, seed: Optional[int] = None, poison: Optional[int] = None,
              sm_count: Optional[int] = None, record: Optional[bool] = None, access: Optional[bool] = None,
              arch: Optional[int] = None, registers: Optional[List[tuple]] = None,
              l2_bytes: Optional[int] = None, dram: Optional[bool] = None) -> Dict[str, Any]:
    """Change harness settings (None keeps one) of every SIMT build loaded (and of any loaded later); returns the
    previous settings.

    order: "forward" | "reverse" | "random" (the order in which runnable threads, and blocks, resume); seed: of
    "random"; poison: the byte shared memory is filled with before every block; sm_count: what kernels see as the
    device's multiprocessor count (132, an H200, by default); record: keep a record of every launch; access: with
    record, also run the warp access model (the plain build; it costs tens of times a launch's run); arch: 90 (H100
    / H200, the default) or 80 (A100): the shared-memory launch rules enforced; registers: (kernel symbol, registers
    per thread) pairs the occupancy query and the per-block register limit use, keyed by the kernel function's
    mangled name (a launch record's ``symbol``; :func:`registers_from_report` reads them from the SASS report); a
    kernel not listed has no register limit; dram: with record, also estimate each launch's DRAM reads
    (``dram_bytes_read``; it keeps a table of every 32-byte sector the launch touches, gigabytes for a launch over a
    gigabyte, so it is off unless asked for); l2_bytes: the L2 of that estimate (50 MB, an H100 / H200, by default).
    """
    old = dict(module().settings())
    new = dict(old)
    for k, v in (("order", order), ("seed", seed), ("poison", poison), ("sm_count", sm_count), ("record", record),
                 ("access", access), ("arch", arch), ("l2_bytes", l2_bytes), ("dram", dram),
                 ("registers", registers)):
        if v is not None:
            new[k] = v
    for m in _ext.loaded_simt():
        _apply(m, new)
    return old


def registers_from_report(report: Dict[str, Any], arch: str = "sm_90a") -> List[tuple]:
    """(kernel symbol, registers per thread) of every kernel in a ``tools/check_cuda.py --json`` report compiled for
    `arch`, for ``configure(registers=...)``: the harness's kernel functions carry the mangled names nvcc gives the GPU
    build's kernels, so each launch is then held to its GPU build's registers (occupancy, cooperative grid limit,
    registers per block)."""
    return sorted({(k["kernel"], int(k["registers"])) for k in report["kernels"]
                   if k.get("arch") == arch and k.get("registers")})


def load_registers(path: str, arch: str = "sm_90a") -> List[tuple]:
    """Hold every launch to the registers of the SASS report at `path` (:func:`registers_from_report`); returns the
    table. A missing or unreadable report is an error naming it."""
    try:
        with open(path) as f:
            report = json.load(f)
        table = registers_from_report(report, arch)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"DSPARK_SIMT_REGISTERS / load_registers: cannot read the SASS report {path!r}: {e}") from e
    configure(registers=table)
    return table


def access_model_available() -> bool:
    """True when the counting build, which has the warp access model, can run (not under the AddressSanitizer build,
    which has none); loads it."""
    return bool(module(counting=True).access_model)


@contextlib.contextmanager
def schedule(order: str, *, seed: int = 0, poison: int = 0xFF) -> Iterator[None]:
    """Run the body under one thread schedule and shared-memory poison byte."""
    old = configure(order=order, seed=seed, poison=poison)
    try:
        yield
    finally:
        configure(**old)


@dataclass
class Recording:
    """The launches made inside :func:`record`, oldest first (one dict per launch, see ``csrc/simt/module.cpp``)."""
    launches: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(r["bytes_read"] for r in self.launches)

    @property
    def bytes_written(self) -> int:
        return sum(r["bytes_written"] for r in self.launches)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def unique_bytes(self) -> int:
        """Distinct global bytes read plus written, summed over launches: what a perfect cache would move (a broadcast
        read of one value by every thread counts once; a re-read in a later launch counts again)."""
        return sum(r["unique_bytes_read"] + r["unique_bytes_written"] for r in self.launches)

    @property
    def dram_bytes(self) -> Optional[int]:
        """Modelled DRAM traffic, summed over launches: each launch's ``dram_bytes_read`` (32-byte sectors read that
        an L2 of ``settings()["l2_bytes"]`` shared by the resident CTAs would not hold; the rule is in
        csrc/simt/runtime.cpp, ``estimate_dram_reads``) plus its distinct bytes written. An estimate, not a count;
        None unless recorded with ``record(dram=True)``."""
        if any(r["dram_bytes_read"] is None for r in self.launches):
            return None
        return sum(r["dram_bytes_read"] + r["unique_bytes_written"] for r in self.launches)

    @property
    def ctas(self) -> int:
        return sum(r["ctas"] for r in self.launches)

    def kernels(self) -> List[str]:
        return [r["kernel"] for r in self.launches]

    @property
    def access(self) -> Optional[Dict[str, int]]:
        """The access model's counts (:data:`ACCESS_KEYS`) summed over the launches; None without the model."""
        if not self.launches or not all(r.get("access_model") for r in self.launches):
            return None
        return {k: sum(r[k] for r in self.launches) for k in ACCESS_KEYS}


@contextlib.contextmanager
def record(*, access: bool = False, sm_count: Optional[int] = None, dram: bool = False) -> Iterator[Recording]:
    """Record every launch made in the body: ``with simt.record() as rec: op(...); rec.launches``.

    Every record has the launch's configuration and its byte, barrier and collective counters. ``access=True`` also
    runs the warp access model (:data:`ACCESS_KEYS` and ``by_line``; ``None`` in the sanitized build): the body's
    kernels run on the counting build, whose hooks cost a call per load and store, and the model tens of times the
    launch itself: ask for it where the counts are read. ``dram=True`` adds each launch's DRAM-read estimate
    (``dram_bytes_read``; None without it)."""
    module(counting=access)
    builds = _ext.loaded_simt()
    for m in builds:
        m.take_records()  # drop anything older
    old = configure(record=True, access=access, sm_count=sm_count, dram=dram)
    routed = _ext.use_counting(access)
    rec = Recording()
    try:
        yield rec
    finally:
        _ext.use_counting(routed)
        for m in builds:
            rec.launches.extend(m.take_records())
        configure(**old)
        _add_by_line(rec.launches)


ACCESS_KEYS = ("shared_instructions", "shared_wavefronts", "shared_wavefronts_ideal", "global_instructions",
               "global_sectors", "global_sectors_ideal")
# Files whose lines are plumbing, not the kernel's: an access inlined from them is attributed to the innermost
# caller outside them (the kernel line that called dspark::ldg, load16, ...). mma_sync.cuh is not among them: an
# emulated ldmatrix's shared-memory reads are counted on its line there (the lanes' 16-byte row loads).
_PLUMBING = ("dspark/platform.cuh", "dspark/vec.cuh", "dspark_simt/runtime.h", "simt/access_model.h")


def _add_by_line(launches: List[Dict[str, Any]]) -> None:
    """Turn each launch's ``by_pc`` (code offsets) into ``by_line``: "file.cuh:123" -> the access counts."""
    pcs = sorted({pc for r in launches for pc, _ in r.get("by_pc", ())})
    lines = _symbolise(pcs)
    for r in launches:
        by_line: Dict[str, Dict[str, int]] = {}
        for pc, counts in r.pop("by_pc", ()):
            acc = by_line.setdefault(lines.get(pc, f"pc:{pc:#x}"), dict.fromkeys(ACCESS_KEYS, 0))
            for k in ACCESS_KEYS:
                acc[k] += counts[k]
        r["by_line"] = by_line if r.get("access_model") else {}


_line_cache: Dict[int, str] = {}


def _symbolise(pcs: List[int]) -> Dict[int, str]:
    """Code offsets of the SIMT module -> "file:line" of the innermost inlined frame outside :data:`_PLUMBING`
    (addr2line on the counting build's line tables; offsets it cannot place keep a "pc:0x..." name)."""
    import shutil
    import subprocess

    todo = [pc for pc in pcs if pc not in _line_cache]
    tool = shutil.which("addr2line") or shutil.which("llvm-addr2line")
    if todo and tool:
        # pc is a return address (of a hook or an emulated instruction's runtime call): pc - 1 is in the call
        path = module(counting=True).module_path  # only the counting build's records carry code offsets
        out = subprocess.run([tool, "-e", path, "-i", "-a"] + [hex(pc - 1) for pc in todo],
                             capture_output=True, text=True).stdout.splitlines()
        chains: Dict[int, List[str]] = {}
        cur = None
        for line in out:
            if line.startswith("0x"):
                cur = int(line, 16) + 1
                chains[cur] = []
            elif cur is not None:
                chains[cur].append(line.split(" (discriminator")[0].strip())
        for pc in todo:
            frames = [f for f in chains.get(pc, []) if not f.startswith("??")]
            mine = [f for f in frames if "/csrc/" in f and not any(p in f for p in _PLUMBING)]
            best = mine[0] if mine else (frames[0] if frames else None)
            if best is not None:
                path, _, num = best.rpartition(":")
                _line_cache[pc] = f"{os.path.basename(path)}:{num}"
    return {pc: _line_cache.get(pc, f"pc:{pc:#x}") for pc in pcs}


# Runs that differ in every way a correct kernel must not care about: thread and block order, and the bytes
# unwritten shared memory holds.
CHECK_SCHEDULES = (("forward", 0, 0xFF), ("reverse", 0, 0x00), ("random", 12345, 0x5A))


def default_schedules():
    """The schedules :func:`check` runs by default: :data:`CHECK_SCHEDULES`, cut to its first
    ``DSPARK_SIMT_CHECK_RUNS`` entries when that variable is set."""
    runs = int(os.environ.get("DSPARK_SIMT_CHECK_RUNS", len(CHECK_SCHEDULES)))
    return CHECK_SCHEDULES[:max(1, runs)]


def check(fn: Callable[[], Any], schedules=None) -> Any:
    """Run ``fn()`` once per schedule (order, seed, poison) and require bit-identical results; return the first.

    ``schedules`` defaults to :func:`default_schedules` (CI's sanitized rerun sets ``DSPARK_SIMT_CHECK_RUNS=1``: the
    schedule comparison already ran in the plain run).

    ``fn`` must be deterministic given its inputs (the package's ops are: randomness comes from the counter-based
    generator) and return a tensor or a (nested) tuple / list / dict of tensors and plain values. A difference means a
    data race on shared or global memory, or a read of shared memory nobody wrote: AssertionError names the output.
    """
    if schedules is None:
        schedules = default_schedules()
    results = []
    for order, seed, poison in schedules:
        with schedule(order, seed=seed, poison=poison):
            results.append(fn())
    for (order, seed, poison), other in zip(schedules[1:], results[1:]):
        _assert_identical(results[0], other, f"schedule {schedules[0][0]}/poison {schedules[0][2]:#x} vs "
                                             f"{order}/poison {poison:#x}", "result")
    return results[0]


def _assert_identical(a, b, what: str, path: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, f"{path}: {what}"
        same = torch.equal(_bits(a), _bits(b))
        if not same:
            diff = (_bits(a) != _bits(b)).nonzero()
            raise AssertionError(f"SIMT check: {path} differs between runs ({what}) at {diff.shape[0]} element(s), "
                                 f"first at {tuple(diff[0].tolist())}: a data race or a read of unwritten shared "
                                 "memory")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{path}: {what}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, what, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: {what}"
        for k in a:
            _assert_identical(a[k], b[k], what, f"{path}[{k!r}]")
    else:
        assert a == b or (a != a and b != b), f"SIMT check: {path} differs between runs ({what}): {a!r} vs {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (NaN == NaN of the same payload)."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t
