"""`xronos run` stopped by a signal, as `timeout`, `kill` or Ctrl-C stop it: it says so, exits
143 (SIGTERM) or 130 (SIGINT), and leaves no rank process and no temporary file behind (the ranks'
configs hold the job's group key)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import runkit  # noqa: E402  (the run test kit lives with the node tests)

from xronos.cli.main import join_dash_values  # noqa: E402


def interruptible() -> None:
    """As at a terminal: a suite started in the background (`cmd &` without job control) passes
    SIGINT on ignored, and Python then installs no KeyboardInterrupt handler, so Ctrl-C is lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_a_signal_stops_the_run_and_cleans_up(tmp_path: Path, sig, code, said) -> None:
    model, data = runkit.small_classifier(tmp_path / "case")
    argv = runkit.run_argv(model, data, "classify", (4, 8), tmp_path / "out")
    i = argv.index("--max-steps")
    argv[i + 1] = "100000"  # still training when the signal comes
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "xronos.cli", *argv], env={**os.environ, "TMPDIR": str(tmp)},
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("xronos-ranks-*/rank1.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp.glob("xronos-ranks-*/rank1.json")), "the ranks never started"
    time.sleep(2.0)  # into training
    proc.send_signal(sig)  # to the command alone, as `kill PID` sends it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert f"xronos run: {said}" in err and "Traceback" not in err, err[-2000:]
    assert list(tmp.iterdir()) == []  # the ranks' configs and the metrics directory are gone
    alive = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout.split()
    assert alive == []  # no rank left running


def test_a_negative_number_in_any_form_reaches_the_options_own_check() -> None:
    assert join_dash_values(["run", "--lr", "-1e-3", "--reserve-mb", "-inf", "--units", "-2,10"]) == [
        "run", "--lr=-1e-3", "--reserve-mb=-inf", "--units=-2,10"]
    assert join_dash_values(["run", "--json", "-h"]) == ["run", "--json", "-h"]  # an option, not a number
    assert join_dash_values(["plan", "--", "--lr", "-1e-3"]) == ["plan", "--", "--lr", "-1e-3"]
