"""Which partition units live on which rank.

A layer with H partition units (heads, or KV-head groups for GQA) is split in contiguous unit
ranges: rank r owns units [sum(units[:r]), sum(units[:r+1])). Any tensor dimension that is
partitioned (head columns, MLP columns, the vocabulary) is cut on `unit_bounds(total, H)`, so a
rank with h units always holds the same h/H share of every partitioned layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def unit_bounds(total: int, H: int) -> list[int]:
    """H+1 boundaries cutting `total` into H near-equal chunks; the first `total % H` get one more."""
    if H <= 0:
        raise ValueError(f"number of partition units must be positive, got H={H}")
    if total < 0:
        raise ValueError(f"cannot partition a negative size {total}")
    base, rem = divmod(total, H)
    bounds = [0]
    for u in range(H):
        bounds.append(bounds[-1] + base + (1 if u < rem else 0))
    return bounds


@dataclass(frozen=True)
class ShardLayout:
    """Units per rank (the whole layout, len == world size) and this process's rank."""

    units: tuple[int, ...]
    rank: int

    def __post_init__(self) -> None:
        units = tuple(self.units)
        object.__setattr__(self, "units", units)
        if not units:
            raise ValueError("layout needs at least one rank")
        if any(not isinstance(u, int) or isinstance(u, bool) or u < 0 for u in units):
            raise ValueError(f"units per rank must be non-negative integers, got {list(units)}")
        if sum(units) == 0:
            raise ValueError(f"layout {list(units)} assigns no partition unit at all")
        if not 0 <= self.rank < len(units):
            raise ValueError(f"rank {self.rank} outside world of size {len(units)}")

    @classmethod
    def single(cls, H: int) -> ShardLayout:
        """Everything on one rank: the unsharded model."""
        return cls((H,), 0)

    @property
    def H(self) -> int:
        return sum(self.units)

    @property
    def world_size(self) -> int:
        return len(self.units)

    def _rank(self, r: int | None) -> int:
        r = self.rank if r is None else r
        if not 0 <= r < len(self.units):
            raise ValueError(f"rank {r} outside world of size {len(self.units)}")
        return r

    def unit_range(self, r: int | None = None) -> tuple[int, int]:
        r = self._rank(r)
        u0 = sum(self.units[:r])
        return u0, u0 + self.units[r]

    def ratio(self, r: int | None = None) -> float:
        return self.units[self._rank(r)] / self.H

    def slice_of(self, total: int, r: int | None = None) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension of size `total` cut on unit boundaries."""
        u0, u1 = self.unit_range(r)
        bounds = unit_bounds(total, self.H)
        return bounds[u0], bounds[u1]
