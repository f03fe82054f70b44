"""`xronos run` refuses bad input with one clean line, before any process is spawned.
(The runs themselves are exercised end to end in tests/node/test_contract.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402  (the run test kit lives with the node tests)

from xronos.cli import run as run_cli  # noqa: E402
from xronos.cli.main import build_parser, main  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("cli-run"))


@pytest.fixture
def no_spawn(monkeypatch):
    runkit.refuse_spawn(monkeypatch)


def _argv(good, tmp_path: Path, **overrides) -> list[str]:
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out")
    for flag, value in overrides.items():
        if flag == "layout":  # instead of --units
            i = argv.index("--units")
            argv[i:i + 2] = [f"--layout={value}"]
            continue
        flag = "--" + flag.replace("_", "-")
        i = argv.index(flag)
        argv[i:i + 2] = [f"{flag}={value}"]  # "=" form: argparse would read "-4,16" as an option
    return argv


def test_run_is_registered_with_the_documented_flags() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for flag in ("--model", "--data", "--task", "--nodes", "--layout", "--units", "--batch-size", "--seq-len", "--lr",
                 "--max-steps", "--seed", "--no-shuffle", "--dropout", "--weight-decay", "--max-grad-norm",
                 "--warmup-steps", "--text-column", "--text-pair-column", "--label-column",
                 "--threads-per-node", "--eval-fraction", "--metrics", "--gloo-timeout", "--export",
                 "--data-format", "--messages-column", "--prompt-column", "--completion-column"):
        assert flag in help_text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"units": "4,7"}, "sums to 11, but the model has 12 attention units"),
        ({"units": "4,4,4"}, "3 entries [4, 4, 4] but --nodes is 2"),
        ({"units": "-4,16"}, "has negative entries [-4]"),
        ({"units": "4,x"}, "--units must be comma-separated integers"),
        ({"nodes": "0"}, "--nodes must be >= 1"),
        ({"seq_len": "65"}, "--seq-len 65 exceeds the model's maximum of 64"),
        ({"batch_size": "0"}, "--batch-size: Input should be greater than 0"),
        ({"batch_size": "13"}, "--batch-size 13 is larger than the 12 training rows"),
        ({"data": "/nonexistent/d.csv"}, "data file /nonexistent/d.csv does not exist"),
        ({"model": "/nonexistent/m"}, "model dir /nonexistent/m does not exist"),
        ({"lr": "-1"}, "--lr: Input should be greater than 0"),
        # --layout (this model: 12 heads, 100 MLP columns, 37 vocabulary rows; quanta 1/32/32)
        ({"layout": "attn=4,7;mlp=64,36;vocab=32,5"}, "attn: counts [4, 7] sum to 11, but the model has 12 attention units"),
        ({"layout": "attn=4,8;mlp=64,35;vocab=32,5"}, "mlp: counts [64, 35] sum to 99, but the model has 100 MLP columns"),
        ({"layout": "attn=4,8;mlp=64,36;vocab=32,6"}, "vocab: counts [32, 6] sum to 38, but the model has 37 vocabulary rows"),
        ({"layout": "attn=4,8;mlp=50,50;vocab=32,5"}, "mlp: the cut after rank 0 falls at 50, not a multiple of the MLP columns quantum 32"),
        ({"layout": "attn=4,8;mlp=64,36;vocab=10,27"}, "vocab: the cut after rank 0 falls at 10, not a multiple of the vocabulary rows quantum 32"),
        ({"layout": "attn=-4,16;mlp=64,36;vocab=32,5"}, "--layout: attn counts must be >= 0, got [-4, 16]"),
        ({"layout": "attn=4,4,4;mlp=32,32,36;vocab=32,5,0"}, "--layout has 3 counts per kind (one per rank), but --nodes is 2"),
        ({"layout": "attn=4,8;mlp=64,36,0;vocab=32,5"}, "every kind needs one count per rank"),
        ({"layout": "attn=4,8;mlp=64,36"}, "--layout: missing vocab"),
        ({"layout": "attn=4,8;ffn=64,36;vocab=32,5"}, "expected kind=c1,c2,... with kind in attn, mlp, vocab"),
    ],
)
def test_bad_input_is_one_clean_error_line(good, tmp_path, capsys, no_spawn, overrides, message) -> None:
    assert main(_argv(good, tmp_path, **overrides)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos run: error: ")
    assert message in err[0], err[0]


def test_labels_out_of_range_for_the_head(good, tmp_path, capsys, no_spawn) -> None:
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"text": t, "label": i % 3} for i, t in enumerate(runkit.texts(8))])
    assert main(_argv(good, tmp_path, data=str(data))) == 2
    assert "row 2 has label 2 outside [0, 2)" in capsys.readouterr().err


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos run: error: "), err
    return err[0]


def test_data_format_and_label_refusals(good, tmp_path, capsys, no_spawn) -> None:
    model, data = good
    argv = _argv(good, tmp_path)
    assert main(argv + ["--data-format", "chat"]) == 2
    assert "--data-format: 'chat' is a causal-lm format (the loss covers the answer tokens), not one for --task 'classify'" in _one_error(capsys)
    # A label of the held-out rows that no training row has.
    rows = [{"text": t, "label": ["cat", "dog"][i % 2]} for i, t in enumerate(runkit.texts(11))]
    unseen = runkit.write_rows(tmp_path / "u.csv", rows + [{"text": "a bird", "label": "bird"}])
    assert main(_argv(good, tmp_path, data=str(unseen)) + ["--eval-fraction", "0.25"]) == 2
    assert "row 11 (held out for evaluation) has label 'bird', which no training row has" in _one_error(capsys)
    # Chat data for a tokenizer without a chat template (the test models have none unless asked).
    chats = runkit.write_rows(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "dog"}]}] * 8)
    lm = runkit.make_model(tmp_path / "lm", "gpt2", "causal-lm")
    capsys.readouterr()  # the model's writing progress
    argv = runkit.run_argv(lm, chats, "causal-lm", (4, 8), tmp_path / "out") + ["--data-format", "chat"]
    assert main(argv) == 2
    assert "the tokenizer has no chat template, which data format 'chat' needs" in _one_error(capsys)
    empty = runkit.write_rows(tmp_path / "p.jsonl", [{"prompt": "cat", "completion": " dog"}] * 7
                              + [{"prompt": "cat", "completion": " "}])
    argv = runkit.run_argv(lm, empty, "causal-lm", (4, 8), tmp_path / "out") + ["--data-format", "prompt-completion"]
    assert main(argv) == 2
    assert "row 7 has an empty completion" in _one_error(capsys)


def test_export_must_not_overwrite_the_input(good, tmp_path, capsys, no_spawn) -> None:
    model, data = good
    # the model or the data itself, a directory holding either, or one inside the model's
    for export, what in ((model, "the input model directory"), (model.parent, "the input model directory"),
                         (model / "sub", "the input model directory")):
        assert main(_argv(good, tmp_path, export=str(export))) == 2
        assert f"--export {export} would overwrite {what}" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    moved = tmp_path / "d" / data.name
    moved.write_bytes(data.read_bytes())
    assert main(_argv(good, tmp_path, data=str(moved), export=str(moved.parent))) == 2
    assert f"--export {moved.parent} would overwrite the data" in capsys.readouterr().err


def test_layout_comes_from_one_replaceable_function(good) -> None:
    args = build_parser().parse_args(["run", "--model", str(good[0]), "--data", "d", "--task", "classify",
                                      "--nodes", "2", "--units", "3,9", "--batch-size", "1", "--seq-len", "8",
                                      "--lr", "1", "--max-steps", "1", "--seed", "0", "--export", "o"])
    lay = run_cli.resolve_layout(args)
    assert lay.attn == (3, 9) and sum(lay.mlp) == 100 and lay.mlp[0] % 32 == 0  # MLP follows the heads
    args.units = None
    with pytest.raises(ValueError, match="one of --layout, --units or --strategy is required"):
        run_cli.resolve_layout(args)
    args.layout = "attn=0,12;mlp=64,36;vocab=32,5"
    assert run_cli.resolve_layout(args).mlp == (64, 36)


def test_a_warmup_longer_than_the_run_is_refused(good, tmp_path, capsys, no_spawn) -> None:
    argv = _argv(good, tmp_path)
    steps = argv[argv.index("--max-steps") + 1]
    assert main([*argv, "--warmup-steps", str(int(steps) + 1)]) == 2
    assert f"--warmup-steps {int(steps) + 1} is longer than the run (--max-steps {steps})" in _one_error(capsys)
