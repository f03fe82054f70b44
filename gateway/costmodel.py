"""Per-node cost model: predicted time and memory of a TP rank holding `units` of `H` (paper Eq. 6-10).

Pure Python over plain frozen dataclasses; the protocol adapter lives in `profiles.py`.

Generalisation of the paper, which reduces to Eq. 6-10 exactly when the embedding is partitioned
and the output layer replicated: every profiled layer carries its own `partitioned` flag (a
vocabulary-parallel LM head is partitioned too); block layers count `B` times, the others once.

Beyond the paper: a partitioned layer's time is not linear in its width when matrices get small
(fixed per-call overheads, cache effects), so with `fit="affine"` each partitioned layer's time is
`alpha + beta*p` fitted to the profile's `time_samples` by least squares with alpha, beta >= 0
(monotone in p, never negative), and a rank with 0 units pays nothing for that layer.
`fit="linear"` is the paper's `p * T_l`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

Fit = Literal["affine", "linear"]
FITS: tuple[str, ...] = ("affine", "linear")


@dataclass(frozen=True)
class LayerCost:
    """One profiled layer at full width (p = 1): the raw numbers of paper §IV-A."""

    name: str
    kind: Literal["emb", "blk", "out"]
    partitioned: bool
    time_s: float  # T_l at p = 1
    time_samples: tuple[tuple[float, float], ...]  # (p, seconds) measured at several widths
    weight_bytes: float  # M_w: weights + grads + optimizer state
    activation_bytes: float  # M_a: kept for backward
    temp_bytes: float  # M_t: peak short-lived buffers


@dataclass(frozen=True)
class NodeProfile:
    node_id: str
    num_blocks: int  # B
    layers: tuple[LayerCost, ...]


@dataclass(frozen=True)
class NodeCost:
    """A node's profile folded into the few coefficients Eq. 6-10 need.

    time(h)   = t_repl + (t_icpt + t_slope * p   if h > 0 else 0)
    memory(h) = m_repl + m_slope * p + max(mt_part * p, mt_repl)
    """

    node_id: str
    t_repl: float  # replicated layers: T_out + B * sum_repl T_l (linear fit, paper layout)
    t_icpt: float  # sum of fitted intercepts of partitioned layers (0 with fit="linear")
    t_slope: float  # T_emb + B * sum_part T_l with fit="linear"
    m_repl: float  # replicated M_w + M_a
    m_slope: float  # partitioned M_w + M_a at p = 1
    mt_repl: float  # largest replicated M_t
    mt_part: float  # largest partitioned M_t at p = 1


def fit_affine(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of t = alpha + beta*p subject to alpha >= 0, beta >= 0.

    With two unknowns the constrained optimum is the unconstrained one if it is admissible,
    otherwise the better of the two boundary fits (through the origin, or flat at the mean).
    """
    ps = [float(p) for p, _ in samples]
    ts = [float(t) for _, t in samples]
    if len({p for p in ps}) < 2:
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


def layer_time(layer: LayerCost, p: float, fit: Fit = "affine") -> float:
    """Predicted time of one layer on a rank with partition ratio p."""
    if not layer.partitioned:
        return layer.time_s
    if p <= 0:
        return 0.0
    if fit == "linear":
        return p * layer.time_s
    alpha, beta = fit_affine(layer.time_samples)
    return alpha + beta * p


def node_cost(profile: NodeProfile, fit: Fit = "affine") -> NodeCost:
    """Fold a profile into NodeCost (Eq. 6, 7, 9, 10 grouped by what scales with p)."""
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    t_repl = t_icpt = t_slope = m_repl = m_slope = mt_repl = mt_part = 0.0
    for layer in profile.layers:
        mult = profile.num_blocks if layer.kind == "blk" else 1
        resident = layer.weight_bytes + layer.activation_bytes
        if layer.partitioned:
            try:
                alpha, beta = (0.0, layer.time_s) if fit == "linear" else fit_affine(layer.time_samples)
            except ValueError as exc:
                raise ValueError(f"node {profile.node_id}, layer {layer.name}: {exc}") from None
            t_icpt += mult * alpha
            t_slope += mult * beta
            m_slope += mult * resident
            mt_part = max(mt_part, layer.temp_bytes)  # Eq. 10: a max, not a sum
        else:
            t_repl += mult * layer.time_s
            m_repl += mult * resident
            mt_repl = max(mt_repl, layer.temp_bytes)
    return NodeCost(profile.node_id, t_repl, t_icpt, t_slope, m_repl, m_slope, mt_repl, mt_part)


def _check_units(units: int, H: int) -> None:
    if H <= 0:
        raise ValueError(f"H (units in total) must be >= 1, got {H}")
    if not 0 <= units <= H:
        raise ValueError(f"units must be in [0, {H}], got {units}")


def predict_time(node: NodeCost, units: int, H: int) -> float:
    """T_d(p) of Eq. 6 with p = units / H (seconds per iteration, compute only)."""
    _check_units(units, H)
    return time_at(node, units / H)


def predict_memory(node: NodeCost, units: int, H: int) -> float:
    """M_total(p) of Eq. 8 = M_w (Eq. 9) + M_a (same structure) + M_t (Eq. 10), in bytes."""
    _check_units(units, H)
    return memory_at(node, units / H)


def time_at(node: NodeCost, p: float) -> float:
    """T_d at a (possibly fractional) ratio p in [0, 1]."""
    if p <= 0:
        return node.t_repl
    return node.t_repl + node.t_icpt + node.t_slope * p


def memory_at(node: NodeCost, p: float) -> float:
    """M_total at a (possibly fractional) ratio p in [0, 1]."""
    return node.m_repl + node.m_slope * p + max(node.mt_part * p, node.mt_repl)


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


# --- communication: a constant per plan (paper §IV-A), here computed rather than assumed ---


@dataclass(frozen=True)
class CommVolume:
    """Per-iteration all-reduces of Megatron-style TP."""

    count: int
    nbytes: float


def tp_comm_volume(
    hidden_size: int,
    batch_size: int,
    seq_len: int,
    num_blocks: int,
    task: Literal["classify", "causal-lm"],
    dtype_bytes: int = 4,
) -> CommVolume:
    """Count and bytes of the all-reduces one training iteration issues.

    Per block: forward, one all-reduce after the attention output and one after the MLP down
    projection (row-parallel "reduce"); backward, one before the QKV and one before the MLP up
    projection (column-parallel "copy"). Each moves the full [batch, seq, hidden] activation.
    Vocabulary-parallel embedding: one forward all-reduce (its backward is the identity: input
    ids need no gradient). Causal LM head (vocab-parallel): one backward all-reduce of its input
    gradient, plus the vocab-parallel cross-entropy's three forward reductions of [batch, seq]
    (max logit, sum of exponentials, target logit). A classification head is replicated: nothing.
    """
    if task not in ("classify", "causal-lm"):
        raise ValueError(f"task must be 'classify' or 'causal-lm', got {task!r}")
    act = batch_size * seq_len * hidden_size * dtype_bytes
    count, nbytes = 1 + 4 * num_blocks, act * (1 + 4 * num_blocks)
    if task == "causal-lm":
        count += 1 + 3
        nbytes += act + 3 * batch_size * seq_len * dtype_bytes
    return CommVolume(count=count, nbytes=float(nbytes))


DEFAULT_BANDWIDTH_BPS = 1e9 / 8  # 1 Gbit/s Ethernet, in bytes per second
DEFAULT_LATENCY_S = 0.5e-3


def comm_time(
    volume: CommVolume,
    n_nodes: int,
    bandwidths_Bps: Sequence[float] | float = DEFAULT_BANDWIDTH_BPS,
    latency_s: float = DEFAULT_LATENCY_S,
) -> float:
    """Ring all-reduce: count*latency + 2(N-1)/N * volume / min bandwidth. Zero for one node."""
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    bws = [bandwidths_Bps] if isinstance(bandwidths_Bps, (int, float)) else list(bandwidths_Bps)
    if not bws or any(not (b > 0 and math.isfinite(b)) for b in bws):
        raise ValueError(f"bandwidths must be finite and > 0, got {bws}")
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be finite and >= 0, got {latency_s}")
    if n_nodes == 1:
        return 0.0
    return volume.count * latency_s + 2 * (n_nodes - 1) / n_nodes * volume.nbytes / min(bws)
