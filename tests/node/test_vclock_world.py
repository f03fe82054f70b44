"""The virtual clock across real Gloo ranks: every kind of collective carries the ranks' virtual
arrivals, all leave together, and a rank made slower by its speed factor makes the others idle,
in virtual time, by what it computed longer — whatever the ranks did in wall time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.node.tp.tp_world import run_world

WORKER = Path(__file__).with_name("vclock_worker.py")


def _run(tmp_path: Path, speeds: list[float], **kw: object) -> list[dict]:
    job = {"speeds": speeds, "bandwidth_Bps": 1e9 / 8, "latency_s": 0.5e-3, "estimator": "med", "gemms": 6,
           "iters": 6, "sleep_rank": -1, "sleep_s": 0.0, **kw}
    run_world(WORKER, len(speeds), job, tmp_path, timeout=180)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(speeds))]


def test_a_slow_box_makes_the_others_idle_by_its_extra_compute(tmp_path: Path) -> None:
    # rank 1 is a box of half the speed, and rank 0 sleeps in wall time before every collective:
    # the wall clock would say rank 1 waits; the virtual one says rank 0 does.
    out = _run(tmp_path, [1.0, 0.5, 1.0], sleep_rank=0, sleep_s=0.01, n=256, gemms=8, p2p=False, end_barrier=True,
               estimator="min")
    # every collective ends at the same virtual time on every rank
    for it in range(len(out[0]["rows"])):
        ends = [[s + d for _, s, d in o["rows"][it]["spans"]] for o in out]
        assert len(ends[0]) == 5
        assert ends[1] == pytest.approx(ends[0], abs=1e-6) and ends[2] == pytest.approx(ends[0], abs=1e-6)
    # the accounts: compute + comm + idle is the clock, on every rank, and all end together
    for o in out:
        assert o["compute"] + o["comm"] + o["idle"] == pytest.approx(o["t"], abs=1e-6)  # (float32 slots)
        assert o["t"] == pytest.approx(out[0]["t"], abs=1e-6)
    fast, slow, peer = out
    assert slow["idle"] < 0.2 * fast["idle"]  # the slow box hardly ever waits (when its bursts are noisy)
    # The prediction from the speeds: the same work W (CPU seconds at host speed) takes W on the
    # fast boxes and W / 0.5 on the slow one, within the host's CPU-time noise between processes
    # (3 ranks on 2 cores here; a suite run on a slow host once read 1.72 W). The peer computes as
    # the slow box does, at host speed; rank 0 sleeps before every collective, and a thread that
    # slept computes its next burst slower (node/measure/profiler.py, `collective_pause_s`).
    assert slow["compute"] == pytest.approx(peer["compute"] / 0.5, rel=0.25)
    # Each fast box idles what the slow box computed longer than it did, burst by burst (it arrives
    # last at every collective): W (1 / 0.5 - 1) for the peer.
    for f in (fast, peer):
        assert f["idle"] == pytest.approx(slow["compute"] - f["compute"], rel=0.05)
    # wall time: rank 0 slept 10 ms before each of 6 collectives an iteration; none of it is virtual
    assert fast["compute"] + fast["idle"] < sum(fast["wall"]) - 0.9 * 6 * 6 * 0.01


def test_every_collective_costs_the_modelled_link(tmp_path: Path) -> None:
    """A slow link (100 kB/s, 10 ms a call): the fastest rank's time in each collective (what the
    metrics count as communication) is the link model's, per algorithm; the CPU cost of the calls
    (well under 10 ms here) does not show."""
    bw, lat = 1e5, 0.01
    out = _run(tmp_path, [1.0, 1.0], gemms=1, bandwidth_Bps=bw, latency_s=lat, iters=3)
    link = {"all_reduce_sum": lat + 32 * 256 * 4 / bw,  # ring of 2: 2(N-1)/N = 1
            "all_reduce_max": lat + 3 * 8 / bw, "broadcast": lat + 4 * 16 * 8 / bw,
            "all_gather": lat + 8 * 4 / bw, "barrier": lat}
    for it in range(3):
        per_rank = [{n: d for n, _, d in o["rows"][it]["spans"] if n in link} for o in out]
        for name, seconds in link.items():
            assert min(p[name] for p in per_rank) == pytest.approx(seconds, abs=1e-6), name
    # the send goes on at once; the receive waits for the bytes on the wire
    (_, sent, send_s), = [s for s in out[0]["rows"][1]["spans"] if s[0] == "send"]
    (_, start, recv_s), = [s for s in out[1]["rows"][1]["spans"] if s[0] == "recv"]
    assert send_s < 0.005  # its own CPU for the call, no link
    assert start + recv_s == pytest.approx(max(sent, start) + lat + 32 * 256 * 4 / bw, abs=0.005)


# A rank process of a virtual-mode run: the clock its TPGroup gets, and its threads.
VIRTUAL_CHILD = """
import json, torch
from xronos.node.emulate import process_clock
c = process_clock()
print(json.dumps([c.describe(), torch.get_num_threads()]), flush=True)
"""


def test_a_virtual_rank_finds_its_box_and_bad_boxes_are_refused_before_anything_starts() -> None:
    from tests.node.test_emulator import confined_output
    from xronos.node.emulate.cgroupfs import find_controller
    from xronos.node.emulate.confinement import Confinement, EmulatorError, RankLimits, leftover_groups
    from xronos.node.emulate.link import Link
    from xronos.node.emulate.vclock import read_box

    for speed in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(EmulatorError, match=r"rank 1 \(pi4\): speed must be a finite number of host cores > 0"):
            Confinement([RankLimits(0.9, box="n100"), RankLimits(speed, box="pi4")], cpu_mode="virtual")
    with pytest.raises(EmulatorError, match=r"rank 0 \(orin\) 4096.00 GiB.*do not fit this host"):
        Confinement([RankLimits(2.0, 4 << 40, box="orin")], cpu_mode="virtual")
    with pytest.raises(ValueError, match="bandwidth must be finite and > 0"):
        Confinement([RankLimits(2.0)], cpu_mode="virtual", link=Link(0.0))
    assert leftover_groups() == []
    if find_controller("cpu") is None:
        pytest.skip("no writable cgroup cpu controller here")
    # a speed above one host core is fine in virtual mode (a box faster than this host's core)
    with Confinement([RankLimits(1.5, box="n100"), RankLimits(0.3, box="pi4")], cpu_mode="virtual",
                     link=Link.mbit(100, stack_s_per_byte=2e-9), estimator="q25") as conf:
        assert conf._poller is None and conf.cores is None
        assert [q["clock"] for q in conf.quotas()] == ["virtual", "virtual"]
        described, threads = json.loads(confined_output(conf, 1, VIRTUAL_CHILD))
        assert described == {"clock": "virtual", "cpu_mode": "virtual", "host_cores": 0.3, "estimator": "q25",
                             "window": 32, "bandwidth_Bps": 100e6 / 8, "latency_s": 0.5e-3, "stack_s_per_byte": 2e-9,
                             "progress_s": 0.0}
        assert threads == 1  # the clock counts one thread's CPU time
        conf.set_share(1, 0.15)
        assert json.loads(confined_output(conf, 1, VIRTUAL_CHILD))[0]["host_cores"] == 0.15
        with pytest.raises(EmulatorError, match="rank 1 .pi4.: speed must be"):
            conf.set_share(1, 0.0)
        box_dir = conf._pace_dir
        assert box_dir is not None and read_box(box_dir / "rank0").host_cores == 1.5
    assert not box_dir.exists() and leftover_groups() == []
