"""Which profile reports one plan may use together: one model and batch shape (task, batch,
sequence, blocks, architecture, sizes) on distinct nodes, and one job's settings (LoRA or not and
which adapters, weight decay, clipping) — the job's own, when the planner is given them. A
report taken under other settings is another job's time and memory. Every refusal names the
file (or node) and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from xronos.protocol.messages import JobSpec, ProfileReport, ProfileSettings


@dataclass(frozen=True)
class Loaded:
    """A validated report and where it came from (for error messages)."""

    source: str
    report: ProfileReport


# Fields that must agree across every report of one plan (they fix the model and the batch).
_SAME = ("task", "batch_size", "seq_len", "num_blocks", "arch", "sizes")


def _show(name: str, value: object) -> str:
    if name == "lora":
        return "None (full fine-tuning)" if value is None else f"LoRA rank {value.r}"  # type: ignore[attr-defined]
    if value is None and name == "lora.targets":
        return "None (the family's default)"
    return repr(value)


def job_settings(spec: JobSpec) -> ProfileSettings:
    """The settings a job's profiles are taken under: what the gateway's ProfileRequest carries
    (gateway/job/effects.py), in the form a report records them."""
    return ProfileSettings.of_key(spec.recipe.profile_key())


def settings_diff(got: ProfileSettings, want: ProfileSettings) -> tuple[str, str, str] | None:
    """(field, got, want) of the first setting `got` differs from `want` in ("lora.r" within the
    adapters), shown for a person, or None when they are the same (adapters compared in one
    form, `LoraShape.shape`: the targets as a set)."""
    for name in ("weight_decay", "clip", "lora"):
        a, b = getattr(got, name), getattr(want, name)
        if name == "lora" and a is not None and b is not None:
            a, b = a.shape(), b.shape()  # a report from the wire may list its targets in another order
        if a == b:
            continue
        if name == "lora" and a is not None and b is not None:
            part = next(f for f in ("r", "targets", "dropout") if getattr(a, f) != getattr(b, f))
            return f"lora.{part}", _show(f"lora.{part}", getattr(a, part)), _show(f"lora.{part}", getattr(b, part))
        return name, _show(name, a), _show(name, b)
    return None


def check_compatible(loaded: Sequence[Loaded], *, batch_size: int | None = None, seq_len: int | None = None,
                     task: str | None = None, settings: ProfileSettings | None = None) -> None:
    """Refuse a set of reports that do not describe one job on distinct nodes, or (when given)
    were taken at another batch size, sequence length, task or job settings than the job's.

    Settings: a report that records none (an older Xronos wrote it) is of unknown settings. With
    the job's `settings` given it is let through (it answered that job's own request, which carried
    them, or `xronos run` just measured it); without, it cannot be planned beside one that records
    its settings, since nothing says they are the same."""
    if not loaded:
        raise ValueError("profiles: a plan needs at least one node's profile, got none")
    first = loaded[0]
    seen: dict[str, str] = {}
    expect = {"batch_size": batch_size, "seq_len": seq_len, "task": task}
    recorded = next((item for item in loaded if item.report.settings is not None), None)
    for item in loaded:
        r = item.report
        if r.node_id in seen:
            raise ValueError(f"{item.source}: field node_id: duplicate node id {r.node_id!r} "
                             f"(also in {seen[r.node_id]})")
        seen[r.node_id] = item.source
        for name, want in expect.items():
            if want is not None and getattr(r, name) != want:
                raise ValueError(f"{item.source}: field {name}: node {r.node_id} was profiled at "
                                 f"{name} {getattr(r, name)!r}, but the job runs {want!r}; profile it again")
        if settings is not None and r.settings is not None:
            diff = settings_diff(r.settings, settings)
            if diff is not None:
                raise ValueError(f"{item.source}: field settings.{diff[0]}: node {r.node_id} was profiled at "
                                 f"{diff[0]} {diff[1]}, but the job runs {diff[2]}; profile it again")
        for name in _SAME:
            mine, theirs = getattr(r, name), getattr(first.report, name)
            if name == "arch":  # name the architecture field that differs, not the whole spec
                diff = [k for k in type(mine).model_fields if getattr(mine, k) != getattr(theirs, k)]
                if diff:
                    name, mine, theirs = f"arch.{diff[0]}", getattr(mine, diff[0]), getattr(theirs, diff[0])
            if mine != theirs:
                raise ValueError(f"{item.source}: field {name}: {mine!r} differs from {theirs!r} in "
                                 f"{first.source}; one plan needs one model and batch shape")
        if recorded is None or settings is not None:
            continue
        # A LoRA profile holds no gradient or moments on the base and a full fine-tune's does, and
        # decay and clipping are passes of their own: one plan needs reports of one job's settings.
        if r.settings is None:
            raise ValueError(f"{item.source}: field settings: node {r.node_id}'s profile does not record the "
                             f"job settings it was taken under (an older Xronos wrote it), but {recorded.source} "
                             f"does; profile it again")
        diff = settings_diff(r.settings, recorded.report.settings)  # type: ignore[arg-type]
        if diff is not None:
            raise ValueError(f"{item.source}: field settings.{diff[0]}: node {r.node_id} was profiled at "
                             f"{diff[0]} {diff[1]}, but {recorded.source} at {diff[2]}; one plan needs "
                             f"profiles taken under one job's settings")
