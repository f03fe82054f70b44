"""A dying rank takes the run down — through the launcher at once, and through Gloo's timeout
when nobody supervises the ranks. Real processes, real SIGKILL."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import runkit
from xronos.node.rank.local import RankFailed, free_port, launch_local
from xronos.node.rank.spawn import rank_env
from xronos.node.runconfig import RunConfig
from xronos.node.rank.validate import model_sizes
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow
PROGRESS = re.compile(r"\b([1-9]\d*)/1000000\b")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launch")
    model = runkit.make_model(root / "gpt2", "gpt2", "causal-lm")
    rng = random.Random(0)
    data = runkit.write_rows(root / "d.jsonl", [{"text": t, "label": rng.randrange(2)} for t in runkit.texts(16)])
    return model, data


def _cfg(setup, units, **kw) -> RunConfig:
    model, data = setup
    base = dict(model_dir=str(model), data_path=str(data), task="causal-lm",
                layout=Layout.tied(list(units), model_sizes(model)),
                batch_size=4, seq_len=runkit.SEQ_LEN, lr=1e-4, max_steps=1_000_000, seed=0)
    return runkit.run_config(**{**base, **kw})


class _StderrSpy:
    """Stands in for sys.stderr: the launcher echoes rank 0's progress bar here."""

    def __init__(self) -> None:
        self.text, self.progressed = "", threading.Event()

    def write(self, s: str) -> int:
        self.text += s
        if PROGRESS.search(self.text):
            self.progressed.set()
        return len(s)

    def flush(self) -> None:
        pass


def test_launcher_kills_the_rest_and_names_the_dead_rank(setup, monkeypatch) -> None:
    spy = _StderrSpy()
    monkeypatch.setattr(sys, "stderr", spy)
    procs: dict[int, subprocess.Popen] = {}
    killed_at: list[float] = []

    def killer() -> None:
        if spy.progressed.wait(timeout=240):
            killed_at.append(time.monotonic())
            os.kill(procs[1].pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(RankFailed) as err:
        launch_local(_cfg(setup, (4, 4, 4), gloo_timeout_s=60), 3, wrap=lambda r, p: procs.__setitem__(r, p))
    assert killed_at, f"training never progressed; rank 0 said: {spy.text[-2000:]}"
    assert time.monotonic() - killed_at[0] < 10  # not the 60 s Gloo timeout: the launcher acted
    assert err.value.rank == 1 and err.value.returncode == -signal.SIGKILL
    assert "rank 1 was killed by signal 9" in str(err.value)
    assert all(p.poll() is not None for p in procs.values())


def test_launcher_reports_a_rank_error_with_its_stderr(setup, tmp_path: Path) -> None:
    cfg = _cfg(setup, (6, 6), data_path=str(tmp_path / "vanished.csv"), max_steps=2, gloo_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        launch_local(cfg, 2, echo_rank0=False)
    assert time.monotonic() - t0 < 60
    assert err.value.rank == 0 and err.value.returncode == 1
    assert "FileNotFoundError: data file" in err.value.tail and "vanished.csv" in err.value.tail


def test_unsupervised_ranks_exit_within_the_gloo_timeout(setup, tmp_path: Path) -> None:
    """No launcher: rank 1 is SIGKILLed mid-run; ranks 0 and 2 must fail on their own.
    (The timeout also bounds start-up skew between ranks, so it cannot be tiny on a busy machine.)"""
    timeout = 60.0
    port = free_port()
    cfg = _cfg(setup, (5, 3, 4), gloo_timeout_s=timeout)
    procs = []
    for r in range(3):
        path = tmp_path / f"rank{r}.json"
        cfg.for_rank(r, port).write(path)
        procs.append(subprocess.Popen([sys.executable, "-m", "xronos.node.rank.localrank", str(path)],
                                      env=rank_env(1), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL))
    try:
        progressed = threading.Event()

        def watch() -> None:  # rank 0's progress bar
            seen = b""
            while chunk := os.read(procs[0].stderr.fileno(), 4096):
                seen += chunk
                if PROGRESS.search(seen.decode(errors="replace")):
                    progressed.set()

        threading.Thread(target=watch, daemon=True).start()
        for r in (1, 2):
            threading.Thread(target=lambda p=procs[r]: p.stderr.read(), daemon=True).start()
        deadline = time.monotonic() + 300
        while not progressed.wait(timeout=1):
            assert time.monotonic() < deadline, "training never progressed"
            assert all(p.poll() is None for p in procs), f"a rank exited before the kill: {[p.poll() for p in procs]}"
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        for r in (0, 2):
            code = procs[r].wait(timeout=timeout + 20)
            assert code != 0, f"rank {r} exited 0 after its peer died"
        elapsed = time.monotonic() - t0
        print(f"peers of the killed rank exited after {elapsed:.1f} s (Gloo timeout {timeout:.0f} s)")
        assert elapsed <= timeout + 10
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
