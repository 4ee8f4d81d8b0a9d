"""Warp instructions a kernel executes, estimated from its line-annotated SASS and how often each source block runs
(a MODEL: it counts what the machine code holds, not what a GPU ran; Nsight Compute's smsp__inst_executed.sum is
the measurement, bench/ncu_draft.py).

The disassembly is nvdisasm's with inline line info (``nvdisasm -gi`` of a cubin built with ``-lineinfo``): each
instruction carries its source chain, the innermost inlined frame first; its *own* line is the first frame in the
project's headers (past inlined toolkit code). The outer "inlined at" frames of optimized code are not always where
the call stands, so the rules below prefer the own line and the SASS loop structure to them. A *region* is a block
of a header's source (the braces that open on the line holding a marker, or that line alone when it opens none)
with the number of times its body runs per CTA, summed over the CTA's warps (0: off the path being counted). An
instruction is charged:
  - inside a SASS loop on the path, where no forward branch of the body jumps over it to a later instruction of
    the body (every iteration runs it), that loop's count, whatever the line info says;
  - else the count of the smallest region holding its own line (0: off the path); a loop's region counts only if the
    instruction lies inside the SASS loop that closes at that line (a loop the compiler unrolled, a loop's setup
    hoisted before it, code whose line info names the loop wrongly: the rules below);
  - else, inside a SASS loop (the innermost backward branch around it, exact from the addresses), that loop's
    count (the region that opens at the loop's line): code inlined from elsewhere runs as often as the loop it
    sits in; but when a line it was inlined at, before the chain reaches the loop's own source, lies in a region
    that does not hold the loop and runs at most as often as the loop, that region's count (a helper inlined into
    a rare branch of the loop body, or into a function off the path: 0; a region that would run more often than
    the loop around the instruction cannot hold it: a misnamed call site); nothing when the loop is off the path
    (it closes in a region of count 0);
  - else the count of the smallest region holding a line it was inlined at (innermost first); else, in a
    subroutine (a ``__noinline__`` function), of the smallest region holding a frame of its first instruction's
    chain; else once.
A region given ``within`` a loop counts only for instructions inside that loop's SASS loop: the copies of code
inlined at two call sites (a lambda called before a loop and in it) then take a count each. A branch's two sides
are charged alike where no region tells them apart, so the estimate is an upper bound for the
path wherever each count is one, and a loop the compiler unrolled must be kept from it (``#pragma unroll 1``) or
the count is charged to each copy.

Every SASS loop of the project's code must open a region, else :func:`estimate` refuses (unless the loop is off
the path): a loop the table forgot cannot pass as straight-line code. Backward branches inside inlined toolkit code
(the retry loops the compiler builds around warp shuffles) are not source loops.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Frame = Tuple[str, int]  # (file name without its folder, line)

_SECTION = re.compile(r"^\.text\.(\S+):\s*$")
_FILE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"BRA(?:\.\S+)?\s+(?:\S+\s*,\s*)?`\((\.L_x_\d+)\)")
_SUB = re.compile(r"^\$\S+:\s*$")  # a subroutine's symbol (a noinline function, a toolkit helper)


@dataclass(frozen=True)
class Insn:
    index: int
    text: str             # the instruction, predicate and operands included
    chain: Tuple[Frame, ...]  # innermost frame first
    target: Optional[int]  # the instruction index a branch goes to
    entry: Tuple[Frame, ...] = ()  # in a subroutine: the chain of its first instruction


def parse_lined(text: str) -> Dict[str, List[Insn]]:
    """``nvdisasm -gi`` output -> {mangled function: its instructions}. A ``__noinline__`` function the kernel calls
    sits in the kernel's section as a subroutine (from its ``$symbol:`` line to the next) whose line info stops at
    its own body; its instructions carry the chain of its first instruction as ``entry``."""
    funcs: Dict[str, List[Insn]] = {}
    raw: List[Tuple[str, Tuple[Frame, ...]]] = []
    labels: Dict[str, int] = {}
    subs: set = set()
    name, pending, chain = None, [], ()

    def close():
        if name is None:
            return
        entries = sorted(subs)
        insns, e = [], -1
        for i, (t, c) in enumerate(raw):
            while e + 1 < len(entries) and entries[e + 1] <= i:
                e += 1
            insns.append(Insn(i, t, c, _target(t, labels), raw[entries[e]][1] if e >= 0 else ()))
        funcs[name] = insns

    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            close()
            name, raw, labels, subs, pending, chain = m.group(1), [], {}, set(), [], ()
            continue
        m = _SUB.match(line)
        if m and name is not None:  # a subroutine: its line info starts afresh
            subs.add(len(raw))
            pending, chain = [], ()
            continue
        m = _FILE.match(line)
        if m:
            pending.append((os.path.basename(m.group(1)), int(m.group(2))))
            continue
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(raw)
            continue
        m = _INSN.match(line)
        if m and name is not None:
            if pending:
                chain, pending = tuple(pending), []
            raw.append((m.group(2).strip(), chain))
    close()
    return funcs


def _target(text: str, labels: Dict[str, int]) -> Optional[int]:
    m = _TARGET.search(text)
    return labels.get(m.group(1)) if m else None


def lined_functions(obj: str, cuobjdump: str, nvdisasm: str, arch: str = "sm_90a") -> Dict[str, List[Insn]]:
    """The `arch` functions of an object file or library, line-annotated: its cubins extracted by cuobjdump and
    disassembled by ``nvdisasm -gi``."""
    out: Dict[str, List[Insn]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(obj)], cwd=tmp, check=True, capture_output=True)
        for cubin in sorted(glob.glob(os.path.join(tmp, f"*.{arch}.cubin"))):
            p = subprocess.run([nvdisasm, "-gi", "-c", cubin], capture_output=True, text=True, check=True)
            out.update(parse_lined(p.stdout))
    return out


@dataclass(frozen=True)
class Region:
    file: str
    first: int
    last: int
    count: float  # body executions per CTA, summed over its warps
    name: str
    loop: bool = False  # it opens at a `for` / `while`: its count holds only inside the SASS loop closing there
    within: Optional[Frame] = None  # its count holds only inside a SASS loop closing at this line (one inlined copy)


def find_region(path: str, marker: str, count: float, after: Optional[str] = None, name: str = "",
                within: Optional[Region] = None) -> Region:
    """The block opening on the first line of `path` holding `marker` (past the first line holding `after`, when
    given): that line through the line of the brace that closes it, or the line alone when it opens no block.
    ``within``: a loop's region; this one then counts only for the copy of its code inside that loop's SASS loop
    (code inlined at two call sites, each copy with its own count)."""
    lines = open(path).read().splitlines()
    start = 0
    if after is not None:
        start = next((i for i, t in enumerate(lines) if after in t), None)
        if start is None:
            raise ValueError(f"{after!r} not in {path}")
    at = next((i for i in range(start, len(lines)) if marker in lines[i]), None)
    if at is None:
        raise ValueError(f"{marker!r} not in {path}" + (f" after {after!r}" if after else ""))
    depth, opened, end = 0, False, at
    for i in range(at, len(lines)):
        code = lines[i][lines[i].index(marker):] if i == at else lines[i]  # ("} else {": from the marker on)
        code = code.split("//")[0]
        for ch in code:
            if ch == "{":
                depth, opened = depth + 1, True
            elif ch == "}":
                depth -= 1
        end = i
        if (opened and depth <= 0) or (not opened and code.rstrip().endswith(";")):
            break
    is_loop = bool(re.search(r"\b(for|while)\s*\(", lines[at][lines[at].index(marker):]))
    return Region(os.path.basename(path), at + 1, end + 1, count, name or marker, is_loop,
                  None if within is None else (within.file, within.first))


def _holding(regions: Sequence[Region], frame: Optional[Frame]) -> List[Region]:
    return [r for r in regions if frame is not None and r.file == frame[0] and r.first <= frame[1] <= r.last]


def _smallest(rs: Sequence[Region]) -> Optional[Region]:
    return min(rs, key=lambda r: r.last - r.first) if rs else None


def own_frame(insn: Insn, files: Sequence[str]) -> Optional[Frame]:
    """The instruction's innermost frame in `files` (past inlined toolkit code)."""
    return next((f for f in insn.chain if f[0] in files), None)


def loops(insns: Sequence[Insn], files: Sequence[str]) -> List[Tuple[int, int, Frame]]:
    """(first, last, the branch's line) of each backward branch whose innermost frame lies in one of `files`; a
    backward branch inside inlined toolkit code (the retry loop of a warp shuffle) is not a source loop."""
    return [(ins.target, ins.index, ins.chain[0]) for ins in insns
            if ins.target is not None and ins.target <= ins.index and ins.chain and ins.chain[0][0] in files]


def every_iteration(insns: Sequence[Insn], first: int, last: int) -> List[bool]:
    """For each instruction of the SASS loop first..last (last: its back edge), whether every iteration runs it: no
    forward branch of the body jumps over it to a later instruction of the body. A branch out of the loop skips
    nothing (code that came back into the body would be a backward branch, a loop of its own: :func:`loops`); an
    inner loop's back edge jumps backward, and its body is its own."""
    skipped = [False] * (last + 1 - first)
    for b in range(first, last):
        to = insns[b].target
        if to is not None and b < to <= last:
            skipped[b + 1 - first:to - first] = [True] * (to - b - 1)
    return [not x for x in skipped]


def charges(insns: Sequence[Insn], regions: Sequence[Region], files: Sequence[str],
            off_path: Optional[Callable[[Sequence[Insn]], bool]] = None) -> List[Tuple[float, str]]:
    """(executions per CTA, what set it: a region's name, "loop <name>", "(entry) <name>" or "(once)") per
    instruction, by the rules of the module's docstring. ``off_path(body)``: true for a SASS loop the path does not
    take although its source line is on it (one instance of a template whose other instance runs): its
    instructions are charged nothing, as are those of a loop that closes in a region of count 0 (code inlined into
    it included). Raises ValueError for a SASS loop no region opens."""
    home: List[Optional[Region]] = [None] * len(insns)
    inside: List[set] = [set() for _ in insns]  # the lines of the SASS loops around each instruction
    off = [False] * len(insns)
    for first, last, (file, line) in sorted(loops(insns, files), key=lambda lp: lp[0] - lp[1]):  # outer first
        if off[first]:
            continue  # inside a loop off the path
        where = _smallest([r for r in _holding(regions, (file, line)) if r.within is None or r.within in inside[first]])
        if (where is not None and where.count == 0) or (off_path is not None and off_path(insns[first:last + 1])):
            off[first:last + 1] = [True] * (last + 1 - first)
            continue
        r = next((r for r in regions if r.file == file and r.first == line and
                  (r.within is None or r.within in inside[first])), None)
        if r is None:
            raise ValueError(f"the SASS loop {first}..{last} closes at {file}:{line}, which no region opens")
        for i in range(first, last + 1):
            home[i] = r  # inner loops, visited later, overwrite (but an instruction off the path stays off)
            inside[i].add((file, line))
    # an instruction of a SASS loop's body that no forward branch of the body jumps over runs every iteration,
    # whatever its line info
    every = [False] * len(insns)
    for first, last, _ in sorted(loops(insns, files), key=lambda lp: lp[0] - lp[1]):  # inner loops overwrite
        every[first:last + 1] = every_iteration(insns, first, last)
    out = []
    for ins, loop, skip, around, always in zip(insns, home, off, inside, every):
        frames = [f for f in ins.chain if f[0] in files]  # its own line first, then where it was inlined

        def region_holding(f):
            return [r for r in _holding(regions, f) if (not r.loop or r.count == 0 or (r.file, r.first) in around)
                    and (r.within is None or r.within in around)]

        def region_of(f):
            return _smallest(region_holding(f))

        own = region_of(frames[0]) if frames else None
        if skip:
            out.append((0.0, "(loop off the path)"))
        elif always and loop is not None:
            out.append((loop.count, f"loop {loop.name}"))
        elif own is not None:
            out.append((own.count, own.name))
        elif loop is not None:
            # inlined into a block that the loop does not sit in (a rare branch inside it; a function off the
            # path, count 0): that block's count; but only a block met before the chain reaches the loop's own
            # source (frames past it are where the loop's function was inlined, which the loop overrules)
            inner = None
            for f in frames[1:]:
                inner = _smallest(region_holding(f))
                if inner is loop:
                    inner = None
                    break
                if inner is not None and not (inner.file == loop.file and inner.first <= loop.first <= inner.last):
                    if inner.count > loop.count:  # it cannot sit inside this loop: a misnamed call site
                        inner = None
                    break
                inner = None
            out.append((inner.count, inner.name) if inner is not None else (loop.count, f"loop {loop.name}"))
        else:
            outer = next((r for r in map(region_of, frames[1:]) if r is not None), None)
            entry = _smallest([r for f in ins.entry for r in _holding(regions, f)])
            if outer is not None:
                out.append((outer.count, outer.name))
            elif entry is not None:
                out.append((entry.count, f"(entry) {entry.name}"))
            else:
                out.append((1.0, "(once)"))
    return out


def estimate(insns: Sequence[Insn], regions: Sequence[Region], files: Sequence[str],
             off_path: Optional[Callable[[Sequence[Insn]], bool]] = None) -> Dict[str, object]:
    """Warp instructions per CTA (the sum of :func:`charges`) and the share of each charging rule / region."""
    total, by = 0.0, {}
    for n, why in charges(insns, regions, files, off_path):
        total += n
        by[why] = by.get(why, 0.0) + n
    return dict(warp_instructions=total, by_region=by)
