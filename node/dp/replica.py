"""A model replica trained data-parallel: torch's DistributedDataParallel over an explicit group.

`DataParallel(model, group)` wraps a family's model — built whole (`ShardLayout.single`, a
`TPGroup.single()`) for pure data parallelism, or at a TP layout inside its own TP group for a
DP×TP mesh — in DDP over `group`, the data-parallel group (its `pg`; never the default group).
DDP buckets the trainable gradients (all of them, or the adapters and a classifier's head under
LoRA: the frozen base has no gradient and is not synchronised) and all-reduces each bucket as soon
as backward has produced it, through `gradsync.GradSync`'s summing hook.

`forward_backward(rows, total)` runs this rank's rows; after it every rank holds the global
batch's gradient (the sum of the ranks' parts, identical on every rank: Gloo's ring all-reduce
gives every rank the same bytes), so the optimizer step, clipping included, is the same on every
rank and its state stays replicated without a word. A rank with no rows (share 0) still takes
part: its loss is 0 times the first element of every trainable tensor, which gives every trainable
tensor an exact zero gradient through DDP's own autograd hooks, so its buckets join the same
all-reduces in the same order — at the cost of filling its gradients with zeros, no forward pass.

DDP's construction options, and why:
- `init_sync=False`: every rank loads the same weights from the same source, so DDP's start-up
  broadcast of the whole model (2 GB for a 0.5B model, 16 s on 1 Gbit/s) is skipped;
- `forward_sync_buffers=False`: the models' buffers (RoPE tables, position ids) are constants;
- `gradient_as_bucket_view=True`: the gradients *are* the buckets, no second copy of them (the
  trainable size again, a whole model under full fine-tuning);
- `find_unused_parameters=False`: every family uses every trainable tensor in each forward (a
  traversal of the graph per step would cost for nothing); a model that did not would fail loudly
  at its second step in DDP itself.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from xronos.node.data.batches import Batch
from xronos.node.models.common import TPModel
from xronos.node.tp.group import TPGroup

from .gradsync import GradSync, sum_hook
from .rows import share_loss


class _ShareLoss(nn.Module):
    """What DDP wraps: the model's loss of this rank's rows (a zero loss over every trainable tensor
    when it has none)."""

    def __init__(self, model: TPModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, rows: Batch | None, total: int) -> torch.Tensor:
        if rows is None:
            # [:1], not [0]: in a DP×TP mesh a rank may hold 0 columns of a tensor (its gradient is
            # then empty, and still counts as ready for DDP)
            firsts = [p.reshape(-1)[:1].sum() for p in self.model.parameters() if p.requires_grad]
            return torch.stack(firsts).sum() * 0.0
        return share_loss(self.model, rows, total)


class DataParallel:
    """`model`'s replica on this rank of the data-parallel `group` (a world of one: no DDP at all)."""

    def __init__(self, model: TPModel, group: TPGroup, *, sync: str = "auto",
                 bucket_cap_mb: float | None = None) -> None:
        if group.alone:
            raise ValueError("data parallelism needs its peers: a rank run alone has no gradient to share")
        if group.world_size > 1 and model.group is group:
            raise ValueError("the data-parallel group must not be the model's tensor-parallel group")
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("materialize the model before wrapping it: DDP needs its parameters' storage")
        self.model = model
        self.group = group
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameter: nothing to train data-parallel")
        self.sync = GradSync(group, sync)
        self._loss: nn.Module = _ShareLoss(model)
        if group.world_size > 1:
            ddp = DistributedDataParallel(self._loss, process_group=group.pg, init_sync=False,
                                          forward_sync_buffers=False, gradient_as_bucket_view=True,
                                          find_unused_parameters=False, bucket_cap_mb=bucket_cap_mb)
            ddp.register_comm_hook(self.sync, sum_hook)
            self._loss = ddp

    @property
    def rank(self) -> int:
        return self.group.rank

    def seed(self, seed: int) -> None:
        """Dropout streams: the same within a TP group (its replicated layers must drop alike), distinct
        across the data-parallel ranks (they hold other rows; equal streams would correlate them)."""
        self.model.seed(zlib.crc32(f"{seed}:dp{self.group.rank}".encode()))

    def forward_backward(self, rows: Batch | None, total: int) -> torch.Tensor:
        """This rank's rows (None or no rows: share 0) forward and backward; `total` is the global
        batch's target count (`rows.target_count` of the whole batch). Returns this rank's part of
        the global loss (detached); the gradients are the global batch's when it returns."""
        if rows is not None and rows.input_ids.shape[0] == 0:
            rows = None
        loss = self._loss(rows, total)
        loss.backward()
        return loss.detach()

    def global_loss(self, part: torch.Tensor) -> float:
        """The global batch's loss: the ranks' parts summed (one all-reduce of one number, untimed:
        it is a report, not training)."""
        t = part.detach().to(torch.float64).reshape(1).clone()
        if self.group.world_size > 1:
            self.group.all_reduce(t, timed=False)
        return float(t)
