"""Per-iteration measurements of one rank, and the idle/communication split across ranks.

At a synchronisation point every rank leaves the collective at (about) the same moment, so the
fastest rank's time inside it is the pure communication cost and anything a rank spent beyond that
was waiting for a straggler: idle = own - min over ranks, comm = min over ranks (summed over the
iteration's collectives).

Compute is split by segment kind from the rank's timeline (`TPGroup` spans, `segment_compute`):
the time before a collective or mark tagged attn / mlp / vocab is that kind's compute; everything
else (the replicated head and final norm, clipping, the optimizer step, rank 0's batch encoding)
is `rest`. The four always sum to `compute_s`.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, fields

from collections.abc import Sequence

import torch

from xronos.protocol.layout import KINDS, Layout

# ru_maxrss is KiB on Linux, bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def comm_and_idle(per_rank: torch.Tensor, rank: int) -> tuple[float, float]:
    """per_rank: [world, C] seconds each rank spent in each of the iteration's C collectives.
    Returns (comm_s, idle_s) of `rank`."""
    if per_rank.numel() == 0:
        return 0.0, 0.0
    fastest = per_rank.min(dim=0).values  # [C]
    comm = float(fastest.sum())
    idle = float((per_rank[rank] - fastest).sum())
    return comm, idle


SEGMENTS = (*KINDS, "rest")  # the per-kind compute fields: compute_<segment>_s


def segment_compute(spans: Sequence, start: float, end: float) -> dict[str, float]:
    """Seconds of compute per segment in [start, end] from a rank's time-ordered spans (`TPGroup`:
    .tag, .start, .seconds): the gap before each span goes to its tag if that is a segment kind,
    else to "rest", as does the gap after the last one."""
    out = dict.fromkeys(SEGMENTS, 0.0)
    at = start
    for s in spans:
        if s.start < start:  # left over from before the iteration
            continue
        out[s.tag if s.tag in KINDS else "rest"] += max(s.start - at, 0.0)
        at = max(at, s.start + s.seconds)
    out["rest"] += max(end - at, 0.0)
    return out


class Rusage:
    """Context-switch deltas and peak RSS of this process (all its threads)."""

    def __init__(self) -> None:
        self._last = resource.getrusage(resource.RUSAGE_SELF)

    def delta(self) -> tuple[int, int]:
        """(voluntary, involuntary) context switches since the previous call."""
        now = resource.getrusage(resource.RUSAGE_SELF)
        d = (now.ru_nvcsw - self._last.ru_nvcsw, now.ru_nivcsw - self._last.ru_nivcsw)
        self._last = now
        return d

    @staticmethod
    def peak_rss() -> int:
        """Peak resident memory of this process since it started its program: Linux's VmHWM.
        Not ru_maxrss: on Linux that keeps the high-water mark across fork + exec, so a rank
        spawned by a process holding 2.6 GiB (the bench harness after writing a checkpoint)
        reported 2.6 GiB whatever it used itself. ru_maxrss where /proc is missing (macOS)."""
        try:
            with open("/proc/self/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


@dataclass(frozen=True)
class IterationRecord:
    """One rank's numbers for one training iteration (seconds, bytes, counts)."""

    step: int
    epoch: int
    loss: float
    lr: float
    iteration_s: float
    compute_s: float
    comm_s: float
    idle_s: float
    data_s: float
    voluntary_ctx_switches: int
    involuntary_ctx_switches: int
    peak_rss: int
    # compute_s split by segment kind (they sum to compute_s; see segment_compute)
    compute_attn_s: float = 0.0
    compute_mlp_s: float = 0.0
    compute_vocab_s: float = 0.0
    compute_rest_s: float = 0.0
    # seconds this rank spent re-sharding at the boundary just before this iteration (not in
    # iteration_s; 0 when the layout stayed)
    reshard_s: float = 0.0
    # The seconds above are on the rank's clock (`TPGroup.now`: virtual on an emulated box in virtual
    # mode, else wall); this is the iteration's wall time beside them, whatever the clock.
    wall_s: float = 0.0

    def as_row(self) -> list[float]:
        return [float(v) for v in asdict(self).values()]

    @classmethod
    def from_row(cls, row: list[float]) -> IterationRecord:
        kinds = {f.name: f.type for f in fields(cls)}
        return cls(**{n: (int(v) if kinds[n] == "int" else float(v)) for n, v in zip(kinds, row)})


@dataclass(frozen=True)
class RankSummary:
    rank: int
    attn: int  # this rank's attention units, MLP columns and vocabulary rows
    mlp: int
    vocab: int
    iterations: int
    iteration_s: float  # mean per iteration (first iteration excluded as warm-up when K > 1)
    compute_s: float
    comm_s: float
    idle_s: float
    data_s: float
    idle_ratio: float  # idle / iteration time
    voluntary_ctx_switches: int  # totals over all iterations
    involuntary_ctx_switches: int
    peak_rss: int
    compute_attn_s: float = 0.0  # mean compute per iteration by segment kind (sum = compute_s)
    compute_mlp_s: float = 0.0
    compute_vocab_s: float = 0.0
    compute_rest_s: float = 0.0


def summarize(rank: int, layout: Layout, records: list[IterationRecord]) -> RankSummary:
    steady = records[1:] if len(records) > 1 else records
    n = len(steady)

    def mean(name: str) -> float:
        return sum(getattr(r, name) for r in steady) / n

    it = mean("iteration_s")
    return RankSummary(
        rank=rank,
        attn=layout.attn[rank],
        mlp=layout.mlp[rank],
        vocab=layout.vocab[rank],
        iterations=len(records),
        iteration_s=it,
        compute_s=mean("compute_s"),
        comm_s=mean("comm_s"),
        idle_s=mean("idle_s"),
        data_s=mean("data_s"),
        idle_ratio=mean("idle_s") / it if it > 0 else 0.0,
        voluntary_ctx_switches=sum(r.voluntary_ctx_switches for r in records),
        involuntary_ctx_switches=sum(r.involuntary_ctx_switches for r in records),
        peak_rss=max(r.peak_rss for r in records),
        **{f"compute_{k}_s": mean(f"compute_{k}_s") for k in SEGMENTS},
    )


def format_table(summaries: list[RankSummary]) -> str:
    head = f"{'rank':>4} {'attn':>4} {'mlp':>6} {'vocab':>6} {'iter s':>8} {'compute s':>9} " \
        f"{'attn s':>8} {'mlp s':>8} {'vocab s':>8} {'rest s':>8} {'comm s':>8} " \
        f"{'idle s':>8} {'idle %':>6} {'data s':>8} {'ctx vol/inv':>13} {'peak RSS':>10}"
    lines = [head]
    for s in summaries:
        ctx = f"{s.voluntary_ctx_switches}/{s.involuntary_ctx_switches}"
        lines.append(
            f"{s.rank:>4} {s.attn:>4} {s.mlp:>6} {s.vocab:>6} {s.iteration_s:>8.4f} {s.compute_s:>9.4f} "
            f"{s.compute_attn_s:>8.4f} {s.compute_mlp_s:>8.4f} {s.compute_vocab_s:>8.4f} {s.compute_rest_s:>8.4f} "
            f"{s.comm_s:>8.4f} {s.idle_s:>8.4f} {100 * s.idle_ratio:>6.1f} {s.data_s:>8.4f} "
            f"{ctx:>13} {s.peak_rss / 2**20:>8.1f}Mi"
        )
    return "\n".join(lines)
