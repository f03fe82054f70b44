"""The job commands' local side: spec files (TOML, YAML) validated before anything is sent, clean
errors, and the plan and state displays."""

from __future__ import annotations

import pytest

from xronos.cli.main import main as xronos
from xronos.cli.mqttclient import format_plan, format_state, load_spec

TOML = """
[job]
name = "t"
owner = "n0"
model_dir = "/srv/m"
data_path = "/srv/d.csv"
task = "classify"
batch_size = 8
seq_len = 64
lr = 2e-5
epochs = 1
export_dir = "/srv/out"
"""


def test_spec_files_toml_yaml_and_errors(tmp_path):
    (tmp_path / "a.toml").write_text(TOML)
    spec = load_spec(tmp_path / "a.toml")
    assert spec.owner == "n0" and spec.recipe.epochs == 1 and spec.strategy == "auto"  # the default
    (tmp_path / "b.yaml").write_text("name: t\nowner: n0\nmodel_dir: /m\ndata_path: /d.csv\ntask: causal-lm\n"
                                     "batch_size: 2\nseq_len: 8\nlr: 0.001\nmax_steps: 5\nexport_dir: /o\n")
    assert load_spec(tmp_path / "b.yaml").recipe.max_steps == 5
    (tmp_path / "c.toml").write_text(TOML.replace("batch_size = 8", "batch_size = 0\nbogus = 1"))
    with pytest.raises(ValueError, match=r"c.toml: recipe.batch_size: .*greater than 0.*; recipe.bogus: Extra inputs"):
        load_spec(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text(TOML.replace("epochs = 1\n", ""))
    with pytest.raises(ValueError, match="epochs/max_steps: at least one"):
        load_spec(tmp_path / "d.toml")
    with pytest.raises(ValueError, match="expected a .toml"):
        (tmp_path / "e.json").write_text("{}")
        load_spec(tmp_path / "e.json")


def test_cli_refuses_a_bad_spec_before_connecting(tmp_path, capsys):
    (tmp_path / "c.toml").write_text(TOML.replace('task = "classify"', 'task = "regress"'))
    assert xronos(["job", "submit", str(tmp_path / "c.toml"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xronos job: error: job spec") and "task" in err


@pytest.mark.parametrize("command", ["pause", "resume", "cancel", "status"])
def test_cli_refuses_a_bad_job_id_in_one_line_before_connecting(command, capsys):
    """Not pydantic's multi-line dump, and no wait for a broker (there is none on port 1)."""
    assert xronos(["job", command, "bad id!", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("xronos job: error: job_id: must be [A-Za-z0-9_][A-Za-z0-9_.-]* (a topic level and a file "
                   "name), got 'bad id!'\n")


def test_cli_without_broker_is_one_clean_line(capsys):
    assert xronos(["nodes", "--port", "1", "--timeout", "1"]) == 2
    assert "cannot reach the MQTT broker" in capsys.readouterr().err


def test_displays():
    plan = {"version": 2, "strategy": "segment", "sizes": {"attn": 12, "mlp": 3072, "vocab": 50257},
            "predicted_iteration_s": 0.5, "ideal_iteration_s": 0.45, "comm_s": 0.05,
            "entries": [{"node_id": "n100", "rank": 0, "attn": 8, "mlp": 2048, "vocab": 33504, "predicted_compute_s": 0.4,
                         "predicted_memory": 2 << 30, "memory_cap": 8 << 30}]}
    text = format_plan(plan)
    assert "plan v2 (segment; 12 attention units, 3072 MLP columns, 50257 vocabulary rows)" in text
    assert "n100" in text and "2048.0" in text and "33504" in text
    state = {"job_id": "j", "name": "t", "phase": "running", "step": 3, "total_steps": 10, "epoch": 0,
             "loss": 0.5, "eval_metric": None, "iteration_s": 0.5, "eta_s": 3.5, "predicted_s": {"n100": 0.4},
             "measured_s": {"n100": 0.42}, "idle_ratio": {"n100": 0.03}, "events": ["x"], "error": None,
             "predicted_comm_s": {"n100": 0.05}, "measured_comm_s": {"n100": 0.04}, "compute_mape_pct": 5.0,
             "comm_mape_pct": 25.0}
    text = format_state(state)
    assert "0.0500" in text and "0.0400" in text and "prediction MAPE: compute 5.0%, comm 25.0%" in text
    assert "step 3/10" in text and "ETA 4 s" in text and "3.0" in text
    assert "overlap:" not in text
    assert "  overlap: bwd (the overlap trial's fastest)" in format_state({**state, "overlap_kept": "bwd"})
    # a plan that overlaps and tries its modes first says so
    tried = {**plan, "overlap": {"backward": True, "chunks": 2},
             "trial": {"modes": [{"backward": True, "chunks": 2}, {"backward": True, "chunks": 1},
                                 {"backward": False, "chunks": 1}], "rounds": 3, "after": 2}}
    assert "; overlap c2; overlap trial of c2, bwd, off over its first 14 steps" in format_plan(tried)


def test_state_shows_peak_memory_per_node():
    state = {"job_id": "j", "name": "t", "phase": "running", "step": 3, "total_steps": 10, "epoch": 0,
             "predicted_s": {}, "measured_s": {}, "idle_ratio": {}, "events": [], "error": None,
             "predicted_peak_bytes": {"n100": 1200 << 20, "pi5": 700 << 20}, "peak_rss_bytes": {"n100": 1150 << 20}}
    text = format_state(state)
    assert "predicted peak MiB" in text
    line = next(ln for ln in text.splitlines() if "n100" in ln)
    assert "1200" in line and "1150" in line
    assert "-" in next(ln for ln in text.splitlines() if "pi5" in ln)  # not measured yet


def test_state_shows_live_re_plans_and_the_last_reason():
    entries = [{"node_id": n, "rank": r, "attn": a, "mlp": c, "vocab": v} for n, r, a, c, v in
               (("n0", 0, 8, 64, 32), ("n1", 1, 4, 36, 5))]
    state = {"job_id": "j", "name": "t", "phase": "running", "step": 30, "total_steps": 60, "epoch": 0,
             "predicted_s": {}, "measured_s": {}, "idle_ratio": {}, "events": [], "error": None,
             "plan": {"entries": entries}, "replans": 2,
             "last_replan_reason": "kept: predicted gain 1.0% <= 5.0%"}
    text = format_state(state)
    assert "live re-plans: 2 (now attn=8,4;mlp=64,36;vocab=32,5)" in text
    assert "last re-plan decision: kept: predicted gain 1.0% <= 5.0%" in text
    assert "re-plan" not in format_state({**state, "replans": 0, "last_replan_reason": None})


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_a_timeout_that_is_not_a_positive_finite_number_of_seconds_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        xronos(["job", "status", "--port", "1", f"--timeout={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--timeout" in err and value in err, err


def test_a_submit_nobody_answers_says_the_job_may_still_be_checked(tmp_path, capsys):
    """A real broker and no gateway: the submit says what it waits for, and at the timeout that a
    running gateway may still be inspecting or profiling the job (a second submit would duplicate it)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from brokers import start_broker

    (tmp_path / "j.toml").write_text(TOML)
    with start_broker(tmp_path) as broker:
        code = xronos(["job", "submit", str(tmp_path / "j.toml"), "--host", broker.host, "--port", str(broker.port),
                       "--timeout", "1.5"])
    out, err = capsys.readouterr()
    assert code == 2 and out.startswith("submitting 't': the owner inspects the model and data")
    assert "no answer to job/submit within 1.5 s: if the gateway is running, the job may still be in its " \
           "inspection or profiling" in err and "xronos job status" in err, err


def test_ctrl_c_while_a_submit_waits_says_the_job_may_go_on(tmp_path):
    """Ctrl-C stops the waiting, not the gateway: the user is told how to find and stop the job."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from brokers import start_broker

    (tmp_path / "j.toml").write_text(TOML)
    with start_broker(tmp_path) as broker:
        proc = subprocess.Popen([sys.executable, "-m", "xronos.cli", "job", "submit", str(tmp_path / "j.toml"),
                                 "--host", broker.host, "--port", str(broker.port), "--timeout", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
                                # as at a terminal: a suite run in the background passes SIGINT on ignored
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert proc.stdout.readline().startswith("submitting 't'")
        time.sleep(1.0)  # waiting for the answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopped waiting: the gateway may still plan and start 't'; `xronos job status` lists it" in err
    assert "xronos job: interrupted" in err and "Traceback" not in err, err
