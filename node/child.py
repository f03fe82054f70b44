"""The node service's handle on its training child process (`xronos.node.jobproc`).

The child gets its config (a `JobRankConfig`) as a JSON file, its controls as JSON lines on stdin, and writes events
as JSON lines on an inherited pipe, which a reader thread turns into a queue the control loop
drains without blocking. stdout/stderr go to a log file next to the config, whose tail explains a
failure. The child runs boxed (`node/box/limits.py`): under the box's memory and task limits, dying
with the node. `kill()` ends the child's whole process group, so a cancel leaves nothing behind
and returns all of its memory; `stop()` does that on a thread of its own.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from xronos.node.box.limits import Child, ChildLimits, boxed_argv
from xronos.node.launch import rank_env
from xronos.node.runconfig import JobRankConfig

log = structlog.get_logger(__name__)


def child_env(threads: int, gloo_ifname: str | None) -> dict[str, str]:
    """The local launcher's rank environment, with Gloo on the configured interface (or its choice)."""
    env = rank_env(threads)
    if gloo_ifname:
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)
    return env


class RankProcess:
    def __init__(self, workdir: Path, config: JobRankConfig, env: dict[str, str],
                 limits: ChildLimits | None = None) -> None:
        """Start the child with `config` (its `events_fd` is set here), boxed by `limits`."""
        workdir.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        cfg_path = workdir / "rank.json"
        cfg_path.write_text(config.model_copy(update={"events_fd": write_fd}).model_dump_json(indent=1))
        self.log_path = workdir / "rank.log"
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        with open(self.log_path, "ab") as logf:
            self.box = Child(boxed_argv("xronos.node.jobproc", str(cfg_path)), env, limits, f"rank-{config.job_id}",
                             stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, pass_fds=(write_fd,))
        self.proc = self.box.proc
        os.close(write_fd)
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()
        log.info("rank process started", pid=self.proc.pid, job=config.job_id,
                 version=config.plan_version, rank=config.run.rank)

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as stream:
            for line in stream:
                try:
                    self.events.put(json.loads(line))
                except ValueError:
                    log.warning("unparsable event from rank process", line=line[:200])

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def send(self, action: str, **fields: Any) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"action": action, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # already gone; exit handling reports it

    def poll(self) -> int | None:
        return self.proc.poll()

    def finished(self) -> bool:
        """Exited and every event it wrote has been read."""
        return self.proc.poll() is not None and not self._reader.is_alive()

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def why(self) -> str:
        """How it ended: its exit code or signal, and whether its memory limit ended it."""
        code = self.proc.poll()
        return "still running" if code is None else self.box.why(code)

    def stop(self, grace_s: float = 3.0) -> threading.Thread:
        """`kill(grace_s)` on a thread of its own, so that the control loop does not wait out the
        grace: a cancel is answered at once, the process gone within the grace."""
        t = threading.Thread(target=self.kill, args=(grace_s,), name=f"rank-stop-{self.proc.pid}", daemon=True)
        t.start()
        return t

    def kill(self, grace_s: float = 3.0) -> None:
        """Ask it to stop, then end its process group; returns once it is gone."""
        if self.proc.poll() is None:
            self.send("cancel")
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.box.kill()
        self.proc.wait()
        self.box.reaped()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self._reader.join(timeout=2.0)
