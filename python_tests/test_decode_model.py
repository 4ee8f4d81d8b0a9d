"""The target model against transformers (fp32, tight), ragged paged batches, the HF adapter, checkpoints."""

import pytest
import torch
import transformers

from dspark_kernels.decode.checkpoint import load_target, save_target
from dspark_kernels.decode.decoder import SpeculativeDecoder
from dspark_kernels.decode.hf_target import HFTarget
from dspark_kernels.decode.model import greedy_reference
from dspark_kernels.decode.testing import OracleDrafter, tiny_drafter_config, tiny_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")




def hf_twin(target):
    c = target.config
    qwen = c.qk_norm
    cfg_cls = transformers.Qwen3Config if qwen else transformers.LlamaConfig
    lm_cls = transformers.Qwen3ForCausalLM if qwen else transformers.LlamaForCausalLM
    cfg = cfg_cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  **({"rope_parameters": {**c.rope_scaling, "rope_theta": c.rope_theta}} if c.rope_scaling else {}))
    hf = lm_cls(cfg).eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in target.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    return hf


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@pytest.mark.parametrize("model_type,extra", [("qwen3", {}), ("llama", {}), ("qwen3", {"attention_bias": True}),
                                              ("llama", {"rope_scaling": LLAMA3_ROPE})])
def test_logits_match_transformers_ragged_paged(model_type, extra):
    target = tiny_target(seed=2, model_type=model_type, **extra)
    target.hidden_layer_ids = [-1, 1]
    hf = hf_twin(target)
    seqs = [torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 1, 9)]
    target.alloc_cache(3, 32, block_size=4, shuffle_seed=0)
    # prefill the first tokens of each sequence, then continue with ragged chunks at per-request positions
    split = [3, 0, 4]
    chunks = [(s[:c], torch.arange(c)) for s, c in zip(seqs, split)]
    rest = [(s[c:], torch.arange(c, len(s))) for s, c in zip(seqs, split)]
    outs = []
    for part in (chunks, rest):
        lens = [len(t) for t, _ in part]
        cu = torch.tensor([0] + lens).cumsum(0).int()
        out = target(torch.cat([t for t, _ in part]), torch.cat([p for _, p in part]), cu, max(lens), 9)
        outs.append((out, cu))
    with torch.no_grad():
        for r, s in enumerate(seqs):
            ref = hf(s[None], output_hidden_states=True)
            got = torch.cat([o.logits[cu[r]:cu[r + 1]] for o, cu in outs])
            hid = torch.cat([o.hidden[cu[r]:cu[r + 1]] for o, cu in outs])
            torch.testing.assert_close(got, ref.logits[0], rtol=1e-5, atol=1e-5)
            want_hidden = torch.cat([ref.hidden_states[0][0], ref.hidden_states[2][0]], -1)
            torch.testing.assert_close(hid, want_hidden, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_and_checkpoint_round_trip(tmp_path):
    for tied in (False, True):
        target = tiny_target(seed=4, model_type="llama", tie_word_embeddings=tied)
        save_target(target, tmp_path / f"t{tied}")
        loaded = load_target(tmp_path / f"t{tied}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"t{tied}").eval()
        seq = torch.arange(1, 12)
        loaded.alloc_cache(1, 16)
        got = loaded(seq, torch.arange(11), torch.tensor([0, 11], dtype=torch.int32), 11, 11).logits
        with torch.no_grad():
            torch.testing.assert_close(got, hf(seq[None]).logits[0], rtol=1e-5, atol=1e-5)
        assert greedy_reference(loaded, [[1, 2, 3]], 6) == greedy_reference(target, [[1, 2, 3]], 6)


def test_hf_adapter_as_target():
    target = tiny_target(seed=6)
    hf = hf_twin(target)
    prompt = [4, 8, 15, 16, 23]
    want = greedy_reference(target, [prompt], 12)
    adapter = HFTarget(hf)
    drafter = OracleDrafter(tiny_drafter_config(target, block_size=4), adapter.input_embeddings,
                            adapter.lm_head_weight).init_random(1)
    drafter.set_reference([prompt + want[0]])
    dec = SpeculativeDecoder(adapter, drafter)
    res = dec.generate([prompt], 12)
    assert res.tokens == want
    assert res.stats.acceptance_length > 1.5
    with pytest.raises(ValueError, match="single request"):
        dec.generate([prompt, prompt], 4)
