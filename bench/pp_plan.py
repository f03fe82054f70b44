"""Asteroid-style heterogeneity-aware pipeline partitioning (pure).

The model is the chain [emb, blk_0 .. blk_{B-1}, out]. Each device d has profiled per-layer times
(forward + backward of one micro-batch) and a memory cap. A plan cuts the chain into contiguous
stages, one per device in some device order (a device may get nothing and sit out), minimising
the bottleneck stage time — per micro-batch compute plus sending its boundary activation (and
receiving the gradient back) — under every device's memory cap. For each device order (all
orders up to 6 devices), a dynamic programme over (devices used, layers placed) finds the best
cut; the order with the lowest predicted 1F1B iteration time wins:

    T_iter ~ sum_s t_s + (M - 1) * max_s t_s        (fill/drain plus M-1 bottleneck slots)

Memory of a stage: its layers' weights+grads+AdamW state plus the activations of the micro-batches
in flight — 1F1B keeps at most min(M, P - s) of them on pipeline stage s — plus the largest of its
layers' transient memory (`transient_memory`, optional: e.g. fp32 copies of a layer's parameters,
which loading, the embedding's dense gradient and the per-tensor AdamW step allocate on top).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PPStage:
    device: int  # index into the device list
    start: int  # layer range [start, stop) of the chain
    stop: int
    time_s: float  # per micro-batch, compute + boundary communication
    memory: float


@dataclass(frozen=True)
class PPPlan:
    stages: tuple[PPStage, ...]  # in pipeline order
    bottleneck_s: float
    predicted_iteration_s: float
    micro_batches: int


class InfeasiblePipeline(ValueError):
    """No contiguous cut fits the devices' memory."""


def plan_pipeline(
    layer_times: Sequence[Sequence[float]],  # [device][layer] seconds per micro-batch
    layer_memory: Sequence[float],  # [layer] resident bytes (weights, grads, optimizer state)
    act_memory: Sequence[float],  # [layer] bytes of activations one micro-batch keeps
    boundary_s: Sequence[float],  # [layer] seconds to ship this layer's output forward and its grad back
    caps: Sequence[float],  # [device] bytes
    micro_batches: int,
    transient_memory: Sequence[float] | None = None,  # [layer] bytes held briefly on top (max per stage)
) -> PPPlan:
    N, L = len(layer_times), len(layer_memory)
    if N == 0 or L == 0:
        raise ValueError("a pipeline needs at least one device and one layer")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if len(caps) != N or len(act_memory) != L or len(boundary_s) != L:
        raise ValueError("layer_times, caps, act_memory and boundary_s disagree in length")
    if any(len(t) != L for t in layer_times):
        raise ValueError(f"every device needs a time for each of the {L} layers")
    transient = list(transient_memory) if transient_memory is not None else [0.0] * L
    if len(transient) != L:
        raise ValueError(f"transient_memory needs one value for each of the {L} layers")
    orders = itertools.permutations(range(N)) if N <= 6 else [tuple(range(N))]
    best: PPPlan | None = None
    for order in orders:
        cand = _plan_in_order(order, layer_times, layer_memory, act_memory, boundary_s, caps, micro_batches,
                              transient)
        if cand is not None and (best is None or cand.predicted_iteration_s < best.predicted_iteration_s - 1e-12):
            best = cand
    if best is None:
        need = sum(layer_memory) + sum(act_memory) + max(transient)
        raise InfeasiblePipeline(
            f"no pipeline cut fits the memory caps: the model needs {need / 2**20:.1f} MiB of weights, "
            f"gradients, optimizer state and one micro-batch of activations; the caps are "
            f"{[round(c / 2**20, 1) for c in caps]} MiB")
    return best


def _plan_in_order(order, layer_times, layer_memory, act_memory, boundary_s, caps, M,
                   transient=None) -> PPPlan | None:
    N, L = len(order), len(layer_memory)
    pre_w = [0.0] + list(itertools.accumulate(layer_memory))
    pre_a = [0.0] + list(itertools.accumulate(act_memory))

    def stage_cost(pos: int, j: int, l: int) -> tuple[float, float]:
        """(time, memory) of layers [j, l) on the device at pipeline position `pos`."""
        d = order[pos]
        t = sum(layer_times[d][j:l]) + (boundary_s[l - 1] if l < L else 0.0)
        in_flight = min(M, N - pos)  # conservative: P - s <= N - pos
        mem = pre_w[l] - pre_w[j] + in_flight * (pre_a[l] - pre_a[j]) + (max(transient[j:l]) if transient else 0.0)
        return t, mem

    INF = math.inf
    # f[k][l]: best bottleneck with the first k devices of the order holding layers [0, l).
    f = [[INF] * (L + 1) for _ in range(N + 1)]
    arg = [[-1] * (L + 1) for _ in range(N + 1)]
    f[0][0] = 0.0
    for k in range(1, N + 1):
        for l in range(L + 1):
            for j in range(l + 1):
                if f[k - 1][j] == INF:
                    continue
                if j == l:
                    val = f[k - 1][j]  # this device sits out
                else:
                    t, mem = stage_cost(k - 1, j, l)
                    if mem > caps[order[k - 1]]:
                        continue
                    val = max(f[k - 1][j], t)
                if val < f[k][l] - 1e-15:
                    f[k][l], arg[k][l] = val, j
    if f[N][L] == INF:
        return None
    stages: list[PPStage] = []
    l = L
    for k in range(N, 0, -1):
        j = arg[k][l]
        if j < l:
            t, mem = stage_cost(k - 1, j, l)
            stages.append(PPStage(order[k - 1], j, l, t, mem))
        l = j
    stages.reverse()
    times = [s.time_s for s in stages]
    return PPPlan(tuple(stages), max(times), sum(times) + (M - 1) * max(times), M)
