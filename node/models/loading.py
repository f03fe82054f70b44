"""Filling a meta-device TPModel: slice reads from safetensors, or seeded random weights.

A rank reads only its own slices (`safe_open(...).get_slice(name)[...]`), so its peak memory is its
shard plus the replicated layers. Each read maps the file only for that read: safetensors reads
through a memory map of the whole file, and the pages a read touches count in the process's
resident set for as long as the map lives — a column slice touches every page of its tensor, so
one map held over the whole load made every rank resident in the whole checkpoint's blocks (a
GPT-2-medium rank without vocabulary rows: 317 MiB of file pages at the end of its build, its
peak, against 396 MiB of its own tensors; bench/results/mem-peak-v10.md).

The loader sits behind `ShardSource.read(spec)`, so the owner can stream slices over Gloo instead
(a second source with the same protocol).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
import torch.nn as nn
from safetensors import safe_open

from xronos.common.paths import confine_path

from .specs import TensorSpec

log = structlog.get_logger(__name__)

# Prefixes the same tensor carries in the base model vs. a task model (GPT2Model vs GPT2LMHeadModel).
HF_PREFIXES = ("transformer.", "bert.", "roberta.", "model.")


class MissingTensorError(ValueError):
    """The checkpoint lacks the tensor a spec asks for."""


class ShardSource(Protocol):
    def read(self, spec: TensorSpec) -> torch.Tensor:
        """The local tensor for `spec` (raises MissingTensorError when the checkpoint lacks it)."""
        ...


MAX_INDEX_BYTES = 16 * 1024 * 1024


def checkpoint_files(model_dir: str | Path, allowed_dirs: Iterable[str | Path] | None = None) -> list[str]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards a
    `model.safetensors.index.json` names. Shard names must be plain relative names inside the
    directory; with `allowed_dirs` (paths that came from the network), every file, symlinks
    resolved, must lie inside them too. ValueError/FileNotFoundError naming the file otherwise."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            if index.stat().st_size > MAX_INDEX_BYTES:
                raise ValueError(f"larger than {MAX_INDEX_BYTES} bytes")
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to file names")
        except (ValueError, KeyError, TypeError, OSError, RecursionError) as e:
            raise ValueError(f"checkpoint index {index} is unreadable: {e}") from e
        files = sorted(set(weight_map.values()))
        for fname in files:
            parts = Path(fname).parts
            if not fname or Path(fname).is_absolute() or ".." in parts or "\0" in fname:
                raise ValueError(f"checkpoint index {index}: shard file name {fname[:80]!r} is not a plain "
                                 "relative name inside the model directory")
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        # A repository downloaded without its safetensors often has PyTorch's pickles instead: say so.
        pickles = sorted(p.name for p in model_dir.glob("*.bin"))[:3] if model_dir.is_dir() else []
        raise FileNotFoundError(
            f"model dir {model_dir} has no model.safetensors (or model.safetensors.index.json and its shards)"
            + (f"; it has {', '.join(pickles)}: PyTorch pickle files, which are never loaded (download the "
               "model's .safetensors files instead)" if pickles else ""))
    if allowed_dirs is not None:
        allowed = list(allowed_dirs)
        for fname in files:
            confine_path(model_dir / fname, allowed, f"checkpoint file {fname!r} of {model_dir}")
    return files


class SafetensorsSource:
    """Slice reads from `model.safetensors` or an index-sharded checkpoint in `model_dir`."""

    def __init__(self, model_dir: str | Path, allowed_dirs: Iterable[str | Path] | None = None) -> None:
        self.model_dir = Path(model_dir)
        try:
            files = checkpoint_files(self.model_dir, allowed_dirs)
        except FileNotFoundError:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {self.model_dir}") from None
        self._where: dict[str, str] = {}
        for fname in files:
            with self._open(fname) as handle:
                self._where.update((k, fname) for k in handle.keys())
        self.slice_reads = 0  # counters let tests prove no whole partitioned tensor is read
        self.full_reads = 0

    def _open(self, fname: str) -> Any:
        path = self.model_dir / fname
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"unreadable safetensors file {path}: {e}") from e

    def keys(self) -> list[str]:
        return list(self._where)

    def resolve(self, hf_name: str) -> str | None:
        """The checkpoint's name for `hf_name`, with or without a task-model prefix."""
        if hf_name in self._where:
            return hf_name
        for p in HF_PREFIXES:
            if hf_name.startswith(p) and hf_name[len(p):] in self._where:
                return hf_name[len(p):]
        for p in HF_PREFIXES:
            if p + hf_name in self._where:
                return p + hf_name
        return None

    def read(self, spec: TensorSpec) -> torch.Tensor:
        key = self.resolve(spec.hf_name)
        if key is None:
            raise MissingTensorError(f"tensor {spec.hf_name} not found in {self.model_dir}")
        with self._open(self._where[key]) as handle:  # the map, and its touched pages, go at the end
            return self._read(handle.get_slice(key), key, spec)

    def _read(self, sl: Any, key: str, spec: TensorSpec) -> torch.Tensor:
        shape = tuple(sl.get_shape())
        if shape != spec.full_shape:
            raise ValueError(f"tensor {key} in {self.model_dir} has shape {list(shape)}, "
                             f"config.json implies {list(spec.full_shape)}")
        if spec.dim is None:
            self.full_reads += 1
            return sl[tuple(slice(None) for _ in shape)]
        parts = []
        for a, b in spec.segments:
            if b > a:
                self.slice_reads += 1
                parts.append(sl[spec.index(a, b)])
        if not parts:
            return torch.empty(spec.local_shape)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def _generator(*key: object) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(":".join(map(str, key)).encode()))


def fresh_tensor(hf_name: str, shape: tuple[int, ...], kind: str, std: float,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole tensor `hf_name` as a run draws it when the checkpoint lacks it (a LoRA adapter,
    a new task head): seeded by its name, so every engine that trains it starts from the same values."""
    t = torch.empty(shape, dtype=dtype)
    _fill(t, kind, std, _generator("missing", hf_name))
    return t


def _fill(t: torch.Tensor, kind: str, std: float, gen: torch.Generator) -> None:
    if kind == "normal":
        t.copy_(torch.empty(t.shape, dtype=t.dtype).normal_(0.0, std, generator=gen))
    elif kind == "zeros":
        t.zero_()
    elif kind == "ones":
        t.fill_(1.0)
    elif kind == "uniform":  # U(-std, std): a LoRA A's kaiming-uniform bound
        t.copy_(torch.empty(t.shape, dtype=t.dtype).uniform_(-std, std, generator=gen))
    else:
        raise ValueError(f"unknown init kind {kind!r}")


@torch.no_grad()
def materialize(model: nn.Module, source: ShardSource) -> nn.Module:
    """Allocate the meta-device model on CPU and load every local parameter from `source`.

    Tensors a base checkpoint lacks but HF would create fresh (task heads: spec.init set) are drawn
    from a generator seeded by their name, so replicated heads agree on every rank.
    """
    specs = model.tensor_specs()
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        spec = specs[name]
        try:
            t = source.read(spec)
        except MissingTensorError:
            if spec.init is None:
                raise
            # A fresh LoRA adapter is the normal start of a LoRA run, not news.
            (log.debug if ".lora_" in spec.hf_name else log.warning)(
                "initialising tensor absent from checkpoint", tensor=spec.hf_name, init=spec.init)
            full = fresh_tensor(spec.hf_name, spec.full_shape, spec.init, spec.std, param.dtype)
            # a partitioned fresh tensor (a LoRA A of a row layer): this rank's slice of one full draw
            param.copy_(full if spec.dim is None else spec.take(full))
            continue
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"{spec.hf_name}: read shape {list(t.shape)}, local parameter {list(param.shape)}")
        param.copy_(t)
    return model


@torch.no_grad()
def init_random(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Allocate the meta-device model and fill it with seeded random weights (norm weights 1,
    biases 0). Replicated tensors are identical on every rank; a partitioned tensor's values depend
    on its segments, so a random sharded model is not slice-equal to a random unsharded one."""
    specs = model.tensor_specs()
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        spec = specs[name]
        if spec.hf_name.endswith(".bias"):
            kind = "zeros"
        elif len(spec.full_shape) == 1:
            kind = "ones"
        else:
            kind = "normal"
        _fill(param, kind, std, _generator(seed, spec.hf_name, spec.segments))
    return model
