"""Which slice of each segment kind lives on which rank (the engine's view of `protocol.layout`).

Rank r holds a contiguous range of every kind: attention units (heads, or KV-head groups for GQA),
MLP columns and vocabulary rows, each cut on its own (`ShardLayout.range`). Any count may be 0;
a rank with 0 of a kind still joins every collective of that kind's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from xronos.protocol.layout import KINDS, NOUN, Layout, LayoutError, Sizes


@dataclass(frozen=True)
class ShardLayout:
    """Counts per rank of each kind (the whole world's) and this process's rank."""

    attn: tuple[int, ...]
    mlp: tuple[int, ...]
    vocab: tuple[int, ...]
    rank: int

    def __post_init__(self) -> None:
        for k in KINDS:
            counts = tuple(getattr(self, k))
            object.__setattr__(self, k, counts)
            if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
                raise LayoutError(f"{k}: counts per rank must be non-negative integers, got {list(counts)}")
            if sum(counts) == 0:
                raise LayoutError(f"{k}: layout {list(counts)} assigns no {NOUN[k]} at all")
        lengths = {k: len(getattr(self, k)) for k in KINDS}
        if len(set(lengths.values())) != 1 or lengths["attn"] == 0:
            raise LayoutError(f"every kind needs one count per rank, got lengths {lengths}")
        if not 0 <= self.rank < len(self.attn):
            raise LayoutError(f"rank {self.rank} outside world of size {len(self.attn)}")

    @classmethod
    def of(cls, layout: Layout, rank: int) -> ShardLayout:
        return cls(layout.attn, layout.mlp, layout.vocab, rank)

    @classmethod
    def single(cls, sizes: Sizes) -> ShardLayout:
        """Everything on one rank: the unsharded model."""
        return cls.of(Layout.single(sizes), 0)

    @classmethod
    def tied(cls, units: Sequence[int], sizes: Sizes, rank: int) -> ShardLayout:
        """The paper's unit (MLP and vocabulary follow the attention share), cut exactly."""
        return cls.of(Layout.tied(units, sizes, quanta=None), rank)

    def layout(self) -> Layout:
        return Layout(attn=self.attn, mlp=self.mlp, vocab=self.vocab)

    @property
    def world_size(self) -> int:
        return len(self.attn)

    def total(self, kind: str) -> int:
        return sum(self.counts(kind))

    def counts(self, kind: str) -> tuple[int, ...]:
        if kind not in KINDS:
            raise LayoutError(f"unknown segment kind {kind!r} (kinds: {', '.join(KINDS)})")
        return getattr(self, kind)

    def _rank(self, r: int | None) -> int:
        r = self.rank if r is None else r
        if not 0 <= r < self.world_size:
            raise LayoutError(f"rank {r} outside world of size {self.world_size}")
        return r

    def range(self, kind: str, r: int | None = None) -> tuple[int, int]:
        """[start, stop) of `kind` held by rank r (default: this rank)."""
        r = self._rank(r)
        counts = self.counts(kind)
        start = sum(counts[:r])
        return start, start + counts[r]

    def count(self, kind: str, r: int | None = None) -> int:
        return self.counts(kind)[self._rank(r)]

    def share(self, kind: str, r: int | None = None) -> float:
        return self.count(kind, r) / self.total(kind)

    def check(self, sizes: Sizes) -> None:
        """Refuse a layout that does not cover the model's sizes exactly (naming the kind)."""
        for k in KINDS:
            if self.total(k) != sizes.total(k):
                raise LayoutError(f"{k}: layout {list(self.counts(k))} sums to {self.total(k)}, but the "
                                  f"model has {sizes.total(k)} {NOUN[k]}")
