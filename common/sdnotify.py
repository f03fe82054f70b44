"""The systemd notify protocol, spoken directly (no python-systemd dependency).

A `Type=notify` unit learns the service is up from `READY=1`, that it is shutting down from
`STOPPING=1`, and that it is alive from `WATCHDOG=1` within `WatchdogSec=`. Each is one datagram
to the AF_UNIX socket named in $NOTIFY_SOCKET; a leading "@" means the Linux abstract namespace.
Outside systemd (no $NOTIFY_SOCKET) every call is a no-op that returns False, so services can call
them unconditionally.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)


def _address(raw: str) -> str | bytes:
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()  # abstract namespace: NUL-prefixed, not a file
    if raw.startswith("/"):
        return raw
    raise ValueError(f"NOTIFY_SOCKET={raw!r}: expected an absolute path or an '@' abstract name")


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1" or "STATUS=training\\nWATCHDOG=1"); True if it was sent."""
    env = os.environ if env is None else env
    raw = env.get("NOTIFY_SOCKET")
    if not raw:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(state.encode(), _address(raw))
        except OSError as exc:
            # A lost notification must never take the service down; systemd will time it out.
            log.warning("sd_notify failed", socket=raw, error=str(exc))
            return False
    return True


def ready(status: str | None = None) -> bool:
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def stopping(status: str | None = None) -> bool:
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def status(text: str) -> bool:
    return notify(f"STATUS={_one_line(text)}")


def _one_line(text: str) -> str:
    # A newline would start a new assignment in the datagram; STATUS is one line.
    return " ".join(text.splitlines())


class Watchdog:
    """Pings systemd's watchdog at half of `WatchdogSec=`, driven by the service's control loop.

    The loop calls `maybe_ping()` on every turn; a ping goes out only when half the interval has
    passed since the last one. If the loop hangs, pings stop and systemd restarts the unit — which
    is the point of pinging from the loop rather than from a timer thread.
    """

    def __init__(
        self,
        interval_s: float | None,
        send: Callable[[str], bool] = notify,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s  # None: no watchdog configured
        self._send = send
        self._clock = clock
        self._last: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs) -> Watchdog:
        """Read $WATCHDOG_USEC (and $WATCHDOG_PID, which must be us if present)."""
        env = os.environ if env is None else env
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return cls(None, **kwargs)
        try:
            value = int(usec)
        except ValueError:
            raise ValueError(f"WATCHDOG_USEC={usec!r}: expected an integer of microseconds") from None
        if value <= 0:
            raise ValueError(f"WATCHDOG_USEC={usec!r}: must be positive")
        return cls(value / 1e6, **kwargs)

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    @property
    def ping_every_s(self) -> float | None:
        return None if self.interval_s is None else self.interval_s / 2

    def maybe_ping(self) -> bool:
        """Ping if half the interval has passed since the last ping; True if a ping was sent."""
        if self.interval_s is None:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s / 2:
            return False
        self._last = now
        return self._send("WATCHDOG=1")
