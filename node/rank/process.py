"""The node service's handle on a job's rank process (`python -m xronos.node.rank.jobrank`).

The rank is a `spawn.ChildProcess`: boxed under the box's memory and task limits, in a process
group of its own, dying with the node. It gets its config (a `JobRankConfig`) as a JSON file, the
service's orders (`messages.RankOrder`) as JSON lines on stdin, and writes its events
(`messages.RankEvent`) on its events pipe; each line is validated once, here, as it is drained, so
the control loop only ever sees typed events. stdout/stderr go to a log file next to the config,
whose tail explains a failure. `kill()` ends the rank's whole process group, so a cancel leaves
nothing behind and returns all of its memory; `stop()` does that on a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import structlog
from pydantic import ValidationError

from xronos.node.box.limits import ChildLimits
from xronos.node.rank import messages as msg
from xronos.node.rank.spawn import ChildProcess, rank_env
from xronos.node.runconfig import JobRankConfig

log = structlog.get_logger(__name__)


def child_env(threads: int, gloo_ifname: str | None) -> dict[str, str]:
    """The ranks' environment, with Gloo on the configured interface (or its own choice)."""
    env = rank_env(threads)
    if gloo_ifname:
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)
    return env


class RankProcess:
    def __init__(self, workdir: Path, config: JobRankConfig, env: dict[str, str],
                 limits: ChildLimits | None = None) -> None:
        """Start the rank with `config`, boxed by `limits`."""
        workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = workdir / "rank.json"
        # It holds the job's group key (`RunConfig.group_key`): readable by this user alone, whatever
        # the umask (a node run by hand has 022; the unit's UMask=0027 still lets the group read).
        cfg_path.unlink(missing_ok=True)  # a file left by an earlier version of this rank keeps its mode
        fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(config.model_dump_json(indent=1))
        self.log_path = workdir / "rank.log"
        self.process = ChildProcess("xronos.node.rank.jobrank", str(cfg_path), env=env, name=f"rank-{config.job_id}",
                                    limits=limits, events=True, orders=True, log=self.log_path)
        self.proc = self.process.proc
        log.info("rank process started", pid=self.proc.pid, job=config.job_id,
                 version=config.plan_version, rank=config.run.rank)

    def drain(self) -> list[msg.RankEvent]:
        """The events it wrote since the last call; a line that is not one is logged and dropped."""
        out = []
        for line in self.process.drain_lines():
            try:
                out.append(msg.read_event(line))
            except ValidationError as exc:
                log.warning("unreadable event from rank process", line=line[:200], error=str(exc)[:300])
        return out

    def send(self, order: msg.RankOrder) -> None:
        self.process.send_line(order.model_dump_json())  # a rank already gone: its exit reports it

    def poll(self) -> int | None:
        return self.proc.poll()

    def finished(self) -> bool:
        """Exited and every event it wrote has been read."""
        return self.process.finished()

    def tail(self, n: int = 1500) -> str:
        """The last `n` bytes of its log."""
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def why(self) -> str:
        """How it ended: its exit code or signal, and whether its memory limit ended it."""
        return self.process.why()

    def stop(self, grace_s: float = 3.0) -> threading.Thread:
        """`kill(grace_s)` on a thread of its own, so that the control loop does not wait out the
        grace: a cancel is answered at once, the process gone within the grace."""
        t = threading.Thread(target=self.kill, args=(grace_s,), name=f"rank-stop-{self.proc.pid}", daemon=True)
        t.start()
        return t

    def kill(self, grace_s: float = 3.0) -> None:
        """Ask it to stop, then end its process group; returns once it is gone."""
        if self.proc.poll() is None:
            self.send(msg.Cancel())
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.process.close()
