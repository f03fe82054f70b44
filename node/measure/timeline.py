"""The profiling set's hooks (`profset.ProfilingSet`): the block's partitioned regions
(`find_regions`) and the timeline that splits one iteration into layers with forward and backward
hooks, accumulating seconds per layer key and knowing which layer runs (`Timeline`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from xronos.node.measure.memprobe import storage_key
from xronos.node.tp.layers import InRegion


def find_regions(block: nn.Module, partitioned: set[int]) -> dict[str, nn.Module]:
    """The largest submodules of `block` whose every parameter-owning module owns a partitioned
    parameter or works on the region's partitioned activations (`InRegion`: Qwen3's q/k norms) —
    attention, MLP; what is left over is the replicated remainder."""
    out: dict[str, nn.Module] = {}

    def owners(m: nn.Module) -> list[bool]:
        return [isinstance(s, InRegion) or any(id(p) in partitioned for p in s.parameters(recurse=False))
                for s in m.modules() if next(s.parameters(recurse=False), None) is not None]

    def visit(name: str, m: nn.Module) -> None:
        flags = owners(m)
        if not any(flags):
            return
        if all(flags) and name:
            out[name] = m
            return
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", block)
    return out


class Timeline:
    """Splits one iteration into layers with hooks; accumulates seconds per layer key and knows
    which layer is running (for attributing saved activations)."""

    def __init__(self, block: nn.Module, regions: dict[str, nn.Module],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.regions = regions
        self.clock = clock  # seconds, leaving out the group's pauses at skipped collectives
        self.seconds: dict[str, float] = defaultdict(float)
        self.inputs: dict[str, set[tuple[int, int]]] = {}
        self.annotate = False
        self.phase, self.top, self._t0, self._rf = "fwd", "", 0.0, None
        self._stack: list[str] = []
        self._sub: dict[str, tuple[float, Any]] = {}
        self._handles = [
            block.register_forward_pre_hook(lambda *_: self.switch("blk")),
            block.register_forward_hook(lambda *_: self.switch("out")),
            block.register_full_backward_pre_hook(lambda *_: self.switch("blk")),
            block.register_full_backward_hook(lambda *_: self.switch("emb")),
        ]
        for name, mod in regions.items():
            self._handles += [
                mod.register_forward_pre_hook(self._enter(name, capture=True)),
                mod.register_forward_hook(self._leave(name)),
                mod.register_full_backward_pre_hook(self._enter(name)),
                mod.register_full_backward_hook(self._leave(name)),
            ]

    def start(self, phase: str, top: str) -> None:
        self.phase = phase
        self._open(top)

    def forward(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()` (the model's forward) timed from the embedding on; the timeline is then at the
        head, in the backward phase, for the caller's `backward()`."""
        self.start("fwd", "emb")
        loss = run()
        self.phase = "bwd"
        self.switch("out")
        return loss

    def switch(self, top: str) -> None:
        self._close()
        self._open(top)

    def stop(self) -> None:
        self._close()

    def _open(self, top: str) -> None:
        self.top = top
        if self.annotate:
            self._rf = record_function(f"xr::{self.phase}::{top}")
            self._rf.__enter__()
        self._t0 = self.clock()

    def _close(self) -> None:
        self.seconds[self.top] += self.clock() - self._t0
        if self._rf is not None:
            self._rf.__exit__(None, None, None)
            self._rf = None

    def _enter(self, name: str, capture: bool = False) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            self._stack.append(name)
            if capture:
                self.inputs[f"blk.{name}"] = {storage_key(a) for a in args if isinstance(a, torch.Tensor)}
            rf = None
            if self.annotate:
                rf = record_function(f"xr::{self.phase}::blk.{name}")
                rf.__enter__()
            self._sub[name] = (self.clock(), rf)
        return hook

    def _leave(self, name: str) -> Callable:
        def hook(_m: nn.Module, *_: object) -> None:
            t0, rf = self._sub.pop(name)
            self.seconds[f"blk.{name}"] += self.clock() - t0
            if rf is not None:
                rf.__exit__(None, None, None)
            assert self._stack.pop() == name, "region hooks out of order"
        return hook

    def current(self) -> str:
        if self._stack:
            return f"blk.{self._stack[-1]}"
        return "blk.rest" if self.top == "blk" else self.top

    def take(self) -> dict[str, float]:
        """Seconds per layer key of the iteration just run (blk.rest = block minus regions)."""
        s = dict(self.seconds)
        self.seconds = defaultdict(float)
        blk = s.pop("blk", 0.0)
        s["blk.rest"] = max(0.0, blk - sum(s.get(f"blk.{r}", 0.0) for r in self.regions))
        return s

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
