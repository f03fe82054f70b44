"""Network emulator: every local rank behind its own rate-limited link, like boxes on a switched LAN.

One network namespace per rank, each with a veth pair whose other end is a port of a bridge in a
"hub" namespace (the switch). The root namespace's interfaces, routes and firewall are never
touched: nothing is created there, and the hub's bridge has no address, so the private subnet
cannot shadow the host's own networks. A `tbf` qdisc limits every link to the rate in both
directions (optionally behind a `netem` delay). Namespaces are removed on exit, also on error and
on KeyboardInterrupt; `leftover_namespaces()` lists any that survived.

A `Network` is a `xronos.node.rank.local.Placement`: ranks run as `ip netns exec NAME python ...`
(ip execs, so the pid is the rank's own and the cgroup `wrap` hook still applies), with
`GLOO_SOCKET_IFNAME=eth0` and rank 0's address as the rendezvous host.

Usage:
    with Confinement(limits) as conf, Network(3, rate_mbit=1000) as net:
        launch_local(cfg, 3, wrap=conf.wrap, placement=net)

    python -m xronos.bench.netem --selftest [--rates 100,1000] [--ranks 2,3]   # achieved bandwidth
    python -m xronos.bench.netem --cleanup    # remove namespaces left by processes that are gone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field

from xronos.common.scoped import Scoped
from xronos.node.emulate.confinement import EmulatorError

log = structlog.get_logger(__name__)

PAPER_RATE_MBIT = 1000.0  # the paper's LAN: 1 Gbit/s Ethernet
LOOPBACK = "loopback (unlimited)"
RANK_IF = "eth0"  # the rank's end of its link, inside its own namespace (so the name never collides)
NETNS_DIR = Path("/run/netns")
_NAME = re.compile(r"^xr(\d+)-[0-9a-f]+-(?:hub|r\d+)$")
_SBIN = "/usr/sbin:/sbin"

# Token bucket depth, as time at the link rate, with a floor. A real port serialises every frame
# at line rate, so the ideal burst is one frame; but tbf refills from a timer, and a bucket smaller
# than what one timer slack lets through makes the link run *below* its rate. About 1 ms of traffic
# (125 kB at 1 Gbit/s) gave 91-94% of the rate as all-reduce bus bandwidth here (--selftest; TCP/IP
# headers alone take ~4%), while staying well below one of TP's all-reduces (a GPT-2-Medium
# [8, 32, 1024] fp32 activation is 1 MiB), so a collective cannot slip through on the bucket alone.
# The floor lets a whole 64 kB GSO packet through as one (tbf would otherwise split it into frames).
BURST_S = 1e-3
MIN_BURST_BYTES = 64 << 10
# Queue per link, as time at the link rate: a switch port's buffer. Big enough that a TCP flow
# through it reaches the rate (a too-short queue drops and TCP backs off below the rate), short
# enough that a small message behind a big one does not wait longer than on a real switch.
QUEUE_S = 20e-3
MIN_QUEUE_BYTES = 256 << 10


def _tool(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{_SBIN}")


def _run(argv: list[str], what: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmulatorError(f"network emulator: {what} failed: `{' '.join(argv)}`: {exc}") from exc
    if out.returncode != 0:
        raise EmulatorError(f"network emulator: {what} failed: `{' '.join(argv)}`: "
                            f"{(out.stderr or out.stdout).strip() or f'exit code {out.returncode}'}")
    return out.stdout


def _tools() -> tuple[str, str]:
    """(ip, tc) paths; refuses when not root or either is missing."""
    if os.geteuid() != 0:
        raise EmulatorError("network emulation needs root (network namespaces, veth, tc); "
                            "run as root or use --bandwidth-mbit 0 for loopback")
    ip, tc = _tool("ip"), _tool("tc")
    missing = [n for n, p in (("ip", ip), ("tc", tc)) if p is None]
    if missing:
        raise EmulatorError(f"network emulation needs iproute2: {' and '.join(missing)} not found "
                            f"on PATH or in {_SBIN} (Debian: apt install iproute2)")
    return ip, tc  # type: ignore[return-value]


def validate_rate(rate_mbit: float, delay_ms: float | None = None) -> None:
    if isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float)) or not (
            math.isfinite(rate_mbit) and rate_mbit > 0):
        raise EmulatorError(f"network rate must be a positive number of Mbit/s, got {rate_mbit!r}")
    if rate_mbit < 1 or rate_mbit > 100_000:
        raise EmulatorError(f"network rate {rate_mbit:g} Mbit/s is outside 1 .. 100000")
    if delay_ms is not None and not (isinstance(delay_ms, (int, float)) and 0 <= delay_ms <= 10_000):
        raise EmulatorError(f"network delay must be 0 .. 10000 ms, got {delay_ms!r}")


def describe(rate_mbit: float | None, delay_ms: float | None = None) -> str:
    """How the ranks were connected, for result files and tables."""
    if not rate_mbit:
        return LOOPBACK
    rate = f"{rate_mbit / 1000:g} Gbit/s" if rate_mbit >= 1000 else f"{rate_mbit:g} Mbit/s"
    delay = f", +{delay_ms:g} ms one-way delay" if delay_ms else ""
    return f"{rate} per rank link, both directions (netns + veth + bridge, tc tbf{delay})"


def _subnet(pid: int) -> str:
    # 198.18.0.0/15 is reserved for network benchmarking (RFC 2544): 512 /24s, picked by pid so
    # that packet captures of parallel runs tell apart. Collisions would be harmless anyway: each
    # run's namespaces only see their own bridge.
    k = pid % 512
    return f"198.{18 + k // 256}.{k % 256}"


class Network(Scoped):
    """n rank namespaces on one emulated switch; each link limited to `rate_mbit` both ways.

    A context manager: the namespaces exist only inside `with`. Also a launch `Placement`."""

    def __init__(self, n: int, rate_mbit: float = PAPER_RATE_MBIT, delay_ms: float | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 250:
            raise EmulatorError(f"network of {n!r} ranks: need 1 .. 250")
        validate_rate(rate_mbit, delay_ms)
        self.n, self.rate_mbit, self.delay_ms = n, float(rate_mbit), delay_ms or None
        self.ip, self.tc = _tools()
        pid = os.getpid()
        # The pid scopes leftovers to their maker; the random part keeps two networks of one
        # process (and a leftover of an earlier process with a reused pid) apart.
        prefix = f"xr{pid}-{uuid.uuid4().hex[:6]}"
        self.hub = f"{prefix}-hub"
        self.names = [f"{prefix}-r{k}" for k in range(n)]
        subnet = _subnet(pid)
        self.addresses = [f"{subnet}.{k + 1}" for k in range(n)]
        self._made: list[str] = []

    # -- Placement (xronos.node.rank.local) -------------------------------------------------------
    @property
    def rendezvous_host(self) -> str:
        return self.addresses[0]

    def argv_prefix(self, rank: int) -> list[str]:
        return [self.ip, "netns", "exec", self.names[rank]]

    def env(self, rank: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": RANK_IF}

    # -- lifecycle ----------------------------------------------------------------------------
    def _netns_add(self, name: str) -> None:
        _run([self.ip, "netns", "add", name], f"creating network namespace {name}")
        self._made.append(name)

    def _create(self) -> None:
        ip, hub = self.ip, self.hub
        self._netns_add(hub)
        for name in self.names:
            self._netns_add(name)
        _run([ip, "-n", hub, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"],
             f"creating the bridge in {hub}")
        _run([ip, "-n", hub, "link", "set", "br0", "up"], "bringing the bridge up")
        for k, name in enumerate(self.names):
            port = f"p{k}"
            _run([ip, "-n", hub, "link", "add", port, "type", "veth", "peer", "name", RANK_IF, "netns", name],
                 f"creating rank {k}'s veth pair")
            _run([ip, "-n", hub, "link", "set", port, "master", "br0", "up"], f"attaching rank {k} to the bridge")
            # lo must be up too: rank 0 reaches its own address (the rendezvous) through it.
            _run([ip, "-n", name, "link", "set", "lo", "up"], f"bringing lo up in {name}")
            _run([ip, "-n", name, "addr", "add", f"{self.addresses[k]}/24", "dev", RANK_IF],
                 f"addressing rank {k}")
            _run([ip, "-n", name, "link", "set", RANK_IF, "up"], f"bringing rank {k}'s link up")
            # Both directions: the rank side's egress is its upload, the bridge side's egress is
            # its download. Shaping only the upload would let several ranks send to one rank at
            # n x the rate (all-to-one phases: broadcasts, gathers, rendezvous), which a switch
            # port cannot; shaping only the download would let a rank upload at memory speed.
            # The delay (one-way) sits on the upload only, so a round trip pays it twice.
            self._shape(name, RANK_IF, self.delay_ms)
            self._shape(hub, port, None)
        log.info("network.created", ranks=self.n, rate_mbit=self.rate_mbit, delay_ms=self.delay_ms,
                 hub=hub, addresses=self.addresses)

    def _shape(self, ns: str, dev: str, delay_ms: float | None) -> None:
        rate_bps = self.rate_mbit * 1e6 / 8
        burst = max(MIN_BURST_BYTES, round(rate_bps * BURST_S))
        limit = max(MIN_QUEUE_BYTES, round(rate_bps * QUEUE_S), 2 * burst)
        tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]
        base = [self.tc, "-n", ns, "qdisc", "add", "dev", dev]
        if delay_ms:
            # netem holds every packet for the delay; tbf below it does the rate (netem's own
            # rate option would serialise per packet and cost much more CPU at 1 Gbit/s).
            _run([*base, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms", "limit", "100000"],
                 f"adding a {delay_ms:g} ms delay on {dev} in {ns}")
            _run([*base, "parent", "1:1", "handle", "10:", *tbf], f"limiting {dev} in {ns}")
        else:
            _run([*base, "root", "handle", "1:", *tbf], f"limiting {dev} in {ns} to {self.rate_mbit:g} Mbit/s")

    def close(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them)."""
        interrupted: BaseException | None = None
        for name in reversed(self._made):
            try:
                _run([self.ip, "netns", "del", name], f"deleting network namespace {name}")
            except EmulatorError as exc:
                if (NETNS_DIR / name).exists():
                    log.warning("network.cleanup_failed", namespace=name, error=str(exc))
            except BaseException as exc:  # a second Ctrl-C: finish the cleanup first
                interrupted = exc
        self._made.clear()
        if interrupted is not None:
            raise interrupted

    def describe(self) -> dict[str, object]:
        """What was enforced, for the result file."""
        return {"kind": "netns", "rate_mbit": self.rate_mbit, "delay_ms": self.delay_ms,
                "description": describe(self.rate_mbit, self.delay_ms), "qdisc": "tbf",
                "burst_s": BURST_S, "queue_s": QUEUE_S, "addresses": list(self.addresses)}


def namespaces() -> list[str]:
    """Every network namespace name made by any Network (any process)."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if _NAME.match(p.name))


def leftover_namespaces(pid: int | None = None) -> list[str]:
    """Namespaces made by process `pid` (default: this one) still present (should be none)."""
    want = str(pid or os.getpid())
    return [n for n in namespaces() if _NAME.match(n).group(1) == want]  # type: ignore[union-attr]


def stale_namespaces() -> list[str]:
    """Namespaces whose maker is no longer running (killed before it could clean up)."""
    return [n for n in namespaces() if not Path(f"/proc/{_NAME.match(n).group(1)}").exists()]  # type: ignore[union-attr]


def check_available() -> None:
    """Refuse up front, naming what failed, unless a shaped network can be built here: creates and
    removes a one-rank Network (a namespace, a bridge, a veth pair, two tbf qdiscs)."""
    with Network(1, PAPER_RATE_MBIT):
        pass


# -- measurement: Gloo all-reduce across the namespaces -------------------------------------------
class ProbeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = Field(gt=1)
    size_bytes: int = Field(gt=0)
    iters: int = Field(gt=0)
    out_path: str
    rank: int = 0
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 29500
    timeout_s: float = 120.0


def _probe_worker(cfg: ProbeConfig) -> None:
    import torch

    from xronos.node.tp.group import TPGroup

    # Measurement: every collective untimed by the group (the probe times them itself).
    group = TPGroup.join(cfg.rank, cfg.world_size, cfg.rendezvous_host, cfg.rendezvous_port, cfg.timeout_s)
    x = torch.ones(cfg.size_bytes // 4)
    group.all_reduce(x, timed=False)  # warm-up: connections, buffers
    times = []
    for _ in range(cfg.iters):
        group.barrier(timed=False)
        t0 = time.perf_counter()
        group.all_reduce(x, timed=False)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    group.all_reduce(t, "max", timed=False)  # an all-reduce ends when its slowest rank is done
    assert float(x[0]) == cfg.world_size ** (cfg.iters + 1)
    if cfg.rank == 0:
        Path(cfg.out_path).write_text(json.dumps({"seconds": t.tolist()}))
    group.leave()


def allreduce_bandwidth(n: int, rate_mbit: float | None, *, size_bytes: int = 8 << 20, iters: int = 3,
                        delay_ms: float | None = None, timeout_s: float = 120.0) -> dict:
    """Time a Gloo all-reduce of `size_bytes` (fp32) across n ranks, each in its own namespace behind
    a `rate_mbit` link (None or 0: plain loopback, for comparison). Bus bandwidth as nccl-tests
    defines it: a ring all-reduce moves 2(n-1)/n x size over every rank's link each way, so on an
    ideal link it equals the link rate."""
    from xronos.node.rank.local import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="xronos-netem-") as tmp:
        out = Path(tmp) / "probe.json"
        cfg = ProbeConfig(world_size=n, size_bytes=size_bytes, iters=iters, out_path=str(out), timeout_s=timeout_s)
        if rate_mbit:
            with Network(n, rate_mbit, delay_ms) as net:
                spawn_ranks("xronos.bench.netem", [cfg] * n, placement=net, timeout_s=timeout_s)
        else:
            spawn_ranks("xronos.bench.netem", [cfg] * n, timeout_s=timeout_s)
        seconds = json.loads(out.read_text())["seconds"]
    med = sorted(seconds)[len(seconds) // 2]
    bus_mbit = 2 * (n - 1) / n * size_bytes * 8 / med / 1e6
    return {"ranks": n, "rate_mbit": rate_mbit or None, "network": describe(rate_mbit, delay_ms),
            "size_bytes": size_bytes, "seconds": seconds, "median_s": med, "bus_mbit": bus_mbit,
            "efficiency": bus_mbit / rate_mbit if rate_mbit else None}


def selftest(rates: list[float], ranks: list[int], size_mb: float, iters: int) -> str:
    lines = ["| ranks | link | all-reduce MiB | median s | bus bandwidth Mbit/s | of the link rate |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for n in ranks:
        for rate in [0.0, *rates]:
            r = allreduce_bandwidth(n, rate, size_bytes=int(size_mb * 2**20) // 4 * 4, iters=iters)
            eff = "–" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
            lines.append(f"| {n} | {'loopback' if not rate else f'{rate:g} Mbit/s'} | {size_mb:g} | "
                         f"{r['median_s']:.3f} | {r['bus_mbit']:.0f} | {eff} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):  # a probe rank (spawned by allreduce_bandwidth)
        _probe_worker(ProbeConfig.model_validate_json(Path(argv[0]).read_text()))
        return 0
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.netem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="measure all-reduce bandwidth: loopback vs shaped")
    ap.add_argument("--rates", default="100,1000", help="Mbit/s, comma list")
    ap.add_argument("--ranks", default="2,3", help="rank counts, comma list")
    ap.add_argument("--size-mb", type=float, default=8.0, help="all-reduce size (MiB, fp32)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cleanup", action="store_true", help="delete namespaces of processes that are gone")
    args = ap.parse_args(argv)
    if args.cleanup:
        ip, _ = _tools()
        for name in stale_namespaces():
            _run([ip, "netns", "del", name], f"deleting stale namespace {name}")
            print(f"deleted {name}")
        return 0
    if not args.selftest:
        ap.print_help()
        return 2
    try:
        _tools()
        selftest([float(r) for r in args.rates.split(",")], [int(n) for n in args.ranks.split(",")],
                 args.size_mb, args.iters)
    except EmulatorError as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
