"""Engines for the end-to-end tests: the demo target in fp32, prompts from the demo's held-out set."""

import gc
import json
import os

from dspark_kernels.demo.demo import ASSETS

TARGET = os.path.join(ASSETS, "target")
with open(os.path.join(ASSETS, "prompts.json")) as fh:
    PROMPTS = json.load(fh)["prompts"][:6]
N_NEW = 128


def make_llm(**kw):
    from vllm import LLM
    return LLM(model=TARGET, dtype="float32", max_model_len=256, max_num_seqs=64, enforce_eager=True, seed=0,
               disable_log_stats=False, **kw)


def generate(llm, prompts, n_new, **params):
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n_new, ignore_eos=True, **params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy(llm, prompts, n_new):
    return generate(llm, prompts, n_new, temperature=0.0)


def release(llm):
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    del llm
    gc.collect()
