"""Pre-flight checks of a run: everything that can be refused before a process is spawned.

Each check raises ValueError/FileNotFoundError with a message naming the file, field or value.
`preflight` returns what it learned (sizes per segment kind, labels, data sizes) so the caller can report it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xronos.node.data.batches import BatchSource, load_tokenizer, owner_batches
from xronos.node.data.labels import LabelSpace
from xronos.node.runconfig import RunConfig
from xronos.protocol.recipe import LoraSpec, Recipe
from xronos.protocol.layout import Sizes


@dataclass(frozen=True)
class Preflight:
    family: str
    sizes: Sizes  # attention units, MLP columns, vocabulary rows
    num_labels: int | None
    train_rows: int
    eval_rows: int
    labels: LabelSpace | None = None  # classify: the classes the run trains (names, and whether the data names them)


MAX_CONFIG_BYTES = 1024 * 1024  # real configs are a few KiB


def read_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        if model_dir.exists():
            raise FileNotFoundError(f"model dir {model_dir} is not a directory (a Hugging Face model is a "
                                    "directory: config.json, safetensors, tokenizer)")
        raise FileNotFoundError(f"model dir {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model dir {model_dir} has no config.json")
    # Read in the node service itself (job inspection): a huge file there is an OOM of the service.
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is {size} bytes; a model's config.json is at most {MAX_CONFIG_BYTES} bytes")
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


def check_lora(config: dict, task: str, lora: LoraSpec | None):
    """A LoRA run's options on this model, before any process starts: the family supports LoRA,
    the targets are module names it has (the error names those it has), r fits every adapted
    layer (r <= min(in, out features)). Returns the LoraSettings (None: full fine-tuning)."""
    from xronos.node.models.registry import family_for
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.tp.lora import add_lora

    family = family_for(config)
    settings = family.lora_settings(lora)
    if settings is not None:  # on the meta device: shapes only, no storage
        add_lora(family.build(config, task, ShardLayout.single(family.sizes(config)), TPGroup.single()), settings)
    return settings


def check_dataset(cfg: Recipe, config: dict, allowed_dirs: list | None = None) -> BatchSource:
    """The data of a run on the checkpoint in cfg.model_dir (config.json `config`), read as its
    owner will read it (`owner_batches`, the runtime's own): columns, texts, the classes (from the
    data when the checkpoint has no classification head), instruction rows rendered and tokenised
    (each keeps an answer token), enough training rows for a batch. Returns the checked source
    (row counts, `label_space`, `config_fields`)."""
    source = owner_batches(cfg, config, allowed_dirs)
    source.check_all_rows()
    n_train, n_eval = source.n_train, source.n_eval
    if n_train < cfg.batch_size:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than the {n_train} training rows of {cfg.data_path}"
            + (f" ({n_eval} rows held out for evaluation)" if n_eval else "")
        )
    return source


def preflight(cfg: RunConfig, nodes: int) -> Preflight:
    from xronos.node.models.gguf import check_gguf
    from xronos.node.models.registry import family_for

    r = cfg.recipe
    config = read_config(r.model_dir)
    family = family_for(config)
    if r.export_gguf is not None:  # before training, not after it: the family, task and tokenizer
        try:
            check_gguf(r.model_dir, config, r.task)
        except ValueError as exc:
            raise ValueError(f"--export-gguf {r.export_gguf}: {str(exc).removeprefix('export_gguf: ')}") from None
    sizes = family.sizes(config)
    cfg.layout.check(sizes, world_size=nodes)
    for move in cfg.reshard_at:
        if move.layout is None:  # a data-parallel re-split (shares, checked by RunConfig): the layout stays
            continue
        try:
            move.layout.check(sizes, world_size=nodes)
        except ValueError as exc:
            raise type(exc)(f"--reshard-at {move.step}: {exc}") from None
    max_pos = family.max_positions(config)
    if r.seq_len > max_pos:
        raise ValueError(f"--seq-len {r.seq_len} exceeds the model's maximum of {max_pos} positions")
    family.hf_class(r.task)
    check_checkpoint(r.model_dir, config, r.task)
    check_lora(config, r.task, r.lora)
    load_tokenizer(r.model_dir)
    source = check_dataset(r, config)
    labels = source.label_space
    return Preflight(family.name, sizes, labels.num_labels if labels else None, source.n_train, source.n_eval,
                     labels)
