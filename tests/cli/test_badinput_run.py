"""`xronos run` / `xronos profile` bad input found by trying the real CLI: refused in one line,
naming the flag and the value, before any process starts (and before minutes of profiling)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402

from xronos.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("cli-badinput"))


@pytest.fixture
def nothing_starts(monkeypatch):
    runkit.refuse_spawn(monkeypatch, "a process was spawned (or profiling began)", "xronos.cli.strategy.plan_run")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos "), err
    return err[0]


@pytest.mark.parametrize("flag, message", [
    # The planner used to check these only after profiling every rank (20-40 s on a tiny GPT-2).
    ("--reserve-mb=-5", "--reserve-mb must be finite and >= 0, got -5.0"),
    ("--reserve-mb=nan", "--reserve-mb must be finite and >= 0, got nan"),
    ("--bandwidth-mbps=0", "--bandwidth-mbps must be finite and > 0, got 0.0"),
    ("--latency-ms=inf", "--latency-ms must be finite and >= 0, got inf"),
])
def test_planner_flags_are_refused_before_profiling(good, tmp_path, capsys, nothing_starts, flag, message):
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out")
    i = argv.index("--units")
    argv[i:i + 2] = ["--strategy", "segment", flag]
    assert main(argv) == 2
    assert message in _error(capsys)


@pytest.mark.parametrize("flags, message", [
    # Accepted and ignored before: a run with --units is not planned.
    (["--reserve-mb", "100"], "--reserve-mb: only with --strategy"),
    (["--profile-cache", "pc", "--latency-ms", "2", "--bandwidth-mbps", "100"],
     "--profile-cache, --bandwidth-mbps, --latency-ms: only with --strategy"),
])
def test_planner_flags_without_strategy_are_refused(good, tmp_path, capsys, nothing_starts, flags, message):
    model, data = good
    assert main(runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out") + flags) == 2
    assert message in _error(capsys)


@pytest.mark.parametrize("flags, message", [
    # This model: 12 heads, 100 MLP columns, 37 vocabulary rows.
    (["--layout=attn=6,6;mlp=64,99999999999;vocab=32,5"], "--layout: mlp counts must be in 0..2147483647"),
    (["--layout=attn=6_0,6;mlp=64,36;vocab=32,5"], "--layout: attn must be comma-separated integers"),
    (["--layout=attn=6,6,0;mlp=64,36,0;vocab=32,5,0"], "--layout has 3 counts per kind (one per rank), but --nodes is 2"),
    (["--layout=attn=6,6;mlp=64,36;vocab=32,5", "--reshard-at=1:attn=6,6,0;mlp=64,36,0;vocab=32,5,0"],
     "--reshard-at step 1: layout has 3 ranks, but --nodes is 2"),
    (["--layout=attn=6,6;mlp=64,36;vocab=32,5", "--reshard-at=-1:attn=6,6;mlp=64,36;vocab=32,5"],
     "--reshard-at: expected STEP:attn=..;mlp=..;vocab=.. with STEP a step number"),
])
def test_layouts_are_refused_in_one_line_naming_flag_and_numbers(good, tmp_path, capsys, nothing_starts, flags,
                                                                 message):
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out")
    i = argv.index("--units")
    argv[i:i + 2] = flags
    assert main(argv) == 2
    err = _error(capsys)
    assert message in err and "got {'model_dir'" not in err, err


@pytest.mark.parametrize("extra, message", [
    # Found only by rank 0 after the last step: the whole run was lost, with two tracebacks.
    (lambda tmp: ["--export", str(_file(tmp))], "exists and is not a directory"),
    (lambda tmp: ["--export", str(_file(tmp) / "sub")], "is not a directory"),
    (lambda tmp: ["--export", "/proc/xronos-export"], "cannot write in /proc"),  # root passes os.access there
    # Without --lora-r these silently fine-tuned every weight.
    (lambda tmp: ["--lora-alpha", "32"], "--lora-r: required by --lora-alpha"),
    (lambda tmp: ["--lora-dropout", "0.1", "--lora-targets", "c_attn"], "--lora-r: required by --lora-dropout, --lora-targets"),
])
def test_export_and_lora_flags_are_refused_before_training(good, tmp_path, capsys, nothing_starts, extra, message):
    model, data = good
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out") + extra(tmp_path)
    if "--export" in extra(tmp_path):
        i = argv.index("--export")
        del argv[i:i + 2]
    assert main(argv) == 2
    assert message in _error(capsys)


def _file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("x")
    return tmp / "a-file"


@pytest.mark.parametrize("flags, message", [
    (["--node-id", "a/b"], "argument --node-id: must be [A-Za-z0-9_][A-Za-z0-9_.-]*"),
    # Without --lora-r this used to profile full fine-tuning silently.
    (["--lora-targets", "c_attn"], "--lora-r: required by --lora-targets"),
])
def test_profile_flags_refused_before_profiling(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr("xronos.node.measure.profiler.profile", lambda *a, **k: pytest.fail("profiled"))
    argv = ["profile", "--arch", "tiny-gpt2", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "8",
            "--out", str(tmp_path / "p.json"), *flags]
    # argparse refuses a bad --node-id itself (exit 2, its usage line first)
    with pytest.raises(SystemExit) if flags[0] == "--node-id" else contextlib.nullcontext():
        assert main(argv) == 2
    assert message in capsys.readouterr().err



@pytest.mark.parametrize("flag", ["--batch-size=-4", "--seq-len=0"])
def test_plan_refuses_a_job_shape_that_is_no_shape(flag, capsys):
    # It used to compare the profiles with it: "node n0 was profiled at batch_size 8, but the job runs -4".
    with pytest.raises(SystemExit):
        main(["plan", "unused.json", flag])
    assert "expected a positive integer" in capsys.readouterr().err


def test_plan_refuses_a_bad_job_id_before_planning(capsys):
    # It used to plan, then print pydantic's four-line dump of the Plan message's job_id.
    with pytest.raises(SystemExit):
        main(["plan", "unused.json", "--json", "--job-id", "bad id!"])
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("xronos plan: error: argument --job-id: must be [A-Za-z0-9_][A-Za-z0-9_.-]* (a topic level "
                       "and a file name), got 'bad id!'")
    assert not any("validation error" in line or "pydantic" in line for line in err)


@pytest.mark.parametrize("units, flags, message", [
    # argparse took a value starting with '-' for a flag: "argument --units: expected one argument".
    ((-2, 10, 4), [], "--units [-2, 10, 4] has negative entries [-2]"),
    ((6, 6), ["--layout", "attn=6,6;mlp=64,36;vocab=32,5", "--reshard-at", "-1:attn=6,6;mlp=64,36;vocab=32,5"],
     "--reshard-at: expected STEP:attn=..;mlp=..;vocab=.. with STEP a step number"),
])
def test_a_value_starting_with_a_minus_reaches_our_own_check(good, tmp_path, capsys, nothing_starts, units, flags,
                                                            message):
    model, data = good
    argv = runkit.run_argv(model, data, "classify", units, tmp_path / "out")
    assert argv[argv.index("--units") + 1] == ",".join(map(str, units))  # space-separated, not --units=...
    if flags:
        i = argv.index("--units")
        argv[i:i + 2] = flags
    assert main(argv) == 2
    assert message in _error(capsys)
