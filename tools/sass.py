"""SASS facts of compiled kernels: what the machine code of each kernel does, for CI and the kernel tests.

``tools/check_cuda.py`` calls :func:`object_facts` on each object it compiles and writes the result under a ``sass``
key per sm_90a kernel of its ``--json`` report; ``python_tests/sass_facts.py`` reads that report for the tests.

Per kernel: instruction count, counts of the opcodes that matter for a memory-bound kernel as SASS spells them
(``LDG.E.128`` = 16-byte global loads, ``LDGSTS`` = cp.async, ``LDSM`` = ldmatrix, ``HMMA`` = tensor-core MMA,
``LDS`` / ``STS`` shared loads / stores, ``BAR`` barriers, ``MUFU`` special-function ops, ``LDL`` / ``STL`` local
memory, ...), and ``loops``: one
entry per innermost loop (a backward branch whose body holds no other backward branch), with its instruction
count and the same opcode counts, i.e. what one iteration issues.

The disassembler is ``cuobjdump`` from, in order: the CUDA toolkit, the Triton wheel's ``backends/nvidia/bin``,
the ``nvidia-cuda-cuobjdump`` wheel. Nothing is downloaded.
"""

from __future__ import annotations

import bisect
import glob
import os
import re
import shutil
import subprocess
from collections import Counter
from typing import Dict, List, Optional

# The opcode counts reported, each a predicate on the full opcode (with its modifiers).
COUNTED = {
    "LDG.E.128": lambda op: op.startswith("LDG.") and ".128" in op,
    "LDG": lambda op: op.startswith("LDG.") or op == "LDG",
    "LD.STRONG": lambda op: op.startswith("LD.") and ".STRONG" in op,  # coherent loads through a generic address
    "STG": lambda op: op.startswith("STG"),
    "LDGSTS": lambda op: op.startswith("LDGSTS"),
    "LDGDEPBAR": lambda op: op.startswith("LDGDEPBAR"),
    "DEPBAR": lambda op: op.startswith("DEPBAR"),
    "LDSM": lambda op: op.startswith("LDSM"),
    "HMMA": lambda op: op.startswith("HMMA"),
    "LDS": lambda op: op == "LDS" or (op.startswith("LDS.") and not op.startswith("LDSM")),
    "STS": lambda op: op.startswith("STS"),
    "BAR": lambda op: op.startswith("BAR"),
    "MUFU": lambda op: op.startswith("MUFU"),
    "SHFL": lambda op: op.startswith("SHFL"),
    "ATOM": lambda op: op.startswith(("ATOM", "RED")),
    "FFMA": lambda op: op.startswith("FFMA"),
    "LDL": lambda op: op.startswith("LDL"),  # local memory: the stack, spills, arrays indexed at run time
    "STL": lambda op: op.startswith("STL"),
}

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_ARCH = re.compile(r"^\s*arch\s*=\s*(sm_\w+)")


def toolkit_tool(name: str, cuda_home: Optional[str] = None) -> Optional[str]:
    """Path of a CUDA binary utility (``cuobjdump``, ``nvdisasm``) from, in order: the toolkit, the Triton wheel's
    ``backends/nvidia/bin``, the ``nvidia-cuda-<name>`` wheel, PATH; or None."""
    cands = []
    if cuda_home:
        cands.append(os.path.join(cuda_home, "bin", name))
    try:
        import triton
        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except ImportError:
        pass
    try:
        import nvidia
        for root in getattr(nvidia, "__path__", []):
            cands += sorted(glob.glob(os.path.join(root, "*", "bin", name)))
    except ImportError:
        pass
    which = shutil.which(name)
    if which:
        cands.append(which)
    return next((c for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuobjdump(cuda_home: Optional[str] = None) -> Optional[str]:
    """Path of a cuobjdump executable (:func:`toolkit_tool`), or None."""
    return toolkit_tool("cuobjdump", cuda_home)


def binary_archs(path: str, tool: str) -> Dict[str, List[str]]:
    """``{"sass": [...], "ptx": [...]}``: the architectures whose SASS (``sm_90a``) and PTX (``compute_100``) an object
    file or library holds (cuobjdump's ELF and PTX listings)."""
    out = {}
    for key, flag, kind in (("sass", "--list-elf", "sm"), ("ptx", "--list-ptx", "compute")):
        p = subprocess.run([tool, flag, path], capture_output=True, text=True)
        found = set(re.findall(r"\.sm_(\w+?)\.(?:cubin|ptx)\s*$", p.stdout, re.M))
        out[key] = sorted((f"{kind}_{a}" for a in found), key=lambda t: (len(t), t))
    return out


def demangle(names: List[str]) -> Dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def parse_sass(text: str) -> Dict[str, Dict[str, object]]:
    """cuobjdump -sass output -> {(mangled kernel name): {"arch": ..., "insns": [(address, opcode, operands)]}}."""
    funcs: Dict[str, Dict[str, object]] = {}
    arch, cur = None, None
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            arch = m.group(1)
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(f"{arch}:{m.group(1)}", {"arch": arch, "name": m.group(1), "insns": []})
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            body = m.group(2).strip()
            if body.startswith("@"):
                body = body.split(None, 1)[1] if " " in body else ""
            op, _, rest = body.partition(" ")
            cur["insns"].append((int(m.group(1), 16), op, rest.strip()))
    return funcs


def _counts(ops: List[str]) -> Dict[str, int]:
    """:data:`COUNTED` over ``ops``, each predicate asked once per distinct opcode."""
    distinct = Counter(ops)
    return {name: sum(n for op, n in distinct.items() if pred(op)) for name, pred in COUNTED.items()}


def innermost_loops(insns) -> List[Dict[str, object]]:
    """Loops from the branch structure: a branch to an earlier (or the same) address closes a loop over
    [target, branch]; the innermost are those whose range holds no other such loop."""
    loops = []
    for addr, op, rest in insns:
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", rest)
        if m and int(m.group(1), 16) < addr:  # (a branch to itself is the trap after EXIT)
            loops.append((int(m.group(1), 16), addr))
    loops = sorted(set(loops))
    inner = [lp for lp in loops
             if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    addrs = [a for a, _, _ in insns]
    out = []
    for lo, hi in inner:
        body = [op for _, op, _ in insns[bisect.bisect_left(addrs, lo):bisect.bisect_right(addrs, hi)]]
        out.append(dict(start=lo, end=hi, instructions=len(body), **_counts(body)))
    return out


def kernel_facts(insns) -> Dict[str, object]:
    ops = [op for _, op, _ in insns if op and op != "NOP"]
    return dict(instructions=len(ops), **_counts(ops), loops=innermost_loops(insns))


def object_facts(obj: str, tool: str, arch: str = "sm_90a") -> Dict[str, Dict[str, object]]:
    """{demangled kernel name: facts} for the `arch` SASS of an object file or fat binary (only that architecture is
    disassembled: a binary without it gives none)."""
    p = subprocess.run([tool, "-sass", "-arch", arch, obj], capture_output=True, text=True)
    if p.returncode != 0 and "does not contain device code" in p.stderr:
        return {}  # a host-only unit (the op registration)
    if p.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {obj} failed: {p.stderr.strip()[:500]}")
    funcs = {k: v for k, v in parse_sass(p.stdout).items() if v["arch"] == arch}
    names = demangle([v["name"] for v in funcs.values()])
    return {names[v["name"]]: dict(mangled=v["name"], **kernel_facts(v["insns"])) for v in funcs.values()}


# Resident CTAs per SM from registers and shared memory (the CUDA occupancy rules; constants of sm_100 / sm_90 / sm_80:
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"; register allocation: 256 per warp
# granule, per-thread counts rounded up to 8; 1 KB of shared memory reserved per block by the driver).
ARCH_LIMITS = {
    "sm_100a": dict(threads=2048, blocks=32, regs=65536, smem=228 * 1024, reserved=1024),
    "sm_90a": dict(threads=2048, blocks=32, regs=65536, smem=228 * 1024, reserved=1024),
    "sm_90": dict(threads=2048, blocks=32, regs=65536, smem=228 * 1024, reserved=1024),
    "sm_80": dict(threads=2048, blocks=32, regs=65536, smem=164 * 1024, reserved=1024),
}


def resident_ctas(registers: int, threads: int, smem_bytes: int, arch: str = "sm_90a") -> int:
    """CTAs of `threads` threads, `registers` per thread and `smem_bytes` of shared memory (static + dynamic)
    resident on one SM."""
    lim = ARCH_LIMITS[arch]
    warps = (threads + 31) // 32
    per_warp = -(-(-(-max(registers, 1) // 8) * 8 * 32) // 256) * 256
    n = min(lim["blocks"], lim["threads"] // threads, lim["regs"] // (per_warp * warps))
    return min(n, lim["smem"] // (smem_bytes + lim["reserved"]))
