"""Consolidated checkpoints on the owner: weights and AdamW state as full HF-named tensors.

Every `checkpoint_interval` steps all ranks call `save_checkpoint`; `gather_full` brings every
partitioned tensor to the owner, which writes
  <dir>/model.safetensors + config.json    the weights (a loadable HF directory, like the export)
  <dir>/optimizer.safetensors              "exp_avg.<hf name>", "exp_avg_sq.<hf name>"
  <dir>/state.json                         step, epoch, seed, plan version and layout, ...
                                           (layout: {"attn": [...], "mlp": [...], "vocab": [...]},
                                           the protocol Layout it was saved under: `saved_layout`)
into a fresh directory that then replaces the current checkpoint by rename; the one it replaces is
kept as `<dir>.prev` (one older checkpoint, no more: a save already needs room for two). A job's
gateway may name that one as the resume point: it decides the instant a node drops, and the owner
can finish writing the next checkpoint (its peers' slices were already gathered) before the
gateway hears of it (`find_checkpoint`). Because everything is
stored unsharded, a resume may use a different plan: the owner serves each rank its new slices of
weights *and* optimizer moments through the same spec table (`CheckpointSource` + streaming).
The data order needs no state of its own: batches are a pure function of (seed, step).

A LoRA run's checkpoint holds only what it trains — the adapters (and a classification head) and
their moments — in model.safetensors: its frozen base never changes, so a resume reads the base
from the base checkpoint (`CheckpointSource(..., base_dir=...)`) and writes cost megabytes, not the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xronos.node.rank.gradnorm import all_finite
from xronos.node.models.export import gather_full, save_hf_dir
from xronos.node.models.loading import MissingTensorError, SafetensorsSource, ShardSource
from xronos.node.models.specs import TensorSpec
from xronos.node.models.stage import ordinary_mode, umask
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.protocol.layout import Layout, LayoutError, Sizes

MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
FORMAT = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@torch.no_grad()
def save_checkpoint(ckpt_dir: str | Path, model: torch.nn.Module, specs: dict[str, TensorSpec],
                    layout: ShardLayout, group: TPGroup, opt: torch.optim.Optimizer,
                    config: dict[str, Any], task: str, meta: dict[str, Any]) -> Path | None:
    """Collective: every rank calls it; the owner (rank 0) writes. Returns the directory on rank 0."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # what the optimizer steps
    trained = {n: specs[n] for n in params}
    lora = getattr(model, "lora", None) is not None  # the frozen base is not saved again
    weights = gather_full(model, trained if lora else specs, layout, group, dst=0)
    moments: dict[str, torch.Tensor] = {}
    for m in MOMENTS:
        local = {n: opt.state[p][m] for n, p in params.items()}
        moments.update({f"{m}.{k}": v for k, v in gather_full(local, trained, layout, group, dst=0).items()})
    if layout.rank != 0:
        return None
    if not all_finite(weights.values()):  # the step's update overflowed: keep the last good checkpoint
        from xronos.node.rank.lifecycle import JobFault

        raise JobFault(f"step {meta.get('step')}: the weights are not finite (inf or nan): checkpoint not "
                       "written, the previous one kept")
    final = Path(ckpt_dir)
    tmp, old, prev = (final.with_name(final.name + s) for s in (".tmp", ".old", ".prev"))
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_dir(tmp, config, task, weights)
    save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / OPTIMIZER_FILE))
    (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT, **meta}, indent=1))
    mode = 0o666 & ~umask()
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            ordinary_mode(fh.fileno(), mode)  # optimizer.safetensors too: not save_file's 0600
            os.fsync(fh.fileno())
    if old.exists():  # a swap cut short: `old` is the newest complete one, or the previous one
        if final.exists():
            _keep_as_previous(old, prev)
        else:
            old.rename(final)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old.exists():
        _keep_as_previous(old, prev)
    return final


def _keep_as_previous(old: Path, prev: Path) -> None:
    shutil.rmtree(prev, ignore_errors=True)
    old.rename(prev)
    _fsync_dir(prev.parent)


MAX_STATE_BYTES = 1024 * 1024


def _read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's state.json, checked: ValueError naming the file and the field otherwise."""
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        meta = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not a readable checkpoint state: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a readable checkpoint state: expected a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT}")
    for field in ("step", "epoch", "plan_version"):
        value = meta.get(field)
        if type(value) is not int or not 0 <= value < 2**31:
            raise ValueError(f"{path}: field {field}: expected an integer in [0, 2**31), got {str(value)[:40]!r}")
    return meta


def read_meta(ckpt_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint's state.json (falling back to the previous one if a swap was cut short)."""
    for d in (Path(ckpt_dir), Path(str(ckpt_dir) + ".old")):
        path = d / STATE_FILE
        if path.is_file():
            return {**_read_state(path), "dir": str(d)}
    return None


def find_checkpoint(ckpt_dir: str | Path, step: int) -> dict[str, Any]:
    """The state.json (with its "dir") of the checkpoint of `step`: the current one or the one
    kept before it. ValueError naming the steps found otherwise."""
    found = []
    for d in (Path(ckpt_dir), *(Path(str(ckpt_dir) + s) for s in (".old", ".prev"))):
        path = d / STATE_FILE
        if path.is_file():
            meta = _read_state(path)
            if meta["step"] == step:
                return {**meta, "dir": str(d)}
            found.append(meta["step"])
    raise ValueError(f"no checkpoint at step {step} in {ckpt_dir} (found steps {sorted(set(found)) or 'none'})")


def saved_layout(meta: dict[str, Any]) -> Layout | None:
    """The per-segment layout a checkpoint was saved under (None if its state.json has none)."""
    raw = meta.get("layout")
    if raw is None:
        return None
    try:
        return Layout.from_data(raw)
    except LayoutError as exc:
        raise ValueError(f"{meta.get('dir')}/{STATE_FILE}: field layout is not a layout: {exc}") from None


def check_saved_layout(meta: dict[str, Any], sizes: Sizes) -> None:
    """A checkpoint's layout must cover this model's sizes (else it was saved for another model).
    Resuming under another layout is fine: the checkpoint is stored unsharded."""
    old = saved_layout(meta)
    if old is None:
        return
    try:
        old.check(sizes, quanta=None)
    except LayoutError as exc:
        raise ValueError(f"checkpoint in {meta.get('dir')} was saved under layout {old.describe()}, which does "
                         f"not fit this model ({sizes.describe()}): {exc}") from None


class CheckpointSource:
    """Owner-side source over a checkpoint: weights by HF name, moments as "<moment>.<HF name>".
    With `base_dir`, a weight the checkpoint lacks (a LoRA run's frozen base) is read from there."""

    def __init__(self, ckpt_dir: str | Path, base_dir: str | Path | None = None,
                 allowed_dirs: list[str] | None = None) -> None:
        self.dir = Path(ckpt_dir)
        self.weights = SafetensorsSource(self.dir)
        self.base = SafetensorsSource(base_dir, allowed_dirs) if base_dir is not None else None
        self._opt = safe_open(str(self.dir / OPTIMIZER_FILE), framework="pt")
        self._opt_keys = set(self._opt.keys())

    def read(self, spec: TensorSpec) -> torch.Tensor:
        if spec.hf_name.split(".", 1)[0] not in MOMENTS:
            if self.base is not None and self.weights.resolve(spec.hf_name) is None:
                return self.base.read(spec)
            return self.weights.read(spec)
        if spec.hf_name not in self._opt_keys:
            raise MissingTensorError(f"optimizer state {spec.hf_name} not in {self.dir}")
        sl = self._opt.get_slice(spec.hf_name)
        if tuple(sl.get_shape()) != spec.full_shape:
            raise ValueError(f"{spec.hf_name} in {self.dir}: shape {sl.get_shape()}, expected {spec.full_shape}")
        return spec.take(sl) if spec.dim is not None else sl[tuple(slice(None) for _ in spec.full_shape)]


@torch.no_grad()
def load_moments(opt: torch.optim.Optimizer, model: torch.nn.Module, specs: dict[str, TensorSpec],
                 source: ShardSource, step: int) -> None:
    """Give every trained local parameter its slice of the saved AdamW moments and the step count."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        spec = specs[name]
        state: dict[str, torch.Tensor] = {"step": torch.tensor(float(step))}
        for m in MOMENTS:
            t = source.read(TensorSpec(f"{m}.{spec.hf_name}", spec.dim, spec.segments, spec.full_shape))
            state[m] = t.to(p.dtype).reshape(p.shape).clone()
        opt.state[p] = state


def remove_checkpoints(ckpt_dir: str | Path) -> list[str]:
    """Remove a finished job's checkpoints (`ckpt_dir` and the ones kept beside it, `.prev`, and
    what a save killed half-way left, `.old`, `.tmp`): a completed job resumes from none of them, and
    a full fine-tune's weights with AdamW's moments are three times the model on the node's disk.
    Return the paths removed. Only a directory (not a link) is removed."""
    import shutil

    removed = []
    for d in (Path(ckpt_dir), *(Path(str(ckpt_dir) + s) for s in (".prev", ".old", ".tmp"))):
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
            removed.append(str(d))
    return removed
