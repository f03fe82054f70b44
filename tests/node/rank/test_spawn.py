"""The one child-process launcher (node/rank/spawn.py), with a real child: its events come back on
the pipe, its orders arrive on stdin, it leads its own process group, and `close` leaves nothing
of it behind — what it started included."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from xronos.node.rank.spawn import EVENTS_FD, ChildProcess, rank_env

CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    from xronos.node.rank.spawn import EVENTS_FD, EventPipe, rank_env

    pipe = EventPipe()
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pipe.send_json('{"started": %d, "grandchild": %d, "inherited": %s}'
                   % (os.getpid(), grandchild.pid, "true" if EVENTS_FD in rank_env(1) else "false"))
    print("to stderr", file=sys.stderr, flush=True)
    for line in sys.stdin:
        if line.strip() == "fail":
            sys.exit(3)
        pipe.send_json('{"echo": "%s"}' % line.strip())
    time.sleep(600)
""")


@pytest.fixture
def module(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "spawn_probe_child.py").write_text(CHILD)
    return {**rank_env(1), "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _lines(child: ChildProcess, n: int) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + 60
    while len(got) < n:
        got += child.drain_lines()
        assert time.monotonic() < deadline and child.poll() is None, child.tail()
        time.sleep(0.02)
    return got


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_events_orders_and_the_process_group(module) -> None:
    import json

    child = ChildProcess("spawn_probe_child", env=module, name="probe", events=True, orders=True)
    try:
        first = json.loads(_lines(child, 1)[0])
        assert first["started"] == child.pid and first["inherited"] is False  # a pipe is its child's own
        assert os.getpgid(child.pid) == child.pid  # it leads its own process group
        assert child.send_line("hello")
        assert json.loads(_lines(child, 1)[0]) == {"echo": "hello"}
    finally:
        child.close()
    assert child.why() == f"signal {signal.SIGKILL}"
    deadline = time.monotonic() + 10
    while not _gone(first["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(first["grandchild"])  # what it started went with its group
    assert not child.send_line("late")  # gone: said, not raised


def test_a_failing_child_tells_its_status_and_its_tail(module) -> None:
    child = ChildProcess("spawn_probe_child", env=module, name="probe", events=True, orders=True)
    try:
        _lines(child, 1)
        child.send_line("fail")
        assert child.wait(60) == 3
        assert "to stderr" in child.tail()
    finally:
        child.close()
    assert child.why() == "exit code 3"


def test_the_child_of_no_pipe_is_told_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != EVENTS_FD}
    (tmp_path / "spawn_probe_nopipe.py").write_text("from xronos.node.rank.spawn import EventPipe\nEventPipe()\n")
    child = ChildProcess("spawn_probe_nopipe", env={**env, "PYTHONPATH": str(tmp_path)}, name="probe")
    try:
        assert child.wait(60) == 1
        assert f"{EVENTS_FD} is not set" in child.tail()
    finally:
        child.close()
