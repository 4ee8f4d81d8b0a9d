"""The shared generator: known answers, stored vectors on every backend, distribution, arguments, registration."""

import importlib
import json
import os

import pytest
import torch

import triton
import triton.language as tl

import dspark_kernels as dk
from dspark_kernels import rng
from dspark_kernels.triton import rng as trng
from stats import passes

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "rng_vectors.json")))["vectors"]

# Random123 known-answer vectors of philox4x32-10: (counter, key, output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _signed(x: int) -> int:
    return x - 2 ** 64 if x >= 2 ** 63 else x


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------ known answers
@pytest.mark.parametrize("ctr,key,want", KNOWN_ANSWERS)
def test_philox_known_answers_torch(ctr, key, want):
    got = rng.philox4x32(*(torch.tensor(c) for c in ctr), *(torch.tensor(k) for k in key))
    assert [int(w) for w in got] == list(want)


@triton.jit
def _kat_kernel(ctr_ptr, key_ptr, out_ptr):
    i = tl.arange(0, 4)
    c = tl.load(ctr_ptr + i).to(tl.uint32)
    j = tl.arange(0, 2)
    k = tl.load(key_ptr + j).to(tl.uint32)
    one = tl.zeros([1], tl.uint32)
    c0 = tl.sum(tl.where(i == 0, c, 0)) + one
    c1 = tl.sum(tl.where(i == 1, c, 0)) + one
    c2 = tl.sum(tl.where(i == 2, c, 0)) + one
    c3 = tl.sum(tl.where(i == 3, c, 0)) + one
    k0 = tl.sum(tl.where(j == 0, k, 0)) + one
    k1 = tl.sum(tl.where(j == 1, k, 0)) + one
    w0, w1, w2, w3 = trng.philox4x32_10(c0, c1, c2, c3, k0, k1)
    o = tl.arange(0, 1)
    tl.store(out_ptr + o, w0.to(tl.int64))
    tl.store(out_ptr + 1 + o, w1.to(tl.int64))
    tl.store(out_ptr + 2 + o, w2.to(tl.int64))
    tl.store(out_ptr + 3 + o, w3.to(tl.int64))


@pytest.mark.parametrize("ctr,key,want", KNOWN_ANSWERS)
def test_philox_known_answers_triton(ctr, key, want, triton_device):
    dev = triton_device
    out = torch.zeros(4, dtype=torch.int64, device=dev)
    _kat_kernel[(1,)](torch.tensor(ctr, device=dev), torch.tensor(key, device=dev), out)
    assert out.tolist() == list(want)


# ------------------------------------------------------------------------------------------ stored vectors
def _vector_tensors(device="cpu"):
    cols = {f: torch.tensor([_signed(v[f]) for v in VECTORS], dtype=torch.int64, device=device)
            for f in ("seed", "offset", "request", "position", "stream", "token")}
    bits = torch.tensor([v["bits"] for v in VECTORS], dtype=torch.int64)
    uniform = torch.tensor([float.fromhex(v["uniform"]) for v in VECTORS], dtype=torch.float32)
    return cols, bits, uniform


def test_vectors_reference():
    for v in VECTORS:
        key = rng.make_rng_key(v["seed"], v["offset"], "cpu")
        cell = (v["request"], v["position"], v["stream"], v["token"])
        assert int(rng.random_bits(key, *cell)) == v["bits"], v
        u = rng.uniform(key, *cell)
        assert u.dtype == torch.float32 and float(u) == float.fromhex(v["uniform"]), v


@triton.jit
def _cells_kernel(seed_ptr, offset_ptr, req_ptr, pos_ptr, stream_ptr, tok_ptr, bits_ptr, u_ptr, n,
          BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    seed = tl.load(seed_ptr + i, mask=m, other=0)
    offset = tl.load(offset_ptr + i, mask=m, other=0)
    k0, k1, offset_lo = trng.make_key(seed, offset)
    bits = trng.random_bits(k0, k1, offset_lo, tl.load(req_ptr + i, mask=m, other=0),
                            tl.load(pos_ptr + i, mask=m, other=0), tl.load(stream_ptr + i, mask=m, other=0),
                            tl.load(tok_ptr + i, mask=m, other=0))
    tl.store(bits_ptr + i, bits.to(tl.int64), mask=m)
    tl.store(u_ptr + i, trng.bits_to_uniform(bits), mask=m)



def test_vectors_triton(triton_device):
    dev = triton_device
    cols, bits, uniform = _vector_tensors(dev)
    n = len(VECTORS)
    got_bits = torch.zeros(n, dtype=torch.int64, device=dev)
    got_u = torch.zeros(n, dtype=torch.float32, device=dev)
    _cells_kernel[(1,)](cols["seed"], cols["offset"], cols["request"], cols["position"], cols["stream"], cols["token"],
                got_bits, got_u, n, BLOCK=triton.next_power_of_2(n))
    assert got_bits.cpu().tolist() == bits.tolist()
    assert torch.equal(_bits_of(got_u.cpu()), _bits_of(uniform))


@pytest.mark.parametrize("backend", ["cuda", "triton"], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vectors_gpu_rng_uniform(backend):
    """Every stored vector whose cell fits a modest [request+1, position+1, token+1] grid, through the op."""
    checked = 0
    for v in VECTORS:
        shape = (v["request"] + 1, v["position"] + 1, v["token"] + 1)
        if shape[0] * shape[1] * shape[2] > 2 ** 26:
            continue
        out = dk.rng_uniform(shape, v["seed"], v["offset"], v["stream"], device="cuda", backend=backend)
        got = out[v["request"], v["position"], v["token"]].item()
        assert got == float.fromhex(v["uniform"]), v
        checked += 1
    assert checked >= 10


# ------------------------------------------------------------------------------------------ backends agree
SHAPES = [(1, 1, 1), (3, 5, 17), (1, 7, 1000), (2, 16, 4), (5, 1, 3), (1, 2, 4099)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seed,offset,stream", [(0, 0, 0), (1, 1, 1), (1234, 99, rng.STREAM_USER),
                                                (2 ** 64 - 1, 2 ** 63 + 5, 255)])
def test_triton_equals_reference(shape, seed, offset, stream, triton_device):
    dev = triton_device
    ref = dk.rng_uniform(shape, seed, offset, stream, device=dev, backend="reference")
    tri = dk.rng_uniform(shape, seed, offset, stream, device=dev, backend="triton")
    assert torch.equal(_bits_of(ref), _bits_of(tri))


def test_triton_equals_reference_large_vocab(triton_device):
    dev = triton_device
    ref = dk.rng_uniform((1, 1, 32003), 77, 2 ** 35, 2, device=dev, backend="reference")
    tri = dk.rng_uniform((1, 1, 32003), 77, 2 ** 35, 2, device=dev, backend="triton")
    assert torch.equal(_bits_of(ref), _bits_of(tri))


def test_triton_rows_beyond_the_grid_loop(triton_device, monkeypatch):
    """More rows (N K) than a grid's first dimension holds: the programs loop over the rest."""
    monkeypatch.setattr(importlib.import_module("dspark_kernels.triton.rng_uniform"), "_MAX_ROW_PROGRAMS", 4)
    ref = dk.rng_uniform((3, 3, 9), 5, 6, 1, device=triton_device, backend="reference")
    tri = dk.rng_uniform((3, 3, 9), 5, 6, 1, device=triton_device, backend="triton")
    assert torch.equal(_bits_of(ref), _bits_of(tri))


@pytest.mark.parametrize("shape", SHAPES + [(3, 2, 5), (1, 1, 32003)], ids=str)
@pytest.mark.parametrize("seed,offset,stream", [(0, 0, 0), (1234, 99, rng.STREAM_USER),
                                                (2 ** 64 - 1, 2 ** 63 + 5, 255)])
def test_cpu_equals_reference(shape, seed, offset, stream):
    ref = dk.rng_uniform(shape, seed, offset, stream, backend="reference")
    cpu = dk.rng_uniform(shape, seed, offset, stream, backend="cpu")
    assert torch.equal(_bits_of(ref), _bits_of(cpu))


def test_vectors_cpu_rng_uniform():
    """Every stored vector whose cell fits a modest grid, through the CPU kernel."""
    checked = 0
    for v in VECTORS:
        shape = (v["request"] + 1, v["position"] + 1, v["token"] + 1)
        if shape[0] * shape[1] * shape[2] > 2 ** 22:
            continue
        out = dk.rng_uniform(shape, v["seed"], v["offset"], v["stream"], backend="cpu")
        assert out[v["request"], v["position"], v["token"]].item() == float.fromhex(v["uniform"]), v
        checked += 1
    assert checked >= 10


def test_opcheck_cpu_op():
    out = torch.empty(2, 3, 33)
    key = rng.make_rng_key(3, 4, "cpu")
    torch.library.opcheck(torch.ops.dspark.rng_uniform_.default, (out, key, 2, "cpu"))


@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 32003), (64, 1, 3), (4, 9, 151936), (3, 2, 5)], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_equals_reference_and_triton(shape):
    for seed, offset, stream in [(0, 0, 0), (7, 2 ** 40 + 3, 1), (2 ** 64 - 1, 2 ** 64 - 1, 255)]:
        ref = dk.rng_uniform(shape, seed, offset, stream, device="cuda", backend="reference")
        tri = dk.rng_uniform(shape, seed, offset, stream, device="cuda", backend="triton")
        cu = torch.full(shape, float("nan"), device="cuda")  # poisoned: every element must be written
        dk.rng_uniform(cu, seed, offset, stream, backend="cuda")
        assert torch.equal(_bits_of(ref), _bits_of(cu)) and torch.equal(_bits_of(ref), _bits_of(tri))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_unaligned_out_and_graph_replay():
    # an out that is not 16-byte aligned takes the scalar-store path
    buf = torch.empty(1 + 2 * 3 * 64, device="cuda")
    out = buf[1:].view(2, 3, 64)
    dk.rng_uniform(out, 5, 6, 0, backend="cuda")
    assert torch.equal(_bits_of(out), _bits_of(dk.rng_uniform((2, 3, 64), 5, 6, 0, device="cuda",
                                                              backend="reference")))
    # a captured graph reads the key at replay time
    out = torch.empty(2, 3, 100, device="cuda")
    key = torch.tensor([11, 0], dtype=torch.int64, device="cuda")  # a device key: the graph reads it at replay
    from dspark_kernels import _ext

    ops = _ext.load()
    ops.rng_uniform_(out, key, 3)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.rng_uniform_(out, key, 3)
    for offset in (1, 2 ** 33 + 1):
        key[1].fill_(offset if offset < 2 ** 63 else offset - 2 ** 64)
        g.replay()
        ref = dk.rng_uniform((2, 3, 100), 11, offset, 3, device="cuda", backend="reference")
        assert torch.equal(_bits_of(out), _bits_of(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_cuda_op():
    from dspark_kernels import _ext

    _ext.load()
    out = torch.empty(2, 3, 33, device="cuda")
    for key in (rng.make_rng_key(3, 4, "cuda"), torch.tensor([3, 4], device="cuda")):  # by value, on the device
        torch.library.opcheck(torch.ops.dspark_C.rng_uniform_.default, (out, key, 2))
        torch.library.opcheck(torch.ops.dspark.rng_uniform_.default, (out, key, 2, "cuda"))


@pytest.mark.parametrize("shape,slack", [((2, 3, 4096), 1.05), ((1, 2, 1001), 1.25)], ids=str)
def test_cuda_access_is_ideal_and_bytes_are_the_output(cuda_device, shape, slack):
    """The harness's access rule (python_tests/access.py): 16-byte stores where V % 4 == 0; at an odd V the warp's
    four scalar stores each cover 32 consecutive elements (4 strided stores a thread would touch 4x the sectors).
    An odd V starts rows off a 32-byte boundary, so a 128-byte store may touch one sector more than its 4: that
    path is held to 1.25x. Every element is written once; the key (16 bytes, read by every thread) is the only
    read."""
    if cuda_device.type != "cpu":
        pytest.skip("the harness's counters (on a GPU the sanitizer cases check the accesses)")
    from access import ideal_access
    out, rec = ideal_access(lambda: dk.rng_uniform(shape, 3, 4, backend="cuda"), sector_slack=slack)
    assert rec.bytes_written == out.numel() * 4 and rec.unique_bytes == out.numel() * 4 + 16


# ------------------------------------------------------------------------------------------ distribution
def test_uniform_range_moments_and_chi_square():
    u = dk.rng_uniform((4, 8, 4096), seed=2024, offset=1, backend="reference").flatten().double()
    assert (u > 0).all() and (u < 1).all()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5  # sd of the sample variance ~ sqrt(1/180n)
    bins = 256
    observed = torch.bincount((u * bins).long().clamp_(max=bins - 1), minlength=bins).double()
    assert passes(observed, torch.full((bins,), n / bins, dtype=torch.float64))
    # the four words of a counter block and neighbouring positions/requests look independent: pairs
    v = dk.rng_uniform((4, 8, 4096), seed=2024, offset=1, backend="reference")
    for a, b in ((v[:, :, 0::4], v[:, :, 1::4]), (v[:, 0], v[:, 1]), (v[0], v[1])):
        a, b = (a.flatten() * 16).long(), (b.flatten() * 16).long()
        pairs = torch.bincount(a * 16 + b, minlength=256).double()
        assert passes(pairs, torch.full((256,), a.numel() / 256, dtype=torch.float64))


def test_extremes_never_zero_or_one():
    bits = torch.tensor([0, 255, 256, 0xFFFFFFFF, 0xFFFFFF00], dtype=torch.int64)
    u = ((bits >> 8) | 1).to(torch.float32) * 2.0 ** -24
    assert (u > 0).all() and (u < 1).all()
    assert u[0].item() == 2.0 ** -24 and u[3].item() == 1 - 2.0 ** -24


# ------------------------------------------------------------------------------------------ arguments
def test_seed_offset_int_or_tensor():
    shape = (2, 3, 9)
    for seed, offset in [(5, 6), (2 ** 64 - 1, 2 ** 63), (2 ** 33 + 1, 2 ** 40 + 7)]:
        a = dk.rng_uniform(shape, seed, offset, backend="reference")
        b = dk.rng_uniform(shape, torch.tensor([_signed(seed)]), torch.tensor(_signed(offset)), backend="reference")
        assert torch.equal(_bits_of(a), _bits_of(b))
    a = dk.rng_uniform(shape, 5, 6, backend="reference")
    c = dk.rng_uniform(shape, torch.tensor(5, dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                       backend="reference")
    assert torch.equal(_bits_of(a), _bits_of(c))
    # the same key gives the same values; another offset, seed or stream gives others
    assert torch.equal(_bits_of(a), _bits_of(dk.rng_uniform(shape, 5, 6, backend="reference")))
    for other in ((5, 7, 0), (6, 6, 0), (5, 6, 1)):
        assert not torch.equal(a, dk.rng_uniform(shape, *other, backend="reference"))


def test_key_of_two_ints_is_a_cpu_tensor_and_a_tensor_key_stays_on_its_device():
    """Two ints build the key on the CPU (the kernels take it by value: no launch builds it); a tensor seed or
    offset gives a key on the op's device (read there, so a CUDA-graph replay sees an offset bumped in place)."""
    key = rng.make_rng_key(2 ** 64 - 1, 7, "meta")
    assert key.device.type == "cpu" and key.tolist() == [-1, 7]
    key = rng.make_rng_key(3, torch.tensor([9], device="meta"), "meta")
    assert key.device.type == "meta" and key.shape == (2,)


def _cpu_and_device_keys_draw_the_same(dev, backend):
    for seed, offset in [(5, 2 ** 40 + 1), (2 ** 64 - 1, 2 ** 63)]:
        want = dk.rng_uniform((2, 3, 37), seed, offset, 4, backend="reference")
        for s, o in ((seed, offset), (torch.tensor([_signed(seed)], device=dev), _signed(offset))):
            got = dk.rng_uniform((2, 3, 37), s, o, 4, device=dev, backend=backend)
            assert torch.equal(_bits_of(got.cpu()), _bits_of(want)), (seed, offset, type(s))


def test_cuda_takes_a_cpu_key_by_value_and_reads_a_device_key(cuda_device):
    """On a GPU the first key is passed by value and the second read on the device (under the SIMT harness both
    are CPU tensors): both give the reference's draws."""
    _cpu_and_device_keys_draw_the_same(cuda_device, "cuda")


def test_cuda_launcher_rejects_requests_beyond_the_counter(cuda_device):
    """The request is a 32-bit counter word: an out of more than 2^32 requests (here an empty one, K = 0) is
    rejected by the launcher, naming them, rather than drawing wrapped requests."""
    if cuda_device.type != "cpu":
        pytest.skip("checked through the SIMT library here")
    key = rng.make_rng_key(1, 2, "cpu")
    with pytest.raises(RuntimeError, match="requests"):
        torch.ops.dspark_simt.rng_uniform_(torch.empty(2 ** 32 + 1, 0, 1), key, 0)
    torch.ops.dspark_simt.rng_uniform_(torch.empty(2 ** 32, 0, 1), key, 0)  # the largest count: nothing to draw


def test_triton_takes_a_cpu_key_by_value_and_reads_a_device_key(triton_device):
    _cpu_and_device_keys_draw_the_same(triton_device, "triton")


def test_out_is_filled_in_place():
    out = torch.full((2, 2, 5), -1.0)
    ret = dk.rng_uniform(out, 1, 2, backend="reference")
    assert ret is out and (out > 0).all()


@pytest.mark.parametrize("call,match", [
    (lambda: dk.rng_uniform(torch.zeros(2, 3, 4, dtype=torch.float64)), "out"),
    (lambda: dk.rng_uniform(torch.zeros(2, 3)), "out"),
    (lambda: dk.rng_uniform(torch.zeros(4, 3, 2).transpose(0, 2)), "out"),
    (lambda: dk.rng_uniform((2, 3)), "shape_or_out"),
    (lambda: dk.rng_uniform((2, -1, 3)), "shape_or_out"),
    (lambda: dk.rng_uniform((1, 1, 1), stream=256), "stream"),
    (lambda: dk.rng_uniform((1, 1, 1), stream=-1), "stream"),
    (lambda: dk.rng_uniform((1, 1, 1), seed=1.5), "seed"),
    (lambda: dk.rng_uniform((1, 1, 1), offset=2 ** 64), "offset"),
    (lambda: dk.rng_uniform((1, 1, 1), seed=torch.tensor([1, 2])), "seed"),
    (lambda: dk.rng_uniform((1, 1, 1), offset=torch.tensor([1.0])), "offset"),
    (lambda: dk.rng_uniform((2 ** 32 + 1, 0, 1), backend="reference"), "requests"),
    (lambda: dk.rng_uniform((1, 0, 2 ** 34 + 1), backend="reference"), "tokens"),
    (lambda: dk.rng_uniform((1, 1, 1), backend="bogus"), "backend"),
    (lambda: dk.rng_uniform((1, 1, 1), backend="cuda"), "cuda"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_empty_shapes():
    for shape in [(0, 3, 4), (2, 0, 4), (2, 3, 0), (2 ** 32, 0, 1)]:  # the most requests: nothing to draw
        assert dk.rng_uniform(shape, backend="reference").shape == shape


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck_registered_op(backend, triton_device):
    dev = triton_device if backend == "triton" else "cpu"
    out = torch.empty(2, 3, 7, device=dev)
    key = rng.make_rng_key(3, 4, dev)
    torch.library.opcheck(torch.ops.dspark.rng_uniform_.default, (out, key, 2, backend))


@pytest.mark.slow
def test_ext_builds_and_registers_its_schema():
    """The extension builds (just in time, or prebuilt in a wheel) and loads without a GPU wherever a toolkit is
    found; its ops only run on one. Marked slow (a whole nvcc build, minutes): bench/gpu_check.sh runs it; CI loads
    its wheel's library instead (test_gpu_build.py, tools/check_wheel.py). Without a toolkit, is_available() is
    False and load() says why."""
    from dspark_kernels import _ext

    first = _ext.is_available()
    assert isinstance(first, bool) and _ext.is_available() is first
    if _ext.cuda_home() is None:
        assert not first
        with pytest.raises(RuntimeError, match="CUDA_HOME"):
            _ext.load()
        return
    assert first, "a CUDA toolkit is present, so the extension must build"
    schema = str(_ext.load().rng_uniform_.default._schema)
    assert schema == "dspark_C::rng_uniform_(Tensor(a!) out, Tensor rng_key, int stream) -> ()"
