"""Per-node cost model, per segment kind: a TP rank's predicted time (paper Eq. 6-7) and the
coefficients it and the memory model (`memorymodel.py`) fold from a profile.

Pure Python over plain frozen dataclasses; the protocol adapter lives in `profiles.py`, the
communication term (all-reduce volume, each node's CPU cost of one, the plan's constant) in `commmodel.py`.

**Segments.** Megatron-style TP has a barrier at every all-reduce, so an iteration costs the sum,
over barrier segments, of the slowest rank's time in each (ARCHITECTURE.md, "Tensor parallelism,
concretely"). The model groups the barriers into one segment per kind and a constant one:

    attn   per block: the attention (column-parallel QKV, scores, row-parallel output projection,
           ending at its "reduce" forward / "copy" backward) and HALF of the block's replicated
           remainder `blk.rest` (the norm and residual add that run between the previous barrier
           and this one: pre-LN blocks run one norm before each of their two barriers, post-LN
           blocks one after each); counted B times
    mlp    per block: the MLP and the other half of the remainder; counted B times
    vocab  the vocabulary-parallel embedding and, for a causal LM, the vocabulary-parallel head
           and cross-entropy
    out    replicated layers outside the blocks (a classification head): the same time at any
           share, a constant segment (its slowest node adds to every plan alike)

A kind's time on a node is `fixed + (icpt + beta * share if share > 0 else 0)`: `fixed` is what it
runs inside that kind's segment at any share — the replicated time (a node with no heads still
runs the norm and waits at the barrier) and the partitioned layers' intercepts `alpha` (see *Time
fit*) — `beta` the summed slope of the kind's partitioned layers (block layers times B); `icpt` is
0 from a profile (the live re-planner's two-point refit, `refit.two_point`, sets one).

*The vocabulary's two barriers.* The embedding and a causal LM's head share one split (tied
weights, one vocabulary layout), but they are two barriers: the embedding's forward "reduce", and
the head's cross-entropy reductions (forward) and input "copy" (backward). The model counts them
as ONE segment whose per-node time is their sum, so `max_d (E_d + O_d)` stands for
`max_d E_d + max_d O_d`: equal whenever the same node is slowest in both (both scale with the
same share on the same CPU), an under-estimate by at most `min(spread E, spread O)` otherwise.
*The optimizer step* of each layer (the profiler times it with the layer) counts in that layer's
kind; strictly every step runs between the clip-norm all-reduce and the next forward's first
barrier, one segment over all kinds, so this is exact when the nodes' per-kind proportions agree.

**Time fit.** A partitioned layer's time is not linear in its width when matrices get small, so
with `fit="affine"` each partitioned layer's time is `alpha + beta*s` fitted to the profile's
`time_samples` (share s of the layer's kind, seconds) by least squares with alpha, beta >= 0
(monotone in s, never negative). A node holding none of the kind still pays the intercept: it runs
the same layers on empty weights — every op dispatched, the row-parallel output a [B, S, E] of
zeros to all-reduce, the backward likewise. On the demo's MiniLM at speeds 0.9/0.5/0.3 (virtual
clock) the Pi 4 rank planned with no attention unit spent 0.0324 s an iteration in the attention
segment, against 0.0171 s of replicated time that the model used to charge it and 0.0350 s with
the intercept. `fit="linear"` is the paper's `s * T_l` (no intercept).

**Memory** (Eq. 8-10) and the rank's peak resident set are in `memorymodel.py`, over the
coefficients `node_cost` folds here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from xronos.protocol.layout import KINDS, Layout

Fit = Literal["affine", "linear"]
FITS: tuple[str, ...] = ("affine", "linear")
SEGMENTS: tuple[str, ...] = (*KINDS, "out")  # barrier segments: one per kind, then the constant one


@dataclass(frozen=True)
class LayerCost:
    """One profiled layer at full width (share 1): the raw numbers of paper §IV-A."""

    name: str
    kind: Literal["emb", "blk", "out"]
    partitioned: bool
    time_s: float  # T_l at share 1
    time_samples: tuple[tuple[float, float], ...]  # (share of the layer's segment kind, seconds)
    weight_bytes: float  # M_w: weights + grads + optimizer state
    activation_bytes: float  # M_a: kept for backward
    temp_bytes: float  # M_t: peak short-lived buffers
    segment: str | None = None  # the kind a partitioned layer's width follows (emb/out: vocab)
    load_bytes: float = 0.0  # the layer's largest single parameter at share 1 (loading's buffer)
    param_bytes: float = 0.0  # its parameters at share 1, weights only (0: not measured)


@dataclass(frozen=True)
class NodeProfile:
    node_id: str
    num_blocks: int  # B
    layers: tuple[LayerCost, ...]
    runtime_bytes: float = 0.0  # the rank process without its model (0: not measured)
    owner_bytes: float = 0.0  # what the owner (rank 0) loads besides: the data stack
    heap_slack: float = 0.0  # the heap's free holes above its in-use peak, full width, one block (0: not measured)
    heap_slack_block: float = 0.0  # what each further block adds to them (0: not measured)
    # One block's holes at the profile's smallest width: (its shares per kind, bytes); None: not measured
    heap_small: tuple[Mapping[str, float], float] | None = None
    # The iteration's share that does not shrink with the rows trained (`rows_fixed_fraction`)
    rows_fixed: float = 0.0


@dataclass(frozen=True)
class KindCost:
    """One segment kind on one node, as functions of the node's share s in [0, 1] of the kind."""

    fixed_s: float  # replicated time inside this kind's segment (paid at any share, also 0)
    icpt_s: float  # paid once the node holds any of the kind (0 from a profile: see the module docstring)
    slope_s: float  # beta: seconds per share
    mem_slope: float  # M_w + M_a of the kind's partitioned layers at share 1
    temp_slope: float  # largest M_t of the kind's partitioned layers at share 1
    load_slope: float = 0.0  # largest single partitioned parameter of the kind at share 1
    work_slope: float = 0.0  # M_a + M_t + gradients of the kind's partitioned layers at share 1, one block (holes' scale)
    act_slope: float = 0.0  # the M_a in mem_slope (A's slope)
    grad_slope: float = 0.0  # the gradients in mem_slope (G's slope)


@dataclass(frozen=True)
class NodeCost:
    """A node's profile folded into per-kind coefficients (see the module docstring)."""

    node_id: str
    attn: KindCost
    mlp: KindCost
    vocab: KindCost
    const_s: float  # replicated layers in their own segment (a classification head)
    mem_repl: float  # replicated M_w + M_a
    temp_repl: float  # largest replicated M_t
    mem_runtime: float = 0.0  # the process without its model (profile's runtime_bytes)
    load_repl: float = 0.0  # largest single replicated parameter
    owner_bytes: float = 0.0  # the owner's data stack (profile's owner_bytes)
    weights_full: float = 0.0  # the whole model's weights (M_w / 4 summed at share 1): the export
    largest_full: float = 0.0  # the whole model's largest tensor (assembled once more at the export)
    trained_full: float = 0.0  # the whole model's trained parameters (a checkpoint gathers them + moments)
    grad_fraction: float = 0.25  # share of M_w + M_a that is gradients (freed before an export)
    act_fraction: float = 0.0  # share of M_w + M_a that is activations (freed before an export too)
    owner: bool = False  # this node is rank 0: it reads the data and gathers the export
    heap_slack: float = 0.0  # the heap's holes at full width and the profile's depth (heap_slack + (B-1) x per block)
    work_repl: float = 0.0  # M_a + M_t + gradients of the replicated layers, one block (heap holes' scale)
    small_slack: float = 0.0  # the heap's holes at the profile's smallest width and the profile's depth
    small_work: float = 0.0  # W at that width (0: no second width measured: holes scale with W alone)
    checkpoints: bool = False  # the run writes consolidated checkpoints (a job's), gathered on the owner
    exports: bool = True  # the run ends with an export gathered on the owner (the bench's runs do not)
    # The export gathers every weight (LoRA's merged model); False: the trained tensors alone —
    # every weight in full fine-tuning, the adapters and a head in LoRA's adapter-only export
    # (`node.models.adapters.exported`). Both give the same peak for full fine-tuning.
    export_all: bool = True
    act_repl: float = 0.0  # the M_a in mem_repl (A's replicated part)
    grad_repl: float = 0.0  # the gradients in mem_repl (G's replicated part)
    rows_fixed: float = 0.0  # the share of its times paid whatever the rows (NodeProfile.rows_fixed)

    def kind(self, kind: str) -> KindCost:
        if kind not in KINDS:
            raise ValueError(f"unknown segment kind {kind!r} (kinds: {', '.join(KINDS)})")
        return getattr(self, kind)


Shares = Mapping[str, float]


def fit_affine(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of t = alpha + beta*s subject to alpha >= 0, beta >= 0.

    With two unknowns the constrained optimum is the unconstrained one if it is admissible,
    otherwise the better of the two boundary fits (through the origin, or flat at the mean).
    """
    ps = [float(p) for p, _ in samples]
    ts = [float(t) for _, t in samples]
    if len(set(ps)) < 2:
        raise ValueError(f"affine fit needs samples at >= 2 distinct widths, got p={ps}")
    n = len(ps)
    mp, mt = sum(ps) / n, sum(ts) / n
    sxx = sum((p - mp) ** 2 for p in ps)
    sxy = sum((p - mp) * (t - mt) for p, t in zip(ps, ts))
    beta = sxy / sxx
    alpha = mt - beta * mp
    if alpha >= 0 and beta >= 0:
        return alpha, beta

    def sse(a: float, b: float) -> float:
        return sum((a + b * p - t) ** 2 for p, t in zip(ps, ts))

    spp = sum(p * p for p in ps)
    through_origin = (0.0, max(0.0, sum(p * t for p, t in zip(ps, ts)) / spp))
    flat = (max(0.0, mt), 0.0)
    return min((through_origin, flat), key=lambda ab: sse(*ab))


def layer_fit(layer: LayerCost, fit: Fit = "affine") -> tuple[float, float]:
    """(alpha, beta) of a partitioned layer: the affine fit, or the paper's (0, T_l)."""
    if fit == "linear":
        return 0.0, layer.time_s
    if layer.time_samples and all(p == 1.0 for p, _ in layer.time_samples):
        # Only the whole width exists (a kind of one unit, e.g. a single KV head): any fit through
        # the samples gives the one time that can occur; use the paper's.
        return 0.0, sum(t for _, t in layer.time_samples) / len(layer.time_samples)
    return fit_affine(layer.time_samples)


def layer_time(layer: LayerCost, s: float, fit: Fit = "affine") -> float:
    """Predicted time of one layer on a node holding share s of the layer's kind."""
    if not layer.partitioned:
        return layer.time_s
    alpha, beta = layer_fit(layer, fit)
    return alpha + beta * max(0.0, s)  # the intercept at share 0 too (module docstring, Time fit)


def layer_segment(layer: LayerCost) -> str | None:
    """The kind a partitioned layer follows: its `segment`, vocab for emb/out; None if replicated."""
    if not layer.partitioned:
        return None
    seg = layer.segment or ("vocab" if layer.kind in ("emb", "out") else None)
    if seg not in KINDS:
        raise ValueError(f"partitioned layer {layer.name!r} has no segment kind (one of {', '.join(KINDS)})")
    if (seg == "vocab") != (layer.kind in ("emb", "out")):
        where = "a block" if layer.kind == "blk" else f"the {layer.kind} layer"
        raise ValueError(f"partitioned layer {layer.name!r}: segment {seg!r} cannot be in {where} "
                         f"(vocab is the embedding's and the head's; attn and mlp are the blocks')")
    return seg


def node_cost(profile: NodeProfile, fit: Fit = "affine") -> NodeCost:
    """Fold a profile into per-kind coefficients (Eq. 6, 7, 9, 10 grouped by kind)."""
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    acc = {k: [0.0] * 9 for k in KINDS}  # fixed, icpt, slope, mem, temp, load, work, act, grad
    const = mem_repl = temp_repl = load_repl = weights_full = largest_full = work_repl = act_repl = grad_repl = 0.0
    measured = all(layer.param_bytes > 0 for layer in profile.layers)
    trained_full = resident_all = acts_all = 0.0
    for layer in profile.layers:
        mult = profile.num_blocks if layer.kind == "blk" else 1
        resident = layer.weight_bytes + layer.activation_bytes
        resident_all += mult * resident
        acts_all += mult * layer.activation_bytes
        if measured:  # M_w = weights + (for trained parameters) gradients and two AdamW moments
            trained = max(0.0, layer.weight_bytes - layer.param_bytes) / 3
            weights_full += mult * layer.param_bytes
        else:  # a profile without param_bytes: everything trained, M_w = 4 x weights
            trained = layer.weight_bytes / 4
            weights_full += mult * trained
        trained_full += mult * trained
        # What cycles through the heap every iteration: saved activations, temporaries, and the
        # gradients (allocated in backward, freed at zero_grad); the heap's holes scale with it.
        work = layer.activation_bytes + layer.temp_bytes + trained
        largest_full = max(largest_full, layer.load_bytes)
        try:
            seg = layer_segment(layer)
        except ValueError as exc:
            raise ValueError(f"node {profile.node_id}: {exc}") from None
        if seg is not None:
            try:
                alpha, beta = layer_fit(layer, fit)
            except ValueError as exc:
                raise ValueError(f"node {profile.node_id}, layer {layer.name}: {exc}") from None
            a = acc[seg]
            a[0] += mult * alpha  # paid at share 0 too (module docstring, *Time fit*)
            a[2] += mult * beta
            a[3] += mult * resident
            a[4] = max(a[4], layer.temp_bytes)  # Eq. 10: a max, not a sum
            a[5] = max(a[5], layer.load_bytes)
            a[6] += work
            a[7] += mult * layer.activation_bytes
            a[8] += mult * trained
            continue
        mem_repl += mult * resident
        act_repl += mult * layer.activation_bytes
        grad_repl += mult * trained
        temp_repl = max(temp_repl, layer.temp_bytes)
        load_repl = max(load_repl, layer.load_bytes)
        work_repl += work
        t = mult * layer.time_s
        if layer.kind == "blk":  # the block's replicated remainder: half before each barrier
            acc["attn"][0] += t / 2
            acc["mlp"][0] += t / 2
        elif layer.kind == "emb":  # runs before the embedding's reduce
            acc["vocab"][0] += t
        else:
            const += t
    kinds = {k: KindCost(*v) for k, v in acc.items()}
    depth = max(0, profile.num_blocks - 1)
    small_slack = small_work = 0.0
    if profile.heap_small is not None:
        shares, one = profile.heap_small
        small_slack = one + depth * profile.heap_slack_block
        small_work = work_repl + sum(kinds[k].work_slope * shares[k] for k in HOLE_KINDS)
    return NodeCost(profile.node_id, kinds["attn"], kinds["mlp"], kinds["vocab"], const, mem_repl, temp_repl,
                    profile.runtime_bytes, load_repl, profile.owner_bytes, weights_full, largest_full,
                    trained_full, trained_full / resident_all if resident_all > 0 else 0.25,
                    act_fraction=acts_all / resident_all if resident_all > 0 else 0.0,
                    heap_slack=profile.heap_slack + depth * profile.heap_slack_block,
                    work_repl=work_repl, small_slack=small_slack, small_work=small_work,
                    act_repl=act_repl, grad_repl=grad_repl, rows_fixed=profile.rows_fixed)


MAX_ROWS_FIXED = 0.9  # a bound against a noisy probe: some of the time always follows the rows


def rows_fixed_fraction(probe_rows: int, batch: int, seconds: float, full_seconds: float) -> float:
    """The share a of an iteration at `batch` rows that a rank pays whatever its rows, from the
    profile's iteration at `probe_rows` (`seconds`) and at the batch (`full_seconds`): with
    T(r) = T(B) * (a + (1 - a) * r / B) through both points, a = (k - x) / (1 - x) where
    k = seconds / full_seconds and x = probe_rows / batch; in [0, MAX_ROWS_FIXED]."""
    if not 0 < probe_rows < batch:
        raise ValueError(f"probe rows must be in (0, {batch}), got {probe_rows}")
    if not (full_seconds > 0 and seconds >= 0):
        raise ValueError(f"probe seconds must be >= 0 and the batch's > 0, got {seconds!r} and {full_seconds!r}")
    x = probe_rows / batch
    return min(MAX_ROWS_FIXED, max(0.0, (seconds / full_seconds - x) / (1 - x)))


def rows_factor(node: NodeCost, rho: float) -> float:
    """A node's times at rho times the profile's rows, as a multiple of its times at the profile's:
    0 with no rows, else a + (1 - a) * rho (a = `NodeCost.rows_fixed`)."""
    if rho < 0:
        raise ValueError(f"rows must be >= 0, got a multiple {rho!r} of the profile's")
    return 0.0 if rho == 0 else node.rows_fixed + (1 - node.rows_fixed) * rho


def kind_time(kc: KindCost, s: float) -> float:
    """Time of one kind's segment on a node holding share s of it."""
    return kc.fixed_s + (kc.icpt_s + kc.slope_s * s if s > 0 else 0.0)


def check_shares(shares: Shares) -> None:
    for k in KINDS:
        s = shares.get(k)
        if s is None or not (0 <= s <= 1):
            raise ValueError(f"share of {k} must be in [0, 1], got {s!r}")


def segment_times(node: NodeCost, shares: Shares) -> dict[str, float]:
    """Seconds per barrier segment (SEGMENTS order) of a node holding `shares` (kind -> share)."""
    check_shares(shares)
    out = {k: kind_time(node.kind(k), shares[k]) for k in KINDS}
    out["out"] = node.const_s
    return out


def predict_time(node: NodeCost, shares: Shares) -> float:
    """T_d: the node's own compute seconds per iteration (the sum over its segments)."""
    return sum(segment_times(node, shares).values())


HOLE_KINDS = ("attn", "mlp")  # the kinds whose transient bytes scale the heap's holes (not the vocabulary's)


def layout_shares(layout: Layout, rank: int) -> dict[str, float]:
    """Rank's share of each kind in a layout."""
    return {k: layout.share(k, rank) for k in KINDS}


def tied(p: float) -> dict[str, float]:
    """The paper's partition ratio: the same share p of every kind."""
    return {k: p for k in KINDS}


def time_at(node: NodeCost, p: float) -> float:
    """The paper's T_d(p) (Eq. 6): every kind at share p."""
    return predict_time(node, tied(p))


@dataclass(frozen=True)
class FitError:
    """Mean absolute percentage error (%) of both time models on held-out samples."""

    linear: float
    affine: float


def fit_error(layer: LayerCost, heldout: Sequence[tuple[float, float]]) -> FitError:
    """How well each model, built from `layer` alone, predicts times measured at other widths."""
    if not heldout:
        raise ValueError("fit_error needs at least one held-out (p, seconds) sample")

    def mape(fit: Fit) -> float:
        return 100.0 * sum(abs(layer_time(layer, p, fit) - t) / t for p, t in heldout) / len(heldout)

    if any(not (t > 0 and math.isfinite(t)) for _, t in heldout):
        raise ValueError("held-out times must be finite and > 0 for a percentage error")
    return FitError(linear=mape("linear"), affine=mape("affine"))
