"""Work bounded by the box before it starts: a profile request or an assignment is checked against
this box's usable cores and the memory it has now less the node's reserve, and refused with the
field, the value asked and the box's capacity named (`node/box/footprint.py` predicts the need; the
child's hard limits, `node/box/limits.py`, catch a prediction that was wrong)."""

from __future__ import annotations

from dataclasses import dataclass

from xronos.node.box import limits
from xronos.node.box.footprint import Footprint, estimate, profile_estimate
from xronos.protocol import messages as m

MiB = limits.MiB


@dataclass(frozen=True)
class Box:
    cores: int  # usable: affinity mask and CPU quota
    available: int  # bytes available now (the cgroup's limit where tighter)
    reserve_mb: int  # left to the device's day job (node.toml)

    @classmethod
    def now(cls, reserve_mb: int) -> Box:
        from xronos.node.box.capabilities import memory, usable_cores

        return cls(usable_cores(), memory()[1], reserve_mb)

    def room(self, freed: int = 0) -> int:
        return self.available + freed - self.reserve_mb * MiB

    def child_limits(self) -> limits.ChildLimits:
        return limits.child_limits(self.available, self.reserve_mb * MiB, self.cores)

    def over(self, what: str, need: Footprint, freed: int = 0) -> str | None:
        """Why `need` does not fit the memory this box has for it, or None."""
        if need.total <= self.room(freed):
            return None
        held = f" and the {freed / MiB:,.0f} MiB its running rank frees" if freed else ""
        return (f"{what} needs about {need.describe()}, but this box has {max(self.room(freed), 0) / MiB:,.0f} MiB "
                f"for it ({self.available / MiB:,.0f} MiB available{held}, less reserve_mb {self.reserve_mb:,})")


def profile_problem(req: m.ProfileRequest, box: Box) -> str | None:
    """Why this box cannot take the profile `req` asks for, or None: its threads within the usable
    cores, the profiling child's predicted peak within the memory available less the reserve."""
    if req.threads is not None and req.threads > box.cores:
        return f"threads {req.threads} asked, but this box has {box.cores} usable cores"
    key = req.key
    need = profile_estimate(req.arch, key.task, key.batch_size, key.seq_len, lora=key.lora is not None)
    return box.over(f"batch_size {key.batch_size} x seq_len {key.seq_len}: the profile", need)


def assignment_problem_on_box(a: m.Assignment, spec: m.JobSpec, shape: tuple[m.ArchSpec, str] | None, box: Box,
                              freed: int = 0) -> str | None:
    """Why this box cannot hold the rank `a` gives it (`shape`: the model's ArchSpec and task; None:
    not known here, nothing to check), or None. `freed`: what a rank it replaces holds now."""
    if shape is None:
        return None
    arch, task = shape
    # With shares the layout is each data-parallel group's: this rank holds TP rank r % tp of it and
    # trains its group's rows (a 0-row rank still holds its replica, its gradients and AdamW state:
    # counted at one row). A live re-split that gives the group more rows is priced by the gateway.
    tp = a.layout.world_size
    shares = {k: a.layout.share(k, a.rank % tp) for k in ("attn", "mlp", "vocab")}
    # dropout None is the checkpoint's own (usually on): counted as the explicit attention path
    r = spec.recipe
    rows = r.batch_size if a.shares is None else max(1, a.shares[a.rank // tp])
    need = estimate(arch, task, rows, r.seq_len, lora=r.lora is not None, scores=r.dropout != 0.0, **shares)
    return box.over(f"rank {a.rank} of {a.job_id} (batch_size {rows} x seq_len {r.seq_len}, "
                    f"{shares['attn']:.0%} of the attention, {shares['mlp']:.0%} of the MLP, {shares['vocab']:.0%} "
                    f"of the vocabulary)", need, freed)


def owner_arch(spec: m.JobSpec) -> tuple[m.ArchSpec, str] | None:
    """The owner's model shape from its (confined) checkpoint's config; None if unreadable (the
    rank reports that)."""
    try:
        from xronos.node.models.registry import arch_spec
        from xronos.node.rank.validate import read_config

        return m.ArchSpec(**arch_spec(read_config(spec.recipe.model_dir), spec.recipe.task)), spec.recipe.task
    except (OSError, ValueError, TypeError, KeyError):
        return None


def resident_bytes(pid: int) -> int:
    """A process's resident set (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
