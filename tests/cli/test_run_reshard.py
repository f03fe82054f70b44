"""`xronos run --reshard-at STEP:LAYOUT` refuses a bad schedule with one clean line, before any
process is spawned. (Runs that re-shard: tests/node/test_reshard_contract.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402

from xronos.cli.main import build_parser, main  # noqa: E402

GOOD = "attn=6,6;mlp=32,68;vocab=32,5"  # this model: 12 heads, 100 MLP columns, 37 vocabulary rows


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("cli-reshard"))


@pytest.fixture
def no_spawn(monkeypatch):
    runkit.refuse_spawn(monkeypatch)


def test_the_flag_is_documented() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--reshard-at" in help_text


@pytest.mark.parametrize(("values", "message"), [
    (["7"], "--reshard-at: expected STEP:attn=..;mlp=..;vocab=.. with STEP a step number (0, 1, ...), got '7'"),
    (["x:" + GOOD], "with STEP a step number (0, 1, ...), got 'x:"),
    (["7:attn=6,6;mlp=32,68"], "--reshard-at 7: missing vocab"),
    (["7:attn=6,5;mlp=32,68;vocab=32,5"], "--reshard-at 7: attn: counts [6, 5] sum to 11, but the model has 12"),
    (["7:attn=6,6;mlp=50,50;vocab=32,5"], "--reshard-at 7: mlp: the cut after rank 0 falls at 50"),
    (["7:attn=4,4,4;mlp=32,32,36;vocab=32,5,0"], "--reshard-at step 7: layout has 3 ranks, but --nodes is 2"),
    (["9:" + GOOD, "7:" + GOOD], "--reshard-at: steps [9, 7] must be distinct and increasing"),
    (["7:" + GOOD, "7:" + GOOD], "--reshard-at: steps [7, 7] must be distinct and increasing"),
    (["20:" + GOOD], "--reshard-at step 20: the run has only 20 steps (0..19)"),
    (["-1:" + GOOD], "--reshard-at: expected STEP:attn=..;mlp=..;vocab=.. with STEP a step number"),
])
def test_bad_schedules_are_refused(good, tmp_path, capsys, no_spawn, values, message) -> None:
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out")
    for v in values:
        argv.append(f"--reshard-at={v}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos run: error: ")
    assert message in err[0], err[0]


def test_rebalance_and_forced_moves_are_not_mixed(good, tmp_path, capsys, no_spawn) -> None:
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out") + ["--rebalance",
                                                                                  f"--reshard-at=7:{GOOD}"]
    assert main(argv) == 2
    assert "give --reshard-at (forced moves) or --rebalance (planned moves), not both" in capsys.readouterr().err
