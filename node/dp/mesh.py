"""A DP×TP mesh cut out of a rank's world: its tensor-parallel group and its data-parallel group.

`form_mesh(world, tp, shares)`: a world of `tp * len(shares)` ranks, rank r in data-parallel
group r // tp (rows `shares[r // tp]` of each global batch) holding TP rank r % tp of the layout
(`protocol.mesh_of`). Its tensor-parallel group is the tp consecutive ranks of its group; its
data-parallel group the ranks at the same place of every group (one per share). Both are
`TPGroup`s over `dist.new_group`, never the default group, so the model's activation all-reduces
and DDP's gradient buckets each stay inside their own peers. `dist.new_group` is collective over
the whole world: every rank creates every subgroup, in the same order (TP groups, then DP groups),
even those it is not in. A group of one rank is `TPGroup.single` (no Gloo group at all).

The clock. Every subgroup reads the process's one clock (wall time, or an emulated box's), so a
rank's figures stay one timeline. A virtual clock (`node/emulate/vclock.py`) sends each rank's
arrival at a collective as an offset from `base`, "the last group-wide departure: the same on every
rank" — true of one world, not of a mesh: after a TP all-reduce the ranks of one TP group share a
departure that the other TP groups' ranks, met next in a DP all-reduce, do not. `GroupClock` keeps
a `base` per group (each group's ranks leave each of its collectives together, so each group's base
is the same on its ranks) and lends it to the clock for that group's meetings; everything else is
the process clock's own. A wall clock has no base and is used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from xronos.node.tp import progress
from xronos.node.tp.clock import Clock, Meet, Runner
from xronos.node.tp.group import TPGroup


class GroupClock(Clock):
    """The process clock as one group sees it: its own `base` for the group's meetings (see the
    module's docstring); every other attribute is the process clock's."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._base = 0.0  # every clock starts at 0 on every rank: so does every group's base
        self.name = clock.name
        self.slots = clock.slots

    def meet(self, meet: Meet, run: Runner, rank: int, world: int) -> tuple[float, float]:
        if not hasattr(self._clock, "base"):
            return self._clock.meet(meet, run, rank, world)
        saved, self._clock.base = self._clock.base, self._base
        try:
            return self._clock.meet(meet, run, rank, world)
        finally:
            self._base, self._clock.base = self._clock.base, saved

    def __getattr__(self, name: str):  # now, skipped, settle, forget, describe, close...
        return getattr(self._clock, name)

    def now(self) -> float:
        return self._clock.now()

    def skipped(self, meet: Meet) -> float:
        return self._clock.skipped(meet)

    def settle(self) -> None:
        self._clock.settle()

    def forget(self) -> None:
        self._clock.forget()

    def describe(self) -> dict[str, object]:
        return self._clock.describe()


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh."""

    tp: TPGroup  # the model's tensor-parallel group (rank = its TP rank of the layout)
    dp: TPGroup  # the data-parallel group (rank = its group's index: which rows)
    shares: tuple[int, ...]  # rows of each global batch per data-parallel group

    @property
    def rows(self) -> int:
        return self.shares[self.dp.rank]


def _group(ranks: list[int], me: int) -> tuple[dist.ProcessGroup | None, int]:
    pg = progress.made(lambda: dist.new_group(ranks)) if len(ranks) > 1 else None
    return pg, ranks.index(me) if me in ranks else -1


def form_mesh(world: TPGroup, tp: int, shares: Sequence[int]) -> Mesh:
    """Collective over `world`: this rank's TP and DP groups (module docstring)."""
    n = len(shares)
    if tp < 1 or world.world_size != tp * n:
        raise ValueError(f"a mesh of {n} data-parallel groups of {tp} ranks needs {tp * n} ranks, the world has "
                         f"{world.world_size}")
    me = world.rank
    if world.world_size > 1 and world.pg is not dist.group.WORLD:
        raise ValueError("a mesh is cut from the default (joined) world: its subgroups are new_group's")
    clock = world.clock
    tps = [list(range(g * tp, (g + 1) * tp)) for g in range(n)]
    dps = [list(range(t, tp * n, tp)) for t in range(tp)]
    made = [_group(ranks, me) for ranks in tps + dps]  # every rank, every group, this order
    (tp_pg, tp_rank), = [m for m in made[:n] if m[1] >= 0]
    (dp_pg, dp_rank), = [m for m in made[n:] if m[1] >= 0]

    def group(pg: dist.ProcessGroup | None, rank: int, size: int) -> TPGroup:
        if size == 1:  # traced as a world of one is by `TPGroup.join`: compute still split by kind
            return TPGroup.single(trace=True, clock=clock)
        return TPGroup(pg, rank, size, clock=GroupClock(clock))

    return Mesh(group(tp_pg, tp_rank, tp), group(dp_pg, dp_rank, n), tuple(shares))
