"""The virtual clock's pure parts: the estimator, the link model, arrival resolution and idle
accounting, the box file, and a VirtualClock driven by fake CPU clocks and fake collectives (no
torch, no processes). The clock across real Gloo ranks: test_vclock_world.py."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from xronos.gateway.plan import commmodel
from xronos.node.emulate.arrivals import Account, decode, encode, resolve, resolve_recv, send_delivery
from xronos.node.emulate.estimator import Estimator, check_mode, statistic
from xronos.node.emulate.link import DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S, Link
from xronos.node.emulate.request import EmulatorError, RankLimits, check_memory_fits, validate_virtual
from xronos.node.emulate.vclock import Box, VirtualClock, read_box, write_box
from xronos.node.tp.clock import Meet


# -- estimator -----------------------------------------------------------------------------------
def test_statistics_of_a_window() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert statistic(xs, "min") == 1.0
    assert statistic(xs, "med") == 3.0
    assert statistic(xs, "mean") == 3.0
    assert statistic(xs, "raw") == 4.0  # the latest sample
    assert statistic(xs, "q25") == 2.0 and statistic(xs, "q0") == 1.0 and statistic(xs, "q100") == 5.0


def test_the_window_forgets_old_samples_per_key() -> None:
    e = Estimator("min", window=3)
    assert e.value("a") == 0.0  # nothing yet
    assert e.add("a", 50.0) == 50.0  # a first run (warm-up) counts until the second arrives
    for x in (1.0, 5.0, 6.0):
        e.add("a", x)
    assert e.add("b", 9.0) == 9.0 and e.value("a") == 1.0  # keys apart; the 50.0 went with the 1.0's arrival
    assert e.add("a", 7.0) == 5.0  # the 1.0 left the window


def test_a_keys_first_sample_is_a_warm_up() -> None:
    e = Estimator("med", window=32)
    assert e.add("k", 2.5) == 2.5
    assert e.add("k", 1.0) == 1.0  # the first went: a slow first step does not stay in the median
    assert e.add("k", 1.2) == 1.2 and e.add("k", 1.1) == 1.1
    e.forget()
    assert e.value("a") == 0.0 and len(e) == 0


@pytest.mark.parametrize("bad", ["max", "q101", "q", "", "MIN"])
def test_unknown_estimators_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="estimator must be one of"):
        check_mode(bad)


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_bad_windows_are_refused(window: object) -> None:
    with pytest.raises(ValueError, match="window"):
        Estimator("min", window)  # type: ignore[arg-type]


def test_a_negative_or_nan_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU time"):
        Estimator().add("k", -1.0)
    with pytest.raises(ValueError, match="CPU time"):
        Estimator().add("k", math.nan)


# -- link ----------------------------------------------------------------------------------------
def test_the_link_is_the_cost_models_in_form_and_parameters() -> None:
    assert DEFAULT_BANDWIDTH_BPS == commmodel.DEFAULT_BANDWIDTH_BPS
    assert DEFAULT_LATENCY_S == commmodel.DEFAULT_LATENCY_S
    link, nbytes = Link(), 32 * 1024 * 4
    for n in (2, 3, 5):
        one = commmodel.comm_time(commmodel.CommVolume(1, nbytes), n)
        assert link.seconds("all_reduce_sum", nbytes, n) == pytest.approx(one)
        assert link.seconds("all_reduce_max", nbytes, n) == pytest.approx(one)


def test_the_link_per_algorithm() -> None:
    link = Link(bandwidth_Bps=1e6, latency_s=1e-3)
    assert link.seconds("all_reduce_sum", 3000, 3) == pytest.approx(1e-3 + 2 * 2 / 3 * 3e-3)
    assert link.seconds("broadcast", 1000, 3) == pytest.approx(1e-3 + 2e-3)
    assert link.seconds("all_gather", 1000, 4) == pytest.approx(1e-3 + 3e-3)
    assert link.seconds("barrier", 0, 4) == pytest.approx(1e-3)
    assert link.seconds("send", 2000, 2) == pytest.approx(3e-3) == link.seconds("recv", 2000, 2)
    assert link.seconds("exchange", 5000, 3) == pytest.approx(6e-3)
    assert link.seconds("all_reduce_sum", 3000, 1) == 0.0  # a world of one moves nothing
    assert Link.mbit(8.0).bandwidth_Bps == 1e6
    with pytest.raises(ValueError, match="no link model"):
        link.seconds("scatter", 1, 2)


@pytest.mark.parametrize("bw", [0, -1.0, math.inf, math.nan])
def test_a_link_without_bandwidth_is_refused(bw: float) -> None:
    with pytest.raises(ValueError, match="bandwidth must be finite and > 0"):
        Link(bandwidth_Bps=bw)
    with pytest.raises(ValueError, match="rate must be finite and > 0 Mbit/s"):
        Link.mbit(bw)


def test_a_negative_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="latency"):
        Link(latency_s=-1e-3)


def test_the_stacks_cpu_is_per_byte_the_link_carries() -> None:
    link = Link(bandwidth_Bps=1e6, latency_s=1e-3, stack_s_per_byte=2e-9)
    assert link.stack_seconds("all_reduce_sum", 3000, 3) == pytest.approx(2e-9 * 2 * 2 / 3 * 3000)
    assert link.stack_seconds("all_reduce_sum", 3000, 2) == pytest.approx(2e-9 * 3000)  # a pair: the tensor
    assert link.stack_seconds("broadcast", 1000, 3) == pytest.approx(2e-9 * 2000)
    assert link.stack_seconds("barrier", 0, 4) == 0.0 and link.stack_seconds("all_reduce_sum", 3000, 1) == 0.0
    assert Link().stack_seconds("all_reduce_sum", 3000, 2) == 0.0  # none unless measured
    # the link's time is unchanged by it
    assert link.seconds("all_reduce_sum", 3000, 3) == Link(1e6, 1e-3).seconds("all_reduce_sum", 3000, 3)
    assert Link.mbit(8.0, 0.0, 1e-9).stack_s_per_byte == 1e-9


@pytest.mark.parametrize("bad", [-1e-3, 1.0, math.inf, math.nan, True])
def test_a_bad_progress_delay_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"progress delay beside a busy core must be in \[0, 1\) s"):
        Link(progress_s=bad)
    assert Link().progress_s == 0.0 and Link.mbit(8.0, 0.0, 0.0, 5e-3).progress_s == 5e-3


@pytest.mark.parametrize("bad", [-1e-9, math.inf, math.nan, True])
def test_a_bad_stack_cost_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="link stack CPU must be finite and >= 0 s per byte"):
        Link(stack_s_per_byte=bad)


# -- arrivals and idle -----------------------------------------------------------------------------
def test_everyone_leaves_at_the_latest_arrival_plus_the_longer_cost() -> None:
    arrivals, costs = [1.0, 1.3, 1.1], [0.001, 0.004, 0.002]
    r0 = resolve(arrivals, costs, link_s=0.002, rank=0)
    r1 = resolve(arrivals, costs, link_s=0.002, rank=1)
    assert r0.leave == r1.leave == pytest.approx(1.3 + 0.004)  # the slow box's CPU for the call
    assert r0.comm == pytest.approx(0.004) and r0.idle == pytest.approx(0.3) and r1.idle == 0.0
    assert resolve(arrivals, costs, link_s=0.01, rank=2).leave == pytest.approx(1.31)  # the link's


def test_point_to_point_is_eager() -> None:
    delivered = send_delivery(arrival=2.0, link_free=2.5, link_s=0.1, cpu_s=0.01)
    assert delivered == pytest.approx(2.6)  # behind the earlier send on the same link
    early = resolve_recv(arrival=1.0, cpu_s=0.01, delivered=delivered, link_s=0.1)
    assert early.leave == pytest.approx(2.6) and early.idle == pytest.approx(1.5) and early.comm == pytest.approx(0.1)
    late = resolve_recv(arrival=3.0, cpu_s=0.01, delivered=delivered, link_s=0.1)
    assert late.leave == pytest.approx(3.01) and late.idle == 0.0 and late.comm == pytest.approx(0.01)


def test_slots_round_trip_as_a_sum_and_as_a_max() -> None:
    world = 3
    per_rank = [encode(r, world, [0.5 * r, 0.01 * (r + 1), 1024.0]) for r in range(world)]
    summed = [sum(col) for col in zip(*per_rank)]
    maxed = [max(col) for col in zip(*per_rank)]
    assert decode(summed, world, 3) == decode(maxed, world, 3) == [[0.0, 0.5, 1.0], [0.01, 0.02, 0.03], [1024.0] * 3]
    with pytest.raises(ValueError, match=">= 0"):
        encode(0, 2, [-1.0])
    with pytest.raises(ValueError, match="expected 6 slots"):
        decode([0.0] * 5, 2, 3)


def test_an_account_books_waits_and_comm() -> None:
    acc = Account(compute=0.7)
    acc.book(resolve([0.0, 0.2], [0.0, 0.0], 0.1, rank=0))
    assert acc.idle == pytest.approx(0.2) and acc.comm == pytest.approx(0.1)
    assert acc.idle_ratio() == pytest.approx(0.2 / 1.0)


# -- bad boxes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("speed", [0, -0.5, math.inf, math.nan])
def test_a_box_without_speed_is_refused_by_name(speed: float) -> None:
    with pytest.raises(EmulatorError, match=r"rank 1 \(pi4\): speed must be a finite number of host cores > 0"):
        validate_virtual([RankLimits(0.3, box="n100"), RankLimits(speed, box="pi4")], None)


def test_boxes_beyond_the_hosts_memory_are_refused_by_name() -> None:
    limits = [RankLimits(0.3, 8 << 30, box="pi5"), RankLimits(0.3, 12 << 30, box="orin")]
    check_memory_fits(limits, 24 << 30)
    with pytest.raises(EmulatorError, match=r"rank 0 \(pi5\) 8.00 GiB, rank 1 \(orin\) 12.00 GiB.*16.00 GiB"):
        check_memory_fits(limits, 16 << 30)


def test_the_box_file_round_trips_and_refuses_garbage(tmp_path: Path) -> None:
    box = Box(0.45, Link.mbit(100, 0.2e-3, 1.8e-9, 5e-3), "q25", 16)
    write_box(tmp_path / "run" / "rank0", box)
    assert read_box(tmp_path / "run" / "rank0") == box
    (tmp_path / "bad").write_text('{"host_cores": 0, "bandwidth_Bps": 1, "latency_s": 0, "estimator": "min", "window": 3}')
    assert read_box(tmp_path / "bad") is None and read_box(tmp_path / "missing") is None


# -- the clock, with fake CPU clocks and collectives -----------------------------------------------
class Fake:
    def __init__(self) -> None:
        self.thread = 0.0
        self.wall = 0.0

    def clock(self, cores: float, link: Link = Link(1e9, 0.0), est: str = "min") -> VirtualClock:
        return VirtualClock(Box(cores, link, est), thread_time=lambda: self.thread,
                            wall=lambda: self.wall, slots=list)


def _exchange(clocks: list[VirtualClock], computes: list[float], fake: list[Fake], op: str = "all_reduce_sum",
              nbytes: int = 0) -> list[tuple[float, float]]:
    """One group collective across the clocks: each first computes its CPU seconds, then all meet
    (the slots summed, as Gloo would); returns every rank's (start, end)."""
    world = len(clocks)
    sent: list[list[float]] = []
    for f, c in zip(fake, computes):
        f.thread += c
    # phase 1: every rank's slots (the runner records them and hands back the sum afterwards)
    barrier = threading.Barrier(world)
    results: list[tuple[float, float] | None] = [None] * world

    def rank(r: int) -> None:
        def run(slots):
            sent.append(slots)
            barrier.wait()
            return [sum(col) for col in zip(*sent)], 0.0

        results[r] = clocks[r].meet(Meet(op, "mlp", nbytes, True), run, r, world)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def test_a_slower_box_makes_the_others_wait_by_the_difference() -> None:
    fakes = [Fake(), Fake()]
    clocks = [fakes[0].clock(1.0), fakes[1].clock(0.5)]  # the same work, a box of half the speed
    (s0, e0), (s1, e1) = _exchange(clocks, [0.010, 0.010], fakes)
    assert e0 == e1 == pytest.approx(0.020)
    assert s0 == pytest.approx(0.010) and s1 == pytest.approx(0.020)
    assert clocks[0].account.idle == pytest.approx(0.010) and clocks[1].account.idle == 0.0
    assert clocks[0].account.compute == pytest.approx(0.010) and clocks[1].account.compute == pytest.approx(0.020)


def test_the_window_minimum_takes_out_a_contended_burst() -> None:
    f = Fake()
    c = f.clock(1.0)
    times = []
    for cpu in (0.010, 0.010, 0.013, 0.010, 0.025):  # the same burst, twice stretched by contention
        t0 = c.t
        f.thread += cpu
        c.settle()
        times.append(c.t - t0)
    assert times == pytest.approx([0.010] * 5)


def test_the_link_sets_the_pace_when_the_boxes_are_equal() -> None:
    fakes = [Fake(), Fake(), Fake()]
    clocks = [f.clock(1.0, Link(1e6, 1e-3)) for f in fakes]
    out = _exchange(clocks, [0.005] * 3, fakes, nbytes=3000)
    assert {round(e, 9) for _, e in out} == {round(0.005 + 1e-3 + 4e-3, 9)}
    assert all(c.account.idle == pytest.approx(0.0) for c in clocks)


def test_a_speed_change_in_the_box_file_is_picked_up(tmp_path: Path) -> None:
    f, path = Fake(), tmp_path / "rank0"
    write_box(path, Box(1.0, Link(), "raw"))
    c = VirtualClock(Box(1.0, Link(), "raw"), path=path, thread_time=lambda: f.thread,
                     wall=lambda: f.wall, slots=list)
    f.thread += 0.01
    c.settle()
    write_box(path, Box(0.5, Link(), "raw"))
    f.wall += 1.0  # past RECHECK_S
    t0 = c.t
    f.thread += 0.01
    c.settle()
    assert c.t - t0 == pytest.approx(0.02)


def test_serialized_clocks_compute_one_at_a_time(tmp_path: Path) -> None:
    """With a shared lock file, a clock between two meetings holds it: another cannot start a burst
    until the first meets its peers."""
    lock = tmp_path / "serialize.lock"
    a, b = (VirtualClock(Box(1.0), serialize=lock, slots=list) for _ in range(2))
    a.now()  # a computes from here
    resumed = threading.Event()

    def other() -> None:
        b.now()  # b computes from here...
        resumed.set()
        b.meet(Meet("barrier", None, 0, False), lambda slots: (slots, 0.0), 0, 1)  # ...until it meets
        b.close()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    assert not resumed.wait(0.3)  # b cannot start computing while a does
    # a meets its peers: while it waits in the collective, b computes
    a.meet(Meet("barrier", None, 0, False), lambda slots: (slots, 0.0) if resumed.wait(5) else (slots, 0.0), 0, 1)
    assert resumed.is_set()
    a.close()  # whichever resumes first after its meeting, the other follows once it ends
    t.join(5)
    assert not t.is_alive()
