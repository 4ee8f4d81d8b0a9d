"""Cost-table profiling, STS calibration and the command line."""

import json

import pytest
import torch
import tokenizers

import dspark_kernels as dk
from dspark_kernels.decode import SpeculativeDecoder, calibrate, profile_cost_table, save_drafter, save_target
from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target
from dspark_kernels.decode.model import greedy_reference
from dspark_kernels import generate as cli


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_profile_cost_table(tmp_path):
    target = tiny_target(seed=0)
    table = profile_cost_table(target, [1, 8, 32], context_len=16, warmup=1, repeats=2, path=tmp_path / "c.json")
    assert table.token_counts == (1, 8, 32) and all(t > 0 for t in table.step_time_ms)
    again = dk.CostTable.from_json(tmp_path / "c.json")
    assert again.token_counts == table.token_counts
    assert set(json.loads((tmp_path / "c.json").read_text())) >= {"token_counts", "step_time_ms"}


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
