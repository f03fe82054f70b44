"""The emulator's poller: CFS quotas enforced at a 0.5 ms grain instead of the scheduler tick
(`Poller`; used by `xronos.node.emulate.confinement.Confinement` in its quota mode)."""

from __future__ import annotations

import os
import time
from pathlib import Path

POLL_S = 0.0005  # how often the poller makes the kernel account each rank's CPU time


class Poller:
    """Quota enforcement at a fine grain: a process (outside the groups) that reads every confined
    process's CPU clock every `POLL_S`.

    The kernel charges a running task's CPU time to its group's quota only when it accounts it: at
    the scheduler tick (4 ms at CONFIG_HZ=250) or a scheduling event on that CPU. A lone compute
    thread meets no event, so a 1 ms quota was overrun to a whole tick and the debt paid back over
    several periods: measured on this 2-core VM, a spinning rank ran 4 ms bursts and stalled 12 / 8 /
    4 ms at shares 0.3 / 0.5 / 0.9, i.e. 0.23 / 0.33 / 0.50 of a core — another device ratio than
    the one asked for, and a 12 ms stall whenever a collective caught a rank in debt. Reading a
    process's CPU clock (clock_gettime on its clock_getcpuclockid) makes the kernel update the
    running thread's runtime, which charges its group and throttles it at once when the quota is
    spent: with a 0.5 ms poll the same rank ran ~1.1 ms and stalled ~2.5 ms, 0.29 of a core.
    The poller's own CPU is outside the quotas."""

    def __init__(self, dirs: list[Path], interval_s: float = POLL_S) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from xronos.node.emulate.poller import poll_main; poll_main()", repr(interval_s),
             *map(str, dirs)], stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def poll_main() -> None:
    """The poller's loop (`Poller`): argv = interval seconds, then the rank groups' directories.
    Ends when its parent does or the groups are gone."""
    import ctypes
    import sys

    interval, dirs = float(sys.argv[1]), [Path(d) for d in sys.argv[2:]]
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    clocks: dict[int, int] = {}
    n = 0
    while True:
        if n % 100 == 0:  # refresh the process list (ranks and profilers start and end)
            if os.getppid() != parent:
                return
            try:
                pids = {int(p) for d in dirs for p in (d / "cgroup.procs").read_text().split()}
            except FileNotFoundError:
                return
            except OSError:
                pids = set(clocks)
            for pid in set(clocks) - pids:
                del clocks[pid]
            for pid in pids - set(clocks):
                cid = ctypes.c_int()
                if libc.clock_getcpuclockid(pid, ctypes.byref(cid)) == 0:
                    clocks[pid] = cid.value
        for pid, cid in list(clocks.items()):
            try:
                time.clock_gettime(cid)
            except OSError:  # it exited
                del clocks[pid]
        n += 1
        time.sleep(interval)
