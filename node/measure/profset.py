"""The profiling set: the engine's one-block model at one width, split into layers by hooks.

See `xronos.node.measure.profiler` for the method; this module holds the machinery: rank 0 of a TP
world profiled alone (`TPGroup.alone`: the peers' collectives are skipped, so the time is this
rank's compute only, what the cost model predicts; communication is a separate term), and the set
that runs one fine-tuning iteration (or one measured-memory iteration) at a time; the block's
partitioned regions and the hook timeline are in `timeline.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xronos.node.emulate import pacer, process_clock
from xronos.node.rank.gradnorm import all_finite, squared_norm
from xronos.node.measure.memprobe import AllocTrace, SavedTensorMeter, mark, state_bytes, storage_key
from xronos.node.measure.timeline import Timeline, find_regions
from xronos.node.models.loading import init_random
from xronos.node.models.registry import family_for
from xronos.node.rank.optim import adamw
from xronos.node.rank.optstate import allocate_state
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import LoraSettings, add_lora
from xronos.protocol.layout import KINDS, Layout


class ProfilingSet:
    """The one-block model at one width, its layer groups, one AdamW over every trained parameter
    (timing) and one per layer (memory), a synthetic batch."""

    def __init__(self, config: dict[str, Any], task: str, layout: Layout, batch: int, seq: int,
                 seed: int, clip: bool, weight_decay: float = 0.0, lora: LoraSettings | None = None,
                 pause_s: float = 0.0) -> None:
        """`layout`: a two-rank layout; this process is rank 0 and holds its counts of each kind.
        `lora`: the job's adapters on a frozen base, so the measured backward has no weight-gradient
        GEMMs for frozen weights and the optimizer state is the adapters' only.
        `pause_s`: a sleep where training waits in a collective (`xronos.node.measure.profiler`)."""
        family = family_for(config)
        layout.check(family.sizes(config), world_size=2, quanta=None)
        self.layout = layout
        # An emulated box's clock (`process_clock`): on the virtual clock a layer's time is its CPU
        # time over the box's speed, estimated per recurring burst as in training: the same ruler.
        self._clock = process_clock()
        self.virtual = self._clock is not None and self._clock.name == "virtual"
        self.group = TPGroup.alone(2, pause_s=pause_s, clock=self._clock if self.virtual else None)
        self.group.clock.forget()  # the process's clock may have estimated another width's bursts
        self._plain = False
        self.model = family.build(config, task, ShardLayout.of(layout, 0), self.group)
        if lora is not None:
            add_lora(self.model, lora)
            # The frozen embedding gives the first block an input without gradient; the profiled
            # block stands for the others, whose input has one (their input gradient is computed).
            _only_block(self.model).register_forward_pre_hook(_input_needs_grad)
        init_random(self.model, seed)
        self.model.train()
        self.clip = clip
        specs = self.model.tensor_specs()
        part = {id(p) for n, p in self.model.named_parameters() if specs[n].dim is not None}
        self.block = _only_block(self.model)
        self.regions = find_regions(self.block, part)
        self.timeline = Timeline(self.block, self.regions, self.clock)
        self.groups = self._groups(config, task, batch, seq, seed)
        # AdamW's default weight decay (0.01) is not the trainer's (the job's, 0 by default): the
        # decay is a pass over every parameter, 30% of RoBERTa-base's optimizer step here.
        # Only trained parameters get an optimizer (all of them, or with LoRA the adapters).
        self.opts = {k: adamw([p for p in ps if p.requires_grad], lr=2e-5, weight_decay=weight_decay)
                     for k, ps in self.groups.items() if any(p.requires_grad for p in ps)}
        # Timing steps ONE AdamW over every trained parameter, as the trainer does: a step call has
        # a fixed cost that one optimizer per layer would pay per layer (and the cost model B times
        # per block layer). The step's time is shared out by trained parameter count (AdamW is
        # elementwise). The per-layer optimizers above are for memory(): each layer's own state.
        trained = [p for ps in self.groups.values() for p in ps if p.requires_grad]
        self.opt_all = adamw(trained, lr=2e-5, weight_decay=weight_decay)
        # Its state up front, as the trainer allocates it at build (node/rank/optstate.py): created
        # lazily inside the first step, above that iteration's gradients, it leaves holes the
        # next gradients do not fit: the heap's slack measured here was 323 MiB on a
        # MobileLLaMA-1.4B block at full width, 96 MiB with the trainer's order.
        allocate_state(self.opt_all)
        self.numel = {k: sum(p.numel() for p in ps if p.requires_grad) for k, ps in self.groups.items()}
        # A layer is partitioned when it holds partitioned parameters — or, for the LM head, when
        # its compute is vocabulary-parallel even though its weight is tied to the embedding's.
        self.partitioned = {k: any(id(p) in part for p in ps) or (k == "out" and task == "causal-lm")
                            for k, ps in self.groups.items()}

    def clock(self) -> float:
        """perf_counter without the pauses at skipped collectives. Under the emulator's paced CPU
        every reading first waits out the compute before it (`xronos.node.emulate.pacer`): each layer the
        hooks split off then takes what it takes on a core of the rank's share, as in training.
        On the virtual clock: its time (every reading ends a burst; `iteration` settles it)."""
        if self.virtual:
            return self.group.now()
        p = pacer.current()
        if p is not None:
            p.pace()
        return time.perf_counter() - self.group.paused_s

    def segment(self, key: str) -> str | None:
        """The segment kind whose width a partitioned layer follows (None: replicated)."""
        if not self.partitioned[key]:
            return None
        if key in ("emb", "out"):
            return "vocab"
        for kind in ("attn", "mlp"):
            if kind in key.rsplit(".", 1)[-1]:
                return kind
        raise RuntimeError(f"cannot tell the segment kind of partitioned layer {key!r}")

    def _batch(self, config: dict[str, Any], task: str, B: int, S: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        V = int(config.get("vocab_size"))
        self.ids = torch.randint(0, V, (B, S), generator=g)
        self.mask = torch.ones(B, S, dtype=torch.long)
        self.labels = (torch.randint(0, self.model.num_labels, (B,), generator=g) if task == "classify"
                       else self.ids.clone())

    def use_rows(self, rows: int) -> None:
        """Train the first `rows` rows of the batch from now on (the profiler's fewer-rows run: the
        same model, no second build). The clock's estimates were of the whole batch's bursts."""
        if not 0 < rows <= self.ids.shape[0]:
            raise ValueError(f"rows must be in [1, {self.ids.shape[0]}], got {rows}")
        self.ids, self.mask, self.labels = self.ids[:rows], self.mask[:rows], self.labels[:rows]
        self.group.clock.forget()

    def _groups(self, config: dict[str, Any], task: str, B: int, S: int, seed: int) -> dict[str, list]:
        """Parameters per layer key: block params by region, others by where they are first used."""
        self._batch(config, task, B, S, seed)
        in_block = {id(p) for p in self.block.parameters()}
        first_use: dict[int, str] = {}
        hooks = []
        for m in self.model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in in_block]
            if own:
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, _a, own=own: first_use.update(
                        {id(p): self.timeline.top for p in own if id(p) not in first_use})))
        self.timeline.start("fwd", "emb")
        with torch.no_grad():
            self.model(self.ids, self.mask, self.labels)
        self.timeline.stop()
        self.timeline.take()
        for h in hooks:
            h.remove()
        groups: dict[str, list] = {"emb": [], **{f"blk.{r}": [] for r in self.regions}, "blk.rest": [], "out": []}
        region_of = {id(p): f"blk.{r}" for r, m in self.regions.items() for p in m.parameters()}
        for p in self.model.parameters():
            if id(p) in in_block:
                groups[region_of.get(id(p), "blk.rest")].append(p)
            else:
                groups["emb" if first_use.get(id(p)) == "emb" else "out"].append(p)
        return groups

    def _clip(self, key: str) -> None:
        """The trainer's work on this layer's gradients before the step: the global-norm clipping
        (norm pass, scale), or without clipping its look for inf/nan (`all_finite`, a read of
        every gradient: 15 ms of the real MiniLM's 123 ms iteration at full width on one host core,
        which the profile did not see when it timed nothing here)."""
        grads = [p.grad for p in self.groups[key] if p.grad is not None]
        if not grads:
            return
        if not self.clip:
            all_finite(grads)
            return
        sq = torch.zeros(1, dtype=torch.float64)
        for g in grads:
            sq.add_(squared_norm(g))  # as the trainer's clipping pass
        for g in grads:
            g.mul_(0.5)

    def _step(self, key: str, measure: Callable[[], None] | None = None) -> None:
        """The trainer's per-step work on this layer's parameters alone: clip, AdamW, zero."""
        opt = self.opts[key]
        self._clip(key)
        opt.step()
        if measure is not None:
            measure()
        opt.zero_grad(set_to_none=True)

    def iteration(self) -> dict[str, float]:
        """One fine-tuning iteration; seconds per layer key (forward + backward + optimizer).
        `self.last` is its (wall, CPU) seconds, pauses left out (see `hook_overhead_s`)."""
        tl = self.timeline
        w0, c0 = self.clock(), time.process_time()
        loss = tl.forward(lambda: self.model(self.ids, self.mask, self.labels))
        loss.backward()
        tl.stop()
        secs = tl.take()
        for key in self.opts:
            t0 = self.clock()
            self._clip(key)
            secs[key] = secs.get(key, 0.0) + self.clock() - t0
        self.group.pause()  # the trainer's optimizer step follows the clipping all-reduce
        t0 = self.clock()
        self.opt_all.step()
        self.opt_all.zero_grad(set_to_none=True)
        step_s = self.clock() - t0
        total = sum(self.numel.values()) or 1
        for key, n in self.numel.items():
            secs[key] = secs.get(key, 0.0) + step_s * n / total
        self.last = (self.clock() - w0, time.process_time() - c0)
        self.group.settle()  # virtual: the next iteration's bursts recur with the same keys
        return secs

    def param_bytes(self, key: str) -> int:
        """Bytes of layer `key`'s parameters at this width (weights only, frozen ones included)."""
        return sum(p.numel() * p.element_size() for p in self.groups[key])

    def largest_tensor(self, key: str) -> int:
        """Bytes of the largest single parameter of layer `key` at this width (the buffer loading
        reads it into before copying it in)."""
        return max((p.numel() * p.element_size() for p in self.groups[key]), default=0)

    def plain_iteration(self) -> tuple[float, float]:
        """The same iteration with the timeline's hooks removed: (wall, CPU) seconds."""
        self.timeline.remove()
        if not self._plain:  # its bursts are not the hooked iteration's (the same keys on the clock)
            self.group.clock.forget()
            self._plain = True
        w0, c0 = self.clock(), time.process_time()
        loss = self.model(self.ids, self.mask, self.labels)
        loss.backward()
        for key in self.opts:
            self._clip(key)
        self.group.pause()
        self.opt_all.step()
        self.opt_all.zero_grad(set_to_none=True)
        out = self.clock() - w0, time.process_time() - c0
        self.group.settle()
        return out

    def memory(self) -> dict[str, tuple[int, int, int]]:
        """(M_w, M_a, M_t) per layer key, measured on one iteration."""
        self.opt_all.state.clear()  # the timing optimizer's moments: not a layer's, and not kept
        # Each layer's moments exist before its step, as in training (allocated at build). Created
        # inside the traced step, 2 x the layer's parameters arrived while its gradients were
        # alive and the gradients left at zero_grad: a rise and fall of exactly the parameters'
        # bytes, which M_t counted as a temporary no training step has (every full fine-tune
        # layer's M_t equalled its param_bytes; the fused AdamW allocates none).
        for opt in self.opts.values():
            allocate_state(opt)
        tl = self.timeline
        exclude = {storage_key(p) for p in self.model.parameters()}
        meter = SavedTensorMeter(exclude, current=tl.current, inputs=tl.inputs)
        weights: dict[str, int] = {}
        tl.annotate = True
        try:
            with AllocTrace() as trace:
                with meter():
                    loss = tl.forward(lambda: self.model(self.ids, self.mask, self.labels))
                loss.backward()
                tl.stop()
                for key in self.opts:
                    with mark(f"opt::{key}"):
                        self._step(key, lambda key=key: weights.__setitem__(
                            key, state_bytes(self.groups[key], self.opts[key])))
        finally:
            tl.annotate = False
            tl.take()
        for key, ps in self.groups.items():  # a layer with nothing to train: its weights alone
            weights.setdefault(key, state_bytes(ps, None))
        out = {}
        subs = [f"blk.{r}" for r in self.regions]
        for key in self.groups:
            if key == "blk.rest":
                names, skip = ["fwd::blk", "bwd::blk"], tuple(f"xr::{ph}::{s}" for ph in ("fwd", "bwd") for s in subs)
            else:
                names, skip = [f"fwd::{key}", f"bwd::{key}"], ()
            temp = max([trace.temp_bytes(f"xr::{n}", skip=skip) for n in names]
                       + [trace.temp_bytes(f"xr::opt::{key}")])
            out[key] = (weights.get(key, 0), meter.by_region.get(key, 0), temp)
        return out

    def close(self) -> None:
        self.timeline.remove()


def _input_needs_grad(_m: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    if torch.is_grad_enabled() and not x.requires_grad:
        return (x.detach().requires_grad_(), *args[1:])
    return None


def _only_block(model: nn.Module) -> nn.Module:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == 1]
    if len(lists) != 1:
        raise RuntimeError(f"cannot find the single transformer block of {type(model).__name__}")
    return lists[0][0]


class ProfileTooLarge(ValueError):
    """This box cannot even hold the profiling set: refused before anything is allocated."""


def floor_bytes(config: dict[str, Any], task: str, lora: bool) -> tuple[int, int]:
    """(bytes, parameters): the least the profile allocates — the one-block set's fp32 weights at
    full width and, unless the base is frozen (LoRA), their gradients and AdamW's two moments
    (4 + 12 bytes a parameter). Activations, temporaries and the runtime come on top, so a box
    below this surely fails; counted on the meta device, nothing allocated."""
    family = family_for(config)
    sizes = family.sizes(config)
    layout = Layout(**{k: (sizes.total(k), 0) for k in KINDS})
    model = family.build(config, task, ShardLayout.of(layout, 0), TPGroup.alone(2))
    n = sum(p.numel() for p in model.parameters())  # tied weights once
    return n * (4 if lora else 16), n
