"""Asynchronous all-reduces on the virtual clock, pure: launch records the rank's arrival, the call
completes at the latest arrival (or when the link is free of the calls before it) plus its cost,
and the wait leaves at max(now + the call's CPU on this box, completion), so compute between launch
and wait hides the link. Fake CPU clocks and a fake wire (no torch, no processes); the same across
real Gloo ranks: test_overlap_world.py."""

from __future__ import annotations

import threading

import pytest

from xronos.node.emulate.arrivals import flight, land, resolve
from xronos.node.emulate.link import Link
from xronos.node.emulate.vclock import Box, VirtualClock
from xronos.node.tp.clock import Meet

LINK = Link(1e6, 0.0)  # 1 MB/s, no latency: an all-reduce of 10 kB among 2 ranks takes 10 ms
AR = Meet("all_reduce_sum", "mlp", 10_000, True)


# -- the arithmetic ------------------------------------------------------------------------------
def test_a_flight_starts_at_the_latest_arrival_or_when_the_link_is_free() -> None:
    assert flight([0.010, 0.020], [0.001, 0.002], 0.005) == pytest.approx((0.020, 0.025))
    assert flight([0.010, 0.020], [0.001, 0.002], 0.005, free=0.030) == pytest.approx((0.030, 0.035))
    assert flight([0.010, 0.020], [0.001, 0.009], 0.005) == pytest.approx((0.020, 0.029))  # the slowest CPU sets it
    with pytest.raises(ValueError, match="one arrival and one cost per rank"):
        flight([0.0], [0.0, 0.0], 0.0)


def test_a_wait_after_enough_compute_costs_only_the_calls_cpu() -> None:
    r = land(now=0.050, own_cost=0.001, completion=0.030, latest=0.020)
    assert r.leave == pytest.approx(0.051) and r.comm == pytest.approx(0.001) and r.idle == 0.0


def test_a_wait_before_completion_splits_into_idle_and_communication() -> None:
    # launched at 0.005, waits at 0.010; the last rank launched at 0.020; completion at 0.030
    r = land(now=0.010, own_cost=0.001, completion=0.030, latest=0.020)
    assert r.leave == pytest.approx(0.030) and r.idle == pytest.approx(0.010) and r.comm == pytest.approx(0.010)


def test_a_call_in_flight_moves_only_once_its_threads_get_the_busy_core() -> None:
    # on the wire from 0.020, the link done at 0.030; its threads wait 5 ms for the core while the
    # rank computes: computing until 0.040 it leaves at 0.035 + its CPU, not at 0.030 + its CPU
    r = land(now=0.040, own_cost=0.001, completion=0.030, latest=0.020, start=0.020, progress_s=0.005)
    assert r.leave == pytest.approx(0.041)  # 0.035 <= now: only the call's CPU shows
    r = land(now=0.032, own_cost=0.001, completion=0.030, latest=0.020, start=0.020, progress_s=0.005)
    assert r.leave == pytest.approx(0.035) and r.comm == pytest.approx(0.003) and r.idle == 0.0
    # a wait before the slice ends gives the threads the core at once: the first 3 ms of compute
    # after the start hid nothing, the call takes its whole link time from the wait
    r = land(now=0.023, own_cost=0.001, completion=0.030, latest=0.020, start=0.020, progress_s=0.005)
    assert r.leave == pytest.approx(0.033)
    # a wait before the last launch: the call has not started, nothing is late
    r = land(now=0.010, own_cost=0.001, completion=0.030, latest=0.020, start=0.020, progress_s=0.005)
    assert r.leave == pytest.approx(0.030) and r.idle == pytest.approx(0.010)
    assert land(0.032, 0.001, 0.030, 0.020, 0.020, 0.0) == land(0.032, 0.001, 0.030, 0.020)  # none unless measured
    with pytest.raises(ValueError, match="needs the call's start"):
        land(0.032, 0.001, 0.030, 0.020, progress_s=0.005)


def test_a_blocking_collective_queues_behind_the_flights_on_the_link() -> None:
    r = resolve([0.010, 0.012], [0.0, 0.0], 0.004, rank=0, free=0.020)
    assert r.leave == pytest.approx(0.024)
    assert r.idle == pytest.approx(0.002)  # the wait for the latest arrival
    assert r.comm == pytest.approx(0.012)  # the link's queue, then the call
    assert resolve([0.010, 0.012], [0.0, 0.0], 0.004, rank=0) == resolve([0.010, 0.012], [0.0, 0.0], 0.004, 0, 0.0)


# -- the clock ---------------------------------------------------------------------------------
class Fake:
    def __init__(self) -> None:
        self.thread = 0.0

    def clock(self, cores: float = 1.0) -> VirtualClock:
        return VirtualClock(Box(cores, LINK, "min"), thread_time=lambda: self.thread, wall=lambda: 0.0, slots=list)


class Wire:
    """One collective's fake Gloo: every rank's slots, handed back summed when a rank finishes
    (after all launched); `cpu`: what the call cost each caller's process."""

    def __init__(self, cpu: float = 0.0) -> None:
        self.sent: list[list[float]] = []
        self.cpu = cpu

    def start(self, slots: list[float]) -> Wire.Flight:
        self.sent.append(slots)
        return Wire.Flight(self)

    class Flight:
        def __init__(self, wire: Wire) -> None:
            self.wire = wire

        def finish(self) -> tuple[list[float], float]:
            return [sum(col) for col in zip(*self.wire.sent)], self.wire.cpu


def _ranks(n: int, cores: tuple[float, ...] | None = None) -> tuple[list[Fake], list[VirtualClock]]:
    fakes = [Fake() for _ in range(n)]
    return fakes, [f.clock(c) for f, c in zip(fakes, cores or (1.0,) * n)]


def _launch(clocks: list[VirtualClock], fakes: list[Fake], before: list[float], wire: Wire,
            meet: Meet = AR) -> list[object]:
    tickets = []
    for r, (f, c) in enumerate(zip(fakes, clocks)):
        f.thread += before[r]
        tickets.append(c.launch(meet, wire.start, r, len(clocks)))
    return tickets


def _land(clocks: list[VirtualClock], fakes: list[Fake], tickets: list[object], between: list[float]
          ) -> list[tuple[float, float]]:
    out = []
    for f, c, t, dt in zip(fakes, clocks, tickets, between):
        f.thread += dt
        out.append(c.land(t))
    return out


def test_compute_between_launch_and_wait_hides_the_link() -> None:
    fakes, clocks = _ranks(2)
    tickets = _launch(clocks, fakes, [0.005, 0.005], Wire())
    # 8 ms of compute while the 10 ms all-reduce travels: 2 ms of it still shows
    out = _land(clocks, fakes, tickets, [0.008, 0.008])
    assert out == [pytest.approx((0.013, 0.015))] * 2
    assert clocks[0].account.comm == pytest.approx(0.002) and clocks[0].account.compute == pytest.approx(0.013)
    # blocking, the same work would end at 0.005 + 0.010 + 0.008 = 0.023: 8 ms hidden
    fakes, clocks = _ranks(2)
    tickets = _launch(clocks, fakes, [0.005, 0.005], Wire())
    out = _land(clocks, fakes, tickets, [0.020, 0.020])  # enough compute: all of it hidden
    assert out == [pytest.approx((0.025, 0.025))] * 2 and clocks[1].account.comm == pytest.approx(0.0)


def test_a_late_launcher_makes_the_others_wait_as_idle() -> None:
    fakes, clocks = _ranks(2, (1.0, 0.5))  # rank 1 at half speed: its 5 ms of CPU take 10 ms
    tickets = _launch(clocks, fakes, [0.005, 0.005], Wire())
    (s0, e0), (s1, e1) = _land(clocks, fakes, tickets, [0.001, 0.001])
    assert e0 == e1 == pytest.approx(0.010 + 0.010)  # latest launch (rank 1's) + the link
    assert s0 == pytest.approx(0.006) and s1 == pytest.approx(0.012)
    assert clocks[0].account.idle == pytest.approx(0.004)  # from 6 ms to rank 1's launch at 10 ms
    assert clocks[0].account.comm == pytest.approx(0.010) and clocks[1].account.idle == 0.0
    for c in clocks:  # the account is the clock
        assert c.account.compute + c.account.comm + c.account.idle == pytest.approx(c.t)


def test_the_calls_cpu_is_charged_to_the_box_even_when_the_link_is_hidden() -> None:
    fakes, clocks = _ranks(2, (0.5, 1.0))
    for it in range(2):  # the first call teaches the estimator its CPU (2 ms of the host's)
        tickets = _launch(clocks, fakes, [0.001, 0.001], Wire(cpu=0.002))
        t0 = [c.t for c in clocks]
        out = _land(clocks, fakes, tickets, [0.050, 0.100])  # both hide the link entirely
    assert out[0][1] - t0[0] == pytest.approx(0.100 + 0.004)  # 50 ms of CPU at half speed + 2 ms / 0.5
    assert out[1][1] - t0[1] == pytest.approx(0.100 + 0.002)


def test_a_launched_call_is_charged_its_typical_cpu_not_its_cheapest() -> None:
    # charged on top of the compute that hides it, the charges must add up to what Gloo's threads
    # took: the window's median (the first sample is a warm-up and goes), not its minimum
    fakes, clocks = _ranks(2)
    for cpu in (0.009, 0.001, 0.003, 0.002):
        tickets = _launch(clocks, fakes, [0.001, 0.001], Wire(cpu=cpu))
        _land(clocks, fakes, tickets, [0.050, 0.050])
    tickets = _launch(clocks, fakes, [0.001, 0.001], Wire())
    t0 = clocks[0].t
    out = _land(clocks, fakes, tickets, [0.050, 0.050])
    assert out[0][1] - t0 == pytest.approx(0.050 + 0.002)  # median of 1, 3, 2 ms; the minimum would be 1
    assert clocks[0].call_est.value(("all_reduce_sum", 10_000, 2)) == 0.0  # blocking calls' own window


def test_the_links_stack_cpu_is_charged_beside_the_calls_own_at_the_boxs_speed() -> None:
    # 1 ns a byte: the 10 kB call's stack takes 10 us of a host core, 20 us of a half-speed box
    link = Link(1e6, 0.0, 1e-9)
    fakes = [Fake(), Fake()]
    clocks = [VirtualClock(Box(c, link, "min"), thread_time=lambda f=f: f.thread, wall=lambda: 0.0, slots=list)
              for f, c in zip(fakes, (0.5, 1.0))]
    for it in range(2):
        tickets = _launch(clocks, fakes, [0.001, 0.001], Wire(cpu=0.002))
        t0 = [c.t for c in clocks]
        out = _land(clocks, fakes, tickets, [0.050, 0.100])
    assert out[0][1] - t0[0] == pytest.approx(0.100 + (0.002 + 10e-6) / 0.5)
    assert out[1][1] - t0[1] == pytest.approx(0.100 + 0.002 + 10e-6)


def test_the_links_progress_delay_reaches_the_clocks_waits() -> None:
    # the 10 ms call on the wire from 5 ms, its threads held 4 ms by the compute after it
    fakes = [Fake(), Fake()]
    clocks = [VirtualClock(Box(1.0, Link(1e6, 0.0, progress_s=0.004), "min"), thread_time=lambda f=f: f.thread,
                           wall=lambda: 0.0, slots=list) for f in fakes]
    tickets = _launch(clocks, fakes, [0.005, 0.005], Wire())
    assert _land(clocks, fakes, tickets, [0.020, 0.020]) == [pytest.approx((0.025, 0.025))] * 2  # still hidden
    tickets = _launch(clocks, fakes, [0.0, 0.0], Wire())  # on the wire at 25 ms, done at 35 ms, seen at 39 ms
    assert _land(clocks, fakes, tickets, [0.012, 0.012]) == [pytest.approx((0.037, 0.039))] * 2
    assert clocks[0].account.comm == pytest.approx(0.002)
    assert clocks[0].describe()["progress_s"] == 0.004


def test_two_flights_share_the_link_in_launch_order_and_a_blocking_call_queues_behind() -> None:
    fakes, clocks = _ranks(2)
    first = _launch(clocks, fakes, [0.001, 0.001], Wire())
    second = _launch(clocks, fakes, [0.001, 0.001], Wire())  # launched at 2 ms, the link busy until 11 ms
    a = _land(clocks, fakes, first, [0.0, 0.0])
    b = _land(clocks, fakes, second, [0.0, 0.0])
    assert a == [pytest.approx((0.002, 0.011))] * 2 and b == [pytest.approx((0.011, 0.021))] * 2
    # a blocking all-reduce meets while a third flies: it starts on the wire when that one is done
    third = _launch(clocks, fakes, [0.001, 0.001], Wire())  # at 22 ms, done at 32 ms
    sent: list[list[float]] = []
    barrier = threading.Barrier(2)
    ends: list[tuple[float, float]] = [(0.0, 0.0)] * 2

    def rank(r: int) -> None:
        def runner(slots):  # a blocking all-reduce: every rank's slots summed
            sent.append(slots)
            barrier.wait()
            return [sum(col) for col in zip(*sent)], 0.0

        fakes[r].thread += 0.001
        ends[r] = clocks[r].meet(Meet("all_reduce_sum", "attn", 1_000, True), runner, r, 2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ends == [pytest.approx((0.023, 0.032 + 0.001))] * 2  # 1 kB: 1 ms, after the third's 10
    assert clocks[0].account.idle == pytest.approx(0.0)  # the link's queue is communication
    c = _land(clocks, fakes, third, [0.0, 0.0])  # complete by now: no wait
    assert c == [pytest.approx((0.033, 0.033))] * 2


def test_pace_mode_paces_a_launch_like_a_meeting() -> None:
    from xronos.node.emulate.pacer import PacedClock

    calls: list[str] = []

    class P:
        share = 0.5

        def pace(self) -> None:
            calls.append("pace")

        def restart(self) -> None:
            calls.append("restart")

    class F:
        def finish(self):
            calls.append("finish")
            return None, 0.0

    clock = PacedClock(P())  # type: ignore[arg-type]
    ticket = clock.launch(AR, lambda slots: calls.append("start") or F(), 0, 2)
    assert calls == ["pace", "start", "restart"]  # the rank pays for its compute before it launches
    start, end = clock.land(ticket)
    assert calls[-1] == "finish" and end >= start
