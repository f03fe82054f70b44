"""The command line's flags of the training recipe, generated from the models: one table of flag
<-> field (`RUN` for `xronos run`, a `RunConfig`; `PROFILE` for `xronos profile`, a `ProfileKey`).

A flag's type, choices and whether it is a switch come from its field's annotation, its default
from the model (the CLI passes only what was typed), so a setting's type and bounds are written
once, in `xronos.protocol.recipe`. A row says only what is the command line's own: the flag's name,
its metavar and help, whether the command insists on it where the model has a default (`xronos run`
needs --seed, --max-steps and --export), and a local run's default where it differs from a job's
(a local run holds out no rows and does not clip unless asked). Errors name the flag the user
typed (`flag_of`).
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

_MODEL = object()  # a row's default: the model's own


@dataclass(frozen=True)
class Flag:
    flag: str  # as typed: "--batch-size"
    field: str  # its field's path in the table's model: "recipe.batch_size", "recipe.lora.r"
    metavar: str | None = None
    help: str | None = None
    required: bool = False  # the command insists on it although the model has a default
    default: Any = _MODEL  # the command's default where it differs from the model's
    negate: bool = False  # a switch that sets the field False (--no-shuffle, --no-clip)
    path: bool = False  # a path, made absolute before it goes into the config

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


# LoRA's flags, the same for `xronos run` and `xronos profile` (`prefix` is where the LoraSpec is).
def _lora(prefix: str) -> tuple[Flag, ...]:
    return (
        Flag("--lora-r", f"{prefix}lora.r", "R", "train LoRA adapters of rank R on a frozen base instead of every weight"),
        Flag("--lora-alpha", f"{prefix}lora.alpha", "A", "LoRA scale A / R (default 16)"),
        Flag("--lora-dropout", f"{prefix}lora.dropout", "P", "dropout on the adapters' input"),
        Flag("--lora-targets", f"{prefix}lora.targets", "M1,M2,..",
             "modules to adapt, peft's names (e.g. q_proj,v_proj; c_attn; query,value); default: the family's "
             "(peft's defaults)"),
    )


RUN: tuple[Flag, ...] = (
    Flag("--model", "recipe.model_dir", "DIR", "Hugging Face model directory", path=True),
    Flag("--data", "recipe.data_path", "FILE", "CSV, JSON, JSONL or Parquet file", path=True),
    Flag("--task", "recipe.task"),
    Flag("--batch-size", "recipe.batch_size", "B"),
    Flag("--seq-len", "recipe.seq_len", "S"),
    Flag("--lr", "recipe.lr"),
    Flag("--max-steps", "recipe.max_steps", "K", required=True),
    Flag("--seed", "recipe.seed", required=True),
    Flag("--no-shuffle", "recipe.shuffle", help="consecutive rows instead of a seeded shuffle", negate=True),
    Flag("--dropout", "recipe.dropout", "P", "override every dropout probability"),
    Flag("--weight-decay", "recipe.weight_decay", "W"),
    Flag("--max-grad-norm", "recipe.max_grad_norm", "G", "clip by the global gradient norm", default=None),
    Flag("--warmup-steps", "recipe.warmup_steps", "W", "linear LR warmup steps"),
    Flag("--text-column", "recipe.text_column", "C"),
    Flag("--text-pair-column", "recipe.text_pair_column", "C2"),
    Flag("--label-column", "recipe.label_column", "L",
         "classify: integer ids, or names (ids in sorted order, stored as id2label in the export; their count "
         "is the number of labels when the checkpoint has no head)"),
    Flag("--data-format", "recipe.data_format", None,
         "causal-lm instruction data: 'chat' renders a messages column (lists of {role, content}) with the "
         "tokenizer's chat template, 'prompt-completion' joins two text columns; the loss covers the answers "
         "only (default: text)"),
    Flag("--messages-column", "recipe.messages_column", "C", "with --data-format chat"),
    Flag("--prompt-column", "recipe.prompt_column", "C", "with --data-format prompt-completion"),
    Flag("--completion-column", "recipe.completion_column", "C", "with --data-format prompt-completion"),
    Flag("--threads-per-node", "threads", "T"),
    Flag("--eval-fraction", "recipe.eval_fraction", "F",
         "hold out this tail fraction of the rows for evaluation before/after training", default=0.0),
    Flag("--metrics", "metrics_path", "FILE.json", "write per-iteration metrics of every rank here", path=True),
    Flag("--gloo-timeout", "gloo_timeout_s", "S", "seconds a rank waits in a collective before giving up "
         "(default 300)"),
    Flag("--export", "recipe.export_dir", "OUT",
         "output Hugging Face directory (with --lora-r: a PEFT adapter directory)", required=True, path=True),
    *_lora("recipe."),
    Flag("--export-merged", "recipe.export_merged", None,
         "with --lora-r: also export the merged model (W + scale B A) to OUT/merged"),
    Flag("--export-gguf", "recipe.export_gguf", "{f32,f16,q8_0}",
         "also write OUT/model-TYPE.gguf for llama.cpp (with --lora-r: of the merged model) and an Ollama "
         "Modelfile beside it (causal LMs of the llama, qwen2, qwen3, gpt2 families)"),
    Flag("--shares", "shares", "R1,...,RG",
         "data parallelism: G groups of --nodes/G ranks each (rank r in group r // (--nodes/G)), group g training "
         "R_g rows of every batch (sum = --batch-size, any of them 0); --layout/--units then give each group's "
         "tensor-parallel layout (default: the whole model on every rank); --reshard-at STEP:shares=.. re-splits "
         "the rows live"),
    Flag("--rebalance", "rebalance", None,
         "re-plan live: rank 0 refits every rank's speed per segment kind from the measured compute and moves "
         "the run to a better layout (as --reshard-at does) when the predicted gain is worth the move (with "
         "--shares: re-splits the batch among the groups from each group's measured compute). Off by "
         "default: a local run keeps the layout it was given"),
)

PROFILE: tuple[Flag, ...] = (
    Flag("--task", "task"),
    Flag("--batch-size", "batch_size", "B"),
    Flag("--seq-len", "seq_len", "S"),
    Flag("--no-clip", "clip", help="the job does not clip gradients (leave out the global-norm pass)", negate=True),
    Flag("--weight-decay", "weight_decay", "W", "the job's AdamW weight decay (default 0, as `xronos run`)"),
    *_lora(""),
)


def _bare(annotation: Any) -> Any:
    """The annotation without Optional and Annotated: int, float, str, bool, a Literal, list[...]
    or a model."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def field_info(model: type[BaseModel], path: str):
    """The pydantic FieldInfo at `path` ("recipe.lora.r") of `model`."""
    *parents, name = path.split(".")
    for part in parents:
        model = _bare(model.model_fields[part].annotation)
    return model.model_fields[name]


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",")]


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], table: tuple[Flag, ...]) -> None:
    """One argparse option per row, typed by its field. Unset options stay None, so the model's
    default applies (or the row's)."""
    for row in table:
        info = field_info(model, row.field)
        kind = _bare(info.annotation)
        kw: dict[str, Any] = {"dest": row.dest, "help": _with_default(row, info, kind)}
        if kind is bool:
            kw.update(action="store_true", default=None)
        else:
            required = row.required or (info.is_required() and "lora." not in row.field)
            kw.update(required=required, default=None, metavar=row.metavar)
            if get_origin(kind) is Literal:
                kw["choices"] = list(get_args(kind))
            elif get_origin(kind) in (list, tuple):  # tuple: `--shares 5,3` (the model converts the items)
                kw["type"] = _comma_list
            elif kind in (int, float):
                kw["type"] = kind
        parser.add_argument(row.flag, **{k: v for k, v in kw.items() if v is not None or k == "default"})


def _with_default(row: Flag, info: Any, kind: Any) -> str | None:
    """The row's help with the default it runs with when not typed, and the model's (a job's) where
    the command's own differs (a local run holds out no rows and does not clip)."""
    from pydantic_core import PydanticUndefined

    if kind is bool or row.required or "default" in (row.help or ""):
        return row.help
    model = None if info.default is PydanticUndefined else info.default

    def text(v: Any) -> str:
        return "none" if v is None else ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    if row.default is not _MODEL and row.default != model:
        note = f"default {text(row.default)} here; a job's: {text(model)}"
    elif info.default is PydanticUndefined or model is None:
        return row.help
    else:
        note = f"default {text(model)}"
    return f"{row.help} ({note})" if row.help else note


def collect(args: argparse.Namespace, table: tuple[Flag, ...]) -> dict[str, Any]:
    """The typed values as the model's nested fields (a LoRA flag makes the `lora` part; without
    --lora-r it is refused there, by the model, naming --lora-r)."""
    out: dict[str, Any] = {}
    for row in table:
        value = getattr(args, row.dest)
        if value is None:
            if row.default is _MODEL:
                continue
            value = row.default
        elif row.negate:
            value = not value
        elif row.path:
            value = str(Path(value).resolve())
        *parents, name = row.field.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return out


def flag_of(table: tuple[Flag, ...], loc: tuple) -> str | None:
    """The flag of an error's location (None: not a flag's field)."""
    path = ".".join(str(p) for p in loc if not isinstance(p, int))
    return next((row.flag for row in table if row.field == path), None)


def given(args: argparse.Namespace, table: tuple[Flag, ...], under: str) -> list[str]:
    """The flags typed of the fields under `under` ("recipe.lora."), for an error about that part."""
    return [row.flag for row in table if row.field.startswith(under) and getattr(args, row.dest) is not None]


def argv(table: tuple[Flag, ...], model: BaseModel) -> list[str]:
    """The flags that give `model`'s values (those not at their field's default) back to the
    command of `table`: how `xronos run --strategy` asks `xronos profile` for its recipe's key."""
    out: list[str] = []
    data = model.model_dump()
    for row in table:
        *parents, name = row.field.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(name) is None:
            continue
        value = node[name]
        if row.negate or isinstance(value, bool):
            out += [row.flag] if value != row.negate else []
        else:
            out += [row.flag, ",".join(value) if isinstance(value, list) else repr(value) if isinstance(value, float)
                    else str(value)]
    return out


def problems(errors: list[dict], args: argparse.Namespace, table: tuple[Flag, ...],
             rule_names: tuple[tuple[str, str], ...] = ()) -> str:
    """A model's validation errors as the user typed them: the flag and the value. A rule across
    fields (no location) names its fields itself (`rule_names` turns them into flags), and its input
    would be the whole config: not repeated. A part's required field (LoRA's rank) names the flags
    that asked for the part."""
    from xronos.common.errtext import reason

    out = []
    for e in errors:
        msg = reason(e)
        loc = tuple(p for p in e["loc"] if not isinstance(p, int))
        path = ".".join(loc)
        if not loc or (flag_of(table, loc) is None and any(f.field.startswith(path + ".") for f in table)):
            for name, flag in rule_names:
                msg = msg.replace(name, flag)
            out.append(msg)
            continue
        flag = flag_of(table, loc) or "--" + str(loc[-1]).replace("_", "-")
        if e["type"] == "missing":
            part = ".".join(loc[:-1]) + "."
            out.append(f"{flag}: required by {', '.join(given(args, table, part))}")
        else:
            out.append(f"{flag}: {msg} (got {e.get('input')!r})")
    return "; ".join(out)
