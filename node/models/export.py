"""Consolidation on the owner rank and export as a standard Hugging Face directory.

Only tensors cross the wire: first every rank's segment table (int64), then each partitioned
tensor's local part, point to point to `dst`. Replicated tensors are taken from dst itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout

from .common import num_labels
from .specs import TensorSpec
from .stage import staged

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def _segment_table(specs: Mapping[str, TensorSpec]) -> torch.Tensor:
    return torch.tensor([x for s in specs.values() if s.dim is not None for seg in s.segments for x in seg],
                        dtype=torch.int64)


def _check_segments(spec: TensorSpec, segs: tuple[tuple[int, int], ...], rank: int) -> None:
    size = spec.full_shape[spec.dim]
    if any(not 0 <= a <= b <= size for a, b in segs) or sum(b - a for a, b in segs) > size:
        raise ValueError(f"gather_full: rank {rank} sent segments {list(segs)[:8]} for {spec.hf_name}, "
                         f"outside its {size} rows along dim {spec.dim}: refused")


@torch.no_grad()
def gather_full(source: nn.Module | Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec],
                layout: ShardLayout, group: TPGroup, dst: int = 0) -> dict[str, torch.Tensor]:
    """Full HF-named tensors on `dst` ({} elsewhere). `source` is the model (its parameters) or any
    mapping local name -> tensor shaped like the parameter (e.g. AdamW's exp_avg). Every rank must
    call it with specs built the same way (same order, same segment counts)."""
    local = dict(source.named_parameters()) if isinstance(source, nn.Module) else dict(source)
    missing = [n for n in specs if n not in local]
    if missing:
        raise ValueError(f"gather_full: no tensor for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    table = _segment_table(specs)
    tables: dict[int, torch.Tensor] = {}
    if layout.rank == dst:
        for r in range(layout.world_size):
            if r != dst:
                tables[r] = group.recv(torch.empty_like(table), r)
    else:
        group.send(table, dst)

    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, spec in specs.items():
        t = local[name].detach()
        if spec.dim is None:
            if layout.rank == dst:
                out[spec.hf_name] = t.clone()
            continue
        n_seg = len(spec.segments)
        if layout.rank != dst:
            group.send(t.contiguous(), dst)
        else:
            full = torch.empty(spec.full_shape, dtype=t.dtype)
            spec.place(full, t)
            for r in range(layout.world_size):
                if r == dst:
                    continue
                flat = tables[r][offset:offset + 2 * n_seg].tolist()
                segs = tuple(zip(flat[0::2], flat[1::2]))
                _check_segments(spec, segs, r)  # a peer's table sizes what the owner allocates
                other = TensorSpec(spec.hf_name, spec.dim, segs, spec.full_shape)
                buf = group.recv(torch.empty(other.local_shape, dtype=t.dtype), r)
                other.place(full, buf)
            out[spec.hf_name] = full
        offset += 2 * n_seg
    return out


def save_hf_dir(out_dir: str | Path, config: dict[str, Any], task: str,
                state: Mapping[str, torch.Tensor], tokenizer_src_dir: str | Path | None = None) -> Path:
    """Write config.json (architectures = the task's HF class), model.safetensors and the tokenizer
    files: a directory `AutoModelFor...from_pretrained` loads with no Xronos code. Tied weights are
    stored once, under the embedding's name, as `save_pretrained` does."""
    from .registry import family_for

    out = Path(out_dir)
    family = family_for(config)
    cfg = dict(config)
    cfg["architectures"] = [family.hf_class(task)]
    if task == "classify":
        n = num_labels(cfg)
        if len(cfg.get("id2label") or {}) != n:
            cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(n)}
        cfg["label2id"] = {name: int(i) for i, name in cfg["id2label"].items()}  # always id2label's inverse
        cfg.pop("num_labels", None)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        cfg["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
    with staged(out) as stage:  # never through a link left in the export directory (stage.py)
        save_file({k: v.contiguous() for k, v in state.items()}, str(stage / "model.safetensors"),
                  metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer_src_dir is not None:
            copy_tokenizer(Path(tokenizer_src_dir), stage)
    return out


def copy_tokenizer(src: Path, stage: Path) -> None:
    """The tokenizer files the model directory has (the export loads with no other directory)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, stage / name)
