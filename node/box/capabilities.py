"""What this box is: the facts a node announces in its retained `Capabilities` message.

Everything is read from Linux pseudo-files (/proc, /sys) so the probe is cheap and needs no
privileges. Cores and memory respect the container this process really runs in: the CPU
affinity mask and a cgroup CPU quota (v1 or v2) cap the cores, a cgroup memory limit caps the
memory, because a planner that believed the host's numbers would overload the box.
Every reader takes its root directory as an argument so tests can point it at a fake tree.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from pathlib import Path

from xronos.protocol.messages import Capabilities

_NO_LIMIT = 1 << 60  # cgroup v1 spells "unlimited" as a huge page-aligned number


def cpu_model(proc: Path = Path("/proc")) -> str:
    """The CPU's marketing name; ARM boards often only give 'Hardware'/'CPU part' lines."""
    try:
        text = (proc / "cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    for key in ("model name", "Model", "Hardware", "cpu model", "Processor"):
        if fields.get(key):
            return fields[key]
    if "CPU part" in fields:
        return f"{fields.get('CPU implementer', '?')}/{fields['CPU part']}"
    return platform.processor() or platform.machine()


def _own_cgroup_paths(proc: Path) -> dict[str, str]:
    """controller -> cgroup path of this process ("" key = the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for ctrl in parts[1].split(",") if parts[1] else [""]:
                paths[ctrl] = parts[2]
    return paths


def _candidates(cgroot: Path, mounts: list[str], rel: str) -> list[Path]:
    """Directories to look in, own cgroup first, then the mount root (inside a container the
    recorded path often does not exist in the namespaced mount, which *is* our cgroup)."""
    out = []
    for mount in mounts:
        base = cgroot / mount if mount else cgroot
        out += [base / rel.lstrip("/"), base]
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_quota(proc: Path, cgroot: Path) -> tuple[int, int] | None:
    """This process's CFS (quota, period) in microseconds, or None when it has no quota (cgroup v2's
    cpu.max, else v1's cfs_quota_us / cfs_period_us)."""
    paths = _own_cgroup_paths(proc)
    for d in _candidates(cgroot, ["", "unified"], paths.get("", "/")):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else (int(quota), int(period))
    for d in _candidates(cgroot, ["cpu", "cpu,cpuacct"], paths.get("cpu", "/")):
        quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
        if quota is not None and period:
            return None if quota < 0 else (quota, period)
    return None


def cgroup_cpu_limit(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU quota in cores (e.g. 0.45), or None when unlimited."""
    q = _cpu_quota(proc, cgroot)
    return None if q is None else q[0] / q[1]


def cgroup_cpu_period_s(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CFS period (seconds) of this process's CPU quota, or None when there is no quota."""
    q = _cpu_quota(proc, cgroot)
    return None if q is None else q[1] / 1e6


def cgroup_memory_limit(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory limit in bytes, or None when unlimited."""
    paths = _own_cgroup_paths(proc)
    for d in _candidates(cgroot, ["", "unified"], paths.get("", "/")):
        try:
            text = (d / "memory.max").read_text().strip()
        except OSError:
            continue
        return None if text == "max" else int(text)
    for d in _candidates(cgroot, ["memory"], paths.get("memory", "/")):
        limit = _read_int(d / "memory.limit_in_bytes")
        if limit is not None:
            return None if limit >= _NO_LIMIT else limit
    return None


def cgroup_memory_usage(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> int | None:
    paths = _own_cgroup_paths(proc)
    for d in _candidates(cgroot, ["", "unified"], paths.get("", "/")):
        if (value := _read_int(d / "memory.current")) is not None:
            return value
    for d in _candidates(cgroot, ["memory"], paths.get("memory", "/")):
        if (value := _read_int(d / "memory.usage_in_bytes")) is not None:
            return value
    return None


def usable_cores(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: affinity mask, capped by the cgroup quota (rounded up,
    at least 1 — a 0.45-core quota still runs one thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_limit(proc, cgroot)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return cores


def meminfo(proc: Path = Path("/proc")) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    total = values["MemTotal"]
    return total, values.get("MemAvailable", values.get("MemFree", total))


def memory(proc: Path = Path("/proc"), cgroot: Path = Path("/sys/fs/cgroup")) -> tuple[int, int]:
    """(total, available) bytes, lowered to the cgroup limit when that is tighter."""
    total, available = meminfo(proc)
    limit = cgroup_memory_limit(proc, cgroot)
    if limit is not None and limit < total:
        used = cgroup_memory_usage(proc, cgroot) or 0
        total, available = limit, min(available, max(0, limit - used))
    return total, available


def cpu_temperature(thermal: Path = Path("/sys/class/thermal")) -> float | None:
    """Hottest CPU-ish thermal zone in °C (Pi: cpu-thermal, x86: x86_pkg_temp), None if absent."""
    temps = []
    for zone in sorted(thermal.glob("thermal_zone*")):
        try:
            kind = (zone / "type").read_text().strip().lower()
            milli = int((zone / "temp").read_text().strip())
        except (OSError, ValueError):
            continue
        if any(tag in kind for tag in ("cpu", "x86_pkg", "soc", "package", "core")):
            temps.append(milli / 1000.0)
    return max(temps) if temps else None


def torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # not installed: a gateway-only box announces torch_version=None
        return None


def probe(node_id: str, data_host: str, participate: bool = True, reserve_mb: int = 0) -> Capabilities:
    """This box now; `reserve_mb`: what the node keeps for the device's day job (node.toml)."""
    total, available = memory()
    return Capabilities(
        node_id=node_id,
        hostname=socket.gethostname(),
        arch=platform.machine(),
        cpu_model=cpu_model(),
        cores=usable_cores(),
        memory_total=total,
        memory_available=available,
        torch_version=torch_version(),
        data_host=data_host,
        participate=participate,
        cpu_temp_c=cpu_temperature(),
        reserve_bytes=reserve_mb * 2**20,
        sent_at=time.time(),
    )


def fingerprint(caps: Capabilities, threads: int | None) -> str:
    """Hardware identity for the profile cache: what makes a profile reusable on this box.
    The live CPU quota is part of it: the same host under a 0.45-core cgroup is another node; so
    is the emulator's paced share (`xronos.node.emulate.pacer`) or virtual box (`vclock`)."""
    from xronos.node.emulate.pacer import share_file, share_of_process
    from xronos.node.emulate.vclock import VCLOCK_ROOT, read_box

    quota, paced = cgroup_cpu_limit(), share_of_process()
    parts = [caps.hostname, caps.arch, caps.cpu_model, f"cores={caps.cores}",
             f"quota={'none' if quota is None else f'{quota:.3f}'}", f"threads={threads}",
             f"torch={caps.torch_version}"]
    if paced is not None:  # only then: the fingerprints of every profile cached before stay the same
        parts.append(f"paced={paced:.3f}")
    box = read_box(share_file(root=VCLOCK_ROOT))  # an emulated box on the virtual clock
    if box is not None:
        parts.append(f"virtual={box.host_cores:.3f},{box.estimator}")
    # Pinned to some of the machine's CPUs (XRONOS_EMULATOR_PIN, taskset): a quota group alone on a
    # core runs otherwise than one the scheduler moves among others (bench/results/demo-idle.md §5).
    pinned = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if pinned and len(pinned) < (os.cpu_count() or 1):
        parts.append(f"cpus={','.join(map(str, pinned))}")
    return "|".join(parts)
