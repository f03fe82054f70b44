"""A plan of any strategy from profile reports — `auto`, `dp` and the TP ones — and its protocol
`Plan` message. The adapter between `profiles.cost_inputs` (reports in) and `choose.choose` (the
candidates and the pick); pure, like both.

- `choose_reports` predicts the candidates the strategy asks for and returns the `Choice`. A
  forced `dp` that does not fit is refused naming every node's need and cap
  (`dpcost.require_fit`); `auto` with no feasible candidate is refused naming each one's reason.
- `choice_message` writes the winner as a `Plan`: TP as `profiles.plan_message`; `dp` one entry per
  node holding the whole layout (tp = 1), `shares` its rows, its compute its rows' and its memory
  its replica's; a mesh its entries in global rank order (group-major, `protocol.messages.mesh_of`),
  every group the same layout, `shares` the rows per group. `comm_s` is what the iteration pays
  beyond the slowest compute (DP: the gradient all-reduce backward does not hide).
- `with_trial` adds the overlap modes the ranks measure against each other at the run's start
  (`Plan.trial`) to a TP plan whose job let the planner choose the mode.
- `candidates_table` / `candidates_data`: the candidates side by side, for `xronos plan`, the job's
  events and the plan preview's answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from xronos.gateway.plan.choose import Candidate, Choice, choose, trial_modes
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.dpcost import require_fit
from xronos.gateway.plan.model import MiB, InfeasiblePlan
from xronos.gateway.plan.profiles import DEFAULT_RESERVE_MB, cost_inputs, plan_message, reserve_note
from xronos.protocol.messages import ModeForecast, Overlap, OverlapTrial, Plan, PlanEntry


def choose_reports(loaded: Sequence[Loaded], strategy: str, *, reserve_mb: float = DEFAULT_RESERVE_MB,
                   batch: int | None = None, overlap: str = "off", chunks: int | None = None,
                   joint: bool = True, **kw: Any) -> Choice:
    """The candidates `strategy` asks for over the reports (ranks in given order) and the pick;
    `kw` as `profiles.cost_inputs` (the job's batch_size, seq_len, ... and the link). `batch`: the
    global batch the shares split (default: the profiles' batch, which a job's must equal).
    `overlap`/`chunks`: a TP candidate's overlap of its all-reduces (`choose.with_overlap`);
    `joint`: its layout planned with its mode (False: the layout planned without overlap)."""
    ins = cost_inputs(loaded, reserve_mb=reserve_mb, **kw)
    bw = kw.get("bandwidth_Bps")
    lat = kw.get("latency_s")
    link = {k: v for k, v in (("bandwidth_Bps", bw), ("latency_s", lat)) if v is not None}
    try:
        choice = choose(list(ins.nodes), ins.sizes, list(ins.caps), ins.volume, ins.comm_s, ins.profile_rows,
                        batch or ins.profile_rows, strategy, node_cpu=ins.node_cpu, overlap=overlap,
                        chunks=chunks, shape=ins.shape, joint=joint, **link)
    except InfeasiblePlan as exc:
        raise reserve_note(exc, loaded, ins.caps, reserve_mb) from None
    if strategy == "dp":
        require_fit(choice.winner.dp)  # type: ignore[arg-type]
    return choice


def choice_message(choice: Choice, job_id: str, version: int = 0) -> Plan:
    """The protocol's Plan message for the chosen candidate (module docstring)."""
    w = choice.winner
    if w.tp is not None:
        msg = plan_message(w.tp, job_id, version)
        if w.overlap is None or not w.overlap.mode.on:
            return msg
        mode = w.overlap.mode
        return msg.model_copy(update={"overlap": Overlap(backward=mode.backward, chunks=mode.chunks),
                                      "predicted_iteration_s": w.iteration_s, "comm_s": w.comm_s})
    if w.dp is not None:
        p = w.dp
        sizes = choice.sizes
        entries = [PlanEntry(node_id=n.node_id, rank=d, attn=sizes.attn, mlp=sizes.mlp, vocab=sizes.vocab,
                             predicted_compute_s=n.compute_s, predicted_memory=n.memory, memory_cap=n.cap)
                   for d, n in enumerate(p.nodes)]
        return Plan(job_id=job_id, version=version, strategy="dp", sizes=sizes, entries=entries,
                    predicted_iteration_s=p.iteration_s, ideal_iteration_s=p.ideal_s, comm_s=p.exposed_s,
                    shares=[n.rows for n in p.nodes])
    m = w.mesh
    assert m is not None
    entries = [PlanEntry(node_id=n.node_id, rank=r, attn=m.layout.attn[n.tp_rank], mlp=m.layout.mlp[n.tp_rank],
                         vocab=m.layout.vocab[n.tp_rank], predicted_compute_s=n.compute_s,
                         predicted_memory=n.memory, memory_cap=n.cap)
               for r, n in enumerate(m.nodes)]
    # A mesh is data-parallel groups of TP: the wire's "dp" with shares per group (mesh_of).
    return Plan(job_id=job_id, version=version, strategy="dp", sizes=choice.sizes, entries=entries,
                predicted_iteration_s=m.iteration_s, ideal_iteration_s=m.iteration_s, comm_s=m.comm_s,
                shares=list(m.rows))


# A plan measures its overlap modes (`Plan.trial`) only in a run at least this many times the
# trial's length: the trial's slower steps are then at most a small part of the run.
TRIAL_MIN_RUN = 4


def with_trial(plan: Plan, choice: Choice, steps: int) -> Plan:
    """`plan` with an overlap trial (`protocol.OverlapTrial`: the winner's mode and the next
    predicted fastest, `choose.trial_modes`, measured against each other on the plan's layout at
    the run's start, each with the layout planned for it where that is another, and each with the
    prediction for it once kept) when there is a choice to measure and the run of `steps` steps is
    long enough; else as it is."""
    modes = trial_modes(choice.winner)
    if not modes or plan.shares is not None:
        return plan
    w = choice.winner
    own = {m: (q, r) for m, q, r in w.own_plans}  # a kept mode whose own layout is another: the ranks move there
    on_plan = {q.mode: q for q in w.ranked}
    layouts = [None, *(own[m][1].layout if m in own else None for m in modes[1:])]
    assert w.tp is not None  # modes to try come only with a TP candidate

    def exposed(q, r) -> float:
        """What the mode does not hide: its iteration past its layout's compute and chunking's."""
        return max(0.0, q.iteration_s - r.bottleneck_s - q.chunk_overhead_s)

    forecasts = []
    for i, m in enumerate(modes):
        if i and m in own:
            q, r = own[m]
            rows = sorted(r.rows, key=lambda x: x.rank)
            forecasts.append(ModeForecast(iteration_s=q.iteration_s, comm_s=exposed(q, r),
                                          compute_s=[x.predicted_compute_s for x in rows],
                                          memory=[x.predicted_memory for x in rows]))
        else:
            forecasts.append(ModeForecast(iteration_s=on_plan[m].iteration_s, comm_s=exposed(on_plan[m], w.tp)))
    trial = OverlapTrial(modes=[Overlap(backward=m.backward, chunks=m.chunks) for m in modes],
                         layouts=layouts if any(x is not None for x in layouts) else None, forecasts=forecasts)
    if steps < TRIAL_MIN_RUN * trial.steps:
        return plan
    return Plan.model_validate({**plan.model_dump(), "trial": trial.model_dump()})


def _mem(c: Candidate) -> str:
    if c.worst_node is None:
        return "-"
    return f"{c.worst_memory / MiB:,.0f} / {c.worst_cap / MiB:,.0f} ({c.worst_node})"


def candidates_table(choice: Choice) -> str:
    """The candidates side by side: predicted iteration, compute, comm, the worst node's memory vs
    its cap, and whether it fits (why not), the winner marked; then why it won."""
    def t(v: float) -> str:
        return f"{v:.4f}" if math.isfinite(v) else "-"

    rows = []
    for c in choice.candidates:
        fits = "yes" if c.feasible else f"no: {(c.why_not or '').splitlines()[0]}"
        rows.append(("*" if c is choice.winner else " ", c.label, t(c.iteration_s), t(c.compute_s), t(c.comm_s),
                     _mem(c), fits))
    head = (" ", "candidate", "iteration s", "compute s", "comm s", "worst memory / cap MiB", "fits")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(f"{x:<{widths[i]}}" if i < 2 else f"{x:>{widths[i]}}" for i, x in enumerate(r[:-1]))
             + "  " + r[-1] for r in [head, *rows]]
    return "\n".join(lines) + f"\nchosen: {choice.why}"


def candidates_data(choice: Choice) -> list[dict[str, Any]]:
    """The candidates as JSON-able rows (the plan preview's answer)."""
    def num(v: float) -> float | None:
        return v if math.isfinite(v) else None
    return [{"strategy": c.strategy, "label": c.label, "chosen": c is choice.winner, "feasible": c.feasible,
             "iteration_s": num(c.iteration_s), "compute_s": num(c.compute_s), "comm_s": num(c.comm_s),
             "worst_node": c.worst_node, "worst_memory": c.worst_memory, "worst_cap": c.worst_cap,
             "why_not": c.why_not} for c in choice.candidates]


def choice_note(choice: Choice) -> str:
    """One line for the job's events: the strategy chosen, its time, and the runner-up."""
    w = choice.winner
    text = f"{w.label} {w.iteration_s:.4f} s"
    if choice.asked != "auto":
        return f"{text} (asked for)"
    second = choice.runner_up
    if second is None:
        return f"{text} (auto: the only candidate)"
    return f"{text} (auto; runner-up {second.summary()})"
