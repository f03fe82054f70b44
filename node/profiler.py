"""The node's profiler (paper §IV-A): time and memory of each layer of the profiling set.

The profiling set is the engine's own model with ONE transformer block: embedding, one
representative block, output layer — random weights, synthetic batch, the same code that trains
(`Family.build` + `init_random`), the same optimizer (AdamW) and the same per-step work as the
trainer (global-norm clipping pass, step, zero_grad). One fine-tuning iteration of that model is
split into layers by module hooks on the block:

    forward : [emb ....][blk: attn | rest | mlp | rest][out + loss]
    backward: [out ....][blk: ...                     ][emb ......]
    step    : one AdamW per layer's parameters, timed separately (norm pass + step + zero_grad)

so T_l = forward + backward + optimizer share of layer l. Inside the block, "regions" are the
largest submodules whose parameters are all (at least partly) partitioned — GPT-2's `attn` and
`mlp` — and `blk.rest` (layer norms, residual adds) is replicated. Block-internal times come from
module pre/post hooks (forward) and full backward pre/post hooks (backward).

Widths: every layer is profiled inside a TP world of two ranks where this process is rank 0 and
owns h of the H units; the peer's collectives are skipped (`_Alone`). h = H gives T_l at p = 1
on the same code path a multi-rank run takes (Megatron's copy/reduce clones included); h = H/2 and
H/4 give the extra (p, seconds) samples the cost model's affine fit needs for partitioned layers.
Statistic: the median over the measured iterations (robust to a neighbour's burst of work).

Memory, measured on one more full-width iteration (see `memprobe` for the instruments and their
limits): M_w = unique bytes of params + grads + AdamW state after a real step; M_a = unique
storages packed for backward by saved-tensor hooks, parameters excluded; M_t = peak allocator
excess over the phase's start/end level, from torch's CPU memory profiler.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn
from torch.autograd.profiler import record_function

from xronos.node.capabilities import fingerprint, probe
from xronos.node.memprobe import AllocTrace, SavedTensorMeter, mark, state_bytes, storage_key
from xronos.node.models.loading import init_random
from xronos.node.models.registry import arch_spec, config_from_arch, family_for
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.protocol.messages import ArchSpec, Capabilities, LayerProfile, ProfileReport

log = structlog.get_logger(__name__)

PROFILER_VERSION = 2  # part of the cache key: bump when the method changes
_LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers")


class _Alone(TPGroup):
    """Rank 0 of a TP world profiled alone: the peers' collectives are skipped, so the time is
    this rank's compute only (what the cost model predicts; communication is a separate term)."""

    def __init__(self, world_size: int) -> None:  # noqa: D107 - no process group on purpose
        self.pg, self.rank, self.world_size, self.timings = None, 0, world_size, []

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        pass

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass


def widths(H: int) -> list[int]:
    """Units the profiled rank holds: H (p = 1), then about H/2 and H/4 (distinct, >= 1)."""
    return sorted({H, math.ceil(H / 2), math.ceil(H / 4)}, reverse=True)


def find_regions(block: nn.Module, partitioned: set[int]) -> dict[str, nn.Module]:
    """The largest submodules of `block` whose every parameter-owning module owns a partitioned
    parameter (attention, MLP); what is left over is the replicated remainder."""
    out: dict[str, nn.Module] = {}

    def owners(m: nn.Module) -> list[bool]:
        return [any(id(p) in partitioned for p in s.parameters(recurse=False))
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


class _Timeline:
    """Splits one iteration into layers with hooks; accumulates seconds per layer key and knows
    which layer is running (for attributing saved activations)."""

    def __init__(self, block: nn.Module, regions: dict[str, nn.Module]) -> None:
        self.regions = regions
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
        self._t0 = time.perf_counter()

    def _close(self) -> None:
        self.seconds[self.top] += time.perf_counter() - self._t0
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
            self._sub[name] = (time.perf_counter(), rf)
        return hook

    def _leave(self, name: str) -> Callable:
        def hook(_m: nn.Module, *_: object) -> None:
            t0, rf = self._sub.pop(name)
            self.seconds[f"blk.{name}"] += time.perf_counter() - t0
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


class _ProfilingSet:
    """The one-block model at one width, its layer groups, one AdamW per layer, a synthetic batch."""

    def __init__(self, config: dict[str, Any], task: str, H: int, h: int, batch: int, seq: int,
                 seed: int, clip: bool) -> None:
        family = family_for(config)
        layout = ShardLayout((h, H - h), 0)
        self.model = family.build(config, task, layout, _Alone(2))
        init_random(self.model, seed)
        self.model.train()
        self.clip = clip
        specs = self.model.tensor_specs()
        part = {id(p) for n, p in self.model.named_parameters() if specs[n].dim is not None}
        self.block = _only_block(self.model)
        self.regions = find_regions(self.block, part)
        self.timeline = _Timeline(self.block, self.regions)
        self.groups = self._groups(config, task, batch, seq, seed)
        self.opts = {k: torch.optim.AdamW(ps, lr=2e-5) for k, ps in self.groups.items() if ps}
        # A layer is partitioned when it holds partitioned parameters — or, for the LM head, when
        # its compute is vocabulary-parallel even though its weight is tied to the embedding's.
        self.partitioned = {k: any(id(p) in part for p in ps) or (k == "out" and task == "causal-lm")
                            for k, ps in self.groups.items()}

    def _batch(self, config: dict[str, Any], task: str, B: int, S: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        V = int(config.get("vocab_size"))
        self.ids = torch.randint(0, V, (B, S), generator=g)
        self.mask = torch.ones(B, S, dtype=torch.long)
        self.labels = (torch.randint(0, self.model.num_labels, (B,), generator=g) if task == "classify"
                       else self.ids.clone())

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

    def _step(self, key: str, measure: Callable[[], None] | None = None) -> None:
        """The trainer's per-step work on this layer's parameters: norm pass, clip, AdamW, zero."""
        opt = self.opts[key]
        grads = [p.grad for p in self.groups[key] if p.grad is not None]
        if self.clip and grads:
            sq = torch.zeros(1, dtype=torch.float64)
            for g in grads:
                sq.add_(g.detach().double().pow(2).sum())
            for g in grads:
                g.mul_(0.5)
        opt.step()
        if measure is not None:
            measure()
        opt.zero_grad(set_to_none=True)

    def iteration(self) -> dict[str, float]:
        """One fine-tuning iteration; seconds per layer key (forward + backward + optimizer)."""
        tl = self.timeline
        tl.start("fwd", "emb")
        loss = self.model(self.ids, self.mask, self.labels)
        tl.phase = "bwd"
        tl.switch("out")
        loss.backward()
        tl.stop()
        secs = tl.take()
        for key in self.opts:
            t0 = time.perf_counter()
            self._step(key)
            secs[key] = secs.get(key, 0.0) + time.perf_counter() - t0
        return secs

    def memory(self) -> dict[str, tuple[int, int, int]]:
        """(M_w, M_a, M_t) per layer key, measured on one iteration."""
        tl = self.timeline
        exclude = {storage_key(p) for p in self.model.parameters()}
        meter = SavedTensorMeter(exclude, current=tl.current, inputs=tl.inputs)
        weights: dict[str, int] = {}
        tl.annotate = True
        try:
            with AllocTrace() as trace:
                with meter():
                    tl.start("fwd", "emb")
                    loss = self.model(self.ids, self.mask, self.labels)
                    tl.phase = "bwd"
                    tl.switch("out")
                loss.backward()
                tl.stop()
                for key in self.opts:
                    with mark(f"opt::{key}"):
                        self._step(key, lambda key=key: weights.__setitem__(
                            key, state_bytes(self.groups[key], self.opts[key])))
        finally:
            tl.annotate = False
            tl.take()
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


def _only_block(model: nn.Module) -> nn.Module:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == 1]
    if len(lists) != 1:
        raise RuntimeError(f"cannot find the single transformer block of {type(model).__name__}")
    return lists[0][0]


def one_block_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same model with one transformer block (the profiling set), pad id defined."""
    c = dict(config)
    keys = [k for k in _LAYER_KEYS if c.get(k) is not None]
    if not keys:
        raise ValueError(f"config has none of {_LAYER_KEYS}: cannot tell the number of blocks")
    for k in keys:
        c[k] = 1
    if c.get("pad_token_id") is None:
        c["pad_token_id"] = int(c["vocab_size"]) - 1
    return c


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def cache_key(fp: str, arch: ArchSpec, task: str, batch: int, seq: int, iters: int, clip: bool) -> str:
    doc = json.dumps([PROFILER_VERSION, fp, arch.model_dump(mode="json"), task, batch, seq, iters, clip],
                     sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:24]


def profile(
    config: dict[str, Any],
    task: str,
    batch_size: int,
    seq_len: int,
    *,
    threads: int | None = None,
    iters: int = 10,
    warmup: int = 2,
    clip: bool = True,
    node_id: str = "local",
    request_id: str = "local",
    job_id: str = "local",
    capabilities: Capabilities | None = None,
    cache_dir: str | Path | None = None,
    seed: int = 0,
) -> ProfileReport:
    """Profile the model described by `config` (a config.json dict; see `config_for`) on this node.

    With `cache_dir`, a report measured earlier for the same hardware fingerprint, shape, task,
    batch and sequence length is returned (with this request's ids and fresh capabilities).
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("iters", iters)):
        _check_positive_int(name, v)
    if threads is not None:
        _check_positive_int("threads", threads)
    family = family_for(config)
    arch = ArchSpec(**arch_spec(config, task))
    if seq_len > arch.max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_positions {arch.max_positions}")
    caps = capabilities or probe(node_id, "127.0.0.1")
    threads = threads or torch.get_num_threads()
    ids = dict(node_id=node_id, request_id=request_id, job_id=job_id, capabilities=caps)
    path = None
    if cache_dir is not None:
        key = cache_key(fingerprint(caps, threads), arch, task, batch_size, seq_len, iters, clip)
        path = Path(cache_dir) / f"profile-{key}.json"
        if path.is_file():
            cached = ProfileReport.model_validate_json(path.read_text())
            log.info("profile.cache_hit", path=str(path))
            return cached.model_copy(update=ids)

    H = family.num_units(config)
    small = one_block_config(config)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    try:
        samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
        partitioned: dict[str, bool] = {}
        mem: dict[str, tuple[int, int, int]] = {}
        for h in widths(H):
            full = h == H
            ps = _ProfilingSet(small, task, H, h, batch_size, seq_len, seed, clip)
            try:
                runs = [ps.iteration() for _ in range(warmup + iters)][warmup:]
                for key in ps.groups:
                    samples[key].append((h / H, statistics.median(r.get(key, 0.0) for r in runs)))
                if full:
                    partitioned = ps.partitioned
                    mem = ps.memory()
            finally:
                ps.close()
            del ps
    finally:
        torch.set_num_threads(before)
    layers = []
    for key, pts in samples.items():
        kind = key.split(".")[0]
        part = partitioned[key]
        w, a, t = mem[key]
        layers.append(LayerProfile(
            name=key, kind=kind, partitioned=part, time_s=pts[0][1],
            time_samples=pts if part else pts[:1], weight_bytes=w, activation_bytes=a, temp_bytes=t))
    report = ProfileReport(
        **ids, arch=arch, task=task, batch_size=batch_size, seq_len=seq_len, threads=threads,
        units=H, num_blocks=arch.num_layers, layers=layers,
        profile_seconds=time.perf_counter() - t_start, created_at=time.time())
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
        tmp.replace(path)
    log.info("profile.done", seconds=round(report.profile_seconds, 2), layers=len(layers), H=H)
    return report


def config_for(*, model_dir: str | Path | None = None, arch: dict[str, Any] | ArchSpec | None = None) -> dict[str, Any]:
    """config.json of a checkpoint directory, or the config of an ArchSpec's shape."""
    if (model_dir is None) == (arch is None):
        raise ValueError("give exactly one of a model directory or an architecture")
    if model_dir is not None:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (is {model_dir} a Hugging Face model directory?)")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    fields = arch.model_dump() if isinstance(arch, ArchSpec) else dict(arch)  # type: ignore[union-attr]
    ArchSpec(**fields)  # validates
    return config_from_arch(fields)
