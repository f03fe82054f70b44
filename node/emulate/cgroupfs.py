"""Where this process can drive cgroup controllers: the mounted hierarchies (v1 or v2), its own
group in each, and the CPU bandwidth that group already has. Read-only; the emulator
(`node/emulate/confinement.py`) creates its run groups below what this finds."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Controller:
    """Where one controller (cpu or memory) can be driven: hierarchy version and our own group."""

    kind: str  # "cpu" | "memory"
    version: int  # 1 | 2
    base: Path  # the cgroup this process is in, under which run groups are created


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _mounts(mounts_file: Path) -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of cgroup mounts."""
    out = []
    for line in mounts_file.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def own_paths(proc_cgroup: Path = Path("/proc/self/cgroup")) -> dict[str, str]:
    """Controller name (or "" for the v2 unified hierarchy) -> this process's cgroup path."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            paths[name] = path
    return paths


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def find_controller(
    kind: str, *, mounts_file: Path = Path("/proc/self/mounts"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> Controller | None:
    """The writable hierarchy that has `kind` ("cpu"|"memory"), preferring v1 where both do."""
    own = own_paths(proc_cgroup)
    v1_file, v2_file = {"cpu": ("cpu.cfs_quota_us", "cpu.max"),
                        "memory": ("memory.limit_in_bytes", "memory.max")}[kind]
    found: list[Controller] = []
    for mount, fstype, opts in _mounts(mounts_file):
        if fstype == "cgroup" and kind in opts and kind in own:
            base = Path(mount) / own[kind].lstrip("/")
            if _writable(base) and (base / v1_file).exists():
                found.append(Controller(kind, 1, base))
        elif fstype == "cgroup2" and "" in own:
            base = Path(mount) / own[""].lstrip("/")
            controllers = (base / "cgroup.controllers")
            if _writable(base) and controllers.exists() and kind in controllers.read_text().split():
                found.append(Controller(kind, 2, base))
    return found[0] if found else None


def cpu_limit_of(ctl: Controller) -> float | None:
    """The CPU bandwidth (cores) our own group is already limited to, None when unlimited."""
    if ctl.version == 1:
        quota = int((ctl.base / "cpu.cfs_quota_us").read_text())
        period = int((ctl.base / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else quota / period
    f = ctl.base / "cpu.max"
    if not f.exists():  # the root group has no cpu.max
        return None
    quota, period = f.read_text().split()
    return None if quota == "max" else int(quota) / int(period)
