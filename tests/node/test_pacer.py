"""The emulator's paced CPU (`xronos.node.emulate.pacer`): pure logic with fake clocks, the share files'
lookup through /proc/<pid>/cgroup, and a real paced process under `Confinement(cpu_mode="pace")`."""

from __future__ import annotations

import os
import json
from pathlib import Path

import pytest

from tests.node.test_emulator import confined_output
from xronos.node.emulate import pacer
from xronos.node.emulate.cgroupfs import find_controller
from xronos.node.emulate.confinement import Confinement, EmulatorError, RankLimits, assign_cores
from xronos.node.emulate.cpumode import CPU_MODE_ENV, default_cpu_mode
from xronos.node.emulate.pacer import (
    PACE_CORE_LOAD, PacedClock, Pacer, heaviest_core, pace_dilation, read_share, share_file, share_path,
)


class FakeClocks:
    """A process CPU clock and a wall clock the test advances; sleep advances the wall."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 100.0
        self.slept: list[float] = []

    def compute(self, s: float) -> None:  # a core at full speed: CPU and wall advance together
        self.cpu += s
        self.wall += s

    def wait(self, s: float) -> None:  # blocked in a collective: wall only
        self.wall += s

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.wall += s

    def pacer(self, share: float, path: Path | None = None) -> Pacer:
        return Pacer(share, path=path, cpu_clock=lambda: self.cpu, wall_clock=lambda: self.wall, sleep=self.sleep)


def test_a_segment_takes_its_cpu_time_over_the_share() -> None:
    c = FakeClocks()
    p = c.pacer(0.25)
    t0 = c.wall
    c.compute(0.010)
    p.pace()
    assert c.wall - t0 == pytest.approx(0.040)  # 10 ms of CPU on a quarter core
    assert c.slept == [pytest.approx(0.030)] and p.slept_s == pytest.approx(0.030)


def test_the_wait_for_peers_is_not_compute() -> None:
    """restart() after a collective: the time blocked there neither pays for the next segment nor
    is charged to it."""
    c = FakeClocks()
    p = c.pacer(0.5)
    c.compute(0.004)
    p.pace()
    c.wait(0.100)  # inside the collective
    p.restart()
    c.compute(0.004)
    p.pace()
    assert c.slept == [pytest.approx(0.004), pytest.approx(0.004)]


def test_a_segment_slowed_by_contention_pays_nothing_more() -> None:
    c = FakeClocks()
    p = c.pacer(0.5)
    c.compute(0.004)
    c.wall += 0.010  # descheduled: already slower than a half core
    p.pace()
    assert c.slept == []


def test_full_share_never_sleeps() -> None:
    c = FakeClocks()
    p = c.pacer(1.0)
    for _ in range(5):
        c.compute(0.003)
        p.pace()
    assert c.slept == []


def test_the_share_file_is_read_again_while_running(tmp_path: Path) -> None:
    f = tmp_path / "rank0"
    f.write_text("0.5")
    c = FakeClocks()
    p = c.pacer(0.5, path=f)
    f.write_text("0.25")  # the bench halves the box's CPU mid-run
    c.compute(0.001)
    p.pace()
    assert p.share == 0.5  # not yet: looked at every RECHECK_S
    c.wait(Pacer.RECHECK_S + 0.01)
    p.restart()
    c.compute(0.010)
    p.pace()
    assert p.share == 0.25 and c.slept[-1] == pytest.approx(0.030)
    f.write_text("garbage")  # unreadable: the last good share stays
    c.wait(Pacer.RECHECK_S + 0.01)
    p.restart()
    c.compute(0.001)
    p.pace()
    assert p.share == 0.25


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_a_share_outside_zero_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="paced share"):
        Pacer(share)


@pytest.mark.parametrize("text,expected", [("0.45", 0.45), ("1", 1.0), ("0", None), ("1.2", None), ("nan", None),
                                           ("", None), ("abc", None)])
def test_read_share(tmp_path: Path, text: str, expected: float | None) -> None:
    f = tmp_path / "s"
    f.write_text(text)
    assert read_share(f) == expected
    assert read_share(tmp_path / "missing") is None and read_share(None) is None


def test_share_file_follows_the_cpu_cgroup_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "cgroup-v1"
    v1.write_text("12:memory:/xronos-bench-1-ab/rank2\n5:cpu,cpuacct:/xronos-bench-1-ab/rank1\n0::/\n")
    assert share_file(v1, root=tmp_path) == share_path("xronos-bench-1-ab", "rank1", root=tmp_path)
    v2 = tmp_path / "cgroup-v2"
    v2.write_text("0::/xronos-bench-2-cd/rank0\n")
    assert share_file(v2, root=tmp_path) == tmp_path / "xronos-bench-2-cd" / "rank0"
    top = tmp_path / "cgroup-top"
    top.write_text("0::/\n")
    assert share_file(top, root=tmp_path) is None  # a real box: not paced
    assert share_file(tmp_path / "missing", root=tmp_path) is None
    assert pacer.share_of_process(v2, root=tmp_path) is None  # no share file: not paced
    (tmp_path / "xronos-bench-2-cd").mkdir()
    (tmp_path / "xronos-bench-2-cd" / "rank0").write_text("0.3")
    assert pacer.share_of_process(v2, root=tmp_path) == 0.3


def test_this_test_process_is_not_paced() -> None:
    pacer.reset_for_tests()
    try:
        assert pacer.current() is None
    finally:
        pacer.reset_for_tests()


def test_cores_are_assigned_and_shares_dilated_to_leave_every_core_headroom() -> None:
    shares = [0.6, 0.3, 0.45, 0.4]
    cores = assign_cores(shares, [0, 1])
    load = {c: sum(s for s, k in zip(shares, cores) if k == c) for c in (0, 1)}
    assert sorted(load.values()) == pytest.approx([0.85, 0.9]) and heaviest_core(shares, [0, 1]) == pytest.approx(0.9)
    assert pace_dilation(shares, [0, 1]) == pytest.approx(PACE_CORE_LOAD / 0.9)
    assert pace_dilation([0.9, 0.5, 0.3, 0.3], [0, 1]) == pytest.approx(PACE_CORE_LOAD / 1.1)  # Set-C-like
    assert pace_dilation([0.3, 0.2], [0, 1]) == 1.0  # never faster than asked
    assert pace_dilation([1.0], [0]) == pytest.approx(PACE_CORE_LOAD)


def test_cpu_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_MODE_ENV, raising=False)
    assert default_cpu_mode() == "virtual"
    monkeypatch.setenv(CPU_MODE_ENV, "Pace")
    assert default_cpu_mode() == "pace"
    monkeypatch.setenv(CPU_MODE_ENV, "turbo")
    with pytest.raises(EmulatorError, match="XRONOS_EMULATOR_CPU must be one of virtual, quota, pace, got 'turbo'"):
        default_cpu_mode()
    with pytest.raises(EmulatorError, match="cpu_mode must be one of"):
        Confinement([RankLimits(0.2)], cpu_mode="turbo")


# A paced process reports its share, its core, and the wall time of 40 ms of CPU paced at the share.
PACED_CHILD = """
import json, os, time
from xronos.node.emulate import pacer
p = pacer.current()
cpu0 = time.process_time(); t0 = time.perf_counter()
while time.process_time() - cpu0 < 0.04:
    pass
p.pace()
print(json.dumps([p.share, sorted(os.sched_getaffinity(0)), time.perf_counter() - t0]), flush=True)
"""


@pytest.mark.skipif(find_controller("cpu") is None, reason="no writable cgroup cpu controller here")
def test_a_paced_rank_finds_its_share_is_pinned_and_runs_at_its_share() -> None:
    with Confinement([RankLimits(0.25), RankLimits(0.5)], cpu_mode="pace") as conf:
        files = [pacer.share_path(conf.name, f"rank{r}") for r in range(2)]
        assert [read_share(f) for f in files] == [0.25, 0.5]
        assert [q["cpu_mode"] for q in conf.quotas()] == ["pace", "pace"]
        assert conf._poller is None  # no quota to enforce
        share, cores, wall = json.loads(confined_output(conf, 0, PACED_CHILD))
        assert share == 0.25 and cores == [conf.cores[0]]
        assert wall >= 0.04 / 0.25 * 0.95  # at least what a quarter core takes (not a speed bound)
        conf.set_share(0, 0.5)
        assert read_share(files[0]) == 0.5 and conf.quotas()[0]["cpu_share"] == 0.5
        run_dir = files[0].parent
    assert not run_dir.exists()  # the share files go with the groups


@pytest.mark.skipif(find_controller("cpu") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a writable cgroup cpu controller and two cores")
def test_paced_shares_are_dilated_together_and_a_later_share_must_fit_its_core() -> None:
    with Confinement([RankLimits(0.9), RankLimits(0.9)], cpu_mode="pace") as conf:
        assert conf.cores is not None and conf.cores[0] != conf.cores[1]
        assert conf.dilation == pytest.approx(PACE_CORE_LOAD / 0.9)
        files = [pacer.share_path(conf.name, f"rank{r}") for r in range(2)]
        assert [read_share(f) for f in files] == pytest.approx([PACE_CORE_LOAD] * 2)
        assert conf.quotas()[0]["cpu_share"] == 0.9 and conf.quotas()[0]["paced_share"] == pytest.approx(PACE_CORE_LOAD)
        conf.set_share(1, 0.45)
        assert read_share(files[1]) == pytest.approx(0.45 * conf.dilation)
        with pytest.raises(EmulatorError, match=r"rank 1: cpu_share 1.1 would put 1.04 of a core's work on core"):
            conf.set_share(1, 1.1)  # fits the machine (2 cores), not its core at the run's dilation


def test_cpu_mode_pace_is_what_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    if find_controller("cpu") is None:
        pytest.skip("no writable cgroup cpu controller here")
    monkeypatch.setenv(CPU_MODE_ENV, "pace")
    with Confinement([RankLimits(0.2)]) as conf:
        assert conf.cpu_mode == "pace" and conf.cores is not None and len(conf.cores) == 1
        assert os.path.exists(pacer.share_path(conf.name, "rank0"))


def test_every_collective_paces_before_and_restarts_after() -> None:
    """TPGroup: compute before a collective is paced, the collective is not; an iteration's tail
    (the optimizer step) is paid by settle()."""
    import torch

    from xronos.node.tp.group import TPGroup

    c = FakeClocks()
    p = c.pacer(0.5)
    group = TPGroup.alone(3, clock=PacedClock(p))  # the hook a paced rank's process sets
    c.compute(0.002)
    group.all_reduce(torch.ones(4))
    assert c.slept == [pytest.approx(0.002)]
    c.wait(0.050)  # idle after the collective: nothing computed, nothing owed
    group.settle()
    assert len(c.slept) == 1
    c.compute(0.001)
    group.settle()
    assert c.slept[-1] == pytest.approx(0.001)
