"""A rank's resident set at its highest, per phase of its life (build, forward, backward, clipping,
optimizer step, checkpoint, export).

The kernel keeps each process's high-water mark of resident pages (`VmHWM` in /proc/self/status,
the same number `getrusage` reports as `ru_maxrss`); it counts every resident page, anonymous
(heap, thread stacks) and file-backed (mapped libraries, a safetensors file mapped while loading).
`phase(name)` reads it at the end of a phase. By default the mark is never reset, so the phase
whose read first shows the process's final peak is the phase that set it. With
`XRONOS_MEM_PHASES=DIR` in the environment (measurement runs: `python -m xronos.bench.mem_peak`),
the mark is reset after every read (`/proc/self/clear_refs` 5), so each phase's own peak is
known, and the rank writes them to `DIR/rank<r>.json` at the end; the process's overall peak is
then the maximum over phases (`peak()`), which every caller reads instead of `ru_maxrss` (the
reset lowers that too).

Reading the status file costs ~20 microseconds, a handful per iteration. Measurement runs also
record glibc's heap at the end of each phase (`heap()`: `mallinfo2`, bytes the heap spans, holds
in use and holds free), which tells live tensors from the heap's free holes in the resident set.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

ENV = "XRONOS_MEM_PHASES"
_STATUS = Path("/proc/self/status")
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in bytes (zeros where not Linux)."""
    out = dict.fromkeys(_FIELDS, 0)
    try:
        text = _STATUS.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0]) * 1024  # kB
    return out


HEAP_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
               "keepcost")  # struct mallinfo2, glibc >= 2.33: ten size_t


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in HEAP_FIELDS]


def heap() -> dict[str, int]:
    """glibc's heap, all arenas: `span` bytes obtained with brk/sbrk (main arena) or arena heaps,
    `used` in allocated chunks, `free` in free chunks (resident unless trimmed), `mmapped` in
    chunks mmapped on their own; {} where there is no glibc >= 2.33."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"span": m.arena, "used": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


class Watch:
    """Per-phase peaks of this process (see the module docstring)."""

    def __init__(self, out_dir: str | None = None) -> None:
        self.out_dir = out_dir if out_dir is not None else os.environ.get(ENV) or None
        self.resetting = self.out_dir is not None
        self.phases: dict[str, int] = {}  # phase -> highest VmHWM read at its end
        self.anon: dict[str, int] = {}  # phase -> RssAnon at its end (what is left, not a peak)
        self.first: str | None = None  # the first phase whose end showed the overall peak
        self.events: list[tuple[str, int, int]] = []  # (phase, peak, RssAnon at its end), first ones
        self.heaps: list[tuple[str, dict[str, int]]] = []  # measurement runs: (phase, heap() at its end)
        self._peak = 0
        self.baseline = status()["VmRSS"]
        if self.resetting:
            self._reset()

    def phase(self, name: str) -> int:
        """End of phase `name`: its peak (since the last read when resetting), in bytes."""
        st = status()
        hwm = st["VmHWM"]
        self.phases[name] = max(self.phases.get(name, 0), hwm)
        self.anon[name] = st["RssAnon"]
        if len(self.events) < 64:
            self.events.append((name, hwm, st["RssAnon"]))
            if self.resetting:
                self.heaps.append((name, heap()))
        if hwm > self._peak:
            self._peak, self.first = hwm, name
        if self.resetting:
            self._reset()
        return hwm

    def peak(self) -> int:
        """The process's peak resident set so far (the maximum over phases when resetting)."""
        return max(self._peak, status()["VmHWM"])

    @staticmethod
    def _reset() -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux, or not allowed: the marks stay cumulative

    def write(self, rank: int, extra: dict | None = None) -> None:
        """Measurement runs: this rank's phases to DIR/rank<r>.json."""
        if self.out_dir is None:
            return
        doc = {"rank": rank, "baseline_rss": self.baseline, "peak": self.peak(), "peak_phase": self.first,
               "phases": self.phases, "anon_after": self.anon,
               "events": self.events, "heaps": self.heaps, **(extra or {})}
        Path(self.out_dir, f"rank{rank}.json").write_text(json.dumps(doc, indent=1))


_WATCH: Watch | None = None


def watch() -> Watch:
    """The process's one watch (made at first use: its baseline is the process at that moment)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = Watch()
    return _WATCH


def phase(name: str) -> int:
    return watch().phase(name)
