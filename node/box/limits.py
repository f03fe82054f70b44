"""Every process the node starts is bounded by the box and dies with the node.

A request is checked before it starts (`node/box/footprint.py`, `NodeService`), but a prediction can be
wrong. So every child — a training rank, a profile child and the heap probes it starts — runs under
a memory limit and a task (threads and processes) limit derived from the box when it starts:

- **a cgroup of its own** where the node may create one (v1 `memory` and `pids` hierarchies, or v2,
  below the node's own group): `memory.limit_in_bytes` with swap capped to it (`memory.memsw`) /
  `memory.max` with `memory.swap.max` 0, and `pids.max`. Exceeding the memory limit makes the
  kernel's OOM killer end that child alone (the service learns why from the group's OOM count);
  a thread past `pids.max` fails to start (EAGAIN). The group goes when the child has ended.
- **`setrlimit` otherwise** (e.g. under the systemd unit, whose `ProtectControlGroups=` makes the
  hierarchy read-only): `RLIMIT_DATA` — the heap and every private writable mapping, which is
  what torch's allocations are; measured here at 400 MiB for 398 MiB resident after training a
  small MLP, where `RLIMIT_AS` would count torch's and glibc's address-space reservations too
  (888 MiB) — so an allocation past it fails with MemoryError inside the child; and
  `RLIMIT_NPROC`, which Linux counts per *user*: set to the user's tasks at the start plus the
  child's allowance (under the unit, the dedicated `xronos` user runs nothing else; the unit's
  `TasksMax=` is the backstop of the whole service). Root is exempt from `RLIMIT_NPROC`; each
  process (the profile child and its heap probe) gets `RLIMIT_DATA` alone.

Every child is started through `python -m xronos.node.box.boxed MODULE ARGS...` (`boxed_argv`), which
sets PR_SET_PDEATHSIG (SIGKILL) on itself, checks that its parent is still the one that started it
(the parent may have died before the call), joins its cgroups and applies its rlimits before the
module runs — so the limits hold from its first allocation and a grandchild inherits all of it.
PR_SET_PDEATHSIG fires when the parent *thread* ends: a child must be started by a thread that
outlives it (the node's control loop for ranks, its worker thread for profiles, which waits for
the child). Each child also leads its own process group (`start_new_session`): the node ends a
child and everything it started with one `killpg`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from xronos.node.emulate.cgroupfs import own_paths  # this process's cgroup per controller

log = structlog.get_logger(__name__)

MiB = 1 << 20
ENV = "XRONOS_BOX"  # the limits a boxed child applies to itself (JSON)
TASKS_BASE = 128  # a torch process's own threads besides its OpenMP pool: interop pool, Gloo, python's
TASKS_PER_CORE = 8
GROUP_PREFIX = "xronos-child-"


@dataclass(frozen=True)
class ChildLimits:
    memory_bytes: int
    tasks: int

    def describe(self) -> str:
        return f"{self.memory_bytes / MiB:,.0f} MiB of memory, {self.tasks} tasks"


def child_limits(available: int, reserve: int, cores: int) -> ChildLimits:
    """What one child may take: the memory available now less the reserve (at least 64 MiB, so
    that the refusal comes from the child with its reason), and a task budget for `cores`."""
    return ChildLimits(memory_bytes=max(available - reserve, 64 * MiB), tasks=TASKS_BASE + TASKS_PER_CORE * cores)


# --- cgroups ------------------------------------------------------------------------------------
def group_bases(mounts_file: Path = Path("/proc/self/mounts")) -> dict[str, tuple[int, Path]]:
    """kind ("memory", "pids") -> (version, our own group's directory) where we may create groups."""
    try:
        own, mounts = own_paths(), mounts_file.read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, tuple[int, Path]] = {}
    for line in mounts:
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("cgroup", "cgroup2"):
            continue
        opts = set(parts[3].split(","))
        for kind in ("memory", "pids"):
            if kind in found:
                continue
            if parts[2] == "cgroup" and kind in opts and kind in own:
                base = Path(parts[1]) / own[kind].lstrip("/")
                # (the root group has no limit files of its own, and is as good a parent)
                if os.access(base, os.W_OK) and (base / "cgroup.procs").exists():
                    found[kind] = (1, base)
            elif parts[2] == "cgroup2" and "" in own:
                base = Path(parts[1]) / own[""].lstrip("/")
                ctl = base / "cgroup.subtree_control"
                if os.access(base, os.W_OK) and ctl.exists() and kind in ctl.read_text().split():
                    found[kind] = (2, base)
    return found


class Groups:
    """One child's cgroups (memory and pids), made before it starts, removed after it ended."""

    def __init__(self, limits: ChildLimits, name: str, bases: dict[str, tuple[int, Path]]) -> None:
        self.dirs: dict[str, tuple[int, Path]] = {}
        try:
            for kind, (version, base) in bases.items():
                d = base / f"{GROUP_PREFIX}{name}"
                d.mkdir(exist_ok=True)
                self.dirs[kind] = (version, d)
                if kind == "pids":
                    (d / "pids.max").write_text(str(limits.tasks))
                elif version == 1:
                    (d / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit
                        (d / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
                else:
                    (d / "memory.max").write_text(str(limits.memory_bytes))
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for _, d in self.dirs.values()]

    def oom_kills(self) -> int:
        """How many times the kernel's OOM killer struck in the memory group."""
        if "memory" not in self.dirs:
            return 0
        version, d = self.dirs["memory"]
        try:
            text = (d / ("memory.oom_control" if version == 1 else "memory.events")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _, d in self.dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass  # still populated (a process not yet reaped): left for `sweep`
        self.dirs = {}


def sweep(bases: dict[str, tuple[int, Path]]) -> None:
    """Remove empty child groups a killed node left behind (rmdir fails on a populated group)."""
    for _, base in bases.values():
        for d in base.glob(f"{GROUP_PREFIX}*"):
            try:
                d.rmdir()
            except OSError:
                pass


# --- rlimits ------------------------------------------------------------------------------------
def user_tasks(uid: int | None = None) -> int:
    """Tasks (threads) of this user now: what Linux compares RLIMIT_NPROC with."""
    uid = os.getuid() if uid is None else uid
    n = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


# --- starting children --------------------------------------------------------------------------
def boxed_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "xronos.node.box.boxed", module, *args]


def box_env(env: dict[str, str], limits: ChildLimits | None, groups: Groups | None = None) -> dict[str, str]:
    """`env` with the box a child applies to itself: this process as its parent, and (with
    `limits`) its cgroups, else its rlimits."""
    box: dict[str, object] = {"parent": os.getpid()}
    if groups is not None:
        box["cgroups"] = groups.procs
    if limits is not None and (groups is None or set(groups.dirs) != {"memory", "pids"}):
        box["data"] = limits.memory_bytes
        box["nproc"] = user_tasks() + limits.tasks
    return {**env, ENV: json.dumps(box)}


class Child:
    """One boxed child process (its own session), its groups removed once it has been reaped."""

    def __init__(self, argv: list[str], env: dict[str, str], limits: ChildLimits | None, name: str,
                 cgroups: bool = True, **popen: object) -> None:
        """`cgroups` False: rlimits even where a cgroup could be made (tests of that path)."""
        self.limits = limits
        self.groups: Groups | None = None
        if limits is not None and cgroups:
            bases = group_bases()
            if bases:
                try:
                    self.groups = Groups(limits, f"{name}-{os.getpid()}-{next(_SEQ)}", bases)
                except OSError as exc:
                    log.warning("limits.no_cgroup", error=str(exc)[:200], fallback="setrlimit")
        try:
            self.proc = subprocess.Popen(argv, env=box_env(env, limits, self.groups), start_new_session=True,
                                         **popen)  # type: ignore[call-overload]
        except BaseException:
            if self.groups is not None:
                self.groups.remove()
            raise
        LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL its whole process group (it and whatever it started)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reaped(self) -> None:
        """After wait(): the group's stragglers killed, its cgroups removed."""
        self.kill()
        if self.groups is not None:
            self.groups.remove()
        LIVE.discard(self)

    def why(self, returncode: int) -> str:
        """A sentence for an ended child: whether its memory limit ended it."""
        if self.groups is not None and self.groups.oom_kills() > 0:
            return f"it exceeded its memory limit of {self.limits.memory_bytes / MiB:,.0f} MiB (killed by the kernel)"
        if returncode < 0:
            return f"signal {-returncode}"
        return f"exit code {returncode}"


class _Live:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: set[Child] = set()
        self.started = 0  # boxed children ever started by this process (a refusal starts none)

    def add(self, c: Child) -> None:
        with self._lock:
            self._children.add(c)
            self.started += 1

    def discard(self, c: Child) -> None:
        with self._lock:
            self._children.discard(c)

    def kill_all(self) -> int:
        """End every boxed child still running (the node is stopping); how many there were."""
        with self._lock:
            children = list(self._children)
        for c in children:
            c.kill()
        return len(children)


LIVE = _Live()  # every boxed child this process started and has not reaped
_SEQ = iter(range(1, 1 << 62))
