"""Pre-flight checks of a run: everything that can be refused before a process is spawned.

Each check raises ValueError/FileNotFoundError with a message naming the file, field or value.
`preflight` returns what it learned (sizes per segment kind, labels, data sizes) so the caller can report it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xronos.node.data import as_int_labels, as_texts, load_columns, load_tokenizer, split_sizes
from xronos.node.runconfig import DataConfig, RunConfig
from xronos.protocol.layout import Sizes


@dataclass(frozen=True)
class Preflight:
    family: str
    sizes: Sizes  # attention units, MLP columns, vocabulary rows
    num_labels: int | None
    train_rows: int
    eval_rows: int


def read_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model dir {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model dir {model_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def model_sizes(model_dir: str | Path) -> Sizes:
    """Totals per segment kind of the model in `model_dir` (for callers that build a layout)."""
    from xronos.node.models.registry import family_for

    config = read_config(model_dir)
    return family_for(config).sizes(config)


def check_units(units: list[int], nodes: int, H: int) -> None:
    """`--units` (the paper's head-tied unit: attention units, the rest following)."""
    if len(units) != nodes:
        raise ValueError(f"--units has {len(units)} entries {units} but --nodes is {nodes}")
    negative = [u for u in units if u < 0]
    if negative:
        raise ValueError(f"--units {units} has negative entries {negative}")
    if sum(units) != H:
        raise ValueError(f"--units {units} sums to {sum(units)}, but the model has {H} attention units")


def checkpoint_shapes(model_dir: str | Path, allowed_dirs: list | None = None) -> dict[str, tuple[int, ...]]:
    """Every safetensors file's header parses; returns tensor name -> shape (no data is read).
    With `allowed_dirs`, every checkpoint file (an index's shards included) must lie inside them."""
    from safetensors import safe_open

    from xronos.node.models.loading import checkpoint_files

    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir, allowed_dirs)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        path = model_dir / f
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} is missing")
        try:
            with safe_open(str(path), framework="pt") as st:
                shapes.update((k, tuple(st.get_slice(k).get_shape())) for k in st.keys())
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise ValueError(f"checkpoint {path} is unreadable: {exc}") from exc
    return shapes


def check_checkpoint(model_dir: str | Path, config: dict, task: str, allowed_dirs: list | None = None) -> None:
    """The checkpoint holds every tensor the model needs, in the shape config.json implies
    (task heads a base checkpoint lacks are created fresh, as transformers does). With
    `allowed_dirs` (a job from the network), its files must lie inside them."""
    from xronos.node.models.loading import SafetensorsSource
    from xronos.node.models.registry import family_for
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout

    shapes = checkpoint_shapes(model_dir, allowed_dirs)
    family = family_for(config)
    model = family.build(config, task, ShardLayout.single(family.sizes(config)), TPGroup.single())
    source = SafetensorsSource(model_dir, allowed_dirs)
    for spec in model.tensor_specs().values():
        key = source.resolve(spec.hf_name)
        if key is None:
            if spec.init is None:
                raise ValueError(f"checkpoint in {model_dir} lacks tensor {spec.hf_name} needed for {task}")
        elif shapes[key] != tuple(spec.full_shape):
            raise ValueError(f"checkpoint tensor {key} in {model_dir} has shape {list(shapes[key])}, "
                             f"config.json implies {list(spec.full_shape)}")


def check_data(cfg: DataConfig, num_labels: int | None) -> tuple[int, int]:
    cols = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
    if cfg.task == "classify":
        cols.append(cfg.label_column)
    table = load_columns(cfg.data_path, cols)
    for c in cols[: 2 if cfg.text_pair_column else 1]:
        as_texts(table[c], cfg.data_path, c)
    if cfg.task == "classify":
        assert num_labels is not None
        as_int_labels(table[cfg.label_column], cfg.data_path, cfg.label_column, num_labels)
    rows = len(table[cols[0]])
    n_train, n_eval = split_sizes(rows, cfg.eval_fraction)
    if n_train < cfg.batch_size:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than the {n_train} training rows of {cfg.data_path}"
            + (f" ({n_eval} rows held out for evaluation)" if n_eval else "")
        )
    return n_train, n_eval


def preflight(cfg: RunConfig, nodes: int) -> Preflight:
    from xronos.node.models.common import num_labels as labels_of
    from xronos.node.models.registry import family_for

    config = read_config(cfg.model_dir)
    family = family_for(config)
    sizes = family.sizes(config)
    cfg.layout.check(sizes, world_size=nodes)
    max_pos = family.max_positions(config)
    if cfg.seq_len > max_pos:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's maximum of {max_pos} positions")
    num_labels = labels_of(config) if cfg.task == "classify" else None
    family.hf_class(cfg.task)
    check_checkpoint(cfg.model_dir, config, cfg.task)
    load_tokenizer(cfg.model_dir)
    n_train, n_eval = check_data(cfg, num_labels)
    return Preflight(family.name, sizes, num_labels, n_train, n_eval)
