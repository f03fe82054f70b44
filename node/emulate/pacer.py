"""The emulator's paced CPU: a rank runs at full core speed and then waits out the rest of what a
core of its share would have taken, at every point where it meets its peers.

Why: a CFS quota is not a slow core (`xronos.node.emulate.confinement`, `bench/results/demo-idle.md`). A rank
that waited in a collective comes back with quota in hand and runs its next segment at full speed
(measured: the share-0.3 rank ran its segments at 1.7-2.5x its share's speed), and a rank whose quota
is spent stalls inside the next all-reduce, whose ring needs every rank's CPU. A slow core banks
nothing while it waits and is never stopped half-way through a collective. Pacing gives exactly
that at the grain that matters to TP — the barrier segment: before each collective the rank sleeps
until its wall time since the last one is (CPU seconds it used) / share, so a segment of c CPU
seconds takes c / share wherever it falls, and the collective itself runs unhindered.

A process is paced when the emulator placed it in a paced group (`Confinement(cpu_mode="pace")`):
the group's share is in a file named after the cgroup (`share_path`), looked up once, on first use,
from /proc/self/cgroup. Processes started inside a confined one (a node's profiler and training
ranks) inherit its group, and so its share. Everywhere else (a real box) `current()` is None and
nothing changes.

What pacing does not model: the CPU the collective's own work needs (Gloo's threads copy and sum
at the host core's speed — microseconds per call here, against milliseconds of compute), and how
the host's other ranks share its cores (the emulator pins each rank to a core and scales the shares
so that no core carries more than PACE_CORE_LOAD of them; ranks that compute at the same moment on
one core still crowd each other, and a crowded-out rank ends its segment later than its share says:
`bench/results/pace.md`).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from xronos.node.tp.clock import Clock, Launcher, Meet, Runner

PACE_ROOT = Path("/run/xronos-pace")  # emulator's share files: <run group>/<rank group>
_PR_SET_TIMERSLACK = 29


def share_path(run: str, rank_group: str, root: Path = PACE_ROOT) -> Path:
    return root / run / rank_group


def _cgroup_tail(proc_cgroup: Path) -> tuple[str, str] | None:
    """(run group, rank group) of this process's cpu cgroup (v1 "cpu" line, else the v2 one)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            paths[name] = path
    path = paths.get("cpu", paths.get(""))
    parts = [p for p in (path or "").split("/") if p]
    return (parts[-2], parts[-1]) if len(parts) >= 2 else None


def share_file(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = PACE_ROOT) -> Path | None:
    """Where this process's paced share would be (None: it is in no run's rank group)."""
    tail = _cgroup_tail(proc_cgroup)
    return None if tail is None else share_path(*tail, root=root)


def read_share(path: Path | None) -> float | None:
    """The share in a share file, None when there is none (or it is not a share)."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        share = float(text)
    except ValueError:
        return None
    return share if 0 < share <= 1 else None


def share_of_process(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = PACE_ROOT) -> float | None:
    """The paced share this process's cgroup was given, or None (not paced)."""
    return read_share(share_file(proc_cgroup, root))


class Pacer:
    """Sleeps a rank to the speed of a core of `share`: `pace()` before it waits for peers (or reads
    a clock it reports), `restart()` once the wait is over (the wait is not compute)."""

    RECHECK_S = 0.5  # how often the share file is looked at again (the bench changes shares mid-run)

    def __init__(self, share: float, *, path: Path | None = None, cpu_clock=time.process_time,
                 wall_clock=time.perf_counter, sleep=time.sleep) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a paced share must be in (0, 1], got {share!r}")
        self.share = share
        self.path = path
        self._cpu, self._wall, self._sleep = cpu_clock, wall_clock, sleep
        self._checked = wall_clock()
        self.slept_s = 0.0  # total, for the record
        self.restart()

    def restart(self) -> None:
        self._cpu0, self._wall0 = self._cpu(), self._wall()

    def pace(self) -> None:
        """Sleep until the wall time since the mark is the CPU time used since it over the share;
        then the mark moves here. A segment that already took longer (contention) pays nothing."""
        cpu, wall = self._cpu(), self._wall()
        if self.path is not None and wall - self._checked > self.RECHECK_S:
            self._checked = wall
            self.share = read_share(self.path) or self.share
        owed = (cpu - self._cpu0) / self.share - (wall - self._wall0)
        if owed > 0:
            self._sleep(owed)
            self.slept_s += owed
        self._cpu0, self._wall0 = cpu, self._wall()


_UNSET = object()
_current: object = _UNSET


def current() -> Pacer | None:
    """This process's pacer (None when it is not in a paced group); resolved once."""
    global _current
    if _current is _UNSET:
        path = share_file()
        share = read_share(path)
        _current = None if share is None else Pacer(share, path=path)
        if share is not None:
            # The default 50 us timer slack would stretch every short sleep; a paced rank sleeps
            # once per collective (the calling thread's setting, which is the one that sleeps).
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
            except (OSError, AttributeError):
                pass
    return _current  # type: ignore[return-value]


def reset_for_tests(pacer: Pacer | None | object = _UNSET) -> None:
    global _current
    _current = pacer


# A paced rank alone on a core still shares it with the kernel's softirq work and Gloo's threads:
# at share 0.9 it ran at 0.81-0.94 of its share (`python -m xronos.bench.barrier_idle --cpu-mode
# pace`). So pace mode dilates time: every share is scaled by one factor such that no core carries
# more than PACE_CORE_LOAD; the devices' speed ratios, which are what a plan depends on, stay the same.
PACE_CORE_LOAD = 0.85


def assign_cores(shares: list[float], cores: list[int]) -> list[int]:
    """A core per rank: largest share first, onto the least loaded core (which minimises the
    heaviest core's load well enough for a handful of ranks)."""
    load = dict.fromkeys(cores, 0.0)
    out = [-1] * len(shares)
    for r in sorted(range(len(shares)), key=lambda r: -shares[r]):
        out[r] = min(cores, key=lambda c: load[c])
        load[out[r]] += shares[r]
    return out


def heaviest_core(shares: list[float], cores: list[int]) -> float:
    """The largest sum of shares on one core under `assign_cores`."""
    placed = assign_cores(shares, cores)
    return max(sum(s for s, c in zip(shares, placed) if c == core) for core in cores)


def pace_dilation(shares: list[float], cores: list[int]) -> float:
    """The factor (<= 1) every paced share is scaled by so that no core carries more than
    PACE_CORE_LOAD (e.g. 0.9, 0.5, 0.3, 0.3 on 2 cores: heaviest core 0.5 + 0.3 + 0.3, factor 0.77)."""
    return min(1.0, PACE_CORE_LOAD / heaviest_core(shares, cores))


class PacedClock(Clock):
    """Pace mode's clock (`xronos.node.tp.clock`): wall time, the rank sleeping to its share's speed
    before it meets its peers (`Pacer.pace`) and restarting the count once the meeting is over."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer

    def meet(self, meet: Meet, run: Runner, rank: int, world: int) -> tuple[float, float]:
        self.pacer.pace()
        try:
            return super().meet(meet, run, rank, world)
        finally:
            self.pacer.restart()

    def launch(self, meet: Meet, start: Launcher, rank: int, world: int) -> object:
        """An asynchronous collective: the rank pays for its compute where it launches it."""
        self.pacer.pace()
        try:
            return super().launch(meet, start, rank, world)
        finally:
            self.pacer.restart()

    def skipped(self, meet: Meet) -> float:
        """Alone (the profiler): where a training rank would meet its peers, it pays as there."""
        self.pacer.pace()
        self.pacer.restart()
        return self.now()

    def settle(self) -> None:
        """A paced rank pays for its last compute (the optimizer step) within the iteration."""
        self.pacer.pace()

    def describe(self) -> dict[str, object]:
        return {"clock": self.name, "cpu_mode": "pace", "paced_share": self.pacer.share}
