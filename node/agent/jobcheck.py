"""The owner's checks of a job before anything runs: what the gateway's inspection request gets.

Paths arrive over MQTT, so they are untrusted: each is confined to the node's allowed directories
first. Then the same pre-flight checks `xronos run` does before spawning ranks: config.json names
a supported family, the sequence fits its positions, the checkpoint holds every tensor in the
right shape, the tokenizer loads, the data file has the columns and valid labels (their classes
from the data when the checkpoint has no classification head) or valid instruction rows. The answer
carries the architecture (for profiling on other nodes), H and the number of steps.
`assignment_problem` is every node's check of an Assignment's layout before it starts a rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from xronos.common.paths import confine_path, overlaps
from xronos.protocol.layout import KINDS, NOUN, QUANTA, Layout, LayoutError
from xronos.protocol.messages import Assignment, JobReshard, JobSpec


def _confine_symlinks(model_dir: Path, allowed: list) -> None:
    """Every symlink directly in the model directory (config.json, tokenizer files, ... which
    transformers reads and the export copies) must resolve inside the allowed directories too, as
    the checkpoint's safetensors files must (`checkpoint_files`): a confined directory is no
    confinement if its files may point anywhere (a credential, another job's checkpoint)."""
    try:
        entries = list(os.scandir(model_dir))
    except OSError:
        return  # a missing model dir is reported by the checks that read it
    for e in entries:
        if e.is_symlink():
            confine_path(e.path, allowed, f"spec.recipe.model_dir entry {e.name!r}")


def confined_spec(spec: JobSpec, allowed_dirs: Iterable[str | Path],
                  reserved: Iterable[str | Path] = ()) -> JobSpec:
    """The spec with model_dir, data_path and export_dir resolved inside allowed_dirs.

    The export is written where the spec says, so it may not overwrite what it reads or what the
    node keeps: export_dir may neither be nor contain nor lie inside the base model directory, the
    data file, or any of `reserved` (the node's job directories, which hold every job's checkpoint).
    """
    allowed = list(allowed_dirs)
    out = {field: str(confine_path(getattr(spec.recipe, field), allowed, f"spec.recipe.{field}"))
           for field in ("model_dir", "data_path", "export_dir")}
    _confine_symlinks(Path(out["model_dir"]), allowed)
    export = Path(out["export_dir"])
    for field in ("model_dir", "data_path"):
        if overlaps(export, Path(out[field])):
            raise ValueError(f"spec.recipe.export_dir {spec.recipe.export_dir!r} (resolves to {export}) would "
                             f"overwrite spec.recipe.{field} {out[field]}: export somewhere else")
    for d in reserved:
        root = Path(d).resolve()
        if overlaps(export, root):
            raise ValueError(f"spec.recipe.export_dir {spec.recipe.export_dir!r} (resolves to {export}) overlaps {root}, "
                             "where this node keeps its jobs' checkpoints and profiles: export somewhere else")
    return spec.model_copy(update={"recipe": spec.recipe.model_copy(update=out)})


def inspect_job(spec: JobSpec, allowed_dirs: Iterable[str | Path],
                reserved: Iterable[str | Path] = ()) -> dict[str, Any]:
    """InspectReport fields (without ids) for a job this node would own; ValueError/FileNotFoundError
    naming the problem otherwise."""
    from xronos.node.data.batches import load_tokenizer
    from xronos.node.models.registry import arch_spec, family_for
    from xronos.node.rank.validate import check_checkpoint, check_dataset, check_lora, read_config

    allowed = list(allowed_dirs)
    r = confined_spec(spec, allowed, reserved).recipe
    if not Path(r.data_path).is_file():
        raise FileNotFoundError(f"spec.recipe.data_path {spec.recipe.data_path!r}: no such file on the owner")
    from xronos.node.models.stage import writable_problem

    if (why := writable_problem(r.export_dir)) is not None:  # now, not after the training
        raise ValueError(f"spec.recipe.export_dir {spec.recipe.export_dir!r}: {why} (the service writes only its "
                         "state directory and its unit's ReadWritePaths=)")
    config = read_config(r.model_dir)
    family = family_for(config)
    if r.export_gguf is not None:  # refused here, before any training, naming the family
        from xronos.node.models.gguf import check_gguf
        check_gguf(r.model_dir, config, r.task)
    if r.seq_len > family.max_positions(config):
        raise ValueError(f"spec.recipe.seq_len {r.seq_len} exceeds the model's maximum of "
                         f"{family.max_positions(config)} positions")
    family.hf_class(r.task)
    check_checkpoint(r.model_dir, config, r.task, allowed_dirs=allowed)
    check_lora(config, r.task, r.lora)
    load_tokenizer(r.model_dir)
    source = check_dataset(r, config, allowed)
    n_train, n_eval = source.n_train, source.n_eval
    config.update(source.config_fields())  # the head the job trains: its classes may come from the data
    total = r.total_steps(n_train)
    if r.warmup_steps > total:  # here, where the run's steps are known (epochs need the data's rows)
        raise ValueError(f"spec.recipe.warmup_steps {r.warmup_steps} is longer than the run: {total} steps "
                         f"({n_train} training rows, batch {r.batch_size}); the learning rate would never reach lr")
    return {"arch": arch_spec(config, r.task), "train_rows": n_train, "eval_rows": n_eval,
            "total_steps": total}


def check_layout_cuts(layout: Layout, quanta: dict[str, int] = QUANTA) -> None:
    """What can be checked of a layout without the model: every cut between ranks falls on the
    kind's quantum, except at the end of the kind (the counts' sum). LayoutError naming the kind."""
    for k in KINDS:
        counts, cut = layout.counts(k), 0
        total = sum(counts)
        if total == 0:
            raise LayoutError(f"{k}: counts {list(counts)} assign no {NOUN[k]} at all")
        for r, c in enumerate(counts[:-1]):
            cut += c
            if cut % quanta[k] and cut != total:
                raise LayoutError(f"{k}: the cut after rank {r} falls at {cut}, not a multiple of the "
                                  f"{NOUN[k]} quantum {quanta[k]} (only the last holder of a kind may "
                                  f"hold a remainder)")


def assignment_problem(a: Assignment, spec: JobSpec) -> str | None:
    """Why a node must refuse Assignment `a`'s layout before starting its rank, or None.

    Every node checks what it can without the model: one count per rank of the world, every kind
    cut on its quantum. The owner (rank 0), which has the model (`spec` holds its confined
    paths), also checks that each kind's counts sum to the model's size — so a job whose plan does
    not fit its model is refused by its owner and never starts. (A model the owner cannot read is
    not a layout problem: the gateway's inspection refuses it, and a rank reports it.)"""
    layout = a.layout
    tp = a.world_size // len(a.shares) if a.shares else a.world_size  # with shares: each TP group's layout
    try:
        if layout.world_size != tp:
            raise LayoutError(f"layout has {layout.world_size} ranks but the world has {a.world_size}")
        check_layout_cuts(layout)
        sizes = _model_sizes(spec.recipe.model_dir) if a.rank == 0 else None
        if sizes is not None:
            layout.check(sizes, world_size=tp)
    except LayoutError as exc:
        return f"layout {layout.to_text()}: {exc}"
    return None


def reshard_problem(c: JobReshard, a: Assignment) -> None:
    """ValueError naming the field when the owner must refuse re-shard order `c` of its running job
    `a`, before it reaches the ranks: a tensor-parallel job's layout must be of its world (and it
    has no shares to re-split); a data-parallel job (`a.shares`) keeps its layout live and re-splits
    its batch — one share per data-parallel group, rows >= 0 summing to the batch. (The counts
    against the model are every rank's check at the boundary, `relayout`.)"""
    head = f"reshard for {c.job_id} v{c.plan_version}"
    if a.shares is None:
        if c.shares is not None:
            raise ValueError(f"{head}: shares {c.shares}: the job is tensor-parallel (no data-parallel groups), "
                             "its live change is a layout")
        if c.layout.world_size != a.world_size:
            raise ValueError(f"reshard for {c.job_id}: layout has {c.layout.world_size} ranks, the job {a.world_size}")
        return
    if c.layout != a.layout:
        raise ValueError(f"{head}: layout {c.layout.to_text()} differs from the job's {a.layout.to_text()}: a "
                         "data-parallel job keeps its layout live (it re-splits its batch: shares)")
    if c.shares is None:
        raise ValueError(f"{head}: shares missing: a data-parallel job's live change is a new split of its batch")
    if len(c.shares) != len(a.shares):
        raise ValueError(f"{head}: shares {c.shares} name {len(c.shares)} data-parallel groups, the job has "
                         f"{len(a.shares)}")
    batch = a.spec.recipe.batch_size
    if sum(c.shares) != batch:
        raise ValueError(f"{head}: shares {c.shares} sum to {sum(c.shares)} rows, the batch has {batch}")


def _model_sizes(model_dir: str):
    from xronos.node.models.registry import family_for
    from xronos.node.rank.validate import read_config

    try:
        config = read_config(model_dir)
        return family_for(config).sizes(config)
    except (OSError, ValueError):
        return None
