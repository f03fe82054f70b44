"""Each rank receives only its rows: the owner's batches cut by a data-parallel plan's shares.

A data-parallel run (`RunConfig.shares`) trains rows [sum(shares[:g]), sum(shares[:g+1])) of each
global batch in data-parallel group g (`xronos.node.dp.rows`), so broadcasting the whole batch
(`BatchChannel`) would send every rank every row. Here the owner (world rank 0, in group 0)
tokenises the whole batch — it alone has the data — and sends each other group's first rank its
group's slice of every tensor point to point over the world group; within a TP group, where every
rank needs the same rows, that rank broadcasts them over its TP group (the owner does in its own
group). So each row leaves the owner once, to the group that trains it (for pure DP, tp = 1, to
the one rank that trains it), and a rank with a share of 0 receives nothing at all. Each rank that has rows also gets
the global batch's target count (`total`: what the loss is averaged over, `dp.rows.target_count`),
which only the owner can count, as one int64 before its rows.

The sends are tagged `data` (data time, not communication), as the broadcasts are. Evaluation
batches (the held-out tail, `batch_size` rows each, the last one shorter) go whole to one group
each, in proportion to the shares (`eval_groups`; a group of 0 rows gets none): each group
evaluates its batches and the engine sums the groups' sums (`xronos.node.rank.dpengine`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from xronos.node.data.batches import Batch, BatchSource, eval_row_groups
from xronos.node.tp.group import TPGroup
from xronos.protocol.recipe import Recipe

IGNORE = -100


@dataclass(frozen=True)
class Rows:
    """One step's data on one rank: its rows (None for a share of 0) and the global batch's count."""

    rows: Batch | None
    total: int  # the global batch's target count (0 on a rank with no rows: it needs none)


def row_bounds(shares: Sequence[int], group: int) -> tuple[int, int]:
    start = sum(shares[:group])
    return start, start + shares[group]


def global_count(batch: Batch, task: str) -> int:
    """Rows (classify) or the target tokens of a causal LM (labels shifted by one, -100 excluded):
    the same count as `xronos.node.dp.rows.target_count` (that room is above this one)."""
    if task == "classify":
        return int(batch.labels.reshape(-1).shape[0])
    return int((batch.labels[:, 1:] != IGNORE).sum())


def eval_groups(n_batches: int, shares: Sequence[int]) -> list[int]:
    """The data-parallel group of each evaluation batch: the one with the fewest batches per row of
    its share so far (ties: the lower group), so the groups evaluate in proportion to their shares."""
    count = [0] * len(shares)
    out = []
    for _ in range(n_batches):
        g = min((g for g, s in enumerate(shares) if s > 0), key=lambda g: ((count[g] + 1) / shares[g], g))
        count[g] += 1
        out.append(g)
    return out


class RowsChannel:
    """Batches from the owner, each rank its data-parallel group's rows (module docstring)."""

    def __init__(self, cfg: Recipe, world: TPGroup, source: BatchSource | None, token_types: bool, tp: int,
                 shares: Sequence[int], tp_group: TPGroup | None = None) -> None:
        """`tp_group`: this rank's TP group (`dp.mesh.Mesh.tp`) where tp > 1."""
        if world.world_size != tp * len(shares):
            raise ValueError(f"{len(shares)} shares of {tp} ranks each need {tp * len(shares)} ranks, the world has "
                             f"{world.world_size}")
        if sum(shares) != cfg.batch_size:
            raise ValueError(f"shares {list(shares)} sum to {sum(shares)} rows, the batch has {cfg.batch_size}")
        self.cfg, self.world, self.source, self.token_types = cfg, world, source, token_types
        self.tp, self.shares = tp, tuple(shares)
        if tp > 1 and (tp_group is None or tp_group.world_size != tp):
            raise ValueError(f"rows for tensor-parallel groups of {tp} ranks need this rank's TP group")
        self.tp_group = tp_group if tp > 1 else None
        self.received = 0  # bytes of training data this rank received (what the tests and a report read)

    @property
    def mine(self) -> int:
        return self.shares[self.world.rank // self.tp]

    def _empty(self, rows: int) -> Batch:
        S = self.cfg.seq_len
        labels = torch.empty((rows,) if self.cfg.task == "classify" else (rows, S), dtype=torch.long)
        types = torch.empty(rows, S, dtype=torch.long) if self.token_types else None
        return Batch(torch.empty(rows, S, dtype=torch.long), torch.empty(rows, S, dtype=torch.long), labels, types)

    @staticmethod
    def _tensors(b: Batch) -> list[torch.Tensor]:
        return [t for t in (b.input_ids, b.attention_mask, b.labels, b.token_type_ids) if t is not None]

    def _send(self, batch: Batch) -> Rows:
        """The owner: every other rank its rows, then its own."""
        total = torch.tensor([global_count(batch, self.cfg.task)], dtype=torch.int64)
        with self.world.segment("data"):
            for r in range(self.tp, self.world.world_size, self.tp):  # every other group's first rank
                a, b = row_bounds(self.shares, r // self.tp)
                if a == b:
                    continue
                self.world.send(total, r)
                for t in self._tensors(batch):
                    self.world.send(t[a:b].contiguous(), r)
        a, b = row_bounds(self.shares, 0)
        if a == b:
            return Rows(None, 0)
        parts = (batch.input_ids, batch.attention_mask, batch.labels, batch.token_type_ids)
        mine = Batch(*[None if t is None else t[a:b].contiguous() for t in parts])
        self._spread([total, *self._tensors(mine)])
        return Rows(mine, int(total))

    def _spread(self, tensors: list[torch.Tensor]) -> None:
        """The group's first rank passes its rows on to the rest of its TP group."""
        if self.tp_group is not None:
            with self.tp_group.segment("data"):
                for t in tensors:
                    self.tp_group.broadcast(t, 0)

    def _from_owner(self, tensors: list[torch.Tensor]) -> None:
        """A group's rows: its first rank receives them from the owner, then the group shares them."""
        if self.world.rank % self.tp == 0:
            with self.world.segment("data"):
                for t in tensors:
                    self.world.recv(t, 0)
        self._spread(tensors)

    def _recv(self) -> Rows:
        if self.mine == 0:
            return Rows(None, 0)
        rows = self._empty(self.mine)
        total = torch.empty(1, dtype=torch.int64)
        self._from_owner([total, *self._tensors(rows)])
        self.received += 8 + sum(t.numel() * t.element_size() for t in self._tensors(rows))
        return Rows(rows, int(total))

    def train(self, n_train: int, start: int = 0) -> Iterator[tuple[int, Rows]]:
        """(epoch, this rank's rows) of every step from step `start` on."""
        if self.source is not None:
            for epoch, b in self.source.train_batches(start):
                yield epoch, self._send(b)
        else:
            per_epoch = n_train // self.cfg.batch_size
            for step in itertools.count(start):
                yield step // per_epoch, self._recv()

    def eval(self, n_train: int, n_eval: int) -> Iterator[Batch]:
        """This group's evaluation batches (`eval_groups`), in order."""
        row_groups = eval_row_groups(n_train, n_eval, self.cfg.batch_size)
        src = self.source.eval_batches() if self.source is not None else None
        me = self.world.rank // self.tp
        for rows, g in zip(row_groups, eval_groups(len(row_groups), self.shares)):
            if src is not None:  # the owner
                b = next(src)
                if g == 0:
                    self._spread(self._tensors(b))
                    yield b
                else:
                    with self.world.segment("data"):
                        for t in self._tensors(b):
                            self.world.send(t, g * self.tp)
            elif g == me:
                b = self._empty(len(rows))
                self._from_owner(self._tensors(b))
                yield b
