"""The network emulator builds per-rank namespaces behind shaped links, really limits Gloo traffic,
leaves nothing behind, and training through it computes what it computes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from benchkit import TINY, _data, _reference
from xronos.bench import netem
from xronos.node.emulate.confinement import EmulatorError
from xronos.bench.netem import Network, allreduce_bandwidth, leftover_namespaces


@pytest.fixture(scope="module")
def netns() -> None:
    try:
        netem.check_available()
    except EmulatorError as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_refuses_without_root_or_iproute2(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulatorError, match="needs root"):
        Network(2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem, "_tool", lambda name: None if name == "tc" else "/usr/sbin/ip")
    with pytest.raises(EmulatorError, match="tc not found"):
        Network(2)
    with pytest.raises(EmulatorError, match="network rate"):
        Network(2, rate_mbit=0)


def test_namespaces_shaped_both_ways_then_removed(netns) -> None:
    with Network(2, rate_mbit=100) as net:
        assert set(leftover_namespaces()) == {net.hub, *net.names}
        for k, name in enumerate(net.names):
            assert f"inet {net.addresses[k]}/24" in _out(net.ip, "-n", name, "addr", "show", "dev", "eth0")
            assert "UP" in _out(net.ip, "-n", name, "link", "show", "lo")
            for ns, dev in ((name, "eth0"), (net.hub, f"p{k}")):  # upload, download
                q = _out(net.tc, "-n", ns, "qdisc", "show", "dev", dev)
                assert "qdisc tbf" in q and "rate 100Mbit" in q, (ns, dev, q)
        assert net.rendezvous_host == net.addresses[0]
        assert net.argv_prefix(1)[-3:] == ["netns", "exec", net.names[1]]
        assert net.env(0) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert leftover_namespaces() == []


def test_delay_in_front_of_the_rate_or_a_named_refusal(netns) -> None:
    try:
        with Network(2, rate_mbit=100, delay_ms=2) as net:
            up = _out(net.tc, "-n", net.names[0], "qdisc", "show", "dev", "eth0")
            down = _out(net.tc, "-n", net.hub, "qdisc", "show", "dev", "p0")
    except EmulatorError as exc:  # a kernel without sch_netem: refused, naming the step, nothing left
        assert "adding a 2 ms delay on eth0" in str(exc)
        assert leftover_namespaces() == []
        pytest.skip(f"no netem qdisc in this kernel: {exc}")
    assert "qdisc netem 1:" in up and "delay 2ms" in up and "qdisc tbf 10:" in up, up
    assert "netem" not in down, down  # one-way delay: on the upload only
    assert leftover_namespaces() == []


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_removed_when_the_body_raises(netns, exc) -> None:
    with pytest.raises(exc):
        with Network(3, rate_mbit=1000):
            assert len(leftover_namespaces()) == 4
            raise exc("boom")
    assert leftover_namespaces() == []


def test_failed_creation_names_the_step_and_cleans_up(netns) -> None:
    net = Network(2, rate_mbit=100)
    net.tc = "/nonexistent/tc"
    with pytest.raises(EmulatorError, match="limiting eth0 in xr.*-r0"):
        with net:
            pass
    assert leftover_namespaces() == []


@pytest.mark.slow
def test_gloo_allreduce_is_limited_to_the_rate(netns) -> None:
    # 2 ranks: a ring all-reduce moves the whole 4 MiB over each link -> 0.67 s at 50 Mbit/s,
    # ~10 ms on loopback. A failing shaper would be way below the 0.7x bound.
    size, rate = 4 << 20, 50
    r = allreduce_bandwidth(2, rate, size_bytes=size, iters=2)
    floor = size * 8 / (rate * 1e6)
    assert 0.7 * floor <= r["median_s"] <= 5 * floor, r
    assert leftover_namespaces() == []


@pytest.mark.slow
def test_tp_run_through_the_network_equals_loopback(netns, tmp_path: Path) -> None:
    # On loopback, a TP run's loss equals single-process transformers' (tests/node/test_contract.py,
    # and the hf-tp/pp tests use the same reference); so the network run is held to that reference
    # rather than to a second, loopback, launch: half the time on this shared machine.
    from xronos.bench.workloads import write_checkpoint
    from xronos.node.rank.local import launch_local
    from xronos.node.runconfig import RunConfig
    from xronos.node.rank.validate import model_sizes
    from xronos.protocol.layout import Layout

    model = write_checkpoint(tmp_path / "model", TINY["gpt2"])
    data = _data(tmp_path / "data.jsonl")
    cfg = RunConfig(recipe=dict(model_dir=str(model), data_path=str(data), task="classify", batch_size=8,
                                seq_len=16, lr=1e-3, max_steps=1, seed=0, eval_fraction=0.0, max_grad_norm=None),
                    layout=Layout.tied([1, 3], model_sizes(model)), progress=False, gloo_timeout_s=60,
                    metrics_path=str(tmp_path / "m.json"))

    in_ns: dict[int, bool] = {}

    def wrap(rank: int, proc: subprocess.Popen) -> None:
        # The pid launch_local hands to `wrap` (the cgroup hook) must end up as the rank itself,
        # inside its namespace: `ip netns exec` execs rather than forks.
        want = os.stat(f"/run/netns/{net.names[rank]}").st_ino
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not in_ns.get(rank):
            try:
                in_ns[rank] = os.stat(f"/proc/{proc.pid}/ns/net").st_ino == want
            except FileNotFoundError:
                break
            time.sleep(0.02)

    with Network(2, rate_mbit=1000) as net:
        launch_local(cfg, 2, wrap=wrap, echo_rank0=False, placement=net)
    assert in_ns == {0: True, 1: True}
    assert leftover_namespaces() == []
    losses = [r["iterations"][0]["loss"] for r in json.loads((tmp_path / "m.json").read_text())["ranks"]]
    ref_loss, _ = _reference(model, data)
    assert losses == pytest.approx([ref_loss] * 2, rel=1e-5)
