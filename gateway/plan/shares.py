"""Batch shares of data parallelism: how many rows of each global batch every rank takes.

Pure integer arithmetic over the ranks' speeds (rows per second, from their profiles), no torch and
no I/O, so the planner can call it for every candidate mesh and the gateway can check a plan (or a
forced `--shares`) before any process starts.

- `proportional_shares`: rows in proportion to speed, rounded by the largest remainder (Hamilton's
  method) so they sum to the global batch exactly; a rank of speed 0 gets 0 rows. Every rank gets
  the floor or the ceiling of its exact quota, so the split is as fair as integers allow.
- `balanced_shares`: the split that minimises the slowest rank's time `rows / speed` (d'Hondt's
  divisor method: each row goes to the rank that would finish it soonest). It may leave a slow
  rank at 0 rather than give it one row that takes longer than the fast ranks' whole share, which
  proportional rounding does not (speeds 7/1/1/1, 5 rows: 5/0/0/0 ends at 0.71, 4/1/0/0 at 1.0).
- `check_shares`: refuses shares that are not integers, are negative, name a node outside the
  mesh, leave one of its nodes out, or do not sum to the global batch, naming the value and the
  limit.

Exact arithmetic (`fractions.Fraction` of the float speeds) keeps the rounding independent of the
order of the ranks and of float noise: ties go to the faster rank, then to the lower index.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction


class ShareError(ValueError):
    """Speeds or shares that no data-parallel plan can use."""


def _check_batch(batch: int) -> None:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ShareError(f"global batch: must be an integer >= 1, got {batch!r}")


def _speeds(speeds: Sequence[float]) -> list[Fraction]:
    if len(speeds) == 0:
        raise ShareError("speeds: need at least one rank, got none")
    out = []
    for r, s in enumerate(speeds):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ShareError(f"speeds[{r}]: must be a finite number >= 0 (rows per second), got {s!r}")
        out.append(Fraction(s))
    if sum(out) == 0:
        raise ShareError(f"speeds: at least one rank must have a speed > 0, got {list(speeds)}")
    return out


def proportional_shares(speeds: Sequence[float], batch: int) -> tuple[int, ...]:
    """Rows per rank in proportion to `speeds`, summing to `batch` exactly (largest remainder)."""
    _check_batch(batch)
    fs = _speeds(speeds)
    total = sum(fs)
    quotas = [batch * s / total for s in fs]
    rows = [math.floor(q) for q in quotas]
    left = batch - sum(rows)  # < number of ranks with a speed > 0: each floor lost less than one
    # The ranks with the largest remainders take one more row each; ties: the faster, then the lower index.
    order = sorted(range(len(fs)), key=lambda r: (-(quotas[r] - rows[r]), -fs[r], r))
    for r in order[:left]:
        rows[r] += 1
    return tuple(rows)


def balanced_shares(speeds: Sequence[float], batch: int) -> tuple[int, ...]:
    """Rows per rank minimising max(rows / speed) over the ranks (d'Hondt: each row in turn to the
    rank whose time after taking it is the least), summing to `batch`; among the splits with that
    least maximum, the one these greedy steps reach (deterministic: ties to the faster rank, then
    the lower index)."""
    _check_batch(batch)
    fs = _speeds(speeds)
    live = [r for r, s in enumerate(fs) if s > 0]
    rows = [0] * len(fs)
    # Start from the floors of the proportional quotas scaled down by one row per rank: no
    # min-max split gives a rank fewer (its time would be below every other's next row), so the
    # greedy steps that follow are at most one per rank (O(N log N), not O(B)).
    total = sum(fs)
    for r in live:
        rows[r] = max(0, math.floor((batch - len(live)) * fs[r] / total))
    while sum(rows) < batch:
        r = min(live, key=lambda d: (Fraction(rows[d] + 1) / fs[d], -fs[d], d))
        rows[r] += 1
    return tuple(rows)


def slowest_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """The slowest rank's compute time `rows / speed` of a split (0 rows cost nothing; rows on a
    rank of speed 0 never finish: inf)."""
    if len(shares) != len(speeds):
        raise ShareError(f"shares: {len(shares)} values for {len(speeds)} speeds")
    worst = 0.0
    for rows, s in zip(shares, speeds):
        if rows:
            worst = max(worst, rows / s if s > 0 else math.inf)
    return worst


def check_shares(shares: Mapping[str, int], nodes: Collection[str], batch: int) -> None:
    """Refuse `shares` (node id -> rows) unless they give every node of `nodes` (the mesh's) a
    non-negative integer number of rows and sum to `batch`; 0 is a share like any other."""
    _check_batch(batch)
    known = set(nodes)
    unknown = sorted(set(shares) - known)
    if unknown:
        raise ShareError(f"shares: unknown node {', '.join(map(repr, unknown))} "
                         f"(the mesh's nodes: {', '.join(sorted(known))})")
    missing = sorted(known - set(shares))
    if missing:
        raise ShareError(f"shares: no share for node {', '.join(map(repr, missing))} (give 0 to leave a node idle)")
    for node, rows in shares.items():
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise ShareError(f"shares[{node!r}]: must be an integer number of rows, got {rows!r}")
        if rows < 0:
            raise ShareError(f"shares[{node!r}]: {rows} rows is negative (limit: >= 0)")
    for node, rows in shares.items():
        if rows > batch:
            raise ShareError(f"shares[{node!r}]: {rows} rows exceeds the global batch of {batch}")
    got = sum(shares.values())
    if got != batch:
        raise ShareError(f"shares: sum to {got} rows, but the global batch is {batch} "
                         f"({', '.join(f'{n}={r}' for n, r in shares.items())})")
