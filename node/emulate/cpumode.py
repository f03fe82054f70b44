"""How an emulated box's CPU share is made, chosen from the environment so that every bench and the
demo can be run any way: the CPU mode, virtual mode's burst estimator, pinning in quota mode, and
the quota poller's interval, and quota mode's CFS period. Each `default_*` refuses a bad value naming the variable.
"""

from __future__ import annotations

import math
import os

from xronos.node.emulate.estimator import DEFAULT_MODE, check_mode
from xronos.node.emulate.poller import POLL_S
from xronos.node.emulate.request import MIN_QUOTA_US, EmulatorError


POLL_ENV = "XRONOS_EMULATOR_POLL_S"  # for measuring the poller's effect: seconds, or "none"

# How a rank's CPU share is made: "virtual" (the default: no quota; the rank's clock advances by its
# CPU time over its share, `xronos.node.emulate.vclock`), "quota" (CFS bandwidth control, the
# poller) or "pace" (each rank pinned to a core and paced at its collectives,
# `xronos.node.emulate.pacer`). XRONOS_EMULATOR_CPU picks the default, so every bench and the demo
# can be run any way; quota and pace are wall clocks, a stress test of the host's scheduler.
CPU_MODES = ("virtual", "quota", "pace")
CPU_MODE_ENV = "XRONOS_EMULATOR_CPU"
ESTIMATOR_ENV = "XRONOS_EMULATOR_ESTIMATOR"  # virtual mode's burst estimator (`estimator.MODES`, qNN; default min)

# XRONOS_EMULATOR_PIN=1 pins quota-mode ranks as paced ones are (`assign_cores`). Off by default: 3+3
# demos ran 9 % faster pinned, no better predicted or balanced, the comm probe worse (demo-idle.md §5-6).
PIN_ENV = "XRONOS_EMULATOR_PIN"


def default_cpu_mode() -> str:
    mode = os.environ.get(CPU_MODE_ENV, "virtual").strip().lower()
    if mode not in CPU_MODES:
        raise EmulatorError(f"{CPU_MODE_ENV} must be one of {', '.join(CPU_MODES)}, got {mode!r}")
    return mode


def default_estimator() -> str:
    text = os.environ.get(ESTIMATOR_ENV, DEFAULT_MODE).strip().lower()
    try:
        return check_mode(text)
    except ValueError as exc:
        raise EmulatorError(f"{ESTIMATOR_ENV}: {exc}") from None


def default_pin() -> bool:
    text = os.environ.get(PIN_ENV, "0").strip()
    if text not in ("0", "1"):
        raise EmulatorError(f"{PIN_ENV} must be 0 or 1, got {text!r}")
    return text == "1"


def default_poll_s() -> float | None:
    """POLL_S, or what XRONOS_EMULATOR_POLL_S says ("none": quotas enforced at the tick only)."""
    text = os.environ.get(POLL_ENV)
    if text is None:
        return POLL_S
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise EmulatorError(f"{POLL_ENV} must be seconds or 'none', got {text!r}") from None


# The CFS period: as short as the kernel allows. A rank that waited (in a collective) starts each
# period with its whole quota and runs it at full core speed, so a period's quota is a burst a slow
# box never has. Measured (a 10 ms CPU segment at share 0.3, after 20 ms asleep vs back to back):
# 21 vs 35 ms with a 10 ms period, 28 vs 33 ms with 4 ms, 31 vs 35 ms with 3.4 ms. The fast and the
# idling ranks of a TP run wait many times per iteration, so a long period made them look faster
# than their profile said. Each rank gets the shortest period at which its quota is the kernel's
# 1 ms minimum, and never below DEFAULT_PERIOD_US.
DEFAULT_PERIOD_US = 2_000


def period_for(share: float, shortest_us: int = DEFAULT_PERIOD_US) -> int:
    """The CFS period of a rank with this share (its quota is then share x period >= 1 ms)."""
    return max(shortest_us, math.ceil(MIN_QUOTA_US / share))
