"""`xronos run --overlap` and `xronos plan --overlap/--chunks` refuse bad values with one clean line,
before any process starts (the runs themselves: tests/node/test_overlap_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402

from xronos.cli.main import main  # noqa: E402

LAYOUT2 = "attn=4,8;mlp=64,36;vocab=32,5"  # runkit's GPT-2 classifier


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("cli-overlap"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--overlap", "c5"), "--overlap: chunks 5 leaves a chunk without a row: the batch has 4 rows"),
        (("--overlap", "c1"), "--overlap 'c1': off, bwd or cN with N chunks, 2 <= N <= 64"),
        (("--overlap", "yes"), "--overlap 'yes': off, bwd or cN"),
        (("--overlap", "bwd", "--shares", "4"), "--overlap: a data-parallel run (shares) does not overlap"),
        (("--overlap-trial", "bwd"), "--overlap-trial 'bwd': 2 to 4 distinct modes"),
        (("--overlap-trial", "bwd,off,bwd"), "--overlap-trial 'bwd,off,bwd': 2 to 4 distinct modes (modes: each "
                                             "mode once, got ['bwd', 'off', 'bwd'])"),
        (("--overlap-trial", "off,c2,c3,c4,bwd"), "--overlap-trial 'off,c2,c3,c4,bwd': 2 to 4 distinct modes"),
        (("--overlap-trial", "off,c9"), "--overlap-trial: chunks 9 leaves a chunk without a row: the batch has 4"),
        (("--overlap-trial", "off,fast"), "--overlap-trial 'off,fast': 'fast': off, bwd or cN"),
        (("--overlap", "bwd", "--overlap-trial", "off,bwd"), "--overlap-trial 'off,bwd': its first mode runs the "
                                                             "warm-up, and --overlap says bwd: name it first"),
        (("--overlap-trial", "off,bwd", "--shares", "4"), "--overlap-trial: a data-parallel plan (shares) has no "
                                                          "overlap modes to try"),
    ],
)
def test_bad_overlap_is_one_clean_error_line(good, tmp_path, capsys, monkeypatch, extra, message) -> None:
    runkit.refuse_spawn(monkeypatch)
    model, data = good
    argv = ["run", "--model", str(model), "--data", str(data), "--task", "classify", "--nodes", "2",
            f"--layout={LAYOUT2}", "--batch-size", "4", "--seq-len", "16", "--lr", "1e-4", "--max-steps", "2",
            "--seed", "0", "--export", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos run: error: "), err
    assert message in err[0], err[0]


def test_plan_chunks_need_overlap_on(tmp_path, capsys) -> None:
    assert main(["plan", str(tmp_path / "a.json"), "--chunks", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chunks 2 needs --overlap on (got --overlap off)" in err, err
