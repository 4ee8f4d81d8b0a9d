"""The SIMT harness's access assertions, one rule for every kernel.

``ideal_access(fn)`` runs ``fn()`` on the harness's counting build (``simt.record(access=True)``) and checks every
launch it made: shared-memory wavefronts equal to the ideal ones (no bank conflict anywhere) and global sectors at
most ``sector_slack`` times the ideal ones (the ideal: the distinct 32-byte sectors each warp instruction's bytes
span). A failure names the kernel and the source lines that miss, with their counts. Returns ``(result,
recording)`` so a test can go on to assert bytes against the floor or CTAs.

Skips where the harness has no access model (the sanitized build), so it runs in the plain SIMT legs only.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest

SECTOR_SLACK = 1.05


def misses(launch: Dict[str, Any], sector_slack: float = SECTOR_SLACK) -> List[str]:
    """The source lines of one launch record that break the rule, with their counts (empty when it holds)."""
    out = []
    for line, c in sorted(launch["by_line"].items()):
        if c["shared_wavefronts"] != c["shared_wavefronts_ideal"]:
            out.append(f"{line}: {c['shared_wavefronts']} shared wavefronts, ideal {c['shared_wavefronts_ideal']}")
        if c["global_sectors"] > sector_slack * c["global_sectors_ideal"]:
            out.append(f"{line}: {c['global_sectors']} global sectors, ideal {c['global_sectors_ideal']}")
    return out


def check_launches(launches: List[Dict[str, Any]], sector_slack: float = SECTOR_SLACK) -> None:
    """Assert the rule on every launch, in total and line by line (a line may not hide behind the total)."""
    assert launches, "no launch was recorded"
    bad = []
    for r in launches:
        total_ok = (r["shared_wavefronts"] == r["shared_wavefronts_ideal"]
                    and r["global_sectors"] <= sector_slack * r["global_sectors_ideal"])
        lines = misses(r, sector_slack)
        if lines or not total_ok:
            bad.append(f"{r['kernel']}: shared {r['shared_wavefronts']}/{r['shared_wavefronts_ideal']} wavefronts, "
                       f"global {r['global_sectors']}/{r['global_sectors_ideal']} sectors; " + "; ".join(lines))
    assert not bad, "\n".join(bad)


def ideal_access(fn: Callable[[], Any], sector_slack: float = SECTOR_SLACK) -> Tuple[Any, Any]:
    """Run ``fn()`` under the access model and assert the rule on each launch; returns (result, recording)."""
    from dspark_kernels import simt

    if not simt.access_model_available():
        pytest.skip("needs the harness's warp access model (the counting SIMT build; the sanitized one has none)")
    with simt.record(access=True) as rec:
        out = fn()
    check_launches(rec.launches, sector_slack)
    return out, rec
