"""Keep a flood of bad input from flooding the log.

Every refused message is still counted (`Dispatcher.errors`) and answered; what is limited is the
log line. A box's disk and journal are small, and a sender that repeats one bad payload thousands
of times a second (a buggy script, an attacker with bus access) would otherwise grow the log
without bound (journald's own rate limit helps only under systemd). Per key, at most `limit` lines
in each `window_s`; the first line admitted after a window with drops says how many were dropped.
Pure: the clock is injected.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable


class LogThrottle:
    OTHER = ("(other keys)",)  # where new keys go while the table is full

    def __init__(self, limit: int = 20, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 256) -> None:
        if limit < 1 or not window_s > 0 or max_keys < 1:
            raise ValueError(f"LogThrottle needs limit >= 1, window_s > 0 and max_keys >= 1, got {limit}, "
                             f"{window_s}, {max_keys}")
        self.limit, self.window_s, self.clock, self.max_keys = limit, window_s, clock, max_keys
        # key -> [window start, lines admitted in it, lines dropped since the last admitted]
        self._state: dict[Hashable, list[float]] = {}

    def admit(self, key: Hashable) -> int | None:
        """None: drop this line. Otherwise log it; the int is how many lines of this key were
        dropped before it (0 when none)."""
        now = self.clock()
        if key not in self._state and len(self._state) >= self.max_keys:
            # Keys can come from the network (a node id in a topic): the table stays bounded.
            self._state = {k: v for k, v in self._state.items() if now - v[0] < self.window_s or v[2]}
            if len(self._state) >= self.max_keys:
                key = self.OTHER
        st = self._state.get(key)
        if st is None or now - st[0] >= self.window_s:
            dropped = int(st[2]) if st is not None else 0
            self._state[key] = [now, 1, 0]
            return dropped
        if st[1] < self.limit:
            st[1] += 1
            dropped, st[2] = int(st[2]), 0
            return dropped
        st[2] += 1
        return None
