"""The spec table: how each local parameter maps onto a Hugging Face checkpoint tensor.

One table per model drives loading (slice reads), streaming from the owner, consolidation and
export. It is derived from the model's modules (`TPModel.tensor_specs`): the parallel layers know
their `Split` of each partitioned dimension, task heads their fresh initialisation. A partitioned local tensor is the concatenation along `dim` of `segments` of the HF tensor
(several segments for fused tensors such as GPT-2's c_attn, whose local part is q|k|v columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    dim: int | None  # None = replicated: the local tensor is the whole HF tensor
    segments: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]
    # How to create the tensor when a base checkpoint lacks it (a fresh task head, as HF does):
    # "normal" (N(0, std)), "zeros", "ones"; None = it must be in the checkpoint.
    init: str | None = None
    std: float = 0.02

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b - a for a, b in self.segments)
        return tuple(shape)

    def index(self, start: int, stop: int) -> tuple[slice, ...]:
        """Index selecting [start, stop) along `dim` (usable on tensors and safetensors slices)."""
        assert self.dim is not None
        return tuple(slice(start, stop) if d == self.dim else slice(None)
                     for d in range(len(self.full_shape)))

    def take(self, full: Any) -> torch.Tensor:
        """This spec's local tensor cut out of the full tensor (or a safetensors slice)."""
        if self.dim is None:
            return full[tuple(slice(None) for _ in self.full_shape)] if hasattr(full, "get_shape") \
                else full
        parts = [full[self.index(a, b)] for a, b in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def place(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write a local tensor with this spec's segments into the full tensor (inverse of take)."""
        if self.dim is None:
            full.copy_(local)
            return
        offset = 0
        for a, b in self.segments:
            full[self.index(a, b)] = local.narrow(self.dim, offset, b - a)
            offset += b - a
