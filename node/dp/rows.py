"""A rank's rows of the global batch, and the loss that makes the ranks' gradients add up exactly.

The global batch's loss is a mean: over the target tokens of a causal LM (the shifted labels that
are not -100, as transformers counts them), over the rows of a classifier. Rank d's loss is the
sum of its own rows' per-target losses divided by the *global* count, so the ranks' losses — and
their gradients — sum to the global mean's. A plain per-rank mean weighted by rows would not: the
rows of a causal LM hold different numbers of targets (padding, prompts).

Rank d takes the contiguous rows [sum(shares[:d]), sum(shares[:d+1])): the owner can send each
rank its slice of the token ids, and a change of shares moves no weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from xronos.node.data.batches import Batch
from xronos.node.models.common import TPModel
from xronos.node.tp.layers import vocab_parallel_cross_entropy

IGNORE = -100  # transformers' ignore index: padding and prompt tokens carry no target


def row_range(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s rows under `shares` (rows per rank, in rank order)."""
    if not 0 <= rank < len(shares):
        raise ValueError(f"rank {rank} outside a data-parallel group of {len(shares)} shares")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shares):
        raise ValueError(f"shares must be non-negative integers, got {list(shares)}")
    start = sum(shares[:rank])
    return start, start + shares[rank]


def rows_of(batch: Batch, shares: Sequence[int], rank: int) -> Batch | None:
    """Rank `rank`'s rows of the global `batch` (None for a share of 0)."""
    rows = batch.input_ids.shape[0]
    if sum(shares) != rows:
        raise ValueError(f"shares {list(shares)} sum to {sum(shares)} rows, but the batch has {rows}")
    start, stop = row_range(shares, rank)
    if start == stop:
        return None

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:stop]

    return Batch(cut(batch.input_ids), cut(batch.attention_mask), cut(batch.labels), cut(batch.token_type_ids))


def target_count(batch: Batch | None, task: str) -> int:
    """What the global loss averages over: rows (classify) or target tokens (causal LM: labels
    shifted left by one, the last position and -100 excluded)."""
    if batch is None:
        return 0
    if task == "classify":
        return int(batch.labels.reshape(-1).shape[0])
    return int((batch.labels[:, 1:] != IGNORE).sum())


def share_loss(model: TPModel, rows: Batch, total: int) -> torch.Tensor:
    """This rank's part of the global batch's loss: its rows' summed per-target losses over the
    global count `total`. The targets are those of `TPModel.forward` (the same shift and ignore
    index), summed instead of averaged."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"the global batch's target count must be an integer >= 1, got {total!r}")
    logits = model.logits(rows.input_ids, rows.attention_mask, rows.token_type_ids)
    if model.task == "classify":
        return F.cross_entropy(logits, rows.labels.reshape(-1), reduction="sum") / total
    targets = F.pad(rows.labels[:, 1:], (0, 1), value=IGNORE)
    return vocab_parallel_cross_entropy(logits, targets, model.vocab_range[0], model.group, reduction="sum") / total
