"""Heterogeneity emulator: confine each local rank to a CPU share (and optionally a memory cap).

One machine stands in for a set of edge boxes by giving every rank its own cgroup with a CFS
bandwidth quota: a rank with share 0.3 may use 0.3 of one core per period, whatever its thread
count, so a "Raspberry Pi 5" rank is slower than an "N100" rank by the ratio of their shares.
cgroup v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.limit_in_bytes`) and v2
(`cpu.max`, `memory.max`) are both supported; whichever hierarchy has the controller mounted and
writable is used. Groups are created *below the cgroup this process already lives in* (so a
supervisor's accounting still covers them), one parent per run with one child per rank, and are
removed on exit, also on error. While the groups exist a poller process (`Poller`) makes the kernel
charge each rank's CPU time every 0.5 ms, so a quota binds at that grain rather than at the
scheduler tick.

A quota is not a slow core: a rank runs at full core speed until its quota for the period is spent,
then stops, and a rank that waited (in a collective) comes back with quota in hand. Segments shorter
than the quota run at full speed and the debt is paid later, often inside a collective
(`bench/results/demo-idle.md`, `python -m xronos.bench.barrier_idle`).

So there is a second way (`cpu_mode="pace"`, or XRONOS_EMULATOR_CPU=pace): no quota; each rank is
pinned to a core and paced — before every collective it sleeps until its wall time is its CPU time
over its share (`xronos.node.emulate.pacer`), which is what a slow core takes for the same work, with nothing
banked and no stall inside a collective. The shares are scaled by one factor so that no core carries
more than PACE_CORE_LOAD of them (time dilation: the ratios between devices stay).

Usage:
    with Confinement([RankLimits(0.45), RankLimits(0.3, memory_bytes=1 << 30)]) as conf:
        popen = subprocess.Popen(...); conf.add(rank, popen.pid)   # or launch_local(wrap=conf.wrap)
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from pathlib import Path

import structlog

from xronos.common.scoped import Scoped
from xronos.node.emulate import pacer
from xronos.node.emulate.cpumode import (
    CPU_MODES, DEFAULT_PERIOD_US, default_cpu_mode, default_estimator, default_pin, default_poll_s, period_for,
)
from xronos.node.emulate.link import Link
from xronos.node.emulate.vclock import Box, box_path, write_box
from xronos.node.emulate.cgroupfs import Controller, cpu_limit_of, find_controller, usable_cores
from xronos.node.emulate.pacer import assign_cores, heaviest_core, pace_dilation
from xronos.node.emulate.poller import Poller
from xronos.node.emulate.request import (  # noqa: F401  (importers take them from here too)
    MIN_QUOTA_US, EmulatorError, RankLimits, host_memory_bytes, validate_limits, validate_virtual,
)

log = structlog.get_logger(__name__)


class Confinement(Scoped):
    """Per-run cgroups, one per rank. A context manager: groups exist only inside `with`."""

    def __init__(self, limits: list[RankLimits], *, period_us: int = DEFAULT_PERIOD_US,
                 cpu: Controller | None = None, memory: Controller | None = None,
                 top_weight: bool = False, poll_s: float | None | str = "default",
                 cpu_mode: str | None = None, pin: bool | None = None, link: Link | None = None,
                 estimator: str | None = None, window: int | None = None) -> None:
        """`link`, `estimator`, `window`: virtual mode's modelled network (1 Gbit/s by default) and
        burst estimator (XRONOS_EMULATOR_ESTIMATOR, else the window minimum over 32 samples)."""
        self.limits = list(limits)
        self.period_us = period_us
        self.cpu_mode = default_cpu_mode() if cpu_mode is None else cpu_mode
        if self.cpu_mode not in CPU_MODES:
            raise EmulatorError(f"cpu_mode must be one of {', '.join(CPU_MODES)}, got {self.cpu_mode!r}")
        self.link = link or Link()
        self.estimator = default_estimator() if estimator is None else estimator
        self.window = window
        if self.cpu_mode == "virtual":
            validate_virtual(self.limits, host_memory_bytes())  # before any group or process exists
            try:
                self._box(self.limits[0].cpu_share)  # the estimator and window are checked here
            except ValueError as exc:
                raise EmulatorError(str(exc)) from None
        if self.cpu_mode in ("pace", "virtual"):
            poll_s = None  # no quota to enforce
        # poll_s: the `Poller`'s interval (None: quotas enforced at the scheduler tick only).
        if poll_s == "default":
            poll_s = default_poll_s()
        if poll_s is not None and not 0 < poll_s < 1:
            raise EmulatorError(f"poll_s must be in (0, 1) s, got {poll_s!r}")
        self.poll_s = poll_s
        self._poller: Poller | None = None
        # A quota is only a ceiling: on a machine other work keeps busy, a group at the default
        # CFS weight gets the leftovers, not its quota, and every emulated device ends up equally
        # slow. With the top weight the quota is what binds (the groups still never exceed it).
        self.top_weight = top_weight
        self.cpu = cpu or find_controller("cpu")
        if self.cpu is None:
            raise EmulatorError(
                "no writable cgroup cpu controller (neither v1 cpu.cfs_quota_us nor v2 cpu.max); "
                "run as root on a machine with the cpu controller mounted")
        self.parent_limit = cpu_limit_of(self.cpu)
        if self.cpu_mode != "virtual":
            validate_limits(self.limits, usable_cores(), self.parent_limit)
        shares, cores = [lim.cpu_share for lim in self.limits], sorted(os.sched_getaffinity(0))
        pin = default_pin() if pin is None else pin  # honoured where no core gets over one core of quota
        # (virtual time does not depend on the cores' load: a pinned virtual run is the validation's)
        pinned = self.cpu_mode == "pace" or (pin and (self.cpu_mode == "virtual" or heaviest_core(shares, cores) <= 1.0))
        if pin and not pinned:
            log.warning("confinement.not_pinned", shares=shares, cores=cores, reason="a core would be overloaded")
        self.cores = assign_cores(shares, cores) if pinned else None
        # pace mode: the paced shares are the asked ones times this (fixed for the run, `pace_dilation`)
        self.dilation = pace_dilation(shares, cores) if self.cpu_mode == "pace" else 1.0
        self.memory: Controller | None = None
        if any(lim.memory_bytes is not None for lim in self.limits):
            self.memory = memory or find_controller("memory")
            if self.memory is None:
                raise EmulatorError("a memory cap was asked for but no writable cgroup memory "
                                    "controller exists (v1 memory.limit_in_bytes or v2 memory.max)")
        self.name = f"xronos-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._dirs: list[Path] = []  # created groups, parents first
        self._pace_dir: Path | None = None  # the paced shares' files (pace mode), the boxes' (virtual)
        self._rank_dirs: dict[int, list[Path]] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def _mkdir(self, path: Path) -> Path:
        path.mkdir()
        self._dirs.append(path)
        return path

    def _create(self) -> None:
        ctls = [c for c in (self.cpu, self.memory) if c is not None]
        # cpu and memory may share one v2 hierarchy: create each run group only once.
        bases = {c.base for c in ctls}
        run_dirs = {base: self._mkdir(base / self.name) for base in bases}
        for base, run in run_dirs.items():
            if any(c.version == 2 and c.base == base for c in ctls):
                wanted = [c.kind for c in ctls if c.base == base and c.version == 2]
                self._enable_v2(base, wanted)
                self._enable_v2(run, wanted)
        if self.top_weight:
            self._write_weight(run_dirs[self.cpu.base])  # type: ignore[union-attr]
        for rank, lim in enumerate(self.limits):
            dirs = []
            for base, run in run_dirs.items():
                dirs.append(self._mkdir(run / f"rank{rank}"))
            self._rank_dirs[rank] = dirs
            if self.cpu_mode == "quota":
                self._write_cpu(self._dir_for(rank, self.cpu), lim.cpu_share)
            elif self.cpu_mode == "virtual":
                self._write_box(rank, lim.cpu_share)
            else:
                self._write_pace(rank, lim.cpu_share * self.dilation)
            if self.top_weight:
                self._write_weight(self._dir_for(rank, self.cpu))  # type: ignore[arg-type]
            if lim.memory_bytes is not None:
                assert self.memory is not None
                self._write_memory(self._dir_for(rank, self.memory), lim.memory_bytes)
        if self.poll_s is not None:
            self._poller = Poller([self._dir_for(r, self.cpu) for r in range(len(self.limits))],  # type: ignore[arg-type]
                                  self.poll_s)
        log.info("confinement.created", name=self.name, cpu_v=self.cpu.version, cpu_mode=self.cpu_mode,
                 poll_s=self.poll_s, cores=self.cores, dilation=self.dilation,
                 shares=[lim.cpu_share for lim in self.limits],
                 period_us=[period_for(lim.cpu_share, self.period_us) for lim in self.limits])

    def _dir_for(self, rank: int, ctl: Controller) -> Path:
        return next(d for d in self._rank_dirs[rank] if d.is_relative_to(ctl.base))

    @staticmethod
    def _enable_v2(group: Path, kinds: list[str]) -> None:
        enabled = (group / "cgroup.subtree_control").read_text().split()
        for kind in kinds:
            if kind not in enabled:
                try:
                    (group / "cgroup.subtree_control").write_text(f"+{kind}")
                except OSError as exc:
                    raise EmulatorError(f"cannot enable the v2 {kind} controller in {group}: "
                                        f"{exc.strerror}") from exc

    def _write_cpu(self, group: Path, share: float) -> None:
        period = period_for(share, self.period_us)
        quota = round(share * period)
        try:
            if self.cpu.version == 1:  # type: ignore[union-attr]
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (group / "cpu.max").write_text(f"{quota} {period}")
        except OSError as exc:
            raise EmulatorError(f"cannot set cpu quota {quota}/{period} us in {group}: "
                                f"{exc.strerror}") from exc

    def _file_dir(self, path: Path) -> None:  # of a rank's pace or box file: made once, removed on close
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
            self._pace_dir = path.parent

    def _write_pace(self, rank: int, share: float) -> None:
        """The share file a paced rank's processes find through their cgroup (`pacer.current`)."""
        path = pacer.share_path(self.name, f"rank{rank}")
        try:
            self._file_dir(path)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(repr(float(share)))
            tmp.replace(path)  # a rank reading it mid-write sees the old share or the new one
        except OSError as exc:
            raise EmulatorError(f"cannot write the paced share file {path}: {exc.strerror}") from exc

    def _box(self, share: float) -> Box:
        if self.window is None:
            return Box(share, self.link, self.estimator)
        return Box(share, self.link, self.estimator, self.window)

    def _write_box(self, rank: int, share: float) -> None:
        """The box a virtual-mode rank's processes find through their cgroup (`process_clock`)."""
        path = box_path(self.name, f"rank{rank}")
        try:
            self._file_dir(path)
            write_box(path, self._box(share))
        except OSError as exc:
            raise EmulatorError(f"cannot write the box file {path}: {exc.strerror}") from exc

    def _write_weight(self, group: Path) -> None:
        name, value = ("cpu.shares", "262144") if self.cpu.version == 1 else ("cpu.weight", "10000")  # type: ignore[union-attr]
        try:
            (group / name).write_text(value)
        except OSError as exc:
            raise EmulatorError(f"cannot set {name}={value} in {group}: {exc.strerror}") from exc

    def _write_memory(self, group: Path, limit: int) -> None:
        name = "memory.limit_in_bytes" if self.memory.version == 1 else "memory.max"  # type: ignore[union-attr]
        try:
            (group / name).write_text(str(limit))
            if self.memory.version == 2:  # type: ignore[union-attr]
                # Without swap off the cap would only push pages out, not stop the rank.
                swap = group / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        except OSError as exc:
            raise EmulatorError(f"cannot set {name}={limit} in {group}: {exc.strerror}") from exc

    # -- placing processes -------------------------------------------------------------------
    def add(self, rank: int, pid: int) -> None:
        """Move process `pid` (all its threads; later children inherit) into rank's groups."""
        if rank not in self._rank_dirs:
            raise EmulatorError(f"rank {rank} has no group (run has {len(self.limits)} ranks)")
        for d in self._rank_dirs[rank]:
            (d / "cgroup.procs").write_text(str(pid))
        if self.cores is not None:
            # Every thread it has now; threads started later inherit their creator's mask.
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), {self.cores[rank]})
                except (ProcessLookupError, FileNotFoundError):
                    pass  # that thread ended meanwhile

    def set_share(self, rank: int, cpu_share: float) -> None:
        """Change rank's CPU quota while it runs (a box that loses part of its CPU mid-run: the
        bench's background-load scenario). Checked like the starting shares."""
        if rank not in self._rank_dirs:
            raise EmulatorError(f"rank {rank} has no group (run has {len(self.limits)} ranks)")
        limits = [RankLimits(cpu_share, lim.memory_bytes, lim.box) if r == rank else lim
                  for r, lim in enumerate(self.limits)]
        if self.cpu_mode == "virtual":  # a box's speed: any finite number of host cores > 0
            validate_virtual(limits, None)
            self._write_box(rank, cpu_share)
            self.limits = limits
            return
        validate_limits(limits, usable_cores(), self.parent_limit)
        if self.cores is not None:
            # the run's cores and dilation stay: the new share must still fit its core at them
            load = self.dilation * sum(lim.cpu_share for r, lim in enumerate(limits)
                                       if self.cores[r] == self.cores[rank])
            if load > 1.0 + 1e-9:
                paced = f" (shares paced at x{self.dilation:.3f})" if self.cpu_mode == "pace" else ""
                raise EmulatorError(f"rank {rank}: cpu_share {cpu_share:g} would put {load:.2f} of a core's "
                                    f"work on core {self.cores[rank]}{paced}")
        if self.cpu_mode == "quota":
            self._write_cpu(self._dir_for(rank, self.cpu), cpu_share)  # type: ignore[arg-type]
        else:
            self._write_pace(rank, cpu_share * self.dilation)
        self.limits = limits

    def wrap(self, rank: int, popen: object) -> None:
        """Hook for launch_local(..., wrap=...): confine a freshly started rank process."""
        self.add(rank, popen.pid)  # type: ignore[attr-defined]

    def quotas(self) -> list[dict[str, object]]:
        """What was enforced, for the result file's environment block."""
        if self.cpu_mode == "virtual":
            return [{"rank": r, "box": lim.box, "cpu_share": lim.cpu_share, "cpu_mode": "virtual", "clock": "virtual",
                     "estimator": self.estimator, "bandwidth_Bps": self.link.bandwidth_Bps,
                     "latency_s": self.link.latency_s, "stack_s_per_byte": self.link.stack_s_per_byte,
                     "progress_s": self.link.progress_s,
                     "core": None if self.cores is None else self.cores[r],
                     "memory_bytes": lim.memory_bytes, "cgroup_version": self.cpu.version}  # type: ignore[union-attr]
                    for r, lim in enumerate(self.limits)]
        if self.cpu_mode == "pace":
            return [{"rank": r, "cpu_share": lim.cpu_share, "cpu_mode": "pace", "core": self.cores[r],  # type: ignore[index]
                     "paced_share": round(lim.cpu_share * self.dilation, 6), "dilation": round(self.dilation, 6),
                     "memory_bytes": lim.memory_bytes, "cgroup_version": self.cpu.version}  # type: ignore[union-attr]
                    for r, lim in enumerate(self.limits)]
        return [{"rank": r, "cpu_share": lim.cpu_share, "period_us": period_for(lim.cpu_share, self.period_us),
                 "quota_us": round(lim.cpu_share * period_for(lim.cpu_share, self.period_us)),
                 "memory_bytes": lim.memory_bytes, "cgroup_version": self.cpu.version, "poll_s": self.poll_s,  # type: ignore[union-attr]
                 "core": None if self.cores is None else self.cores[r]}
                for r, lim in enumerate(self.limits)]

    def throttle_stats(self, rank: int) -> dict[str, int]:
        """Kernel throttling counters of rank's cpu group (evidence the quota was hit)."""
        group = self._dir_for(rank, self.cpu)  # type: ignore[arg-type]
        fields = (group / "cpu.stat").read_text().split()
        return {k: int(v) for k, v in zip(fields[::2], fields[1::2])
                if k in ("nr_periods", "nr_throttled", "throttled_time", "throttled_usec")}

    def memory_stats(self, rank: int) -> dict[str, int]:
        """What the kernel enforced and saw in rank's memory group: `limit` (the cap as the kernel
        holds it), `peak` (the group's highest charge: resident pages plus page cache, so at least
        the rank's peak resident set while the cache is not reclaimed; v1 max_usage_in_bytes, v2
        memory.peak where the kernel has it, else absent), `oom_kills` (processes the kernel killed
        for the cap)."""
        if self.memory is None or self.limits[rank].memory_bytes is None:
            raise EmulatorError(f"rank {rank} has no memory cap")
        group = self._dir_for(rank, self.memory)
        out: dict[str, int] = {}
        if self.memory.version == 1:
            out["limit"] = int((group / "memory.limit_in_bytes").read_text())
            out["peak"] = int((group / "memory.max_usage_in_bytes").read_text())
            events = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        else:
            out["limit"] = int((group / "memory.max").read_text())
            if (group / "memory.peak").exists():
                out["peak"] = int((group / "memory.peak").read_text())
            events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
        out["oom_kills"] = int(events.get("oom_kill", 0))
        return out

    # -- cleanup -----------------------------------------------------------------------------
    def close(self) -> None:
        """Move survivors back to our own group, then remove every group we made (leaves first)."""
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        for d in reversed(self._dirs):
            home = d.parent.parent if d.name.startswith("rank") else d.parent
            procs = d / "cgroup.procs"
            try:
                pids = procs.read_text().split() if procs.exists() else []
            except OSError:
                pids = []
            for pid in pids:
                try:
                    (home / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # it exited meanwhile
            for attempt in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or attempt == 49:
                        log.warning("confinement.cleanup_failed", group=str(d), error=str(exc))
                        break
                    time.sleep(0.02)  # exiting tasks leave the group asynchronously
        self._dirs.clear()
        self._rank_dirs.clear()
        if self._pace_dir is not None:
            for f in self._pace_dir.iterdir():
                f.unlink(missing_ok=True)
            self._pace_dir.rmdir()
            self._pace_dir = None


def leftover_groups(pid: int | None = None) -> list[Path]:
    """Run groups made by process `pid` (default: this one) still present (should be none)."""
    out: list[Path] = []
    for kind in ("cpu", "memory"):
        ctl = find_controller(kind)
        if ctl is not None:
            out += sorted(ctl.base.glob(f"xronos-bench-{pid or os.getpid()}-*"))
    return out
