"""Speed-weighted data parallelism: every rank a whole replica, its own rows of each global batch.

- `rows`: a rank's rows of the global batch (contiguous, by the plan's shares) and the global
  count the loss is weighted by (target tokens of a causal LM, rows of a classifier).
- `gradsync`: the DDP communication hook that sums the gradient buckets over the data-parallel
  group, overlapped with backward on wall time, or through the group's clock (`node/tp/clock.py`).
- `replica`: `DataParallel`, a model (full or LoRA, any TP layout) wrapped in torch's own
  DistributedDataParallel over an explicit group; a rank with no rows still joins every all-reduce.

Nothing here owns the optimizer, clipping or the data: the rank's engine does, as for TP.
"""
