"""Machine facts of a bench record: device, CPU, cores, versions, commit, date; and the id its files are named by."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import re
import socket
import subprocess
from typing import Optional

import torch

import dspark_kernels as dk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, cwd=ROOT, timeout=10, strip=True) -> Optional[str]:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout.strip() if strip else p.stdout) if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


KERNEL_SOURCES = ("csrc/", "dspark_kernels/")  # a GPU record counts only if none of these differ from its commit


def dirty_paths(cwd: str = ROOT) -> list:
    """The tracked files of the checkout at ``cwd`` that differ from HEAD (staged or not), sorted; [] outside a git
    checkout."""
    out = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, strip=False) or ""
    return sorted(line[3:].split(" -> ")[-1] for line in out.splitlines() if len(line) > 3)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:40] or "unknown"


def machine_info(dev) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    try:
        cores_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cores_usable = os.cpu_count()
    commit = _run(["git", "rev-parse", "HEAD"])
    dirty = dirty_paths()
    info = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        device_type=dev.type,
        cpu_model=_cpu_model(), cpu_cores=os.cpu_count(), cpu_cores_usable=cores_usable,
        torch_threads=torch.get_num_threads(),
        load_avg_1m=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        hostname=socket.gethostname(), os=platform.platform(), python=platform.python_version(),
        torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
        numpy=_version("numpy"), flashinfer=_version("flashinfer"), dspark_kernels=dk.__version__,
        git_commit=commit or "unknown", git_dirty=bool(dirty) if commit else None,
        git_dirty_paths=dirty if commit else None,
        kernel_sources_clean=not any(p.startswith(KERNEL_SOURCES) for p in dirty) if commit else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu_sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    gpu_capability=f"{props.major}.{props.minor}",
                    driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    return info


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001
        return None


def machine_id(info: dict) -> str:
    """``<device>-<cores>c-<host id>``: the device (GPU name, or CPU model), and a short hash of the host name and
    /etc/machine-id, so two machines never share a file name."""
    dev = info["device"] if info["device_type"] == "cuda" else info["cpu_model"]
    mid = ""
    try:
        with open("/etc/machine-id") as f:
            mid = f.read().strip()
    except OSError:
        pass
    host = hashlib.sha1((info["hostname"] + mid).encode()).hexdigest()[:8]
    return f"{_slug(dev)}-{info['cpu_cores']}c-{host}"

