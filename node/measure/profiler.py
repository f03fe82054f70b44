"""The node's profiler (paper §IV-A): time and memory of each layer of the profiling set.

The profiling set is the engine's own model with ONE transformer block: embedding, one
representative block, output layer — random weights, synthetic batch, the same code that trains
(`Family.build` + `init_random`), the same optimizer (AdamW, with the job's weight decay) and the
same per-step work as the trainer (global-norm clipping pass, step, zero_grad). One fine-tuning iteration of that model is
split into layers by module hooks on the block:

    forward : [emb ....][blk: attn | rest | mlp | rest][out + loss]
    backward: [out ....][blk: ...                     ][emb ......]
    step    : the clipping norm pass per layer's gradients, timed per layer; then ONE AdamW step
              over every parameter (as the trainer), its time shared out by parameter count

so T_l = forward + backward + clipping + optimizer share of layer l. (One optimizer per layer
paid the step call's fixed cost once per layer, and the cost model B times per block layer,
where training pays it once.) Inside the block, "regions" are the
largest submodules whose parameters are all (at least partly) partitioned — GPT-2's `attn` and
`mlp` — and `blk.rest` (layer norms, residual adds) is replicated. Block-internal times come from
module pre/post hooks (forward) and full backward pre/post hooks (backward).

Widths: every layer is profiled inside a TP world of two ranks where this process is rank 0 and
holds its own count of every segment kind; the peer's collectives are skipped (`TPGroup.alone`). The
first run holds everything (share 1 of every kind: T_l at s = 1 on the same code path a
multi-rank run takes, Megatron's copy/reduce clones included); the next two hold about 1/2 and 1/4
of each kind — attention by whole units (ceil(H/2), ceil(H/4)), MLP columns and vocabulary rows at
multiples of their quantum (`protocol.layout.QUANTA`), as a plan would cut them — which gives each
partitioned layer the (share of its kind, seconds) samples the cost model's affine fit needs.
Each layer's time depends only on its own kind's width, so one run samples every kind at once:
three model builds, as when the kinds were tied. Statistic: the median over the measured
iterations (robust to a neighbour's burst of work). On the virtual clock under the window minimum
the three widths are timed twice, the second pass in reverse order, and each width keeps its
faster pass (`readings.profile_passes`: a host's slow phases can cover a whole width's set).

Waits: where a training rank would block in a collective (every skipped timed collective, and
before the optimizer step, which follows the clipping all-reduce) the profiled rank sleeps
(`collective_pause_s`: one CFS period under a CPU quota, 1 ms without) and the sleep is left out
of every layer's time. Under a quota a rank that waited starts with its whole quota at full core
speed; the pause takes 22.7-33.8 % off the MiniLM one-block set's layer times at 0.3 core, and
took the MiniLM's compute MAPE from 44.7 % to 5.5-13.5 % (bench/results/prediction-error.md). On
the virtual clock it goes the other way: a thread that slept computes the next burst slower, and
without the pause the demo's small shards read 10-24 % over their prediction.

Rows: the full-width set then trains a quarter of the batch's rows (`probe_rows`), timed as whole
plain iterations beside the full batch's (`ProfileReport.rows_probe`). A data-parallel rank trains a
few rows of each batch, and a row's time is not the batch's over its rows: the optimizer step, the
clipping pass and each layer's dispatch are paid once per iteration, and small GEMMs run slower per
row (on bench/choice's LoRA cells replicas at 2-7 of 16 rows measured 8-27 % above the per-row
prediction; `gateway.plan.costmodel.rows_fixed_fraction`).

Communication: `commprobe` times all-reduces of the job's activation on this node's CPU (two Gloo
ranks in this process over loopback, under its quota and threads); the planner's `comm_time`
takes the longer of the link's time and the slowest node's CPU time per all-reduce.

Memory, measured on one more full-width iteration (see `memprobe` for the instruments and their
limits): M_w = unique bytes of params + grads + AdamW state after a real step; M_a = unique
storages packed for backward by saved-tensor hooks, parameters excluded; M_t = peak allocator
excess over the phase's start/end level, from torch's CPU memory profiler (AdamW's state exists
before the step, as in training). The heap's slack — its span minus its in-use peak, the free
holes a training rank keeps resident under the ranks' allocator setting — is measured on the
trainer's own iteration of the model with one block at full width (`heap_slack_bytes`) and at the
smallest profiled width (`heap_slack_small_bytes`), and with four blocks at the smallest width for
what each further block adds (`heap_slack_block_bytes`), each in a fresh process, the smallest
width's two depths three times each and their medians taken (`node/measure/heapprobe.py`; with
XRONOS_MALLOC=glibc the ranks and the probe both run glibc's default, whose big blocks are mmapped
apart).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from xronos.node.box.capabilities import fingerprint, probe
from xronos.node.measure import memprobe
from xronos.node.measure.commprobe import probe_collectives
from xronos.node.measure.heapprobe import blocks_config, measure_in_child, slack_per_depth
from xronos.node.measure.profset import ProfileTooLarge, ProfilingSet, floor_bytes
from xronos.node.measure.readings import (  # noqa: F401 (DEFAULT_PAUSE_S: the profiler's public name)
    DEFAULT_PAUSE_S, collective_pause_s, profile_passes, to_plain_total, virtual_cpu_scale, virtual_stack_s_per_byte,
    without_hook_overhead,
)
from xronos.node.models.registry import arch_spec, config_from_arch, family_for
from xronos.node.tp.lora import LoraSettings
from xronos.protocol.layout import KINDS, QUANTA, Layout, Sizes
from xronos.protocol.messages import (
    ArchSpec, Capabilities, LayerProfile, LoraSpec, ProfileKey, ProfileReport, ProfileSettings, RowsProbe,
)

log = structlog.get_logger(__name__)

# Part of the cache key: bump when the method changes. 5: per-kind widths at quantum multiples.
# 6: a pause at every skipped collective (and before the optimizer step), as training waits there;
#    one AdamW step over every parameter, shared out by parameter count; the hooks' own CPU cost
#    taken out of the block's layers; the node's CPU cost of an all-reduce (`commprobe`); the
#    chunked clipping pass, AdamW state at build, the runtime's resident set and each layer's
#    largest tensor (peak-memory prediction).
# 7: the heap's slack (free holes above the in-use peak) at full width, one block, once the heap
#    has settled.
# 8: the slack measured in fresh processes at two widths and two depths, AdamW state allocated at build
#    (as the trainer); each layer's M_t without the moments' lazy creation inside its step.
# 9: the smallest width's heap probes at 1 and 4 blocks three times each, medians (one pair of
#    draws gave 11 to 21 MiB per block on the same RoBERTa-base shape).
# 10: the whole one-block iteration at full width at a quarter of the batch's rows beside the batch
#     itself (`ProfileReport.rows_probe`): what does not shrink with a data-parallel rank's rows.
# (ProfileReport.settings, the job settings a report was taken under, is not a change of method and
# needs no bump: the key holds those settings, so a report cached before it was recorded is served
# with this request's settings, which are the ones it was measured under.)
# 11: without clipping, the trainer's inf/nan look over the gradients (`all_finite`) is timed with
#     each layer, as the clipping pass is with it; on the virtual clock the layers sum to the plain
#     iteration's time (`to_plain_total`).
# 12: the all-reduce probe times a call launched beside compute too (`CollectiveProfile.launched_*`),
#     what the overlap model charges an overlapped call.
# 13: on the virtual clock the widths are timed in two passes, the second in reverse, each width's
#     times the lesser pass's (`readings.profile_passes`: the host's slow phases)
# 14: the all-reduce probe over three fresh loopback pairs, their calls pooled (`commprobe.PROBE_ROUNDS`)
PROFILER_VERSION = 14


SHARES = (1.0, 0.5, 0.25)  # the widths profiled, as shares of each kind


def probe_rows(batch_size: int) -> int | None:
    """The rows of the fewer-rows run (`ProfileReport.rows_probe`): a quarter of the batch, at least
    one; None for a batch of one row (nothing fewer to time)."""
    return max(1, batch_size // 4) if batch_size > 1 else None


def widths(sizes: Sizes, quanta: dict[str, int] = QUANTA) -> list[dict[str, int]]:
    """Per run, the profiled rank's count of each kind: everything, then about 1/2 and 1/4 of
    each (attention in whole units, the others at multiples of their quantum, at least one);
    runs that would repeat an earlier one are dropped."""
    runs: list[dict[str, int]] = []
    for s in SHARES:
        run = {}
        for k in KINDS:
            total = sizes.total(k)
            if s == 1 or k == "attn":
                run[k] = math.ceil(total * s)
            else:
                q = quanta[k]
                run[k] = min(total, q * max(1, round(total * s / q)))
        if run not in runs:
            runs.append(run)
    return runs


# The heap probes run where memory can decide a plan: where the whole model's training state on
# this one box, times this, exceeds the memory the box has. The holes they measure were at most
# ~0.7x the in-use peak (a qwen2.5-1.5b LoRA rank: 526 MiB in use, a heap spanning 750-870 MiB,
# node/measure/allocator.py), so with the whole model fitting three times over no plan's memory
# check can turn on them; the probes are then skipped (their fields stay 0: not measured), which
# took `make demo`'s MiniLM profile from ~20 s to ~5 s of wall time on a 2-core host at load ~1-3,
# of which they were ~15 s.
HEAP_HEADROOM = 3
HEAP_ENV = "XRONOS_PROFILE_HEAP"  # "auto" (the default: as above) or "always" (tests, measurements)


def heap_always() -> bool:
    text = os.environ.get(HEAP_ENV, "auto").strip().lower()
    if text not in ("auto", "always"):
        raise ValueError(f"{HEAP_ENV} must be auto or always, got {text!r}")
    return text == "always"


def heap_can_bind(layers: list[tuple[str, int, int, int]], num_blocks: int, runtime_bytes: int,
                  available: int) -> bool:
    """Whether the heap's holes could decide a plan on a box with `available` bytes: `layers` as
    (kind, M_w, M_a, M_t) at full width (the block's once, counted `num_blocks` times)."""
    full = sum((num_blocks if kind == "blk" else 1) * (w + a) for kind, w, a, _ in layers)
    full += max((t for *_, t in layers), default=0) + runtime_bytes
    return HEAP_HEADROOM * full > available


def _unprobed(report: ProfileReport) -> bool:
    return report.heap_slack_bytes == 0 and report.heap_slack_small_counts is None


def one_block_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same model with one transformer block (the profiling set), pad id defined."""
    return blocks_config(config, 1)


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def cache_key(fp: str, arch: ArchSpec, task: str, batch: int, seq: int, iters: int, clip: bool,
              weight_decay: float = 0.0, lora: LoraSettings | None = None, pause_s: float = 0.0) -> str:
    fields: list[Any] = [PROFILER_VERSION, fp, arch.model_dump(mode="json"), task, batch, seq, iters, clip,
                         weight_decay, pause_s]
    if lora is not None:  # a LoRA job's profile is its own
        fields.append(["lora", lora.r, sorted(lora.targets), lora.dropout])
    doc = json.dumps(fields, sort_keys=True)
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
    weight_decay: float = 0.0,
    lora: LoraSpec | None = None,
    node_id: str = "local",
    request_id: str = "local",
    job_id: str = "local",
    capabilities: Capabilities | None = None,
    cache_dir: str | Path | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ProfileReport:
    """Profile the model described by `config` (a config.json dict; see `config_for`) on this node.

    With `cache_dir`, a report measured earlier for the same hardware fingerprint, shape, task,
    batch and sequence length is returned (with this request's ids and fresh capabilities).
    With `lora` (a recipe's LoraSpec), the profiling set trains its LoRA adapters (targets None:
    the family's default) on a frozen base, as the job will; its cache entry is its own. The report records
    these settings (`ProfileReport.settings`), so it is refused for a job run under others.
    `progress(stage)` hears each stage as it begins (a person waits minutes on a slow box).
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("iters", iters)):
        _check_positive_int(name, v)
    if not weight_decay >= 0:  # also NaN
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if threads is not None:
        _check_positive_int("threads", threads)
    always = heap_always()  # a wrong setting is refused before anything is measured
    family = family_for(config)
    key = ProfileKey(task=task, batch_size=batch_size, seq_len=seq_len, weight_decay=weight_decay, clip=clip, lora=lora)
    adapters = family.lora_settings(lora)
    arch = ArchSpec(**arch_spec(config, task))
    if seq_len > arch.max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_positions {arch.max_positions}")
    # Echoed in the report (and onto a cached one: the key holds them), so the planner can refuse
    # it for a job run under other settings.
    settings = ProfileSettings.of_key(key)
    caps = capabilities or probe(node_id, "127.0.0.1")
    threads = threads or torch.get_num_threads()
    ids = dict(node_id=node_id, request_id=request_id, job_id=job_id, capabilities=caps, settings=settings)
    path = None
    pause = collective_pause_s()
    if cache_dir is not None:
        key = cache_key(fingerprint(caps, threads), arch, task, batch_size, seq_len, iters, clip, weight_decay, adapters,
                        pause)
        path = Path(cache_dir) / f"profile-{key}.json"
        if path.is_file():
            try:
                cached = ProfileReport.model_validate_json(path.read_text())
            except (OSError, ValueError) as exc:  # a damaged cache entry is measured again, not fatal
                log.warning("profile.cache_unreadable", path=str(path), error=str(exc)[:200])
            else:
                mem_of = [(l.kind, l.weight_bytes, l.activation_bytes, l.temp_bytes) for l in cached.layers]
                if _unprobed(cached) and (always or heap_can_bind(
                        mem_of, cached.num_blocks, cached.runtime_bytes, caps.memory_available)):
                    # taken where memory could not bind, without the heap probes; here it can
                    log.info("profile.cache_without_heap", path=str(path))
                else:
                    log.info("profile.cache_hit", path=str(path))
                    try:  # used now: the cache keeps its most recently used entries (`prune_cache`)
                        os.utime(path)
                    except OSError:
                        pass
                    return cached.model_copy(update=ids)

    sizes = family.sizes(config)
    H = sizes.attn
    small = one_block_config(config)
    # A model whose one-block set alone exceeds the box would page it until the OOM killer picks
    # something (under the node's unit, this process first): refused with the figures instead.
    need, n_params = floor_bytes(small, task, adapters is not None)
    if need > caps.memory_available:
        what = "fp32 weights" if adapters is not None else "fp32 weights, gradients and AdamW moments"
        raise ProfileTooLarge(
            f"profiling this model needs at least {need / 2**20:,.1f} MiB (its one-block profiling set's {what}: "
            f"{n_params:,} parameters, the embedding's {sizes.vocab:,} x {arch.hidden_size} among them), but node "
            f"{node_id} has {caps.memory_available / 2**20:,.1f} MiB available")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    try:
        samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
        partitioned: dict[str, bool] = {}
        segments: dict[str, str | None] = {}
        mem: dict[str, tuple[int, int, int]] = {}
        largest: dict[str, int] = {}
        params: dict[str, int] = {}
        steps = widths(sizes)
        # passes over the widths (`profile_passes`): the second in reverse order; each width keeps
        # the pass whose iteration was the shorter, all its layers (their split is that pass's)
        order = [*range(len(steps)), *reversed(range(len(steps)))] if profile_passes() > 1 else list(range(len(steps)))
        by_width: list[dict[str, tuple[float, float]]] = [{} for _ in steps]
        for n, i in enumerate(order):
            run = steps[i]
            if progress is not None:
                what = f"timing width {i + 1}/{len(steps)}"
                if len(order) > len(steps):
                    what += f", pass {1 + n // len(steps)} of {len(order) // len(steps)}"
                progress(f"{what} ({', '.join(f'{k} {run[k]}' for k in KINDS)})")
            full = n == 0
            layout = Layout(**{k: (run[k], sizes.total(k) - run[k]) for k in KINDS})
            ps = ProfilingSet(small, task, layout, batch_size, seq_len, seed, clip, weight_decay, adapters, pause)
            try:
                runs, hooked = [], []
                for _ in range(warmup + iters):
                    runs.append(ps.iteration())
                    hooked.append(ps.last)
                if full:
                    partitioned = ps.partitioned
                    segments = {k: ps.segment(k) for k in ps.groups}
                    mem = ps.memory()
                    largest = {k: ps.largest_tensor(k) for k in ps.groups}
                    params = {k: ps.param_bytes(k) for k in ps.groups}
                plain = [ps.plain_iteration() for _ in range(warmup + max(3, iters // 2))][warmup:]
                if full:
                    rows_probe = _rows_probe(ps, batch_size, plain, warmup, iters, progress)
                med = {key: statistics.median(r.get(key, 0.0) for r in runs[warmup:]) for key in ps.groups}
                # the hooks split the iteration; on the virtual clock the plain one sizes it
                med = to_plain_total(med, plain) if ps.virtual else without_hook_overhead(med, hooked[warmup:], plain)
                if not by_width[i] or sum(med.values()) < sum(t for _, t in by_width[i].values()):
                    by_width[i] = {key: (ps.layout.share(ps.segment(key), 0) if ps.segment(key) else 1.0, med[key])
                                   for key in ps.groups}
            finally:
                ps.close()
            del ps
        for width in by_width:
            for key, point in width.items():
                samples[key].append(point)
        if progress is not None:
            progress("all-reduce probe")
        scale, stat = virtual_cpu_scale()
        collectives = probe_collectives(batch_size, seq_len, arch.hidden_size, cpu_scale=scale, cpu_stat=stat,
                                        stack_s_per_byte=virtual_stack_s_per_byte())
        runtime = memprobe.runtime_rss()  # after the probe: a training rank's process has joined a Gloo group too
        owner = memprobe.owner_rss()
        # The heap's holes of one block at full width and at the smallest profiled one, and their
        # growth with depth (1 and 4 blocks at the smallest, medians of three), each in a fresh process
        # (node/measure/heapprobe.py); after runtime_rss, which handed this process's freed heap back,
        # so the box holds one model at a time.
        heap_job = dict(config=config, task=task, batch=batch_size, seq=seq_len, seed=seed, clip=clip,
                     weight_decay=weight_decay,
                     lora=None if adapters is None else dict(r=adapters.r, alpha=adapters.alpha,
                                                             dropout=adapters.dropout, targets=list(adapters.targets)))
        small_counts = widths(sizes)[-1]
        slack = slack_small = slack_block = 0
        probe_heap = always or heap_can_bind([(k.split(".")[0], *mem[k]) for k in mem], arch.num_layers,
                                                    runtime, caps.memory_available)
        if probe_heap:
            if progress is not None:
                progress("heap probes (7 fresh processes)")
            full_layout = {k: (sizes.total(k), 0) for k in KINDS}
            small_layout = {k: (small_counts[k], sizes.total(k) - small_counts[k]) for k in KINDS}
            slack = (measure_in_child(heap_job | {"layout": full_layout, "blocks": 1}, threads) or {}).get("slack", 0)
            slack_small, slack_block = slack_per_depth(heap_job | {"layout": small_layout}, threads)
        else:
            log.info("profile.heap_skipped", available=caps.memory_available, headroom=HEAP_HEADROOM)
    finally:
        torch.set_num_threads(before)
    layers = []
    for key, pts in samples.items():
        kind = key.split(".")[0]
        part = partitioned[key]
        w, a, t = mem[key]
        layers.append(LayerProfile(
            name=key, kind=kind, partitioned=part, segment=segments[key], time_s=pts[0][1],
            time_samples=pts if part else pts[:1], weight_bytes=w, activation_bytes=a, temp_bytes=t,
            load_bytes=largest.get(key, 0), param_bytes=params.get(key, 0)))
    report = ProfileReport(
        **ids, arch=arch, task=task, batch_size=batch_size, seq_len=seq_len, threads=threads,
        sizes=sizes, num_blocks=arch.num_layers, layers=layers, runtime_bytes=runtime,
        owner_bytes=owner, heap_slack_bytes=slack, heap_slack_block_bytes=slack_block, heap_slack_small_bytes=slack_small,
        heap_slack_small_counts=Sizes(**small_counts)
        if probe_heap and small_counts != {k: sizes.total(k) for k in KINDS} else None,
        collectives=collectives, rows_probe=rows_probe,
        profile_seconds=time.perf_counter() - t_start, created_at=time.time())
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
        tmp.replace(path)
        prune_cache(path.parent)
    log.info("profile.done", seconds=round(report.profile_seconds, 2), layers=len(layers), H=H)
    return report


CACHE_KEEP = 64  # profile cache entries kept (the newest): a shape per request would fill the disk


def prune_cache(cache_dir: Path, keep: int = CACHE_KEEP) -> list[Path]:
    """Remove all but the `keep` most recently used `profile-*.json` of `cache_dir` (by
    modification time, which a cache hit refreshes):
    the entries removed. Every request with a new shape adds one, and the gateway's requests are
    not the only ones a node answers."""
    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime  # written or served last (a hit touches it)
        except OSError:  # removed meanwhile by another profile's prune
            return 0.0

    entries = sorted(cache_dir.glob("profile-*.json"), key=used, reverse=True)
    gone = []
    for old in entries[keep:]:
        try:
            old.unlink()
            gone.append(old)
        except OSError:  # gone already, or not ours to remove: the next write tries again
            pass
    return gone


def _rows_probe(ps: ProfilingSet, batch_size: int, plain: list[tuple[float, float]], warmup: int, iters: int,
               progress: Callable[[str], None] | None) -> RowsProbe | None:
    """The full-width set's plain iteration at `probe_rows` rows beside the batch's (`plain`, its
    measured iterations), on the same model: a second full-width build would need its memory
    again, above a heap that the first one's holes still fill (it was OOM-killed on a Pi 5 cap
    profiling Llama-3.2-1B). Leaves `ps` at those rows: the last thing timed on it."""
    rows = probe_rows(batch_size)
    full = statistics.median(w for w, _ in plain)
    if rows is None or not full > 0:
        return None
    if progress is not None:
        progress(f"timing {rows} of the batch's {batch_size} rows")
    ps.use_rows(rows)
    few = [ps.plain_iteration() for _ in range(warmup + max(3, iters // 2))][warmup:]
    return RowsProbe(rows=rows, seconds=statistics.median(w for w, _ in few), full_seconds=full)


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
