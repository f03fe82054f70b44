"""The communication term of the cost model: Megatron-style TP's all-reduces per iteration
(`tp_comm_volume`), each node's CPU cost of one (`node_comm`, from the profile's collective probe)
and the plan's constant communication time over the links (`comm_time`, paper §IV-A). Pure
Python, like `costmodel`, which holds the compute and memory terms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# --- communication: a constant per plan (paper §IV-A), from the link and each node's CPU ---


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
    The volume does not depend on the layout (uneven widths still reduce full-hidden tensors).
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


@dataclass(frozen=True)
class NodeComm:
    """One node's CPU cost of an all-reduce, from its profile's loopback probe
    (`xronos.node.measure.commprobe`, two local ranks): `fixed_s` per ring step pair, `per_byte_s` per byte
    of the tensor as one rank of a two-rank ring pays it. Gloo's all-reduce is a ring: reduce-scatter
    then all-gather, 2(N-1) steps, each rank sending and receiving 2(N-1)/N of the tensor. So one
    rank of a ring of N pays `fixed * (N-1) + per_byte * 2(N-1)/N * bytes`."""

    fixed_s: float
    per_byte_s: float
    # The same for a call launched beside compute (`commprobe._time_launched`), which costs the CPU
    # more than a blocking one; None: not probed, charged as a blocking call.
    launched: NodeComm | None = None

    def allreduce_s(self, nbytes: float, n_nodes: int) -> float:
        if n_nodes <= 1:
            return 0.0
        return self.fixed_s * (n_nodes - 1) + self.per_byte_s * 2 * (n_nodes - 1) / n_nodes * nbytes

    def in_flight(self) -> NodeComm:
        """What the node pays for a call it launched beside compute (the overlap model's calls)."""
        return self.launched or self


def node_comm(nbytes: float, seconds: float, small_bytes: float, small_seconds: float,
              parallel: int = 1) -> NodeComm:
    """The probe's two points (a few bytes, the activation) as a fixed cost and a cost per byte.
    `parallel`: how many of the probe's two ranks ran at once (1 when the node has one core or a
    quota of at most one, 2 otherwise): serialised, the probe's time paid for both ranks' bytes, so
    one rank's share of it is half."""
    for name, v in (("nbytes", nbytes), ("seconds", seconds), ("small_bytes", small_bytes),
                    ("small_seconds", small_seconds)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"collectives.{name} must be finite and >= 0, got {v!r}")
    if not small_bytes < nbytes:
        raise ValueError(f"collectives.small_bytes ({small_bytes}) must be below nbytes ({nbytes})")
    if parallel not in (1, 2):
        raise ValueError(f"parallel must be 1 or 2, got {parallel!r}")
    slope = max(0.0, seconds - small_seconds) / (nbytes - small_bytes)
    fixed = max(0.0, small_seconds - slope * small_bytes)
    # A two-rank ring moves the whole tensor per rank (2(N-1)/N = 1): per byte of tensor, one rank
    # pays `slope` if the two ran side by side, half of it if they took turns on one core.
    return NodeComm(fixed_s=fixed, per_byte_s=slope * parallel / 2)


def comm_time(
    volume: CommVolume,
    n_nodes: int,
    bandwidths_Bps: Sequence[float] | float = DEFAULT_BANDWIDTH_BPS,
    latency_s: float = DEFAULT_LATENCY_S,
    node_cpu: Sequence[NodeComm] = (),
) -> float:
    """Ring all-reduce over the link: count*latency + 2(N-1)/N * volume / min bandwidth (zero for
    one node). With the nodes' measured CPU costs, each all-reduce takes the longer of the link's
    time and the slowest node's CPU time for it (the bytes of one call: volume / count)."""
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    bws = [bandwidths_Bps] if isinstance(bandwidths_Bps, (int, float)) else list(bandwidths_Bps)
    if not bws or any(not (b > 0 and math.isfinite(b)) for b in bws):
        raise ValueError(f"bandwidths must be finite and > 0, got {bws}")
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be finite and >= 0, got {latency_s}")
    if n_nodes == 1:
        return 0.0
    link = volume.count * latency_s + 2 * (n_nodes - 1) / n_nodes * volume.nbytes / min(bws)
    if not node_cpu or volume.count == 0:
        return link
    per_call = volume.nbytes / volume.count
    cpu = volume.count * max(c.allreduce_s(per_call, n_nodes) for c in node_cpu)
    return max(link, cpu)


def comm_per_node(volume: CommVolume, n_nodes: int, node_cpu: Sequence[NodeComm | None]) -> list[float | None]:
    """Each node's own CPU seconds in the iteration's all-reduces (None: not profiled)."""
    if volume.count == 0:
        return [0.0 if c is not None else None for c in node_cpu]
    per_call = volume.nbytes / volume.count
    return [None if c is None else volume.count * c.allreduce_s(per_call, n_nodes) for c in node_cpu]
