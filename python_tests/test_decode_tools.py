"""Cost-table profiling, STS calibration and the command line."""

import json
import re
import warnings

import pytest
import torch
import tokenizers

import dspark_kernels as dk
from dspark_kernels.decode import (Scheduler, SpeculativeDecoder, calibrate, profile_cost_table, profile_draft_cost,
                                   save_drafter, save_target)
from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target
from dspark_kernels.decode.model import greedy_reference
from dspark_kernels import generate as cli


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_profile_cost_table(tmp_path):
    target = tiny_target(seed=0)
    table = profile_cost_table(target, [1, 8, 32], context_len=16, warmup=1, repeats=2, path=tmp_path / "c.json",
                               warn=False)  # real timings on a shared machine: noise is expected here
    assert all(a <= b for a, b in zip(table.step_time_ms, table.step_time_ms[1:]))
    assert table.token_counts == (1, 8, 32) and all(t > 0 for t in table.step_time_ms)
    again = dk.CostTable.from_json(tmp_path / "c.json")
    assert again.token_counts == table.token_counts
    assert set(json.loads((tmp_path / "c.json").read_text())) >= {"token_counts", "step_time_ms"}


def _fake_timer(monkeypatch, durations_ms):
    """Every pair of timer reads (start, end) of profile_cost_table spans the next of ``durations_ms``."""
    from dspark_kernels.decode import tools
    it, state = iter(durations_ms), {"t": 0.0, "start": True}

    def timer():
        if not state["start"]:
            state["t"] += next(it) / 1e3
        state["start"] = not state["start"]
        return state["t"]
    monkeypatch.setattr(tools, "_timer", timer)


def test_profile_cost_table_noisy_machine(tmp_path, monkeypatch):
    """Medians of the repeats (the warm-up runs untimed), a monotone table (running max), and a warning, a flag
    and reasons when a point's spread is large or the medians fall (e.g. 36, 297, 560, 58 ms)."""
    target = tiny_target(seed=0)
    slow = 10_000.0  # the warm-up run of each point: never in the table
    _fake_timer(monkeypatch, [slow, 36, 35, 37, 36, 36,
                              slow, 297, 290, 300, 295, 299,
                              slow, 300, 560, 900, 400, 700,   # IQR / median = 300 / 560
                              slow, 58, 58, 59, 57, 58])       # 90% below the smaller batch's median
    with pytest.warns(RuntimeWarning, match="too noisy") as rec:
        table = profile_cost_table(target, [1, 8, 32, 64], context_len=8, warmup=1, repeats=5,
                                   path=tmp_path / "c.json")
    assert table.raw_median_ms == pytest.approx((36.0, 297.0, 560.0, 58.0))
    assert table.step_time_ms == pytest.approx((36.0, 297.0, 560.0, 560.0))          # monotone non-decreasing
    assert table.noisy and table.repeats == 5 and len(table.noise) == 2
    assert "B=32" in table.noise[0] and "spread" in table.noise[0] and "B=64" in table.noise[1]
    assert "B=32" in str(rec[0].message) and "B=64" in str(rec[0].message)
    assert table.spread[2] == pytest.approx(300 / 560) and table.spread[0] < 0.1
    saved = dk.CostTable.from_json(tmp_path / "c.json")  # the file is a plain cost table, the monotone one
    assert saved.step_time_ms == table.step_time_ms
    # a quiet machine: no warning, the medians as they are
    _fake_timer(monkeypatch, [slow, 10, 11, 10] + [slow, 20, 20, 21] + [slow, 19.5, 19.5, 19.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = profile_cost_table(target, [1, 8, 32], context_len=8, warmup=1, repeats=3)
    assert not quiet.noisy and quiet.noise == ()
    assert quiet.raw_median_ms == pytest.approx((10.0, 20.0, 19.5))
    assert quiet.step_time_ms == pytest.approx((10.0, 20.0, 20.0))


def test_calibration_run(tmp_path):
    target = tiny_target(seed=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ref = greedy_reference(target, prompts, 12)
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(prompts, ref)])
    out = calibrate(SpeculativeDecoder(target, drafter), prompts, 12, path=tmp_path / "sts.json")
    assert len(out["sts_temperatures"]) == 4 and out["rows"] > 0
    assert len(out["ece_after"]) == 4 and out["ece_after"][0] <= out["ece_before"][0] + 1e-9
    assert all(t > 0 for t in out["sts_temperatures"])
    assert json.loads((tmp_path / "sts.json").read_text())["sts_temperatures"] == out["sts_temperatures"]


def test_calibration_log_leaves_drafts_after_a_stop_token_unobserved():
    """The oracle drafter's drafts are all accepted, so every observed label ``num_accepted >= k`` is true. A step
    that accepts a stop token ends there, its later drafts unjudged: verify_lens counts them, observed_lens not."""
    target = tiny_target(seed=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ref = greedy_reference(target, prompts, 24)
    drafter = oracle_drafter(target, block_size=4)
    drafter.set_reference([p + r for p, r in zip(prompts, ref)], wrong_every=10 ** 9)   # never wrong
    stop = ref[0][5]
    log = {}
    SpeculativeDecoder(target, drafter).generate(prompts, 12, stop_token_ids=[stop], scheduler=Scheduler("fixed"),
                                                 log=log)
    active = torch.cat(log["active"])
    acc, observed, vlen = (torch.cat(log[k])[active].long() for k in ("num_accepted", "observed_lens", "verify_lens"))
    assert torch.equal(acc, observed)
    assert (vlen > observed).any()


@pytest.fixture
def folders(tmp_path):
    target = tiny_target(seed=0)
    drafter = tiny_drafter(target, block_size=4)
    save_target(target, tmp_path / "target")
    save_drafter(drafter, tmp_path / "draft")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat and dog ran".split())}}
    vocab.update({f"w{i}": i for i in range(len(vocab), 48)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "target" / "tokenizer.json"))
    return tmp_path, target


def test_cli_generates_and_reports(folders, capsys):
    tmp_path, target = folders
    rc = cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
                   "the cat sat", "--prompt", "a dog", "--max-new-tokens", "8", "--mode", "threshold",
                   "--thresholds", "0.5", "0.4", "0.3", "0.2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "=== the cat sat" in out and "acceptance length" in out and "tokens / second" in out
    assert "conditional acceptance" in out and "verified tokens / step" in out
    # the decoded text is the target's own greedy continuation
    ids = greedy_reference(target, [[1, 2, 3]], 8)[0]
    tok = __import__("tokenizers").Tokenizer.from_file(str(tmp_path / "target" / "tokenizer.json"))
    assert tok.decode(ids) in out

    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                     "--profile-cost-table", str(tmp_path / "cost.json")]) == 0
    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "the cat",
                     "--calibrate", str(tmp_path / "sts.json"), "--max-new-tokens", "6"]) == 0
    rc = cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "the mat",
                   "--mode", "exact", "--cost-table", str(tmp_path / "cost.json"), "--sts", str(tmp_path / "sts.json"),
                   "--max-new-tokens", "5", "--no-progress"])
    assert rc == 0
    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                     "--profile-draft-cost", str(tmp_path / "draft_cost.json"), "--profile-repeats", "1"]) == 0
    assert dk.CostTable.from_json(tmp_path / "draft_cost.json").token_counts == (1, 2, 4, 8, 16, 32, 64)
    capsys.readouterr()
    dk.CostTable([1], [1e6]).to_json(tmp_path / "costly.json")  # drafting never pays: the target alone decodes
    rc = cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "the cat sat",
                   "--mode", "exact", "--cost-table", str(tmp_path / "cost.json"), "--draft-cost",
                   str(tmp_path / "costly.json"), "--max-new-tokens", "64", "--no-progress"])
    out = capsys.readouterr().out
    drafted, steps = map(int, re.search(r"drafting steps +(\d+) of (\d+)", out).groups())
    assert rc == 0 and tok.decode(greedy_reference(target, [[1, 2, 3]], 64)[0]) in out
    assert 33 <= drafted < steps - 15  # a window of 32 request-steps (+1 read late), then 16 plain steps


def test_cli_bad_input(folders, capsys):
    tmp_path, _ = folders
    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "error" in capsys.readouterr().err
    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]) == 2


def test_cli_help_documents_every_option(capsys):
    """Every option has help text; every optional one shows its default (argparse's "(default: ...)", or the help
    text's own "(default: ...)" where the default is None)."""
    parser = cli.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        text = formatter._expand_help(action)
        assert action.required or "(default:" in text, (action.option_strings, text)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 128)" in out and "(default: fixed)" in out and "(default: the checkpoint's eos ids)" in out


def test_cli_exact_mode_that_verifies_nothing_says_why(folders, capsys):
    """A cost table under which the first draft never pays for its verify cost: exact mode verifies no drafts,
    the CLI says why in one line and prints no nan for the conditional acceptance."""
    tmp_path, _ = folders
    dk.CostTable([1, 2], [1.0, 1000.0]).to_json(tmp_path / "steep.json")
    rc = cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "the cat",
                   "--mode", "exact", "--cost-table", str(tmp_path / "steep.json"), "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "nan" not in out.lower()
    assert "conditional acceptance  n/a n/a n/a n/a" in out
    assert "(n/a: no drafts verified at positions 1, 2, 3, 4)" in out
    why = [line for line in out.splitlines() if line.startswith("exact mode verified no drafts")]
    assert len(why) == 1 and "cost table" in why[0] and "--mode argmax" in why[0]
    assert "(0 drafts verified)" in out
    # with a table under which drafts pay, no explanation; positions never reached still print n/a, not nan
    dk.CostTable([1, 64], [1.0, 1.01]).to_json(tmp_path / "flat.json")
    assert cli.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
                     "the cat", "--mode", "exact", "--cost-table", str(tmp_path / "flat.json"),
                     "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "verified no drafts" not in out and "nan" not in out.lower() and "(0 drafts verified)" not in out


def test_conditional_acceptance_formatting():
    nan = float("nan")
    assert cli.conditional_acceptance_lines([0.5, 0.25]) == ["conditional acceptance  0.50 0.25"]
    lines = cli.conditional_acceptance_lines([0.5, nan, nan])
    assert lines[0] == "conditional acceptance  0.50 n/a n/a" and "no drafts verified at positions 2, 3" in lines[1]
    assert "at position 3)" in cli.conditional_acceptance_lines([0.5, 0.1, nan])[1]


def test_decoder_counts_verified_drafts():
    target = tiny_target(seed=0)
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=4))
    steep = Scheduler("exact", cost_table=dk.CostTable([1, 2], [1.0, 1000.0]))
    st = dec.generate([[1, 2, 3], [4]], 6, scheduler=steep).stats
    assert st.drafts_verified == 0 and st.verified_tokens_per_step == 2.0
    assert all(a != a for a in st.conditional_acceptance)  # NaN: no draft verified at any position
    st = dec.generate([[1, 2, 3], [4]], 6, scheduler=Scheduler("fixed", verify_len=2)).stats
    active_request_steps = round(st.generated_tokens / st.acceptance_length)
    assert st.drafts_verified == 2 * active_request_steps > 0


def test_profile_draft_cost(tmp_path, monkeypatch):
    """One drafting pass timed per request count (medians of the repeats, made monotone); the table is the
    Scheduler's draft_cost, and a loop given it decodes as before."""
    target = tiny_target(seed=0)
    dec = SpeculativeDecoder(target, tiny_drafter(target, block_size=3))
    slow = 10_000.0
    _fake_timer(monkeypatch, [slow, 2, 3, 2] + [slow, 5, 5, 6] + [slow, 4, 4, 4])
    table = profile_draft_cost(dec, [1, 4, 16], context_len=8, warmup=1, repeats=3, path=tmp_path / "d.json",
                               warn=False)
    assert table.token_counts == (1, 4, 16) and table.raw_median_ms == pytest.approx((2.0, 5.0, 4.0))
    assert table.step_time_ms == pytest.approx((2.0, 5.0, 5.0)) and table.noisy
    assert dk.CostTable.from_json(tmp_path / "d.json").step_time_ms == table.step_time_ms
    monkeypatch.undo()
    real = profile_draft_cost(dec, [1, 3], context_len=8, warmup=1, repeats=2, temperature=1.0, warn=False)
    assert all(t > 0 for t in real.step_time_ms)
    sched = Scheduler("exact", cost_table=dk.CostTable([1, 8], [1.0, 2.0]), draft_cost=real)
    greedy = dec.generate([[1, 2, 3], [4]], 5).tokens
    assert dec.generate([[1, 2, 3], [4]], 5, scheduler=sched).tokens == greedy
