"""The emulator really confines CPU and memory, cleans up after itself, and refuses bad input
(quota mode here, unless a test says otherwise; virtual mode: test_vclock*.py)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xronos.node.emulate.cgroupfs import find_controller
from xronos.node.emulate.confinement import (
    Confinement, EmulatorError, RankLimits, leftover_groups, validate_limits,
)
from xronos.node.emulate.cpumode import CPU_MODE_ENV

CPU = find_controller("cpu")


@pytest.fixture(autouse=True)
def _quota_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about CFS quotas: the emulator's default mode is virtual."""
    monkeypatch.setenv(CPU_MODE_ENV, "quota")


needs_cgroup = pytest.mark.skipif(CPU is None, reason="no writable cgroup cpu controller here")

# A busy process with a second thread: the quota must hold for all threads of the process.
BUSY = "import threading\ndef spin():\n    while True: pass\nthreading.Thread(target=spin, daemon=True).start()\nspin()\n"


def confined_output(conf: Confinement, rank: int, code: str) -> str:
    """stdout of `python -c code` started stopped at the door: the child waits on stdin until it is
    in rank's group (and pinned, where the run pins), then runs `code`."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()\n" + code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        conf.wrap(rank, proc)
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    return out


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@needs_cgroup
def test_quota_limits_cpu_rate_of_busy_process() -> None:
    share = 0.2
    with Confinement([RankLimits(share)]) as conf:
        proc = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            conf.wrap(0, proc)
            time.sleep(0.3)
            c0, t0 = _cpu_seconds(proc.pid), time.monotonic()
            time.sleep(2.0)
            rate = (_cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
            throttled = conf.throttle_stats(0)
        finally:
            proc.kill()
            proc.wait()
    # Unconfined this would be ~1 core (two spinning threads, GIL-bound); the quota caps it.
    # Generous tolerance: clock-tick accounting and a shared machine. Not a speed assertion.
    assert 0.02 < rate < share * 1.5, rate
    assert throttled["nr_throttled"] > 0, throttled


@needs_cgroup
def test_groups_removed_after_run_and_after_error() -> None:
    with Confinement([RankLimits(0.1), RankLimits(0.1)], top_weight=True) as conf:
        made = list(conf._dirs)
        weight = "cpu.shares" if conf.cpu.version == 1 else "cpu.weight"
        assert all((d / weight).read_text().strip() in ("262144", "10000") for d in made if d.is_relative_to(conf.cpu.base))
        assert made and all(d.is_dir() for d in made)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        conf.wrap(1, proc)  # a live process inside must not keep the group alive
    assert not any(d.exists() for d in made)
    proc.kill()
    proc.wait()
    with pytest.raises(RuntimeError, match="boom"):
        with Confinement([RankLimits(0.1)]) as conf:
            made = list(conf._dirs)
            raise RuntimeError("boom")
    assert not any(d.exists() for d in made)
    assert leftover_groups() == []


@needs_cgroup
@pytest.mark.skipif(find_controller("memory") is None, reason="no writable memory controller")
def test_memory_cap_stops_a_process_that_exceeds_it() -> None:
    grab = "import time\nx = bytearray(300 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nprint('survived')\n"
    with Confinement([RankLimits(0.5, memory_bytes=128 << 20)]) as conf:
        # Start it stopped so the allocation happens only once it is inside the group.
        proc = subprocess.Popen([sys.executable, "-c", "import os,signal; os.kill(os.getpid(), signal.SIGSTOP)\n" + grab],
                                stdout=subprocess.PIPE, text=True)
        _wait_stopped(proc.pid)
        conf.wrap(0, proc)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in out


MEMORY = find_controller("memory")


@needs_cgroup
@pytest.mark.skipif(MEMORY is None, reason="no writable cgroup memory controller (neither v1 "
                    "memory.limit_in_bytes nor v2 memory.max) on this machine")
def test_memory_cap_is_the_kernels_and_a_process_under_it_survives() -> None:
    """The cap is written where the kernel enforces it (read back from the group's own file), the
    rank's process lives in that group, and one that stays below the cap runs to the end with no
    OOM kill while the group's peak charge covers what it touched."""
    cap = 256 << 20
    grab = "x = bytearray(96 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nprint('survived')\n"
    with Confinement([RankLimits(0.5, memory_bytes=cap)]) as conf:
        group = conf._dir_for(0, conf.memory)
        limit_file = "memory.limit_in_bytes" if conf.memory.version == 1 else "memory.max"
        assert int((group / limit_file).read_text()) == cap
        proc = subprocess.Popen([sys.executable, "-c", "import os,signal; os.kill(os.getpid(), signal.SIGSTOP)\n" + grab],
                                stdout=subprocess.PIPE, text=True)
        _wait_stopped(proc.pid)
        conf.wrap(0, proc)
        where = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert group.name in where and conf.name in where
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
        stats = conf.memory_stats(0)
    assert proc.returncode == 0 and "survived" in out
    assert stats["limit"] == cap and stats["oom_kills"] == 0
    if "peak" in stats:
        assert 96 << 20 <= stats["peak"] <= cap


def _wait_stopped(pid: int) -> None:
    for _ in range(500):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError("child never stopped")


@pytest.mark.parametrize("limits, match", [
    ([RankLimits(3.5)], "exceeds the 2 cores"),
    ([RankLimits(1.2), RankLimits(1.2)], "total cpu share 2.4"),
    ([RankLimits(0.0)], "below 0.1%"),
    ([RankLimits(-0.5)], "below 0.1%"),
    ([RankLimits(math.nan)], "below 0.1%"),
    ([RankLimits(0.3, memory_bytes=1024)], "below 64 MiB"),
    ([], "no ranks"),
])
def test_bad_limits_refused(limits: list[RankLimits], match: str) -> None:
    with pytest.raises(EmulatorError, match=match):
        validate_limits(limits, cores=2, parent_limit=None)


def test_parent_quota_bounds_what_can_be_enforced() -> None:
    with pytest.raises(EmulatorError, match="exceeds the 0.5 cores"):
        validate_limits([RankLimits(0.8)], cores=2, parent_limit=0.5)
    with pytest.raises(TypeError, match="must be a number"):
        validate_limits([RankLimits("0.5")], cores=2, parent_limit=None)  # type: ignore[arg-type]


@needs_cgroup
def test_bad_rank_refused_and_nothing_left() -> None:
    with Confinement([RankLimits(0.1)]) as conf:
        with pytest.raises(EmulatorError, match="rank 3 has no group"):
            conf.add(3, os.getpid())
    assert leftover_groups() == []


def test_v2_hierarchy_detected(tmp_path: Path) -> None:
    """Pure detection logic on a v2-shaped tree (this machine's cpu controller is on v1)."""
    root = tmp_path / "unified"
    (root / "svc").mkdir(parents=True)
    (root / "svc" / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "svc" / "cpu.max").write_text("50000 100000\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {root} cgroup2 rw,relatime 0 0\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/svc\n")
    ctl = find_controller("cpu", mounts_file=mounts, proc_cgroup=own)
    assert ctl is not None and ctl.version == 2 and ctl.base == root / "svc"
    from xronos.node.emulate.cgroupfs import cpu_limit_of
    assert cpu_limit_of(ctl) == 0.5
    (root / "svc" / "cgroup.controllers").write_text("pids\n")
    assert find_controller("cpu", mounts_file=mounts, proc_cgroup=own) is None


def test_period_is_the_shortest_with_a_one_millisecond_quota() -> None:
    from xronos.node.emulate.confinement import MIN_QUOTA_US
    from xronos.node.emulate.cpumode import DEFAULT_PERIOD_US, period_for

    for share in (0.01, 0.05, 0.3, 0.405, 0.45, 1.0, 1.5):
        period = period_for(share)
        assert period >= DEFAULT_PERIOD_US
        assert round(share * period) >= MIN_QUOTA_US  # what the kernel accepts
        # ...and no longer than that needs: a longer period is a longer burst after a wait.
        assert period == DEFAULT_PERIOD_US or round(share * (period - 1)) < MIN_QUOTA_US + 1
    # Small shares are not silently rounded up to a bigger quota (the rank would run faster).
    assert abs(0.05 * period_for(0.05) - MIN_QUOTA_US) < 1


@needs_cgroup
def test_a_share_changes_while_the_rank_runs() -> None:
    """The background-load scenario halves a box's quota mid-run: the group's quota is rewritten,
    what `quotas()` reports follows, and a share the machine cannot give is refused."""
    with Confinement([RankLimits(0.4), RankLimits(0.2)]) as conf:
        group = conf._dir_for(0, conf.cpu)

        def quota() -> tuple[int, int]:
            if conf.cpu.version == 1:
                return int((group / "cpu.cfs_quota_us").read_text()), int((group / "cpu.cfs_period_us").read_text())
            q, p = (group / "cpu.max").read_text().split()
            return int(q), int(p)

        q0, p0 = quota()
        conf.set_share(0, 0.2)
        q1, p1 = quota()
        assert q0 / p0 == pytest.approx(0.4) and q1 / p1 == pytest.approx(0.2)
        assert conf.quotas()[0]["cpu_share"] == 0.2
        with pytest.raises(EmulatorError, match="rank 3 has no group"):
            conf.set_share(3, 0.1)
        with pytest.raises(EmulatorError, match="below 0.1% of a core"):
            conf.set_share(1, 0.0)


@needs_cgroup
def test_poller_runs_while_confined_and_stops_with_the_groups() -> None:
    """The poller (fine-grained quota enforcement) is a live process reading the rank groups while
    confined, outside them, and is gone after close; without poll_s there is none."""
    with Confinement([RankLimits(0.2), RankLimits(0.1)]) as conf:
        poller = conf._poller
        assert poller is not None and poller.proc.poll() is None
        in_groups = {int(p) for r in range(2) for p in (conf._dir_for(r, conf.cpu) / "cgroup.procs").read_text().split()}
        assert poller.proc.pid not in in_groups  # its CPU is not charged to any rank's quota
        assert all(q["poll_s"] == conf.poll_s for q in conf.quotas())
    assert poller.proc.poll() is not None
    with Confinement([RankLimits(0.2)], poll_s=None) as conf:
        assert conf._poller is None


@pytest.mark.parametrize("poll_s", [0.0, -1.0, 1.0, math.nan])
def test_poll_interval_out_of_range_is_refused(poll_s: float) -> None:
    with pytest.raises(EmulatorError, match="poll_s"):
        Confinement([RankLimits(0.2)], poll_s=poll_s)


def test_poll_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from xronos.node.emulate.poller import POLL_S
    from xronos.node.emulate.cpumode import POLL_ENV, default_poll_s

    monkeypatch.delenv(POLL_ENV, raising=False)
    assert default_poll_s() == POLL_S
    monkeypatch.setenv(POLL_ENV, "none")
    assert default_poll_s() is None
    monkeypatch.setenv(POLL_ENV, "0.001")
    assert default_poll_s() == 0.001
    monkeypatch.setenv(POLL_ENV, "fast")
    with pytest.raises(EmulatorError, match=POLL_ENV):
        default_poll_s()


@pytest.mark.skipif(CPU is None or len(os.sched_getaffinity(0)) != 2,
                    reason="needs a writable cgroup cpu controller and exactly two cores")
def test_pinned_quota_ranks_get_a_core_each_and_a_later_share_must_fit_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """XRONOS_EMULATOR_PIN=1 (or pin=True): quota-mode ranks pinned largest share first, the quota
    still the CFS one; a share that would overload its core is refused; shares that cannot fit
    the cores at one core each stay unpinned; unpinned is the default."""
    from xronos.node.emulate.cpumode import PIN_ENV, default_pin

    monkeypatch.delenv(PIN_ENV, raising=False)
    assert default_pin() is False
    with Confinement([RankLimits(0.2)], cpu_mode="quota") as conf:
        assert conf.cores is None and conf.quotas()[0]["core"] is None
    monkeypatch.setenv(PIN_ENV, "yes")
    with pytest.raises(EmulatorError, match=PIN_ENV):
        default_pin()
    monkeypatch.setenv(PIN_ENV, "1")
    with Confinement([RankLimits(0.5), RankLimits(0.3), RankLimits(0.2)], cpu_mode="quota") as conf:
        assert conf.cores is not None and conf._poller is not None  # still a quota, still polled
        assert conf.cores[1] == conf.cores[2] != conf.cores[0]  # 0.5 alone, 0.3 + 0.2 together
        assert [q["core"] for q in conf.quotas()] == conf.cores
        out = confined_output(conf, 1, "import os; print(sorted(os.sched_getaffinity(0)))")
        assert out.strip() == str([conf.cores[1]])
        conf.set_share(1, 0.8)  # 0.8 + 0.2: the core is full, not overloaded
        with pytest.raises(EmulatorError, match="1.10 of a core's work on core"):
            conf.set_share(1, 0.9)
        assert conf.quotas()[1]["cpu_share"] == 0.8
    with Confinement([RankLimits(0.6), RankLimits(0.6), RankLimits(0.5)], cpu_mode="quota", pin=True) as conf:
        assert conf.cores is None  # one core would carry 1.1 cores of quota: left to the scheduler
