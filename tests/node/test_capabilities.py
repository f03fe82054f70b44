"""Capabilities probe: readers against fake /proc and /sys trees, and the real probe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xronos.node.box import capabilities as cap
from xronos.protocol.messages import Capabilities


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    p = tmp_path / "proc"
    _write(p / "meminfo", "MemTotal:       8000000 kB\nMemFree:  100 kB\nMemAvailable:   6000000 kB\n")
    _write(p / "cpuinfo", "processor\t: 0\nmodel name\t: Intel(R) N100\n\nprocessor\t: 1\nmodel name\t: Intel(R) N100\n")
    _write(p / "self" / "cgroup", "0::/job/rank1\n")
    return p


def test_cpu_model_x86_and_arm(proc: Path, tmp_path: Path) -> None:
    assert cap.cpu_model(proc) == "Intel(R) N100"
    arm = tmp_path / "arm"
    _write(arm / "cpuinfo", "processor\t: 0\nBogoMIPS\t: 108.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n\n"
           "Hardware\t: BCM2835\nModel\t: Raspberry Pi 5 Model B Rev 1.0\n")
    assert cap.cpu_model(arm) == "Raspberry Pi 5 Model B Rev 1.0"
    bare = tmp_path / "bare"
    _write(bare / "cpuinfo", "processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n")
    assert cap.cpu_model(bare) == "0x41/0xd0b"


def test_cgroup_v2_quota_and_memory_limit(proc: Path, tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _write(cg / "job" / "rank1" / "cpu.max", "45000 100000\n")
    _write(cg / "job" / "rank1" / "memory.max", str(2 << 30) + "\n")
    _write(cg / "job" / "rank1" / "memory.current", str(512 << 20) + "\n")
    assert cap.cgroup_cpu_limit(proc, cg) == pytest.approx(0.45)
    assert cap.usable_cores(proc, cg) == 1  # a fractional quota still runs one thread
    total, available = cap.memory(proc, cg)
    assert total == 2 << 30  # the cgroup limit is tighter than MemTotal (8 GB)
    assert available == (2 << 30) - (512 << 20)


def test_cgroup_v2_unlimited(proc: Path, tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _write(cg / "job" / "rank1" / "cpu.max", "max 100000\n")
    _write(cg / "job" / "rank1" / "memory.max", "max\n")
    assert cap.cgroup_cpu_limit(proc, cg) is None
    assert cap.usable_cores(proc, cg) == len(os.sched_getaffinity(0))
    assert cap.memory(proc, cg) == (8000000 * 1024, 6000000 * 1024)


def test_cgroup_v1_in_container_namespace(proc: Path, tmp_path: Path) -> None:
    # v1, and the recorded path does not exist in the mount (container): the mount root is ours.
    _write(proc / "self" / "cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    cg = tmp_path / "cg"
    _write(cg / "cpu,cpuacct" / "cpu.cfs_quota_us", "150000\n")
    _write(cg / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(cg / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert cap.cgroup_cpu_limit(proc, cg) == pytest.approx(1.5)
    assert cap.usable_cores(proc, cg) == min(2, len(os.sched_getaffinity(0)))
    assert cap.cgroup_memory_limit(proc, cg) is None  # the v1 "unlimited" sentinel


def test_cpu_temperature(tmp_path: Path) -> None:
    th = tmp_path / "thermal"
    assert cap.cpu_temperature(th) is None
    _write(th / "thermal_zone0" / "type", "acpitz\n")
    _write(th / "thermal_zone0" / "temp", "90000\n")  # not a CPU zone: ignored
    _write(th / "thermal_zone1" / "type", "cpu-thermal\n")
    _write(th / "thermal_zone1" / "temp", "51350\n")
    assert cap.cpu_temperature(th) == pytest.approx(51.35)


def test_probe_real_machine() -> None:
    caps = cap.probe("n1", "10.0.0.5")
    assert isinstance(caps, Capabilities)
    assert caps.node_id == "n1" and caps.data_host == "10.0.0.5" and caps.participate
    assert 1 <= caps.cores <= (os.cpu_count() or 1)
    assert 0 < caps.memory_available <= caps.memory_total
    assert caps.cpu_model and caps.arch and caps.hostname
    assert caps.torch_version and caps.torch_version.startswith("2.")
    again = Capabilities.model_validate_json(caps.model_dump_json())
    assert again == caps
    fp = cap.fingerprint(caps, threads=1)
    assert caps.cpu_model in fp and "threads=1" in fp
    assert caps.reserve_bytes == 0 and cap.probe("n1", "10.0.0.5", reserve_mb=512).reserve_bytes == 512 << 20


def test_a_process_pinned_to_fewer_cpus_is_another_node() -> None:
    """A profile taken pinned to one core (the emulator's XRONOS_EMULATOR_PIN, or taskset) is not
    reused unpinned, nor on another core."""
    caps = cap.probe("n1", "10.0.0.5")
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("needs two CPUs")
    free = cap.fingerprint(caps, threads=1)
    try:
        os.sched_setaffinity(0, {min(every)})
        one = cap.fingerprint(caps, threads=1)
        os.sched_setaffinity(0, {max(every)})
        other = cap.fingerprint(caps, threads=1)
    finally:
        os.sched_setaffinity(0, every)
    assert len({free, one, other}) == 3 and f"cpus={min(every)}" in one
    assert cap.fingerprint(caps, threads=1) == free
