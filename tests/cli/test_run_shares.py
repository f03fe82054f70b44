"""`xronos run --shares` refuses bad shares and meshes with one clean line, before any process
starts (the runs themselves: tests/node/dp/test_dp_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402  (the run test kit lives with the node tests)

from xronos.cli.main import main  # noqa: E402

LAYOUT2 = "attn=4,8;mlp=64,36;vocab=32,5"  # runkit's GPT-2 classifier: 12 heads, 100 columns, 37 rows


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("cli-shares"))


def _argv(good, tmp_path: Path, nodes: int, *split: str) -> list[str]:
    model, data = good
    return ["run", "--model", str(model), "--data", str(data), "--task", "classify", "--nodes", str(nodes), *split,
            "--batch-size", "4", "--seq-len", "16", "--lr", "1e-4", "--max-steps", "2", "--seed", "0",
            "--export", str(tmp_path / "out")]


@pytest.mark.parametrize(
    ("nodes", "split", "message"),
    [
        (2, ("--shares", "3,3"), "--shares 3,3: sum to 6 rows, but --batch-size is 4"),
        (2, ("--shares=-1,5",), "--shares: rows per data-parallel group must be >= 0, got [-1, 5]"),
        (2, ("--shares", "2,x"), "--shares must be comma-separated integers (rows per group), got '2,x'"),
        (2, ("--shares", "1,1,2"), "--shares: 3 data-parallel groups cannot split --nodes 2 into equal"),
        (4, ("--shares", "2,2", "--layout=" + "attn=3,3,3,3;mlp=32,32,32,4;vocab=32,5,0,0"),
         "--layout has 4 counts per kind (one per rank), but --nodes / 2 groups of --shares is 2"),
        (4, ("--shares", "2,2"), "one of --layout, --units or --strategy is required (a tensor-parallel group of 2"),
        (4, ("--shares", "2,2", "--units", "4,4,4"),
         "--units has 3 entries [4, 4, 4], but --nodes / 2 groups of --shares is 2"),
        (2, ("--shares", "2,2", "--strategy", "segment"), "give either --shares (a hand-chosen data-parallel mesh) "
                                                          "or --strategy, not both"),
        (4, ("--shares", "2,2", "--layout=" + LAYOUT2, "--reshard-at", "1:" + LAYOUT2),
         "--shares: a data-parallel run does not re-shard its layout (--reshard-at with a layout)"),
        # a re-shard layout of the run's every rank: the same rule, not a count of the group's ranks
        (4, ("--shares", "2,2", "--layout=" + LAYOUT2, "--reshard-at",
             "1:attn=3,3,3,3;mlp=32,32,32,4;vocab=32,5,0,0"),
         "--shares: a data-parallel run does not re-shard its layout (--reshard-at with a layout)"),
        # a live re-split of the batch: one share per group, >= 0, summing to the batch; only with --shares
        (2, ("--shares", "2,2", "--reshard-at", "3:shares=3,2"), "--reshard-at step 3: shares [3, 2] must be 2 "
                                                                 "integers >= 0 (one per data-parallel group) summing "
                                                                 "to the batch, 4"),
        (2, ("--shares", "2,2", "--reshard-at", "3:shares=1,1,2"), "--reshard-at step 3: shares [1, 1, 2] must be 2"),
        (2, ("--shares", "2,2", "--reshard-at", "3:shares=4,-0"), "--reshard-at 3: shares must be comma-separated "
                                                                  "integers >= 0 (rows per data-parallel group), got "
                                                                  "'4,-0'"),
        (2, ("--layout=" + LAYOUT2, "--reshard-at", "3:shares=2,2"), "--reshard-at step 3: shares [2, 2] re-split a "
                                                                     "data-parallel run's batch, and this run has no "
                                                                     "shares"),
    ],
)
def test_bad_shares_are_one_clean_error_line(good, tmp_path, capsys, monkeypatch, nodes, split, message) -> None:
    runkit.refuse_spawn(monkeypatch)
    assert main(_argv(good, tmp_path, nodes, *split)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos run: error: "), err
    assert message in err[0], err[0]
