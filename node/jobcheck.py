"""The owner's checks of a job before anything runs: what the gateway's inspection request gets.

Paths arrive over MQTT, so they are untrusted: each is confined to the node's allowed directories
first. Then the same pre-flight checks `xronos run` does before spawning ranks: config.json names
a supported family, the sequence fits its positions, the checkpoint holds every tensor in the
right shape, the tokenizer loads, the data file has the columns and integer labels. The answer
carries the architecture (for profiling on other nodes), H and the number of steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from xronos.protocol.messages import JobSpec
from xronos.protocol.paths import confine_path


def total_steps(spec: dict[str, Any], n_train: int) -> int:
    """Steps of the job: max_steps, or epochs of full batches, whichever ends first."""
    per_epoch = n_train // spec["batch_size"]
    limits = [s for s in (spec.get("max_steps"), spec["epochs"] * per_epoch if spec.get("epochs") else None)
              if s is not None]
    return min(limits)


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def confined_spec(spec: JobSpec, allowed_dirs: Iterable[str | Path],
                  reserved: Iterable[str | Path] = ()) -> dict[str, Any]:
    """The spec (JSON form) with model_dir, data_path and export_dir resolved inside allowed_dirs.

    The export is written where the spec says, so it may not overwrite what it reads or what the
    node keeps: export_dir may neither be nor contain nor lie inside the base model directory, the
    data file, or any of `reserved` (the node's job directories, which hold every job's checkpoint).
    """
    allowed = list(allowed_dirs)
    out = spec.model_dump(mode="json")
    for field in ("model_dir", "data_path", "export_dir"):
        out[field] = str(confine_path(out[field], allowed, f"spec.{field}"))
    export = Path(out["export_dir"])
    for field in ("model_dir", "data_path"):
        if _overlap(export, Path(out[field])):
            raise ValueError(f"spec.export_dir {spec.export_dir!r} (resolves to {export}) would overwrite "
                             f"spec.{field} {out[field]}: export somewhere else")
    for d in reserved:
        root = Path(d).resolve()
        if _overlap(export, root):
            raise ValueError(f"spec.export_dir {spec.export_dir!r} (resolves to {export}) overlaps {root}, "
                             "where this node keeps its jobs' checkpoints and profiles: export somewhere else")
    return out


def inspect_job(spec: JobSpec, allowed_dirs: Iterable[str | Path],
                reserved: Iterable[str | Path] = ()) -> dict[str, Any]:
    """InspectReport fields (without ids) for a job this node would own; ValueError/FileNotFoundError
    naming the problem otherwise."""
    from xronos.node.data import load_tokenizer
    from xronos.node.jobproc import spec_run_config
    from xronos.node.models.common import num_labels
    from xronos.node.models.registry import arch_spec, family_for
    from xronos.node.validate import check_checkpoint, check_data, read_config

    allowed = list(allowed_dirs)
    s = confined_spec(spec, allowed, reserved)
    if not Path(s["data_path"]).is_file():
        raise FileNotFoundError(f"spec.data_path {spec.data_path!r}: no such file on the owner")
    config = read_config(s["model_dir"])
    family = family_for(config)
    H = family.num_units(config)
    if spec.seq_len > family.max_positions(config):
        raise ValueError(f"spec.seq_len {spec.seq_len} exceeds the model's maximum of "
                         f"{family.max_positions(config)} positions")
    family.hf_class(spec.task)
    check_checkpoint(s["model_dir"], config, spec.task, allowed_dirs=allowed)
    load_tokenizer(s["model_dir"])
    run = spec_run_config(s, units=[H], rank=0, host="127.0.0.1", port=1, threads=1, gloo_timeout_s=1.0)
    n_train, n_eval = check_data(run, num_labels(config) if spec.task == "classify" else None)
    return {"arch": arch_spec(config, spec.task), "units": H, "train_rows": n_train, "eval_rows": n_eval,
            "total_steps": total_steps(s, n_train)}
