"""The SIMT harness: CUDA kernels on the CPU, its fault checks (each on a planted bug, next to the correct twin), its
counters against hand-computed values, and the kernel building blocks (16-byte loads, split-V partials, races)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import dspark_kernels as dk
from cpp_sources import registered_schemas, registration_schemas
from dspark_kernels import _ext, rng, simt
from dspark_kernels.distributed import ops as _dist_ops  # noqa: F401  (the vocabulary-parallel ops and their fakes)
from dspark_kernels.ops._common import resolve_backend

pytestmark = pytest.mark.simt  # CI runs these again under AddressSanitizer + UBSan


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.setenv("DSPARK_SIMT", "1")
    return simt.module()


def selftest(m, name, *, x=None, n=256, grid=1, block=128, variant=0, aux=8):
    x = torch.arange(n, dtype=torch.float32) if x is None else x
    y = torch.zeros(max(n, grid * block))
    a = torch.zeros(aux)
    m.selftest(name, x, y, a, grid, block, variant)
    return y, a


# ------------------------------------------------------------------------------------------------ interface

def test_cuda_on_cpu_tensors_needs_the_variable(monkeypatch):
    monkeypatch.delenv("DSPARK_SIMT", raising=False)
    with pytest.raises(ValueError, match="DSPARK_SIMT=1"):
        resolve_backend("cuda", torch.device("cpu"), "rng_uniform_")
    with pytest.raises(ValueError, match="DSPARK_SIMT=1"):
        dk.rng_uniform((1, 1, 4), backend="cuda")


def test_auto_on_the_cpu_never_runs_the_harness(monkeypatch):
    """With DSPARK_SIMT=1, "auto" on CPU tensors still means the CPU kernels (or the reference where they cannot
    be built), never the CUDA kernels through the harness."""
    from dspark_kernels import _ext
    monkeypatch.setenv("DSPARK_SIMT", "1")
    want = "cpu" if _ext.cpu_available() else "reference"
    assert resolve_backend("auto", torch.device("cpu"), "rng_uniform_") == want


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 17), (3, 5, 1001), (1, 2, 4096), (2, 1, 6)])
def test_rng_uniform_equals_the_reference(cuda_device, simt_check, shape):
    want = dk.rng_uniform(shape, seed=2**40 + 7, offset=2**33 + 5, stream=3, backend="reference")
    got = simt_check(lambda: dk.rng_uniform(shape, seed=2**40 + 7, offset=2**33 + 5, stream=3,
                                            device=cuda_device, backend="cuda"))
    assert torch.equal(got.cpu(), want)


def test_rng_uniform_unaligned_output_and_counters(harness):
    """A 4-byte-aligned output takes the scalar-store path; every element is written once, the key read per thread."""
    buf = torch.zeros(1 + 2 * 3 * 8)
    out = buf[1:].view(2, 3, 8)
    with simt.record() as rec:
        dk.rng_uniform(out, seed=9, offset=1, backend="cuda")
    want = dk.rng_uniform((2, 3, 8), seed=9, offset=1, backend="reference")
    assert torch.equal(out, want) and buf[0] == 0
    first = rec.launches[0]
    assert len(rec.launches) == 1
    assert first["kernel"] == "rng_uniform_kernel<u32>"
    assert first["bytes_written"] == first["unique_bytes_written"] == out.numel() * 4
    assert first["unique_bytes_read"] == 16 and first["bytes_read"] == 16 * first["ctas"] * first["threads"]


def test_opcheck_rng_uniform(harness):
    out = torch.empty(2, 3, 7)
    key = rng.make_rng_key(3, 4, "cpu")
    torch.library.opcheck(torch.ops.dspark_simt.rng_uniform_.default, (out, key, 2))


def test_schemas_are_the_registration_source(harness):
    """The SIMT library registers every op of csrc/torch/registration.cpp with that file's schema (the GPU build
    compiles the same file: python_tests/test_gpu_build.py compares the two builds where CI links the GPU one);
    every op has a fake implementation."""
    registered = registered_schemas("dspark_simt")
    source = registration_schemas()
    assert sorted(registered) == sorted(source) and "rng_uniform_" in registered
    for name, schema in registered.items():
        assert schema == str(torch._C.parse_schema(f"dspark_simt::{source[name]}")), name
        assert name in _ext._fakes, f"{name} has no fake implementation"


# ------------------------------------------------------------------------------------------------ counters

def test_counters_of_a_toy_kernel_match_hand_computed_values(harness):
    n, grid, block = 1000, 4, 128
    x = torch.arange(n, dtype=torch.float32)
    y, sums = torch.empty(n), torch.zeros(grid)
    with simt.record() as rec:
        harness.selftest("scale_sum", x, y, sums, grid, block, 0, 2.0)
    assert torch.equal(y, 2 * x)
    visited = [x[b * block::grid * block].sum() + sum(x[b * block + t::grid * block].sum() for t in range(1, block))
               for b in range(grid)]
    assert torch.allclose(sums, torch.stack(visited))
    (r,) = rec.launches
    assert r["kernel"] == "scale_sum_kernel" and r["ctas"] == grid and r["threads"] == block
    assert r["grid"] == (grid, 1, 1) and r["block"] == (block, 1, 1)
    assert r["bytes_read"] == 4 * n and r["unique_bytes_read"] == 4 * n
    assert r["bytes_written"] == 4 * n + 4 * grid
    assert r["barriers"] == 2 * grid                      # block_sum: two barriers per block
    assert r["warp_collectives"] == grid * (block // 32) * 5  # five shuffle steps per warp
    assert r["static_smem"] == 32 * 4 and r["dynamic_smem"] == 0 and not r["cooperative"]


def test_sm_count_setting_reaches_the_launch_code(harness):
    with simt.record(sm_count=7) as rec:
        dk.rng_uniform((64, 64, 1024), backend="cuda")
    assert rec.launches[0]["ctas"] == 7 * 8 * 4  # rng_uniform caps its grid at 4 waves of 8 blocks per SM
    assert simt.settings()["sm_count"] == simt.H200_SMS


# ------------------------------------------------------------------------------------------------ faults

def test_missing_barrier_is_caught(harness):
    x = torch.randn(256)
    good = simt.check(lambda: selftest(harness, "neighbour", x=x, grid=2, block=128, variant=0)[0])
    assert torch.equal(good, x.view(2, 128).roll(-1, dims=1).flatten())
    with pytest.raises(AssertionError, match="differs between runs"):
        simt.check(lambda: selftest(harness, "neighbour", x=x, grid=2, block=128, variant=1)[0], simt.CHECK_SCHEDULES)


def test_divergent_barrier_is_an_error_naming_the_kernel(harness):
    y, _ = selftest(harness, "divergent_barrier", variant=0)
    assert torch.equal(y[:128], torch.arange(127, -1, -1, dtype=torch.float32))
    for order in ("forward", "reverse"):
        with simt.schedule(order), pytest.raises(RuntimeError, match="divergent_barrier_kernel.*divergent code"):
            selftest(harness, "divergent_barrier", variant=1)


def test_unwritten_shared_memory_is_caught(harness):
    y = simt.check(lambda: selftest(harness, "uninitialised", variant=0)[0])
    assert torch.equal(y[:128], torch.arange(127, -1, -1, dtype=torch.float32))
    with pytest.raises(AssertionError, match="differs between runs"):
        simt.check(lambda: selftest(harness, "uninitialised", variant=1)[0], simt.CHECK_SCHEDULES)


def test_shuffle_mask_naming_an_absent_lane_is_an_error(harness):
    y, _ = selftest(harness, "shuffle_mask", block=64, variant=0)
    lanes = torch.arange(64, dtype=torch.float32)
    assert torch.equal(y[:64], lanes + (torch.arange(64) ^ 1).float())
    for order in ("forward", "reverse"):
        with simt.schedule(order), pytest.raises(RuntimeError, match=r"shuffle_mask_kernel.*mask 0xffffffff.*lane 16"):
            selftest(harness, "shuffle_mask", block=64, variant=1)


@pytest.mark.parametrize("grid,variant,l2,reads", [
    (1, 0, 1 << 20, 1),   # one CTA re-reads 16 KB within its share of L2 -> DRAM once
    (1, 0, 8 << 10, 2),   # ... an L2 of 8 KB: its own 16 KB stream evicts it -> twice
    (3, 0, 1 << 20, 1),   # three CTAs read the same bytes: the later ones hit what the first brought in -> once
    (3, 0, 30 << 10, 4),  # ... a share of 10 KB per CTA: each CTA's own re-read of 16 KB misses (the first pass
                          # of CTAs 1 and 2 hits CTA 0's): pessimistic where CTAs share data (a GPU keeps one copy)
    (3, 1, 30 << 10, 1),  # a grid barrier between the passes: 16 KB moved since the last touch, within L2 -> once
    (3, 1, 2 << 10, 2),   # ... an L2 of 2 KB: the first reader after the barrier misses, the others hit -> twice,
                          # less the 32 sectors the last thread to arrive re-reads before the others resume (it runs
                          # on at once in the harness, its own reads of just before still near)
])
def test_dram_estimate_of_re_reads(harness, grid, variant, l2, reads):
    """The DRAM-read estimate (csrc/simt/runtime.cpp, estimate_dram_reads) on a kernel whose every block reads the
    same 16 KB twice, computed by hand: 32-byte sectors, a CTA's share of L2, other CTAs in the same phase."""
    n, block = 4096, 128
    x = torch.arange(n, dtype=torch.float32)
    y = torch.zeros(grid * block)
    old = simt.configure(l2_bytes=l2)
    try:
        with simt.record(dram=True) as rec:
            harness.selftest("reread", x, y, torch.zeros(1), grid, block, variant)
    finally:
        simt.configure(**old)
    sums = torch.stack([2 * x[t::block].sum() for t in range(block)]).repeat(grid)
    assert torch.allclose(y, sums)
    (r,) = rec.launches
    assert r["bytes_read"] == 2 * grid * 4 * n and r["unique_bytes_read"] == 4 * n
    near = 32 * 32 if (variant, reads) == (1, 2) else 0
    assert r["dram_bytes_read"] == reads * 4 * n - near, (r["dram_bytes_read"], reads * 4 * n)
    assert rec.dram_bytes == r["dram_bytes_read"] + grid * block * 4
    with simt.record() as plain:  # off unless asked for
        harness.selftest("reread", x, y, torch.zeros(1), grid, block, variant)
    assert plain.launches[0]["dram_bytes_read"] is None and plain.dram_bytes is None


def test_grid_barrier_needs_a_cooperative_launch(harness):
    y, buf = simt.check(lambda: selftest(harness, "grid_barrier", grid=5, block=64, aux=5, variant=0))
    assert torch.equal(buf, torch.arange(1, 6, dtype=torch.float32))
    assert torch.equal(y[:5], torch.tensor([2.0, 3, 4, 5, 1]))  # block b read block b+1's value after the barrier
    with pytest.raises(RuntimeError, match="grid_barrier_kernel.*not cooperative"):
        selftest(harness, "grid_barrier", grid=5, block=64, aux=5, variant=1)


@pytest.mark.parametrize("variant,error", [(1, "read memory the launch before it wrote"),
                                           (2, "wrote global memory before grid_dependency_wait"),
                                           (3, "launch_dependents .* before grid_dependency_wait")])
def test_programmatic_dependent_launch_rule(harness, variant, error):
    """A pdl launch runs after the launch before it (stream order), and the harness holds it to the GPU's rule: no
    read of what that launch wrote, no global write and no launch_dependents before grid_dependency_wait."""
    x = torch.arange(64, dtype=torch.float32)
    with simt.record() as rec:
        y, aux = selftest(harness, "pdl", x=x, grid=1, block=64, aux=64, variant=0)
    assert torch.equal(y[:64], 2 * x) and torch.equal(aux, 2 * x + 1)
    assert [r["pdl"] for r in rec.launches] == [False, True]
    with pytest.raises(RuntimeError, match="pdl_reader_kernel.*" + error):
        selftest(harness, "pdl", x=x, grid=1, block=64, aux=64, variant=variant)


_OOB_SCRIPT = textwrap.dedent("""
    import sys, torch
    from dspark_kernels import simt
    m = simt.module()
    assert m.sanitized
    x = torch.arange(100, dtype=torch.float32)
    y, aux = torch.zeros(128), torch.zeros(1)
    m.selftest("oob_read", x, y, aux, 1, 128, int(sys.argv[1]))
    print("finished", float(y[:100].sum()))
""")


@pytest.mark.sanitized
def test_out_of_bounds_read_is_caught_by_the_sanitized_build():
    """CI's sanitizer leg runs this, against the build that leg uses. Runs in a child process: AddressSanitizer needs its runtime preloaded, and a report ends the process."""
    env = dict(os.environ, DSPARK_SIMT="1", DSPARK_SIMT_SANITIZE="1", LD_PRELOAD=_ext.asan_preload(),
               ASAN_OPTIONS="detect_leaks=0")
    run = [sys.executable, "-c", _OOB_SCRIPT]
    ok = subprocess.run(run + ["0"], env=env, capture_output=True, text=True, timeout=900)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "finished 4950.0" in ok.stdout
    bad = subprocess.run(run + ["1"], env=env, capture_output=True, text=True, timeout=900)
    assert bad.returncode != 0 and "finished" not in bad.stdout
    # the report names the kernel and its source line (the build keeps line tables: -g1)
    assert "AddressSanitizer: heap-buffer-overflow" in bad.stderr and "oob_read_kernel" in bad.stderr, \
        bad.stderr[-3000:]
    assert re.search(r"oob_read_kernel\(.*\) \S*selftest\.cuh:\d+", bad.stderr), bad.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ building blocks

def _split_v(vocab, rows, target_ctas, min_chunk):
    """dspark::split_v (reduce.cuh), by hand: chunks per row."""
    want = max(1, -(-target_ctas // rows))
    chunk = -(-max(-(-vocab // want), min_chunk) // 32) * 32
    return -(-vocab // chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 17, 1000, 4099])
def test_split_v_partials_equal_torch(harness, dtype, vocab):
    """16-byte loads with head/tail at every row alignment (odd V packs rows at odd offsets), the split-V partials
    and their combine: log-sum-exp, the argmax rule (NaN as -inf, ties low) and the Gumbel race winner."""
    rows, temp = 5, 0.7
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    if vocab > 3:
        x[1, vocab // 2] = float("nan")
        x[2, :] = x[2, 0]                                       # one big tie
        x[3, vocab - 1] = float("-inf")
        x[4, 1] = x[4].float().max() + 1                        # a clear winner near the head
    key = rng.make_rng_key(11, 2, "cpu")
    with simt.record() as rec:
        lse, amax, race, chunks = simt.check(lambda: harness.row_stats(x, temp, key, 64))
    xf = x.float()
    finite = torch.where(torch.isnan(xf), float("-inf"), xf) / temp
    assert torch.allclose(lse, torch.logsumexp(finite, dim=-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(amax, rng.argmax_nan_low(xf))
    u = rng.uniform_rows(key, torch.arange(rows), 0, rng.STREAM_RESIDUAL, vocab)
    assert torch.equal(race, rng.gumbel_argmax(xf / temp, u))
    assert chunks == _split_v(vocab, rows, 2 * simt.H200_SMS, 64)
    if vocab >= 1000:
        assert chunks > 1
    phase1 = rec.launches[0]
    assert phase1["ctas"] == rows * chunks
    assert phase1["unique_bytes_read"] == x.numel() * x.element_size() + 16  # every logit once, and the key
    assert phase1["bytes_read"] == x.numel() * x.element_size() + 16 * phase1["ctas"] * phase1["threads"]


# ------------------------------------------------------------------------------------------------ access model

SELFTEST_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "simt",
                            "selftest.cuh")


def _line(marker):
    """selftest.cuh:<n> of the line holding the comment `// model: <marker>` (what by_line names)."""
    with open(SELFTEST_SRC) as f:
        for n, text in enumerate(f, 1):
            if text.rstrip().endswith(f"// model: {marker}"):
                return f"selftest.cuh:{n}"
    raise AssertionError(marker)


@pytest.fixture
def model(harness):
    """The counting build (the access model's hooks), which ``simt.record(access=True)`` runs on."""
    if not simt.access_model_available():
        pytest.skip("the AddressSanitizer build has no access model (kernel-address instrumentation feeds it); "
                    "the counting build runs this test")
    return simt.module(counting=True)


def _modelled(m, name, *, grid=1, block=32, variant=0, alpha=1.0, x=None, ny=256):
    x = torch.arange(4096, dtype=torch.float32) if x is None else x
    y = torch.zeros(ny)
    with simt.record(access=True) as rec:
        m.selftest(name, x, y, torch.zeros(1), grid, block, variant, alpha)
    (r,) = rec.launches
    assert r["access_model"]
    return r, y


def _counts(r):
    return tuple(r[k] for k in simt.ACCESS_KEYS)


@pytest.mark.parametrize("variant,wavefronts", [
    (0, 1),   # word l: 32 banks, one word each
    (1, 8),   # word 8 l: banks 0, 8, 16, 24 hold 8 distinct words each
    (2, 4),   # float4 l: four quarter-warp phases of 8 lanes x 16 bytes, conflict-free each
])
def test_shared_bank_conflicts_are_counted_exactly(model, variant, wavefronts):
    r, y = _modelled(model, "bank", variant=variant)
    want = torch.arange(32.0) if variant != 2 else 2 * ((torch.arange(32) + 1) % 32).float()
    assert torch.equal(y[:32], want)
    # one warp: a global load and store of 32 consecutive floats (4 sectors each), one shared store and one load;
    # without conflicts the same words would cost 1 wavefront (32 words) or 4 (4 phases of 32 words)
    ideal = 4 if variant == 2 else 1
    assert _counts(r) == (2, 2 * wavefronts, 2 * ideal, 2, 8, 8)
    marker = "16-byte store" if variant == 2 else "shared store"
    assert r["by_line"][_line(marker)] == dict(shared_instructions=1, shared_wavefronts=wavefronts,
                                               shared_wavefronts_ideal=ideal, global_instructions=0,
                                               global_sectors=0, global_sectors_ideal=0)
    assert r["misaligned_segments"] == 0


def test_a_broadcast_is_not_a_conflict(model):
    r, y = _modelled(model, "bank", variant=3)
    assert torch.equal(y[:32], torch.zeros(32))
    assert r["by_line"][_line("shared load")]["shared_wavefronts"] == 1
    assert r["by_line"][_line("shared load")]["shared_wavefronts_ideal"] == 1  # one word: one wavefront at best
    assert r["shared_wavefronts"] == 2


@pytest.mark.parametrize("stride,sectors", [(1, 4), (32, 32)])
def test_strided_global_loads_touch_more_sectors(model, stride, sectors):
    """Two warps; lane t loads x[t * stride] (4 bytes): 4 sectors per warp when consecutive, 32 at a 128-byte
    stride; the ideal stays 4 (128 distinct bytes). The store is consecutive either way."""
    r, y = _modelled(model, "strided", block=64, alpha=stride, ny=128)
    assert torch.equal(y[:64], torch.arange(64.0) * stride)
    assert _counts(r) == (0, 0, 0, 4, 2 * sectors + 8, 16)
    assert r["by_line"][_line("strided load")] == dict(shared_instructions=0, shared_wavefronts=0,
                                                       shared_wavefronts_ideal=0, global_instructions=2,
                                                       global_sectors=2 * sectors, global_sectors_ideal=8)


def test_sequences_that_do_not_line_up_are_flagged(model):
    """Odd lanes store once more: per warp, one store of 16 lanes (every other float: 4 sectors, 2 ideal)."""
    r, y = _modelled(model, "strided", block=64, variant=1, ny=128)
    assert torch.equal(y[64:], torch.where(torch.arange(64) % 2 == 1, torch.arange(64.0), 0.0))
    assert r["misaligned_segments"] == 2 and r["misaligned_accesses"] == 2 * (32 * 2 + 16)
    assert r["by_line"][_line("divergent store")] == dict(shared_instructions=0, shared_wavefronts=0,
                                                          shared_wavefronts_ideal=0, global_instructions=2,
                                                          global_sectors=8, global_sectors_ideal=4)
    aligned, _ = _modelled(model, "strided", block=64, variant=0, ny=128)
    assert aligned["misaligned_segments"] == 0


def test_the_access_rule_fails_on_a_conflict_and_on_strided_loads(model):
    """python_tests/access.py, the rule every kernel's access test applies: it passes a conflict-free, consecutive
    launch and names the line of a bank conflict or of a strided load."""
    from access import check_launches
    check_launches([_modelled(model, "bank", variant=0)[0]])
    for launch, marker in ((_modelled(model, "bank", variant=1)[0], "shared store"),
                           (_modelled(model, "strided", block=64, alpha=32, ny=128)[0], "strided load")):
        with pytest.raises(AssertionError, match=_line(marker)):
            check_launches([launch])


def test_access_model_is_off_outside_a_recording(model):
    with simt.record() as rec:
        pass
    assert rec.launches == []
    y = torch.zeros(64)
    model.selftest("bank", torch.arange(64.0), y, torch.zeros(1), 1, 32, 1, 1.0)  # no recording: runs, no record
    assert torch.equal(y[:32], torch.arange(32.0))


def test_access_model_runs_only_when_asked(model):
    x, y = torch.arange(64.0), torch.zeros(64)
    with simt.record() as rec:
        model.selftest("bank", x, y, torch.zeros(1), 1, 32, 1, 1.0)
    (r,) = rec.launches
    assert not r["access_model"] and r["by_line"] == {} and r["shared_wavefronts"] is None
    assert r["bytes_read"] > 0  # the byte counters run in every recording
    with simt.record(access=True) as rec:
        model.selftest("bank", x, y, torch.zeros(1), 1, 32, 1, 1.0)
    assert rec.launches[0]["access_model"] and rec.launches[0]["shared_wavefronts"] > 0


def test_two_builds_correctness_on_the_plain_one_counts_on_the_counting_one(harness, model):
    """The plain build has no hooks (the correctness tests run on it, several times faster); ``record(access=True)``
    runs its body's kernels on the counting build, whose records carry the model's counts, and nothing else does;
    ``configure`` sets both builds alike."""
    assert harness is not model and not harness.access_model and model.access_model

    def one_launch(access):
        with simt.record(access=access) as rec:
            dk.rng_uniform((2, 3, 64), seed=5, backend="cuda")
        (r,) = rec.launches
        return r

    assert not one_launch(False)["access_model"]
    counted = one_launch(True)
    assert counted["access_model"] and counted["global_instructions"] > 0 and counted["by_line"]
    assert not one_launch(False)["access_model"]  # back on the plain build
    old = simt.configure(sm_count=7, order="reverse")
    try:
        assert harness.settings() == model.settings() and harness.settings()["sm_count"] == 7
    finally:
        simt.configure(**old)
    assert harness.settings() == model.settings()


# ------------------------------------------------------------------------------------------------ cp.async

def _cp_async_reference(x, n=64):
    a = x[:4 * n].view(n, 4)
    b = x[4 * n:6 * n].view(n, 2)
    c = torch.where(torch.arange(n) % 2 == 0, x[6 * n:7 * n], 0.0)
    u = (torch.arange(n) + 1) % n
    return a[u].sum(1) + b[u].sum(1) + c[u] + a[:, 3]


def test_cp_async_copies_and_zero_fills(harness):
    x = torch.randn(4096)
    y = simt.check(lambda: selftest(harness, "cp_async", x=x, n=4096, block=64)[0])
    torch.testing.assert_close(y[:64], _cp_async_reference(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant,what", [(1, "read 4 byte"), (2, "read 4 byte"), (3, "read 4 byte")])
def test_reading_a_cp_async_destination_before_its_wait_fails(model, variant, what):
    """The check runs on the access hooks of the counting build (so the AddressSanitizer build skips it)."""
    with pytest.raises(RuntimeError, match=rf"cp_async_kernel.*{what}.*destination of a cp.async.*no cp_async_wait"):
        selftest(model, "cp_async", n=4096, block=64, variant=variant)


@pytest.mark.parametrize("variant", [1, 2, 3])
def test_an_early_cp_async_read_changes_the_result_between_schedules(harness, variant):
    """Without the hooks (the plain and the sanitized builds) a cp.async destination holds the run's poison byte until
    its wait, so a read before the wait differs between simt.check's runs (variant 3: the slot held a value before).
    Every schedule is passed explicitly: the comparison itself is under test, whatever DSPARK_SIMT_CHECK_RUNS says."""
    with pytest.raises(AssertionError, match="differs between runs"):
        simt.check(lambda: selftest(harness, "cp_async", x=torch.randn(4096), n=4096, block=64, variant=variant)[0],
                   schedules=simt.CHECK_SCHEDULES)


def test_cp_async_is_counted_by_the_model(model):
    """Two warps. 16-byte rows: per warp 512 contiguous bytes (16 sectors) and four quarter-warp wavefronts; 8-byte
    rows: 8 sectors, two half-warp wavefronts; 4-byte words with odd lanes zero-filled: the 16 even lanes read 64
    bytes spread over 128 (4 sectors, 2 ideal), and all 32 lanes write one wavefront. Each write is conflict-free
    (its wavefronts are the ideal ones)."""
    r, _ = _modelled(model, "cp_async", block=64)
    want = {"cp.async 16": (2, 8, 8, 2, 32, 32), "cp.async 8": (2, 4, 4, 2, 16, 16), "cp.async 4": (2, 2, 2, 2, 8, 4)}
    for marker, counts in want.items():
        assert _counts(r["by_line"][_line(marker)]) == counts, marker


# ------------------------------------------------------------------------------------------------ launch rules

def test_dynamic_shared_memory_over_48k_needs_the_attribute(harness):
    """bank_kernel has 4096 bytes of static shared memory: 45 KB dynamic passes alone but not with it."""
    x, y, a = torch.arange(64.0), torch.zeros(64), torch.zeros(1)
    harness.launch_rule_case("bank", 44 * 1024, 0, x, y, a)           # 4 KB + 44 KB = 48 KB: the default limit
    with pytest.raises(RuntimeError, match=r"bank_kernel.*4096 bytes of static \+ 46080 bytes of dynamic.*"
                                           r"set_max_dynamic_smem"):
        harness.launch_rule_case("bank", 45 * 1024, 0, x, y, a)
    harness.launch_rule_case("bank", 45 * 1024, 45 * 1024, x, y, a)   # with the attribute
    with pytest.raises(RuntimeError, match="more dynamic shared memory than the 46080 bytes"):
        harness.launch_rule_case("bank", 46 * 1024, 45 * 1024, x, y, a)


@pytest.mark.parametrize("arch,kb,ok", [(90, 223, True), (90, 224, False), (80, 159, True), (80, 160, False)])
def test_per_block_shared_memory_maximum(harness, arch, kb, ok):
    """227 KB per block on sm_90, 163 KB on sm_80, static (4 KB here) + dynamic."""
    x, y, a = torch.arange(64.0), torch.zeros(64), torch.zeros(1)
    old = simt.configure(arch=arch)
    try:
        if ok:
            harness.launch_rule_case("bank", kb * 1024, kb * 1024, x, y, a)
        else:
            with pytest.raises(RuntimeError, match=rf"bytes a block may have on sm_{arch}"):
                harness.launch_rule_case("bank", kb * 1024, kb * 1024, x, y, a)
    finally:
        simt.configure(**old)


def test_shared_memory_arenas_outlive_an_arch_change(harness):
    """Block arenas are pooled across launches: one first made while arch=80 is set (163 KB a block) must serve a
    later sm_90 launch of 223 KB (a test order once made exactly that, and the block's poison fill overran it). A
    fresh process (an empty pool) makes that order; under the sanitizers' build (CI's ASan leg) an arena sized by
    the setting in force would be a heap overflow there, and it crashed the plain build too."""
    code = textwrap.dedent("""
        import torch
        from dspark_kernels import simt
        m = simt.module()
        x, y, a = torch.arange(64.0), torch.zeros(64), torch.zeros(1)
        simt.configure(arch=80)
        m.launch_rule_case("bank", 159 * 1024, 159 * 1024, x, y, a)
        simt.configure(arch=90)
        for _ in range(4):
            m.launch_rule_case("bank", 223 * 1024, 223 * 1024, x, y, a)
        print("arenas ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("arenas ok"), (res.returncode, res.stderr[-3000:])


# the selftest kernels' linker symbols: dspark::selftest::strided_kernel(const float*, float*, int, int) and
# dspark::selftest::grid_barrier_kernel(float*, float*)
STRIDED = "_ZN6dspark8selftest14strided_kernelEPKfPfii"
GRID_BARRIER = "_ZN6dspark8selftest19grid_barrier_kernelEPfS1_"


def test_launches_carry_their_kernel_symbol(harness):
    """The harness finds each kernel function's mangled name (what the SASS report keys on); with no register table
    a launch's registers are unknown."""
    x, y, a = torch.arange(64.0), torch.zeros(64), torch.zeros(1)
    with simt.record() as rec:
        harness.selftest("strided", x, y, a, 1, 64, 0, 1.0)
    (launch,) = rec.launches
    assert launch["kernel"] == "strided_kernel" and launch["symbol"] == STRIDED
    assert launch["registers"] is None and launch["ctas_per_sm"] == 32  # 64 threads: the 32-block limit


def test_registers_times_threads(harness):
    x, y, a = torch.arange(1024.0), torch.zeros(1024), torch.zeros(1)
    old = simt.configure(registers=[(STRIDED, 64)])   # 64 x 1024 = 65536: exactly a block's registers
    try:
        assert simt.settings()["registers"] == [(STRIDED, 64)]
        with simt.record() as rec:
            harness.selftest("strided", x, y, a, 1, 1024, 0, 1.0)
        assert rec.launches[0]["registers"] == 64 and rec.launches[0]["ctas_per_sm"] == 1
        simt.configure(registers=[(STRIDED, 65)])        # rounds up to 72 per thread
        with pytest.raises(RuntimeError, match=r"strided_kernel.*1024 threads of 65 registers need 73728"):
            harness.selftest("strided", x, y, a, 1, 1024, 0, 1.0)
        simt.configure(registers=[("strided_kernel", 65)])  # a launch name is not a symbol: no limit
        harness.selftest("strided", x, y, a, 1, 1024, 0, 1.0)
    finally:
        simt.configure(**old)
    assert simt.settings()["registers"] == old["registers"]


def test_registers_limit_the_cooperative_grid(harness):
    """64-thread blocks of 128 registers: 8192 registers a block, so 8 per SM (not the 32 the block limit allows)
    and 4 SMs hold 32 of them."""
    old = simt.configure(registers=[(GRID_BARRIER, 128)], sm_count=4)
    try:
        y = torch.zeros(33 * 64)
        harness.selftest("grid_barrier", torch.zeros(1), y, torch.zeros(32), 32, 64, 0)
        with pytest.raises(RuntimeError, match=r"cooperative grid of 33 blocks cannot be resident on 4 SMs \(8 per"):
            harness.selftest("grid_barrier", torch.zeros(1), y, torch.zeros(33), 33, 64, 0)
    finally:
        simt.configure(**old)


def test_registers_from_the_sass_report(harness, tmp_path):
    """load_registers takes the report's sm_90a entries that have registers; a missing report is an error naming
    it."""
    report = {"kernels": [dict(arch="sm_90a", kernel=STRIDED, registers=64),
                          dict(arch="sm_80", kernel=STRIDED, registers=72),
                          dict(arch="sm_90a", kernel="_ZN6dspark5draft12phase_matvecILi1EEEvv", registers=None)]}
    assert simt.registers_from_report(report) == [(STRIDED, 64)]
    assert simt.registers_from_report(report, "sm_80") == [(STRIDED, 72)]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    old = simt.settings()
    try:
        assert simt.load_registers(str(path)) == [(STRIDED, 64)]
        assert simt.settings()["registers"] == [(STRIDED, 64)]
        with pytest.raises(RuntimeError, match=r"cannot read the SASS report .*absent\.json"):
            simt.load_registers(str(tmp_path / "absent.json"))
    finally:
        simt.configure(registers=old["registers"])


def test_cooperative_grid_limit(harness):
    """64-thread blocks: 32 resident per SM (the block limit), so 132 SMs hold 4224."""
    buf, y = torch.zeros(4225), torch.zeros(4225 * 64)
    with pytest.raises(RuntimeError, match=r"cooperative grid of 4225 blocks cannot be resident on 132 SMs \(32 per"):
        harness.selftest("grid_barrier", torch.zeros(1), y, buf, 4225, 64, 0)


@pytest.mark.sass
def test_every_launched_kernel_has_its_gpu_registers(harness):
    """Each kernel the ops launch through the harness carries the symbol of a kernel in the SASS report, so the
    report's register table holds every harness launch to its GPU build's registers (no launch goes unlimited)."""
    from sass_facts import report, report_path
    from test_draft_block import make_triton_case
    table = dict(simt.registers_from_report(report()))
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 4, 300, generator=g).to(torch.bfloat16)
    draft_logits = torch.randn(2, 3, 300, generator=g)
    drafts = torch.randint(0, 300, (2, 3), generator=g)
    with simt.record() as rec:
        dk.verify_chain(target, drafts, backend="cuda")
        dk.verify_chain(target, drafts, draft_logits=draft_logits, temperature=1.0, method="block", backend="cuda")
        dk.verify_chain(target, drafts, draft_logits=draft_logits, temperature=torch.tensor([1.0, 0.0]),
                        backend="cuda")
        for n in (3, 2000):
            dk.accept_prefix_scan(torch.randint(0, 9, (n, 4), generator=g), torch.randint(1, 9, (n,), generator=g),
                                  num_accepted=torch.randint(0, 4, (n,), generator=g), backend="cuda")
        dk.schedule_verify_lens(torch.rand(3, 4, generator=g).sort(-1, descending=True).values,
                                cost_table=dk.CostTable([1, 8], [10.0, 11.0]), mode="argmax", backend="cuda")
        for kind, dtype in (("vanilla", torch.bfloat16), ("rnn", torch.float32)):
            base, anchors, head, hidden, conf, temp = make_triton_case(kind, 2, 3, 300, 16, 8, dtype, "mixed",
                                                                       "sts", seed=1)
            dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, temperature=temp, seed=1,
                           backend="cuda")
        dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, temperature=temp, top_k=8,
                       backend="cuda")  # the top-k proposal kernel
    launched = {(r["kernel"], r["symbol"]) for r in rec.launches}
    assert len({k for k, _ in launched}) >= 9, sorted(launched)
    missing = sorted((k, s) for k, s in launched if s not in table)
    assert not missing, f"launches whose kernel is not in the SASS report's sm_90a table: {missing}"
    if os.environ.get("DSPARK_SIMT_REGISTERS") == report_path():  # conftest.py loads the report's table
        assert all(r["registers"] == table[r["symbol"]] for r in rec.launches)
