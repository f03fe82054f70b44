"""Live re-balancing of a running job at the gateway (issue 14): the glue between the ranks'
`IterationMetrics` and the policy (`xronos.gateway.plan.rebalance.Rebalancer`). Pure: no I/O, no clock.

`JobRebalance.for_job(job)` starts the policy from the job's plan: its layout, every node's
`NodeCost` from the job's profile (checkpoints on, as the planner priced them) and the plan's
memory caps. `observe(metrics)` collects one iteration's per-kind compute from every rank; when a
step is complete (every rank heard) it feeds the policy in step order and asks it about a boundary
`lead` steps ahead of that step, so the order reaches the owner before the ranks get there (the
owner applies it at the first boundary at or after `at_step` regardless). The iterations before
the move are then left out of the policy's measurements: they ran under the old layout.
A `Decision` is a re-plan to order (`layout` set) or the plan kept (`layout` None) for a reason
other than the last one told (warming up, the gain below the bar, the move not repaid, a re-plan
that does not fit the memory caps, ...). A data-parallel plan (shares) is re-split instead
(`JobResplit`, the policy `xronos.gateway.plan.dpresplit`): its layout stays, its
batch's rows per group follow the groups' measured speed, and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xronos.gateway.plan.costmodel import NodeCost, node_cost, predict_time
from xronos.gateway.plan.memorymodel import predict_memory
from xronos.gateway.plan.profiles import node_profile
from xronos.gateway.plan.dpresplit import Resplitter, group_costs
from xronos.gateway.plan.mesh import at_rows
from xronos.gateway.plan.rebalance import PolicyConfig, Rebalancer
from xronos.protocol import messages as m
from xronos.protocol.layout import KINDS, Layout

from .types import Job, Rebalanced

GATED = ("llama", "qwen2", "qwen3")  # gated MLPs: three matrices per column
PENDING_STEPS = 16  # incomplete steps kept while waiting for slower ranks' metrics


def unit_bytes(arch: m.ArchSpec, num_blocks: int, task: str, lora: bool) -> dict[str, float]:
    """Per kind, the bytes one unit moves in a re-shard, from the architecture (the gateway has no
    torch: `xronos.node.rank.relayout.unit_bytes` counts the built tensors instead): an attention unit
    is a KV head with its query heads (q, k, v, o rows/columns), an MLP column two or three
    vectors, a vocabulary row the embedding's (and an untied head's); fp32 weights with AdamW's
    two moments, or without moments under LoRA (the partitioned base is frozen)."""
    head_dim = arch.hidden_size / arch.num_heads
    group = arch.num_heads / arch.num_kv_heads
    per_block = {"attn": arch.hidden_size * head_dim * (2 * group + 2),
                 "mlp": arch.hidden_size * (3 if arch.family in GATED else 2)}
    vocab_rows = 2 if task == "causal-lm" and not arch.tie_word_embeddings else 1
    per_weight = {"attn": per_block["attn"] * num_blocks, "mlp": per_block["mlp"] * num_blocks,
                  "vocab": arch.hidden_size * vocab_rows}
    return {k: v * 4 * (1 if lora else 3) for k, v in per_weight.items()}


def _shares(layout: Layout, rank: int) -> dict[str, float]:
    return {k: layout.share(k, rank) for k in KINDS}


@dataclass(frozen=True)
class Decision:
    at_step: int  # the boundary before this (0-based) step
    layout: Layout | None  # None: the plan is kept, `reason` says why
    reason: str
    old: Layout
    gain: float = 0.0
    # At the new layout: per rank, compute seconds (the refitted model) and peak memory (the
    # profile's); the slowest-per-kind sum (the policy's barrier time).
    predicted_compute_s: tuple[float, ...] = ()
    predicted_memory: tuple[float, ...] = ()
    predicted_bottleneck_s: float = 0.0
    shares: tuple[int, ...] | None = None  # a data-parallel plan's re-split (`layout` its own)
    old_shares: tuple[int, ...] | None = None


def _costs(job: Job) -> list[NodeCost]:
    """Every node's cost model from the job's profile, as the planner priced it (checkpoints on;
    rank 0 the owner: its peak holds the data stack and the export's gather). ValueError when a
    node of the plan has no profile."""
    assert job.plan is not None
    nodes = [e.node_id for e in job.plan.entries]
    missing = [n for n in nodes if n not in job.profiles]
    if missing:
        raise ValueError(f"job {job.job_id}: no profile for {missing}, nothing to re-balance from")
    recipe = job.spec.recipe
    return [replace(node_cost(node_profile(job.profiles[n])), checkpoints=True,
                    export_all=recipe.exports_whole_model, owner=d == 0) for d, n in enumerate(nodes)]


class JobRebalance:
    """One plan version of one running job."""

    def __init__(self, plan_version: int, node_ids: list[str], policy: Rebalancer, base: list[NodeCost],
                 lead: int = 2) -> None:
        self.plan_version, self.node_ids, self.policy, self.base, self.lead = \
            plan_version, node_ids, policy, base, lead
        self.pending: dict[int, dict[int, dict[str, float]]] = {}  # step -> rank -> per-kind compute
        self.fed = 0  # the last step fed to the policy
        self.ignore_until = 0  # metrics of steps up to this one ran under a superseded layout
        self.told = ""  # the policy's last reason told (a repeat is not)
        self.move_seen: int | None = None  # the boundary of the last measured move fed to the policy

    @classmethod
    def for_job(cls, job: Job, config: PolicyConfig = PolicyConfig(), lead: int = 2) -> JobRebalance:
        """ValueError when the job has no plan or a node of the plan has no profile."""
        if job.plan is None:
            raise ValueError(f"job {job.job_id} has no plan to re-balance")
        nodes = [e.node_id for e in job.plan.entries]
        # Rank 0 is the owner, as the planner marks it: its peak holds the data stack and the
        # export's gather, so a re-plan's memory for it is the plan's arithmetic, not a plain rank's.
        recipe = job.spec.recipe
        base = _costs(job)
        report = job.profiles[nodes[0]]
        ub = unit_bytes(report.arch, report.num_blocks, recipe.task, lora=recipe.lora is not None)
        policy = Rebalancer(job.plan.sizes, job.plan.layout(), base, [e.memory_cap for e in job.plan.entries],
                            ub, config=config, total_steps=job.total_steps or None)
        out = cls(job.plan_version, nodes, policy, base, lead)
        if job.plan.trial is not None:  # the trial's steps run other overlap modes: not the speeds to fit
            out.ignore_until = job.resume_step + job.plan.trial.steps
        return out

    def moved(self, s: m.NodeJobStatus) -> bool:
        """The owner's word on an applied re-shard: its measured cost refits the policy's move
        model (as `xronos run` does), so the payback test prices the next move by this job's own.
        True when it was fed (once per boundary; only the owner of this plan version speaks)."""
        if s.plan_version != self.plan_version or s.rank != 0 or self.node_ids[0] != s.node_id \
                or s.reshard_step is None or s.reshard_s is None or s.reshard_bytes is None \
                or s.reshard_step == self.move_seen:
            return False
        self.move_seen = s.reshard_step
        self.policy.observe_move(float(s.reshard_bytes), s.reshard_s)
        if s.reshard_layout is not None and s.reshard_layout != self.policy.layout:
            # a move the policy did not order (the overlap trial's): booked as its own, measured afresh
            try:
                self.policy.moved_to(s.reshard_layout)
            except ValueError:  # not a layout of this job (the job's machine ignores it alike)
                return True
            self.pending.clear()
            self.ignore_until = max(self.ignore_until, s.reshard_step)
        return True

    def observe(self, x: m.IterationMetrics) -> Decision | None:
        """One rank's metrics; a Decision when a complete step made the policy decide something
        worth telling."""
        if x.plan_version != self.plan_version or x.rank >= len(self.node_ids) \
                or self.node_ids[x.rank] != x.node_id or x.step <= max(self.fed, self.ignore_until):
            return None
        times = (x.compute_attn_s, x.compute_mlp_s, x.compute_vocab_s)
        if any(t is None for t in times):
            return None  # a rank that does not split its compute by kind: nothing to learn from
        row = self.pending.setdefault(x.step, {})
        row[x.rank] = dict(zip(KINDS, times))
        if x.compute_rest_s is not None:  # the optimizer step and clipping: the policy books them by bytes held
            row[x.rank]["rest"] = x.compute_rest_s
        if len(row) < len(self.node_ids):
            for old in [s for s in self.pending if s < x.step - PENDING_STEPS]:
                del self.pending[old]
            return None
        del self.pending[x.step]
        for old in [s for s in self.pending if s < x.step]:  # never completed: skipped
            del self.pending[old]
        self.fed = x.step
        self.policy.observe([row[r] for r in range(len(self.node_ids))])
        # Metric step s is the s-th iteration done; the next boundary is the one before step s.
        at = x.step + self.lead
        old = self.policy.layout
        replan = self.policy.decide(at)
        if replan is not None:
            self.ignore_until = at  # iterations before the move ran under the old layout
            self.pending.clear()
            nodes = self.policy.refitted() or self.base  # the measured speeds, where there are some
            new = replan.new
            return Decision(at, new, replan.reason, old, replan.gain,
                            tuple(predict_time(n, _shares(new, d)) for d, n in enumerate(nodes)),
                            tuple(predict_memory(n, _shares(new, d)) for d, n in enumerate(self.base)),
                            replan.predicted_new_s)
        reason = self.policy.last_reason
        if reason != self.told:  # the job shows the policy's latest word (Home Assistant's Last re-plan)
            self.told = reason
            return Decision(at, None, reason, old)
        return None


class JobResplit:
    """One plan version of a running data-parallel job (`Plan.shares`): its groups' measured speed
    re-splits its batch (`dpresplit.Resplitter`); the layout stays and nothing moves. Fed and asked
    as `JobRebalance` is (a complete step, a boundary `lead` steps ahead)."""

    def __init__(self, plan_version: int, node_ids: list[str], tp: int, policy: Resplitter, nodes: list[NodeCost],
                 layout: Layout, profile_rows: int, lead: int = 2) -> None:
        self.plan_version, self.node_ids, self.tp, self.policy = plan_version, node_ids, tp, policy
        self.nodes, self.layout, self.profile_rows, self.lead = nodes, layout, profile_rows, lead
        self.pending: dict[int, dict[int, float]] = {}  # step -> rank -> compute_s
        self.fed = 0
        self.ignore_until = 0  # metrics of steps up to this one ran under a superseded split
        self.told = ""

    @classmethod
    def for_job(cls, job: Job, config: PolicyConfig = PolicyConfig(), lead: int = 2) -> JobResplit:
        """ValueError when the job has no data-parallel plan or a node of it has no profile."""
        if job.plan is None or job.plan.shares is None:
            raise ValueError(f"job {job.job_id} has no data-parallel plan to re-split")
        plan, nodes = job.plan, _costs(job)
        layout, groups, tp = plan.layout(), len(plan.shares), plan.tp_size
        profile_rows = job.profiles[plan.entries[0].node_id].batch_size
        caps = [e.memory_cap for e in plan.entries]
        batch = sum(plan.shares)

        def fits(g: int, rows: int) -> bool:
            return all(cls._memory(nodes[r], layout, r % tp, rows, profile_rows) <= caps[r]
                       for r in range(g * tp, (g + 1) * tp))

        def most(g: int) -> int:  # the most rows the group's nodes fit: memory grows with the rows' activations
            lo, hi = 0, batch
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(g, mid) else (lo, mid - 1)
            return lo

        limits = [most(g) for g in range(groups)]
        policy = Resplitter(tuple(plan.shares), profile_rows, group_costs(nodes, layout, groups), limits, config)
        return cls(job.plan_version, [e.node_id for e in plan.entries], tp, policy, nodes, layout, profile_rows, lead)

    @staticmethod
    def _memory(node: NodeCost, layout: Layout, tp_rank: int, rows: int, profile_rows: int) -> float:
        return predict_memory(at_rows(node, rows / profile_rows), _shares(layout, tp_rank))

    def moved(self, s: m.NodeJobStatus) -> bool:
        """The owner's word on an applied re-split (nothing moved: no cost to learn). An order may
        land later than the boundary it asked for: the metrics up to the step the ranks really
        changed rows at ran under the old ones, so the policy measures afresh from there. True when
        it re-synchronised (once per boundary; only the owner of this plan version speaks)."""
        if s.plan_version != self.plan_version or s.rank != 0 or self.node_ids[0] != s.node_id \
                or s.reshard_step is None or s.reshard_shares is None \
                or tuple(s.reshard_shares) != self.policy.shares or s.reshard_step <= self.ignore_until:
            return False
        self.ignore_until = s.reshard_step
        self.pending = {k: v for k, v in self.pending.items() if k > s.reshard_step}
        self.policy.restart()
        return True

    def observe(self, x: m.IterationMetrics) -> Decision | None:
        if x.plan_version != self.plan_version or x.rank >= len(self.node_ids) \
                or self.node_ids[x.rank] != x.node_id or x.step <= max(self.fed, self.ignore_until):
            return None
        row = self.pending.setdefault(x.step, {})
        row[x.rank] = x.compute_s
        if len(row) < len(self.node_ids):
            for old in [s for s in self.pending if s < x.step - PENDING_STEPS]:
                del self.pending[old]
            return None
        del self.pending[x.step]
        for old in [s for s in self.pending if s < x.step]:
            del self.pending[old]
        self.fed = x.step
        tp = self.tp
        self.policy.observe([max(row[r] for r in range(g * tp, (g + 1) * tp))  # a group waits for its slowest
                             for g in range(len(self.node_ids) // tp)])
        at = x.step + self.lead
        d = self.policy.decide(at)
        if d is not None:
            self.ignore_until = at  # iterations before the re-split ran under the old rows
            self.pending.clear()
            compute, memory = [], []
            for r, node in enumerate(self.nodes):
                g, rho = r // tp, d.new[r // tp] / self.profile_rows
                own = predict_time(at_rows(node, rho), _shares(self.layout, r % tp))  # the rank's own, scaled
                compute.append(own * d.scale[g] if d.new[g] else 0.0)
                memory.append(self._memory(node, self.layout, r % tp, d.new[g], self.profile_rows))
            return Decision(at, self.layout, d.reason, self.layout, d.gain, tuple(compute), tuple(memory),
                            d.predicted_new_s, d.new, d.old)
        reason = self.policy.last_reason
        if reason != self.told:
            self.told = reason
            return Decision(at, None, reason, self.layout)
        return None


class Rebalancers:
    """The gateway's policies, one per running job, each for the plan version it was built for."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.by_job: dict[str, tuple[int, JobRebalance | JobResplit | None]] = {}

    def observe(self, job: Job | None, x: m.IterationMetrics) -> Rebalanced | None:
        """Feed `x` to its job's policy; its decision as the state machine's event. Raises
        ValueError when no policy can be made for the job (it runs on unbalanced), and whatever
        the policy raised (this plan version then goes on without one)."""
        if job is None or not job.spec.rebalance or job.plan is None or job.phase not in ("running", "paused"):
            self.by_job.pop(x.job_id, None)
            return None
        version, policy = self.by_job.get(x.job_id, (-1, None))
        ordered = job.pending_plan if job.pending_plan is not None else job.plan
        make = JobResplit.for_job if job.plan.shares is not None else JobRebalance.for_job
        # A new plan version, or an order the ranks refused (or a gateway restart dropped): the
        # policy's layout (or shares) is not what the ranks run or were ordered to; it starts again from the plan.
        if isinstance(policy, JobResplit):
            stale = policy.policy.shares != tuple(ordered.shares or ())
        else:
            stale = policy is not None and policy.policy.layout != ordered.layout()
        if version != job.plan_version or stale:
            self.by_job[x.job_id] = (job.plan_version, None)
            policy = make(job, self.config)  # e.g. a node without a profile: ValueError
            self.by_job[x.job_id] = (job.plan_version, policy)
        if policy is None:
            return None
        try:
            d = policy.observe(x)
        except Exception:
            self.by_job[x.job_id] = (job.plan_version, None)
            raise
        if d is None:
            return None
        return Rebalanced(policy.plan_version, d.at_step, d.layout, d.reason, d.old, d.gain,
                          d.predicted_compute_s, d.predicted_memory, d.predicted_bottleneck_s,
                          d.shares, d.old_shares)

    def moved(self, msg: m.NodeJobStatus) -> None:
        """A re-shard's measured cost refits the job's policy."""
        policy = self.by_job.get(msg.job_id, (-1, None))[1]
        if msg.reshard_step is not None and policy is not None:
            policy.moved(msg)
