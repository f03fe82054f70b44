"""Adapters between protocol messages and the planner core: profile reports in, Plan out.

`load_report` reads one ProfileReport JSON file (as the profiler writes it, `model_dump(mode=
"json")`); `check_report` refuses a report the planner cannot use (non-finite or negative
numbers, a segment kind without a partitioned layer, no embedding, block remainder or output
layer, too few widths for the fit); `check_compatible` refuses a set of reports that cannot be
planned together (another model, batch shape or job settings — LoRA or not, weight decay,
clipping) or that were taken at another batch size, sequence length, task or settings than the
job's (`xronos.gateway.plan.compatible`); `plan_reports` runs the cost model and planner over them. Every refusal names the file (or
node) and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from pydantic import TypeAdapter, ValidationError

from xronos.common.errtext import reason, where
from xronos.gateway.plan.compatible import Loaded, check_compatible
from xronos.gateway.plan.commmodel import (
    DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S, CommVolume, NodeComm, comm_time, node_comm, tp_comm_volume,
)
from xronos.gateway.plan.costmodel import Fit, LayerCost, NodeCost, NodeProfile, node_cost, rows_fixed_fraction
from xronos.gateway.plan.overlapcost import TPShape
from xronos.gateway.plan.planner import InfeasiblePlan, MiB, PlanResult, Strategy, plan
from xronos.protocol.codec import MAX_PAYLOAD
from xronos.protocol.layout import KINDS, NOUN, Sizes
from xronos.protocol.messages import (
    MAX_ID, SCHEMA_VERSION, Id, Plan, PlanEntry, ProfileReport, ProfileSettings,
)

RequestId = TypeAdapter(Id)

DEFAULT_RESERVE_MB = 512


def _loc(loc: tuple) -> str:
    return where(loc, "<document>")


def parse_report(data: object, source: str) -> ProfileReport:
    """Validate a decoded JSON document as a ProfileReport; ValueError names source and field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object (a ProfileReport), got {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version != SCHEMA_VERSION:
        raise ValueError(f"{source}: field schema_version: unknown schema version {version!r} "
                         f"(this Xronos reads {SCHEMA_VERSION})")
    try:
        report = ProfileReport.model_validate(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        got = f" (got {first['input']!r})" if "input" in first and not isinstance(first["input"], dict) else ""
        msg = reason(first)
        raise ValueError(f"{source}: field {_loc(first['loc'])}: {msg}{got}{more}") from None
    _check_numbers(report, source)
    return report


def _check_numbers(r: ProfileReport, source: str) -> None:
    check_report(r, source)


def check_report(r: ProfileReport, source: str) -> None:
    """What the schema lets through but the planner cannot use: NaN/inf and negative numbers,
    shares outside (0, 1], a partitioned layer in the wrong place or with too few widths, a
    segment kind no layer times. ValueError "SOURCE: field F: ..."."""
    if not r.layers:
        raise ValueError(f"{source}: field layers: a profile needs at least one layer")
    # The totals the planner cuts and the depth it multiplies by are the architecture's: a report
    # whose own figures disagree with its arch would plan a model that is not the job's.
    want = r.arch.sizes()
    for k in KINDS:
        if r.sizes.total(k) != want.total(k):
            raise ValueError(f"{source}: field sizes.{k}: node {r.node_id} reports {r.sizes.total(k)} "
                             f"{NOUN[k]}, but its arch ({r.arch.family}) has {want.total(k)}")
    if r.num_blocks != r.arch.num_layers:
        raise ValueError(f"{source}: field num_blocks: node {r.node_id} reports {r.num_blocks} blocks, but its "
                         f"arch has num_layers {r.arch.num_layers}")
    for i, lay in enumerate(r.layers):
        values = {"time_s": lay.time_s, "weight_bytes": lay.weight_bytes,
                  "activation_bytes": lay.activation_bytes, "temp_bytes": lay.temp_bytes,
                  "load_bytes": lay.load_bytes, "param_bytes": lay.param_bytes}
        for j, (p, t) in enumerate(lay.time_samples):
            values[f"time_samples[{j}][0]"] = p
            values[f"time_samples[{j}][1]"] = t
        for name, v in values.items():
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{source}: field layers[{i}].{name}: must be finite and >= 0, got {v!r}")
        for j, (p, _) in enumerate(lay.time_samples):
            if not 0 < p <= 1:
                raise ValueError(f"{source}: field layers[{i}].time_samples[{j}][0]: share must be "
                                 f"in (0, 1], got {p!r}")
        if not lay.partitioned:
            continue
        seg = lay.segment
        if (seg == "vocab") != (lay.kind in ("emb", "out")):
            raise ValueError(f"{source}: field layers[{i}].segment: a partitioned {lay.kind} layer "
                             f"({lay.name!r}) cannot follow {seg!r} (vocab is the embedding's and the "
                             f"head's; attn and mlp are the blocks')")
        # A kind of a single quantum has one width only (all samples at share 1).
        only_whole = r.sizes.quanta(seg) == 1
        if not only_whole and len({p for p, _ in lay.time_samples}) < 2:
            raise ValueError(f"{source}: field layers[{i}].time_samples: partitioned layer "
                             f"{lay.name!r} needs samples at >= 2 distinct shares for the affine fit")
    small = r.heap_slack_small_counts
    for k in KINDS if small is not None else ():
        if small.total(k) > r.sizes.total(k):
            raise ValueError(f"{source}: field heap_slack_small_counts.{k}: {small.total(k)} is more than the "
                             f"model's {r.sizes.total(k)}")
    if not any(t > 0 for lay in r.layers for _, t in lay.time_samples) and not any(lay.time_s > 0 for lay in r.layers):
        raise ValueError(f"{source}: field layers: every time in node {r.node_id}'s profile is 0 s (a timer that did "
                         f"not run): the planner would give this node the whole model")
    timed = {lay.segment for lay in r.layers if lay.partitioned}
    missing = [k for k in KINDS if k not in timed]
    if missing:
        raise ValueError(f"{source}: field layers: no partitioned layer of segment "
                         f"{', '.join(repr(k) for k in missing)} (a profile times every kind: "
                         f"{', '.join(NOUN[k] for k in KINDS)})")
    # Every kind holds weights (a tied LM head may hold none of its own, the embedding does): a kind
    # at 0 bytes is memory that was not measured, and the planner would put all of it on this node
    # as if it took no memory.
    weightless = [k for k in KINDS if not any(lay.weight_bytes > 0 for lay in r.layers
                                              if lay.partitioned and lay.segment == k)]
    if weightless:
        raise ValueError(f"{source}: field layers[].weight_bytes: node {r.node_id}'s partitioned "
                         f"{', '.join(repr(k) for k in weightless)} layers report 0 bytes of weights "
                         f"(their memory was not measured)")
    names = [lay.name for lay in r.layers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{source}: field layers: layer {dup[0]!r} appears {names.count(dup[0])} times")
    absent = [k for k in ("emb", "blk", "out") if not any(lay.kind == k for lay in r.layers)]
    if absent:
        raise ValueError(f"{source}: field layers: no {' or '.join(repr(k) for k in absent)} layer (a profile "
                         f"times the embedding, the block and the output layer)")
    # The block's replicated remainder (blk.rest: its norms and residual adds) runs whole on every
    # rank, B times: without it the cost model would count neither its time nor its memory.
    if not any(lay.kind == "blk" and not lay.partitioned for lay in r.layers):
        raise ValueError(f"{source}: field layers: node {r.node_id}'s profile has no replicated 'blk' layer "
                         f"(blk.rest: the block's norms and residual adds, which every rank runs whole)")
    c = r.collectives
    if c is not None:
        for name in ("seconds", "small_seconds", "launched_seconds", "launched_small_seconds"):
            v = getattr(c, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{source}: field collectives.{name}: must be finite and >= 0, got {v!r}")
        want = 4 * r.batch_size * r.seq_len * r.arch.hidden_size
        if c.nbytes != want:
            raise ValueError(f"{source}: field collectives.nbytes: node {r.node_id} probed all-reduces of "
                             f"{c.nbytes} bytes, but the activation of batch {r.batch_size} x seq "
                             f"{r.seq_len} x hidden {r.arch.hidden_size} (fp32) is {want} bytes")


# A wider slice timed this much faster than a narrower one of the same layer: the profile was
# disturbed (other work on the box, a throttled period), not a property of the layer.
FALL_TOLERANCE = 0.2


def falling_times(r: ProfileReport) -> list[str]:
    """Partitioned layers whose time falls with width by more than FALL_TOLERANCE, as sentences
    naming node, layer and samples. The affine fit flattens such a layer (its slope is clamped at 0),
    so the plan may give the node more of that kind than its speed says. A warning, not a refusal: a
    small layer's times are mostly fixed cost and noisy, and a refused profile leaves the node out."""
    out = []
    for lay in r.layers:
        if not lay.partitioned or len(lay.time_samples) < 2:
            continue
        spread: dict[float, tuple[float, float]] = {}  # share -> (fastest, slowest) time there
        for p, t in lay.time_samples:
            lo, hi = spread.get(p, (t, t))
            spread[p] = (min(lo, t), max(hi, t))
        slow: tuple[float, float] | None = None  # the slowest sample at a narrower share so far
        worst: tuple[float, float, float, float] | None = None  # the largest fall: p0, t0, p1, t1
        for p in sorted(spread):
            fast, slowest = spread[p]
            if slow is not None and fast < (1 - FALL_TOLERANCE) * slow[1]:
                if worst is None or fast / slow[1] < worst[3] / worst[1]:
                    worst = (*slow, p, fast)
            if slow is None or slowest > slow[1]:
                slow = (p, slowest)
        if worst is not None:
            p0, t0, p1, t1 = worst
            noun = NOUN.get(lay.segment or "", "of it")
            out.append(f"node {r.node_id}: layer {lay.name!r} took {t0 * 1e3:.3f} ms at share {p0:g} but "
                       f"{t1 * 1e3:.3f} ms at share {p1:g}: time falling with width is a disturbed profile, "
                       f"which the fit flattens, so the plan may give this node more {noun} than its speed "
                       f"warrants (profile it again on a quieter box)")
    return out


def screen_report(r: ProfileReport) -> tuple[ProfileReport | None, str | None]:
    """(r, None) for a report that arrived over the bus and the planner can use, else (None, why),
    the node and field named. The gateway checks it on arrival, so a bad report leaves its node out
    of the job at once, instead of failing the plan of every node later."""
    try:
        check_report(r, f"node {r.node_id}'s profile")
    except ValueError as exc:
        return None, str(exc)
    return r, None


def refused_request_id(payload: bytes) -> str | None:
    """The request id of a ProfileReport payload the codec refused (a NaN time, a missing field...),
    read best-effort, so the job that asked hears at once why the node's answer does not count
    instead of waiting out the profile timeout. None when there is none to read: the job's core
    checks the id against the requests it sent that very node, so a made-up one changes nothing."""
    import msgpack

    if not isinstance(payload, (bytes, bytearray)) or len(payload) > MAX_PAYLOAD:
        return None
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, timestamp=0)
    except Exception:  # msgpack raises a zoo of types for broken input
        return None
    rid = data.get("request_id") if isinstance(data, dict) else None
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID:
        return None
    try:
        return RequestId.validate_python(rid)
    except ValidationError:
        return None


def load_report(path: str | Path) -> ProfileReport:
    """Read and validate one ProfileReport JSON file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such profile file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the profile: {exc}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return parse_report(data, str(path))


def node_profile(report: ProfileReport) -> NodeProfile:
    """Cost-model input of one report."""
    layers = tuple(
        LayerCost(
            name=lay.name, kind=lay.kind, partitioned=lay.partitioned, time_s=lay.time_s,
            time_samples=tuple((float(p), float(t)) for p, t in lay.time_samples),
            weight_bytes=float(lay.weight_bytes), activation_bytes=float(lay.activation_bytes),
            temp_bytes=float(lay.temp_bytes), segment=lay.segment, load_bytes=float(lay.load_bytes),
            param_bytes=float(lay.param_bytes),
        )
        for lay in report.layers
    )
    return NodeProfile(node_id=report.node_id, num_blocks=report.num_blocks, layers=layers,
                       runtime_bytes=float(report.runtime_bytes), owner_bytes=float(report.owner_bytes),
                       heap_slack=float(report.heap_slack_bytes),
                       heap_slack_block=float(report.heap_slack_block_bytes),
                       heap_small=None if report.heap_slack_small_counts is None else (
                           {k: report.heap_slack_small_counts.total(k) / report.sizes.total(k) for k in KINDS},
                           float(report.heap_slack_small_bytes)),
                       rows_fixed=0.0 if report.rows_probe is None else rows_fixed_fraction(
                           report.rows_probe.rows, report.batch_size, report.rows_probe.seconds,
                           report.rows_probe.full_seconds))


def collective_cost(report: ProfileReport) -> NodeComm | None:
    """The node's measured CPU cost of an all-reduce (None: the report has no probe)."""
    c = report.collectives
    if c is None:
        return None
    parallel = 2 if report.capabilities.cores >= 2 else 1  # cores: capped by the CPU quota, rounded up
    blocking = node_comm(c.nbytes, c.seconds, c.small_bytes, c.small_seconds, parallel)
    if c.launched_seconds is None or c.launched_small_seconds is None:
        return blocking
    # one rank's own CPU, measured per rank: as two ranks side by side, whatever the cores
    launched = node_comm(c.nbytes, c.launched_seconds, c.small_bytes, c.launched_small_seconds, 2)
    return replace(blocking, launched=launched)


def memory_cap(report: ProfileReport, reserve_mb: float = DEFAULT_RESERVE_MB) -> float:
    """Bytes the job may use on this node: available memory minus the day job's reserve, the
    job's `reserve_mb` or the node's own (`Capabilities.reserve_bytes`), whichever is larger."""
    if not (reserve_mb >= 0 and math.isfinite(reserve_mb)):
        raise ValueError(f"reserve_mb must be finite and >= 0, got {reserve_mb}")
    caps = report.capabilities
    return max(0.0, float(caps.memory_available) - max(reserve_mb * MiB, float(caps.reserve_bytes)))


@dataclass(frozen=True)
class CostInputs:
    """What every strategy plans from: the nodes' costs (rank order, checkpoint/export flags set),
    their caps, TP's all-reduce volume and time over all of them, each node's CPU cost of an
    all-reduce (None: not probed), the model's sizes and the profiles' batch."""

    nodes: tuple[NodeCost, ...]
    caps: tuple[float, ...]
    volume: CommVolume
    comm_s: float
    node_cpu: tuple[NodeComm | None, ...]
    sizes: Sizes
    profile_rows: int
    shape: TPShape | None = None  # what the overlap model needs (None: the reports do not say LoRA or not)


def cost_inputs(
    loaded: Sequence[Loaded],
    *,
    reserve_mb: float = DEFAULT_RESERVE_MB,
    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS,
    latency_s: float = DEFAULT_LATENCY_S,
    fit: Fit = "affine",
    batch_size: int | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    settings: ProfileSettings | None = None,
    checkpoints: bool = False,
    exports: bool = True,
    export_merged: bool = False,
) -> CostInputs:
    """The checked reports folded into the cost model's inputs (see `plan_reports` for the flags)."""
    for item in loaded:
        check_report(item.report, item.source)
    check_compatible(loaded, batch_size=batch_size, seq_len=seq_len, task=task, settings=settings)
    r0 = loaded[0].report
    volume = tp_comm_volume(r0.arch.hidden_size, r0.batch_size, r0.seq_len, r0.num_blocks, r0.task)
    per_node = tuple(collective_cost(item.report) for item in loaded)
    cpu = [c for c in per_node if c is not None]
    comm = comm_time(volume, len(loaded), bandwidth_Bps, latency_s, cpu)
    nodes = []
    for item in loaded:
        try:
            nodes.append(node_cost(node_profile(item.report), fit))
        except ValueError as exc:
            raise ValueError(f"{item.source}: field layers: {exc}") from None
    # Without the merged model an export gathers the trained tensors: every weight in full
    # fine-tuning, the adapters (and a classifier's head) under LoRA.
    nodes = [replace(nd, checkpoints=checkpoints, exports=exports, export_all=export_merged) for nd in nodes]
    caps = tuple(memory_cap(item.report, reserve_mb) for item in loaded)
    lora = settings.lora if settings is not None else (r0.settings.lora if r0.settings is not None else None)
    known = settings is not None or r0.settings is not None
    shape = TPShape(4.0 * r0.batch_size * r0.seq_len * r0.arch.hidden_size, r0.num_blocks, r0.task,
                    r0.batch_size, lora is None) if known else None
    return CostInputs(tuple(nodes), caps, volume, comm, per_node, r0.sizes, r0.batch_size, shape)


def reserve_note(exc: InfeasiblePlan, loaded: Sequence[Loaded], caps: Sequence[float],
                 reserve_mb: float) -> InfeasiblePlan:
    """`exc` with a word on the reserve: the caps are net of the day job's, or "cap 0.0 MiB" reads as a bug."""
    own = [(item.report.node_id, item.report.capabilities.reserve_bytes / MiB) for item in loaded
           if item.report.capabilities.reserve_bytes > reserve_mb * MiB]
    if reserve_mb <= 0 and not own:
        return exc
    gone = [f"{item.report.node_id} ({item.report.capabilities.memory_available / MiB:,.0f} MiB available)"
            for item, cap in zip(loaded, caps) if cap <= 0]
    nodes = "".join(f"; {n} keeps {mb:,.0f} MiB of its own (node.toml reserve_mb)" for n, mb in own)
    return type(exc)(f"{exc}\neach cap is the node's available memory minus reserve_mb {reserve_mb:,.0f} MiB{nodes}"
                     + (f"; the reserve takes all of it on {', '.join(gone)}" if gone else ""))


def plan_reports(
    loaded: Sequence[Loaded],
    strategy: Strategy,
    *,
    reserve_mb: float = DEFAULT_RESERVE_MB,
    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS,
    latency_s: float = DEFAULT_LATENCY_S,
    fit: Fit = "affine",
    batch_size: int | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    settings: ProfileSettings | None = None,
    checkpoints: bool = False,
    exports: bool = True,
    export_merged: bool = False,
) -> PlanResult:
    """Cost model + communication term + TP planner over validated reports (ranks in given order).
    `batch_size`/`seq_len`/`task`/`settings`, when given, are the job's: a report taken at others
    is refused.
    `checkpoints`: the run writes consolidated checkpoints (a job), which the owner's memory holds;
    `exports`: it ends with an export (every run and job; not the bench's timed runs): of the trained
    tensors, or with `export_merged` (LoRA's merged model) of every weight. `auto` and `dp`:
    `xronos.gateway.plan.auto.choose_reports`."""
    ins = cost_inputs(loaded, reserve_mb=reserve_mb, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s, fit=fit,
                      batch_size=batch_size, seq_len=seq_len, task=task, settings=settings, checkpoints=checkpoints,
                      exports=exports, export_merged=export_merged)
    try:
        return plan(list(ins.nodes), ins.sizes, strategy, list(ins.caps), ins.comm_s)
    except InfeasiblePlan as exc:
        raise reserve_note(exc, loaded, ins.caps, reserve_mb) from None


def plan_message(result: PlanResult, job_id: str, version: int = 0) -> Plan:
    """The protocol's Plan message for a planner result (counts per kind per node)."""
    return Plan(
        job_id=job_id, version=version, strategy=result.strategy, sizes=result.sizes,
        entries=[
            PlanEntry(node_id=r.node_id, rank=r.rank, attn=r.attn, mlp=r.mlp, vocab=r.vocab,
                      predicted_compute_s=r.predicted_compute_s, predicted_memory=r.predicted_memory,
                      memory_cap=r.memory_cap)
            for r in result.rows
        ],
        predicted_iteration_s=result.predicted_iteration_s,
        ideal_iteration_s=result.ideal_iteration_s, comm_s=result.comm_s,
    )
