"""Free TCP ports to listen on: for a broker, a rendezvous, a range of rendezvous ports.

Not the kernel's own `bind(0)`: that hands out a port of the ephemeral range
(`net.ipv4.ip_local_port_range`), and once the probe socket closes, the next outgoing connection
on this machine — an MQTT client, one of Gloo's many pair connections — may take it before the
listener binds it. CI saw exactly that: a gateway's rendezvous range began at such a port, and
rank 0 found it "not free: Address already in use" a minute later. A port below (or above) the
ephemeral range is never handed to an outgoing connection, so a port probed free here stays free
unless something binds it on purpose.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW = 10000  # below: registered services (1024-9999) more often listen there
_lock = threading.Lock()
_given: set[int] = set()  # this process's own: two calls before either binds still differ


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _EPHEMERAL.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidates(n: int, tries: int = 2000) -> list[int]:
    """Random first ports of `n`-port blocks outside the ephemeral range (none if it covers all)."""
    lo, hi = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOW, lo - n), (hi + 1, 65536 - n)) if b > a]
    total = sum(b - a for a, b in spans)
    out = []
    for k in (random.randrange(total) for _ in range(tries if total else 0)):
        for a, b in spans:
            if k < b - a:
                out.append(a + k)
                break
            k -= b - a
    return out


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", n: int = 1) -> int:
    """The first of `n` consecutive ports free on `host`, outside the ephemeral range, not given
    before by this process."""
    with _lock:
        for base in _candidates(n):
            ports = range(base, base + n)
            if _given.isdisjoint(ports) and all(_bindable(host, p) for p in ports):
                _given.update(ports)
                return base
    if n == 1:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    raise OSError(f"no {n} consecutive free ports on {host} outside the ephemeral range {ephemeral_range()}")
