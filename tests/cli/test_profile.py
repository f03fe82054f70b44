"""`xronos profile` end to end on a tiny shape and on a model directory's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli.main import build_parser, main
from xronos.gateway.plan.profiles import load_report

ARGS = ["--task", "classify", "--batch-size", "2", "--seq-len", "8", "--iters", "2", "--threads", "1"]


def test_listed_in_help() -> None:
    assert "profile" in build_parser().format_help()


def test_profile_builtin_arch_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XRONOS_PROFILE_HEAP", "always")  # its stages: a tiny model on a big host skips the heap's
    out = tmp_path / "p.json"
    assert main(["profile", "--arch", "tiny-gpt2", *ARGS, "--node-id", "box1", "--out", str(out)]) == 0
    report = load_report(out)  # the planner's own validation accepts it
    assert report.node_id == "box1" and report.sizes.attn == 4 and report.num_blocks == 2
    err = capsys.readouterr().err
    assert "blk.attn" in err
    # each stage as it begins (minutes on a slow box), and no library debug lines among them
    stages = [ln.split(" ... (")[0] for ln in err.splitlines() if " ... (" in ln]
    assert stages[0].startswith("xronos profile: timing width 1/") and len(stages) >= 3, stages
    assert stages[-2:] == ["xronos profile: all-reduce probe", "xronos profile: heap probes (7 fresh processes)"]
    assert "[debug" not in err and "debug:" not in err


def test_profile_model_dir(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=300, n_positions=64,
               architectures=["GPT2ForSequenceClassification"]).save_pretrained(tmp_path / "m")
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(tmp_path / "m"), *ARGS, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["sizes"]["attn"] == 2 and data["num_blocks"] == 3 and data["arch"]["vocab_size"] == 300


def test_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "p.json")
    assert main(["profile", "--arch", "nope", *ARGS, "--out", out]) == 2
    assert "unknown --arch 'nope'" in capsys.readouterr().err
    assert main(["profile", "--arch", "tiny-gpt2", "--task", "classify", "--batch-size", "0",
                 "--seq-len", "8", "--out", out]) == 2
    assert "--batch-size: Input should be greater than 0 (got 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --model and --arch together
        main(["profile", "--arch", "tiny-gpt2", "--model", str(tmp_path), *ARGS, "--out", out])
    assert main(["profile", "--model", str(tmp_path / "none"), *ARGS, "--out", out]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["profile", "--arch", "tiny-gpt2", *ARGS[:-4], "--seq-len", "4096", "--out", out]) == 2
    assert "max_positions" in capsys.readouterr().err
    assert main(["profile", "--arch", "tiny-gpt2", *ARGS, "--out", str(tmp_path / "no" / "p.json")]) == 2
    assert main(["profile", "--arch", "tiny-gpt2", *ARGS, "--threads", "999", "--out", out]) == 2
    assert "--threads 999: this box has " in capsys.readouterr().err
    assert not Path(out).exists()


def test_no_profiler_lines_on_stderr(tmp_path: Path) -> None:
    """Kineto writes "USDT: ... profiler_start" straight to the process's stderr (capsys does not
    see it), so the command runs as a user runs it, in its own process."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "xronos.cli", "profile", "--arch", "tiny-gpt2", *ARGS,
                           "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "blk.attn" in proc.stderr and "USDT" not in proc.stderr and "profiler_st" not in proc.stderr
