"""GPU ONLY, NEVER RUN INSIDE vLLM HERE: Model Runner v2's DSpark drafting and verification routed through
dspark_kernels.

Written against vLLM 0.32's signatures (``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.rejection_sample``,
``vllm/v1/worker/gpu/spec_decode/dspark/speculator.DSparkSpeculator._sample_sequential``); Model Runner v2 needs a
CUDA GPU, so this file has not run inside vLLM in this repository's CI (the CPU leg tests Model Runner v1); its two
functions are tested on the inputs MRv2 hands over, without vLLM (``python_tests/test_vllm_mrv2.py``). The plugin
installs it on CUDA platforms only, when ``DSPARK_VLLM=1``.

* Verification: MRv2 already hands over the packed layout dk uses (target rows ``[anchor, d_1..d_L]`` per request,
  exclusive ``cu_num_logits``, the draft scored by row i is ``draft_sampled[i + 1]``, draft logits per request
  state). Its target logits arrive divided by each request's temperature (``Sampler.apply_sampling_params``), its
  draft logits before it: the draft rows are divided here and dk verifies at temperature 1 (0 for greedy requests).
  One ``dk.verify_chain`` call replaces the Triton kernels; the emitted token after the accepted drafts is dk's
  (correction or bonus). MRv2 seeds every request; dk keys the whole batch with one (seed, offset), here the
  requests' seeds mixed with their positions, so a seeded request's samples are lossless but depend on its batch
  neighbours. Synthetic acceptance and watermarking stay with vLLM's own kernels.
* Drafting: the sequential Markov stage of greedy DSpark drafting (full-vocabulary drafts, no top-k candidates) is
  one ``dk.draft_block`` launch over the backbone's logits, with the confidence head; sampled drafting (which fills
  vLLM's draft-logits cache), adaptive verification's acceptance estimator (fed at each step of vLLM's loop), and
  a logits processor that scales or soft-caps the Markov bias stay with vLLM's own loop.
"""

from __future__ import annotations

import importlib

import torch

import dspark_kernels as dk

_MIX = 0x9E3779B97F4A7C15 - 2 ** 64  # odd 64-bit constant (as int64)


def install() -> list:
    """Patch MRv2's verification and DSpark Markov sampling; returns what was replaced."""
    targets = (("vllm.v1.worker.gpu.spec_decode.rejection_sampler", None, "rejection_sample", rejection_sample),
               ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "_sample_sequential",
                _sample_sequential))
    done = []
    for module_name, owner_name, attr, replacement in targets:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(owner, owner_name) if owner_name else owner
        _original[attr] = getattr(owner, attr)
        setattr(owner, attr, replacement)
        done.append(f"mrv2 {owner_name or module_name}.{attr}")
    return done


_original: dict = {}


def rejection_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                     expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                     synthetic_conditional_rates=None, use_fp64=False, use_block_verification=False, contexts=None,
                     watermarking=None, watermarking_skip_mask=None, watermark_key=None):
    """MRv2's ``rejection_sample`` on ``dk.verify_chain``: returns (sampled int64 [R, S + 1], num_sampled int32 [R])."""
    num_logits, vocab = target_logits.shape
    if (synthetic_conditional_rates is not None or contexts is not None
            or (draft_logits is not None and draft_logits.shape[-1] != vocab)):
        return _original["rejection_sample"](
            target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
            expanded_local_pos, temperature, seed, num_speculative_steps, synthetic_conditional_rates, use_fp64,
            use_block_verification, contexts, watermarking, watermarking_skip_mask, watermark_key)
    steps = max(int(num_speculative_steps), 1)  # a draft column even without drafts; cut from the output below
    cu = cu_num_logits.to(torch.int64)
    j = torch.arange(steps, device=cu.device)
    rows = (cu[:-1].unsqueeze(1) + 1 + j).clamp(max=num_logits - 1)
    valid = j < (cu[1:] - cu[:-1] - 1).unsqueeze(1)
    drafts = torch.where(valid, draft_sampled.to(torch.int64)[rows], -1)
    req_state = idx_mapping.to(torch.int64)
    key = (seed.to(torch.int64)[req_state] * _MIX + pos.to(torch.int64)[cu[:-1]]).sum().reshape(1)
    temps = temperature.float()[req_state]
    sampled = temps > 0
    out = dk.verify_chain(target_logits, drafts, cu_seqlens=cu_num_logits,
                          draft_logits=_scaled_draft_logits(draft_logits, req_state, steps, temps, sampled),
                          temperature=sampled.float(), seed=key,
                          method="block" if use_block_verification else "token")
    return out.tokens[:, :int(num_speculative_steps) + 1], out.num_accepted + 1


def _scaled_draft_logits(draft_logits, req_state, steps, temps, sampled):
    """float32 ``[R, S, V]``: MRv2's draft logits (stored before temperature) divided by each sampled request's
    temperature, so both sides are verified at temperature 1 (MRv2's target logits arrive already divided)."""
    if draft_logits is None:
        return None
    rows = draft_logits[req_state, :steps].float()  # a copy (indexed by a tensor): divided in place
    return rows.div_(torch.where(sampled, temps, 1.0).view(-1, 1, 1))


def _sample_sequential(self, num_reqs: int, head_hidden: torch.Tensor) -> None:
    """DSparkSpeculator's sequential Markov stage as one ``dk.draft_block`` (greedy, full-vocabulary drafts)."""
    model = self.model
    if (self._draft_topk is not None or self.draft_logits is not None
            or getattr(self, "acceptance_estimator", None) is not None
            or getattr(model, "draft_id_to_target_id", None) is not None or model.logits_processor.scale != 1.0
            or getattr(model.logits_processor, "soft_cap", None) is not None):
        return _original["_sample_sequential"](self, num_reqs, head_hidden)
    n_spec = self.num_speculative_steps
    sample_hidden = head_hidden[self.sample_indices[:num_reqs * n_spec]]
    base = model.compute_draft_logits(sample_hidden).view(num_reqs, n_spec, -1)
    anchor = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]]
    markov = model.model.markov_head
    head = dk.MarkovHead("vanilla", markov.markov_w1.weight, markov.markov_w2.weight)
    conf = None
    if self.use_confidence_head:
        c = model.model.confidence_head
        w = c.proj.weight.reshape(-1)
        rank = markov.markov_w1.weight.shape[1]
        if not c.with_markov:
            w = torch.cat([w, w.new_zeros(rank)])
        conf = dk.ConfidenceHead(w, c.proj.bias if c.proj.bias is not None else 0.0)
    d = dk.draft_block(base, anchor, head, hidden=sample_hidden.view(num_reqs, n_spec, -1), confidence=conf,
                       temperature=0.0)
    self.draft_tokens[:num_reqs, :n_spec] = d.tokens
    if self.use_confidence_head:
        self.draft_token_confidence_probs[:num_reqs] = torch.sigmoid(d.conf_logits)
