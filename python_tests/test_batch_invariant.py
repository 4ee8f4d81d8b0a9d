"""The decode loop's batch-invariant CPU kernels: a row's result does not depend on the other rows, the padded
shapes or the thread count (bit for bit, on this machine), and equals PyTorch's float32 result within the rounding
of the 16-bit output; a bf16 target built on them decodes greedily to the same tokens speculatively and alone."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from dspark_kernels import _ext
from dspark_kernels.decode import SpeculativeDecoder, TargetModel, greedy_reference
from dspark_kernels.decode import batch_invariant as bi
from dspark_kernels.decode.kv_cache import PagedKVCache, ragged_attention, ragged_batch, sdpa_gqa
from dspark_kernels.decode.model import ModelConfig
from dspark_kernels.decode.testing import tiny_drafter, tiny_hf_config

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _kernels():
    """Built on first use, when a test runs (never while tests are collected: a run that selects none of these
    compiles nothing)."""
    if not bi.available():
        why = _ext.cpu_error()
        if shutil.which(os.environ.get("CXX", "c++")) and os.environ.get("DSPARK_NO_JIT") != "1":
            pytest.fail(f"a C++ compiler is here, yet the CPU kernels did not build: {why}")
        pytest.skip(f"the batch-invariant kernels need a C++ compiler: {why}")


def _bf16_bound(ref: torch.Tensor, dtype) -> torch.Tensor:
    """Half a unit in the last place of the output dtype, plus float32 accumulation slack."""
    eps = torch.finfo(dtype).eps
    return ref.abs() * eps + 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(17, 13), (40, 70), (576, 1536), (300, 32)])
def test_row_linear_is_batch_invariant_and_close(dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(37, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    full = bi.row_linear(x, w, b)
    assert full.dtype == dtype and full.shape == (37, n)
    for m in (1, 2, 5, 8, 9, 16, 33):
        for r in (0, m // 2, m - 1):
            assert torch.equal(bi.row_linear(x[r:r + m], w, b)[0], full[r]), (m, r)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bi.row_linear(x, w, b), full)
    finally:
        torch.set_num_threads(threads)
    ref = F.linear(x.float(), w.float(), b.float())
    assert ((full.float() - ref).abs() <= _bf16_bound(ref, dtype)).all()


def test_row_linear_shapes_and_errors():
    w = torch.randn(6, 4).bfloat16()
    assert bi.row_linear(torch.randn(2, 3, 4).bfloat16(), w).shape == (2, 3, 6)
    assert bi.row_linear(torch.randn(0, 4).bfloat16(), w).shape == (0, 6)
    with pytest.raises(RuntimeError, match=r"x must be \[..., K = 4\]"):
        bi.row_linear(torch.randn(2, 5).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bias must be"):
        bi.row_linear(torch.randn(2, 4).bfloat16(), w, torch.randn(5).bfloat16())
    torch.library.opcheck(torch.ops.dspark_decode.row_linear, (torch.randn(3, 4).bfloat16(), w, None))


def _cache(dtype, seed=0, n=3, length=40, kv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, kv, d, n, length, block_size=4, dtype=dtype, shuffle_seed=seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_attention_is_batch_invariant_and_matches_sdpa(dtype):
    cache = _cache(dtype)
    h, d = 6, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, h, d, generator=g).to(dtype)
    # requests 0, 1, 2 with 8, 5, 7 rows at ragged positions
    cu = torch.tensor([0, 8, 13, 20], dtype=torch.int32)
    starts = [10, 0, 25]
    pos = torch.cat([torch.arange(s, s + int(cu[i + 1] - cu[i])) for i, s in enumerate(starts)])
    b = ragged_batch(cache, pos, cu, 8, 36)
    req = b.req
    assert torch.equal(req, torch.div(b.pad_index, b.max_q, rounding_mode="floor"))
    out = bi.row_attention(q, cache.k[0], cache.v[0], b.kv_slots, req, b.pos, d ** -0.5)
    # each row alone, with a different padded key length: the same bits
    for t in (0, 7, 8, 12, 19):
        alone = ragged_batch(cache, pos[t:t + 1], torch.tensor([0, 1], dtype=torch.int32), 1, int(pos[t]) + 1)
        slots = alone.kv_slots if int(req[t]) == 0 else b.kv_slots[int(req[t]):int(req[t]) + 1, :int(pos[t]) + 1]
        got = bi.row_attention(q[t:t + 1], cache.k[0], cache.v[0], slots, torch.zeros(1, dtype=torch.long),
                               pos[t:t + 1], d ** -0.5)
        assert torch.equal(got[0], out[t]), t
    # PyTorch's attention in float32 on the same rows
    qp = q.float().new_zeros(3 * 8, h, d).index_copy_(0, b.pad_index, q.float()).view(3, 8, h, d).transpose(1, 2)
    k, v = cache.gather(0, b.kv_slots)
    ref = sdpa_gqa(qp, k.float(), v.float(), b.mask, d ** -0.5).transpose(1, 2).reshape(24, h * d)[b.pad_index]
    assert ((out.float() - ref).abs() <= _bf16_bound(ref, dtype) + 1e-5).all()


def test_ragged_attention_routes_16_bit_cpu_tensors():
    cache = _cache(torch.bfloat16)
    q = torch.randn(4, 6, 16).bfloat16()
    cu, pos = torch.tensor([0, 4], dtype=torch.int32), torch.arange(3, 7)
    b = ragged_batch(cache, pos, cu, 4, 7)
    req = torch.zeros(4, dtype=torch.long)
    assert torch.equal(ragged_attention(q, cache, 0, b, 0.25),
                       bi.row_attention(q, cache.k[0], cache.v[0], b.kv_slots, req, b.pos, 0.25))
    torch.library.opcheck(torch.ops.dspark_decode.row_attention,
                          (q, cache.k[0], cache.v[0], b.kv_slots, req, b.pos, 0.25))


def test_bf16_target_decodes_the_same_speculatively_and_alone():
    """A bf16 target whose logits tie often (a small vocabulary, flat weights): speculative greedy output equals the
    target's own greedy decoding, whatever the verify batch looks like."""
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", vocab=64, layers=3))
    target = TargetModel(cfg).init_random(seed=5, std=0.05).to(torch.bfloat16).eval()
    prompts = [[3, 7, 1, 9], [5], [2, 9, 4, 4, 11, 30, 8, 1, 6]]
    ref = greedy_reference(target, prompts, 24)
    drafter = tiny_drafter(target, block_size=5).to(torch.bfloat16)
    dec = SpeculativeDecoder(target, drafter, kv_block_size=4)
    assert dec.generate(prompts, 24).tokens == ref
