"""vLLM's DSpark proposer against the package's own loop on the same prompts, lengths and states (greedy, fixed K).

Shared by ``test_engine_dspark.py`` and the by-hand ``compare_acceptance.py``.

How the two count. vLLM's spec-decode metrics count verification steps ("drafts", one per request and step that
sent drafts) and accepted drafts per position; its mean acceptance length is ``1 + accepted / drafts``. Its first
token comes from the prefill, so its first draft is made from the state ``prompt + [first token]``. The package's
``SpeculativeDecoder`` already verifies the first token (its prefill stops one token short, the last prompt token is
the first anchor) and reports tokens per request-step, the last, truncated step included. So the package's loop is
run here from vLLM's first drafting state (``prompt + [first token]``, one token fewer): greedy, both then walk the
same committed states, and with the same drafter both must accept the same drafts at every step; the counts are
comparable one for one. ``package_as_reported`` gives the loop's own figure on the plain prompts as well.
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import List, NamedTuple, Optional

import torch

from dspark_kernels.demo.demo import ASSETS

TARGET_DIR = os.path.join(ASSETS, "target")


class Acceptance(NamedTuple):
    drafts: int          # verification steps that sent drafts (request-steps)
    accepted: int        # accepted drafts
    per_position: list   # accepted drafts at positions 1..K

    @property
    def length(self) -> float:
        """Mean acceptance length as vLLM reports it: 1 + accepted / drafts."""
        return 1.0 + self.accepted / max(self.drafts, 1)

    def __sub__(self, other: "Acceptance") -> "Acceptance":
        return Acceptance(self.drafts - other.drafts, self.accepted - other.accepted,
                          [a - b for a, b in zip(self.per_position, other.per_position)])


def vllm_counters(llm, k: int) -> Acceptance:
    """vLLM's cumulative spec-decode counters (take the difference around a run)."""
    drafts = accepted = 0
    per_pos = [0] * k
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)]
    return Acceptance(int(drafts), int(accepted), per_pos)


@contextlib.contextmanager
def recorded_proposals():
    """Records every (committed tokens, drafts) pair the DSpark proposer returns while the block runs
    (``.proposals``), and the calls and seconds spent in ``propose`` (``.calls``, ``.seconds``); the engine core
    must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from dspark_kernels.integrations.vllm.proposer import DSparkProposer
    original, rec = DSparkProposer.propose, SimpleNamespace(proposals=[], calls=0, seconds=0.0)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        t0 = time.perf_counter()
        drafts = original(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs)
        rec.calls, rec.seconds = rec.calls + 1, rec.seconds + time.perf_counter() - t0
        for i, d in enumerate(drafts):
            if len(d):
                rec.proposals.append((token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist(), list(d)))
        return drafts

    DSparkProposer.propose = propose
    try:
        yield rec
    finally:
        DSparkProposer.propose = original


def _decoder(drafter_dir: str):
    from dspark_kernels.decode import SpeculativeDecoder, load_drafter, load_target
    target = load_target(TARGET_DIR, dtype=torch.float32)
    return SpeculativeDecoder(target, load_drafter(drafter_dir, target), backend="reference")


def _counts(log: dict, k: int, first_step: int = 0) -> Acceptance:
    lens = torch.stack(log["verify_lens"])[first_step:].long()
    acc = torch.stack(log["num_accepted"])[first_step:].long()
    active = torch.stack(log["active"])[first_step:]
    pos = torch.arange(k)
    verified = (pos < lens.unsqueeze(-1)) & active.unsqueeze(-1)
    accepted = verified & (pos < acc.unsqueeze(-1))
    return Acceptance(int(((lens > 0) & active).sum()), int(accepted.sum()), accepted.sum((0, 1)).tolist())


def package_from_vllm_state(drafter_dir: str, prompts, first_tokens, n_new: int, k: int):
    """The package's loop (greedy, fixed K) from vLLM's first drafting state: ``prompt + [first token]``,
    ``n_new - 1`` new tokens. Returns (its output with the first token put back, its counts)."""
    from dspark_kernels.decode import Scheduler
    log: dict = {}
    res = _decoder(drafter_dir).generate([list(p) + [int(t)] for p, t in zip(prompts, first_tokens)], n_new - 1,
                                         scheduler=Scheduler("fixed", verify_len=k), log=log)
    return [[int(t)] + row for t, row in zip(first_tokens, res.tokens)], _counts(log, k)


def package_as_reported(drafter_dir: str, prompts, n_new: int, k: int):
    """The package's loop on the plain prompts, as its demo reports it: (tokens per request-step with the bonus,
    the counts of all its steps, the counts without its first step, which vLLM's prefill replaces)."""
    from dspark_kernels.decode import Scheduler
    log: dict = {}
    res = _decoder(drafter_dir).generate(prompts, n_new, scheduler=Scheduler("fixed", verify_len=k), log=log)
    return res.stats.acceptance_length, _counts(log, k), _counts(log, k, first_step=1)


def package_drafts(drafter_dir: str, states: List[List[int]], k: int, batch: int = 64) -> List[List[int]]:
    """The first ``k`` drafts the package's loop makes from each committed state (its first step with the state
    as the prompt: the target's hidden rows of positions 0..S-2 as context, the last token as the anchor)."""
    import dspark_kernels as dk
    from dspark_kernels.decode import Scheduler
    dec, original, out = _decoder(drafter_dir), dk.draft_block, []
    for s in range(0, len(states), batch):
        got: List[Optional[torch.Tensor]] = []

        def draft_block(*args, **kwargs):
            d = original(*args, **kwargs)
            if not got:
                got.append(d.tokens[:, :k].clone())
            return d

        dk.draft_block = draft_block
        try:
            dec.generate(states[s:s + batch], 1, scheduler=Scheduler("fixed", verify_len=k))
        finally:
            dk.draft_block = original
        out.extend(got[0].tolist())
    return out


def same_state_agreement(drafter_dir: str, proposals, k: int):
    """(states where the package's drafts equal vLLM's proposal, states compared, first differing pair or None)."""
    states = [s for s, _ in proposals]
    mine = package_drafts(drafter_dir, states, k)
    equal, first = 0, None
    for (state, theirs), ours in zip(proposals, mine):
        if list(theirs) == ours[:len(theirs)]:
            equal += 1
        elif first is None:
            first = (state, list(theirs), ours)
    return equal, len(proposals), first
