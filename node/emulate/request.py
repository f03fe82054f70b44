"""What the emulator is asked for, and what it refuses before any group or process exists (pure
but for reading the host's memory size): a rank's limits (`RankLimits`), the quota modes' capacity
rules (`validate_limits`), virtual mode's (`validate_virtual`), the boxes' memory against the host's."""

from __future__ import annotations

from dataclasses import dataclass

from xronos.node.emulate.vclock import check_speed

MIN_QUOTA_US = 1_000  # the kernel's lower bound for cfs_quota_us
MIN_MEMORY_BYTES = 64 << 20


class EmulatorError(ValueError):
    """The requested confinement cannot be enforced on this machine (or the request is bad)."""


@dataclass(frozen=True)
class RankLimits:
    cpu_share: float  # cores, e.g. 0.3 = 30% of one core (virtual mode: the box's speed in host cores)
    memory_bytes: int | None = None
    box: str | None = None  # what the rank emulates ("pi4"), for messages

    def who(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.box})" if self.box else "")


def validate_virtual(limits: list[RankLimits], memory_bytes: int | None) -> None:
    """Refuse what virtual mode cannot run: a speed that is not a finite number of host cores > 0,
    or memory caps that do not fit the host's memory together (the caps are real)."""
    if not limits:
        raise EmulatorError("no ranks to confine")
    for r, lim in enumerate(limits):
        try:
            check_speed(lim.cpu_share, lim.who(r))
        except ValueError as exc:
            raise EmulatorError(str(exc)) from None
        if lim.memory_bytes is not None and lim.memory_bytes < MIN_MEMORY_BYTES:
            raise EmulatorError(f"{lim.who(r)}: memory cap {lim.memory_bytes} B is below 64 MiB")
    check_memory_fits(limits, memory_bytes)


def check_memory_fits(limits: list[RankLimits], memory_bytes: int | None) -> None:
    """The boxes' memory caps must fit this host's memory together (None: not known, not checked)."""
    if memory_bytes is None:
        return
    caps = [(lim.who(r), lim.memory_bytes) for r, lim in enumerate(limits) if lim.memory_bytes is not None]
    total = sum(c for _, c in caps)
    if total > memory_bytes:
        boxes = ", ".join(f"{w} {c / 2**30:.2f} GiB" for w, c in caps)
        raise EmulatorError(f"the boxes' memory caps ({boxes}; {total / 2**30:.2f} GiB in all) do not fit "
                            f"this host's {memory_bytes / 2**30:.2f} GiB of memory")


def host_memory_bytes() -> int | None:
    """MemTotal of this host (None where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def validate_limits(limits: list[RankLimits], cores: int, parent_limit: float | None) -> None:
    """Refuse what a CFS quota cannot deliver: the shares must fit the cores we actually have."""
    if not limits:
        raise EmulatorError("no ranks to confine")
    capacity = float(cores) if parent_limit is None else min(float(cores), parent_limit)
    for r, lim in enumerate(limits):
        if isinstance(lim.cpu_share, bool) or not isinstance(lim.cpu_share, (int, float)):
            raise TypeError(f"{lim.who(r)}: cpu_share must be a number, got {lim.cpu_share!r}")
        if not lim.cpu_share * 1_000_000 >= MIN_QUOTA_US * 100:  # also rejects NaN
            raise EmulatorError(f"{lim.who(r)}: cpu_share {lim.cpu_share} is below 0.1% of a core")
        if lim.cpu_share > capacity:
            raise EmulatorError(
                f"{lim.who(r)}: cpu_share {lim.cpu_share} exceeds the {capacity:g} cores this "
                "machine can give one process; a quota above that cannot be enforced")
        if lim.memory_bytes is not None and lim.memory_bytes < MIN_MEMORY_BYTES:
            raise EmulatorError(f"{lim.who(r)}: memory cap {lim.memory_bytes} B is below 64 MiB")
    total = sum(lim.cpu_share for lim in limits)
    if total > capacity + 1e-9:
        # Each quota alone would hold, but together the ranks would contend for cores and the
        # speed *ratios* — the point of the emulation — would no longer be the quotas' ratios.
        raise EmulatorError(
            f"total cpu share {total:.3g} exceeds the {capacity:g} cores available; "
            "scale the shares down")
