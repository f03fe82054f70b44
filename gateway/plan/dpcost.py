"""The cost of speed-weighted data parallelism, from the same profiles as TP's plans. Pure Python.

Every node holds a whole replica and takes `rows[d]` rows of each global batch of B
(`shares.py`); an iteration is the slowest node's compute, then whatever of the gradient
all-reduce backward could not hide:

    compute_d  = T_d * (a_d + (1 - a_d) * rows_d / B_p)     (0 with no rows)
                                              T_d = T_d(every kind at share 1), a_d its fixed share
    allreduce  = sum over DDP's buckets of max(link, slowest CPU)   (commmodel's alpha-beta ring)
    exposed    = C_last + max(0, (C - C_last) - f_bwd * max_d compute_d)
    iteration  = max_d compute_d + exposed

- `T_d`: the node's whole-model time at the profile's batch (`costmodel.time_at(node, 1)`: every
  layer at full width, the blocks B times). `a_d` (`NodeCost.rows_fixed`, from the profile's
  `rows_probe`) is the share of it paid whatever the rows: the clipping pass and the AdamW step, each
  layer's dispatch, and small GEMMs' lower speed per row. Without a probe (an older profile) a_d = 0
  and a row costs T_d / B_p, which under-predicted ranks at 2-7 of 16 rows by 8-27 % (the Set-A
  and Set-C LoRA cells of `bench/choice`). A rank with 0 rows is counted 0 (it still steps its
  optimizer: not modelled).
- Rows: each in turn to the node that would finish it soonest (`greedy_rows`), which minimises the
  slowest node's time for any nondecreasing times; with a_d = 0 it is `shares.balanced_shares`.
- The gradient all-reduce moves the trained parameters' bytes (`NodeCost.trained_full`: every
  weight in full fine-tuning, the adapters and a classifier's head under LoRA) in DDP's buckets
  (the first 1 MiB, then 25 MiB each, gradients in reverse order of the parameters: the last
  bucket holds the first layers, ready only when backward ends). Each bucket is a ring all-reduce:
  over the link `latency + 2(N-1)/N * bytes / min bandwidth`, on each node's CPU
  `NodeComm.allreduce_s`, the longer of the two (as `commmodel.comm_time` counts TP's).
- Overlap: DDP all-reduces a bucket while backward goes on, so every bucket but the last can hide
  behind the slowest rank's backward (a bucket waits for every rank: the slowest one's backward is
  the window), taken as `f_bwd` of its compute (2/3 by default: backward costs about twice the
  forward pass).
- Memory: a replica at the profile's shape (`costmodel.predict_memory` at share 1 of every kind),
  its saved activations scaled by rows / B_p, its temporaries never below the profile's (some are
  weight-sized). A node with 0 rows still holds the model, its gradients (zeros, which join the
  all-reduce) and the optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from xronos.gateway.plan.commmodel import DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S, NodeComm
from xronos.gateway.plan.costmodel import KindCost, NodeCost, rows_factor, time_at
from xronos.gateway.plan.memorymodel import memory_at
from xronos.gateway.plan.shares import balanced_shares, check_shares
from xronos.protocol.layout import KINDS

MiB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MiB  # torch's DDP: a small first bucket, so the first all-reduce starts early
BUCKET_BYTES = 25 * MiB  # DDP's default bucket_cap_mb
BACKWARD_FRACTION = 2 / 3


class DPInfeasible(ValueError):
    """Data parallelism cannot run on these nodes (a replica does not fit)."""


@dataclass(frozen=True)
class DPNode:
    node_id: str
    rows: int
    row_s: float  # a row's compute seconds on this node
    compute_s: float
    memory: float  # predicted peak resident set with its rows, bytes
    cap: float

    @property
    def fits(self) -> bool:
        return self.memory <= self.cap


@dataclass(frozen=True)
class DPPrediction:
    nodes: tuple[DPNode, ...]
    batch: int
    grad_bytes: float  # the trained parameters' gradients, all-reduced each iteration
    buckets: int
    allreduce_s: float  # all buckets' all-reduce time
    exposed_s: float  # the part backward does not hide
    compute_s: float  # the slowest node's
    iteration_s: float
    ideal_s: float  # fractional rows (every node busy the same time), the same all-reduce

    @property
    def feasible(self) -> bool:
        return all(n.fits for n in self.nodes)

    def shortfall(self) -> str:
        """Each node's need and cap (MiB), the ones over cap marked."""
        return "; ".join(f"{n.node_id} needs {n.memory / MiB:,.0f} MiB with {n.rows} rows, cap {n.cap / MiB:,.0f} MiB"
                         + ("" if n.fits else " (over)") for n in self.nodes)


def rows_time(node: NodeCost, rows: int, profile_rows: int) -> float:
    """Compute seconds of a whole replica on `node` training `rows` rows per iteration."""
    return time_at(node, 1.0) * rows_factor(node, rows / profile_rows)


def greedy_rows(time_of: Callable[[int, int], float], n: int, batch: int) -> list[int]:
    """Each of `batch` rows in turn to the one of `n` workers that would finish it soonest
    (`time_of(worker, rows)` nondecreasing in rows): the split with the least slowest time."""
    rows = [0] * n
    for _ in range(batch):
        w = min(range(n), key=lambda w: (time_of(w, rows[w] + 1), w))
        rows[w] += 1
    return rows


def _fluid_compute(nodes: Sequence[NodeCost], profile_rows: int, batch: int) -> float:
    """The slowest node's compute with fractional rows, every working node busy the same time:
    node d trains rho_d(T) = max(0, (T / T_d - a_d) / (1 - a_d)) profile batches; T by bisection."""
    full = [time_at(n, 1.0) for n in nodes]

    def rows_at(t: float) -> float:
        return profile_rows * sum(max(0.0, (t / f - n.rows_fixed) / (1 - n.rows_fixed)) for n, f in zip(nodes, full))

    lo, hi = 0.0, max(rows_time(n, batch, profile_rows) for n in nodes)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rows_at(mid) < batch else (lo, mid)
    return hi


def row_time(node: NodeCost, profile_rows: int) -> float:
    """A row's compute seconds on `node` (its whole-model time at the profile's rows, per row)."""
    if isinstance(profile_rows, bool) or not isinstance(profile_rows, int) or profile_rows < 1:
        raise ValueError(f"profile batch size must be an integer >= 1, got {profile_rows!r}")
    t = time_at(node, 1.0) / profile_rows
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"node {node.node_id}: a row's predicted time must be finite and > 0, got {t!r}")
    return t


def replica_memory(node: NodeCost, rows: int, profile_rows: int) -> float:
    """Peak resident bytes of a whole replica training `rows` rows per iteration."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    rho = rows / profile_rows

    def scaled(kc: KindCost) -> KindCost:
        return replace(kc, mem_slope=kc.mem_slope - kc.act_slope * (1 - rho), act_slope=kc.act_slope * rho,
                       temp_slope=kc.temp_slope * max(1.0, rho))

    at_rows = replace(node, **{k: scaled(node.kind(k)) for k in KINDS},
                      mem_repl=node.mem_repl - node.act_repl * (1 - rho), act_repl=node.act_repl * rho,
                      temp_repl=node.temp_repl * max(1.0, rho))
    return memory_at(at_rows, 1.0)


def bucket_sizes(grad_bytes: float, first: float = FIRST_BUCKET_BYTES, cap: float = BUCKET_BYTES) -> list[float]:
    """DDP's buckets of `grad_bytes`, in the order backward fills them (by size; tensors are not split)."""
    if not (grad_bytes >= 0 and math.isfinite(grad_bytes)):
        raise ValueError(f"gradient bytes must be finite and >= 0, got {grad_bytes!r}")
    if grad_bytes == 0:
        return []
    sizes = [min(first, grad_bytes)]
    left = grad_bytes - sizes[0]
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
    return sizes


def allreduce_s(nbytes: float, n_nodes: int, bandwidth_Bps: float, latency_s: float,
                node_cpu: Sequence[NodeComm] = ()) -> float:
    """One ring all-reduce of `nbytes`: the longer of the link's time and the slowest node's CPU time."""
    if n_nodes <= 1:
        return 0.0
    link = latency_s + 2 * (n_nodes - 1) / n_nodes * nbytes / bandwidth_Bps
    return max([link] + [c.allreduce_s(nbytes, n_nodes) for c in node_cpu])


def _exposed(buckets: Sequence[float], window: float) -> float:
    if not buckets:
        return 0.0
    return buckets[-1] + max(0.0, sum(buckets[:-1]) - window)


def predict_dp(nodes: Sequence[NodeCost], caps: Sequence[float], profile_rows: int, batch: int, *,
               shares: Mapping[str, int] | None = None, bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS,
               latency_s: float = DEFAULT_LATENCY_S, node_cpu: Sequence[NodeComm | None] = (),
               backward_fraction: float = BACKWARD_FRACTION) -> DPPrediction:
    """Predicted iteration and memory of data parallelism over `nodes` (the owner, rank 0, first)
    at `shares` (node id -> rows; None: the split that minimises the slowest node's compute)."""
    if not nodes:
        raise ValueError("data parallelism needs at least one node")
    if len(caps) != len(nodes):
        raise ValueError(f"caps: {len(caps)} values for {len(nodes)} nodes")
    if not (bandwidth_Bps > 0 and math.isfinite(bandwidth_Bps)):
        raise ValueError(f"bandwidth must be finite and > 0, got {bandwidth_Bps!r}")
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be finite and >= 0, got {latency_s!r}")
    if not 0 <= backward_fraction <= 1:
        raise ValueError(f"backward_fraction must be in [0, 1], got {backward_fraction!r}")
    ids = [n.node_id for n in nodes]
    row_s = [row_time(n, profile_rows) for n in nodes]
    if shares is None and not any(n.rows_fixed for n in nodes):
        rows = list(balanced_shares([1 / t for t in row_s], batch))
    elif shares is None:
        rows = greedy_rows(lambda d, r: rows_time(nodes[d], r, profile_rows), len(nodes), batch)
    else:
        check_shares(shares, ids, batch)
        rows = [shares[i] for i in ids]
    cpu = [c for c in node_cpu if c is not None]
    grad_bytes = max(n.trained_full for n in nodes)
    sizes = bucket_sizes(grad_bytes)
    buckets = [allreduce_s(s, len(nodes), bandwidth_Bps, latency_s, cpu) for s in sizes]
    compute = [rows_time(n, r, profile_rows) for n, r in zip(nodes, rows)]
    slowest = max(compute)
    exposed = _exposed(buckets, backward_fraction * slowest)
    ideal_compute = _fluid_compute(nodes, profile_rows, batch)
    out = tuple(DPNode(n.node_id, r, t, c, replica_memory(n, r, profile_rows), cap)
                for n, r, t, c, cap in zip(nodes, rows, row_s, compute, caps))
    return DPPrediction(out, batch, grad_bytes, len(sizes), sum(buckets), exposed, slowest, slowest + exposed,
                        ideal_compute + _exposed(buckets, backward_fraction * ideal_compute))


def require_fit(pred: DPPrediction) -> DPPrediction:
    """`pred`, or DPInfeasible naming every node's need and cap (a forced `dp` that cannot fit)."""
    if not pred.feasible:
        raise DPInfeasible(f"data parallelism does not fit: every node holds a whole replica; {pred.shortfall()}")
    return pred
