"""Class labels of a classification run (`xronos.node.data.batches` reads the rows).

Class labels (classify) are integer ids or strings (names). Names get ids in sorted (code point)
order of the distinct names of the training rows — unless config.json names its labels
(`id2label` other than transformers' LABEL_i), whose ids are then kept. The number of labels is
the checkpoint's when it has a classification head; without one it comes from the data (names:
their count; integer ids: at least config.json's count, or the largest training id + 1). A label
of an evaluation row that no training row has is refused. `LabelSpace.config_fields` is what
config.json gets (num_labels, id2label, label2id): every rank builds its head from it, and the
export carries it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, StringConstraints, field_validator
from pydantic.dataclasses import dataclass as checked_dataclass

from xronos.node.tp.group import TPGroup


MAX_LABELS = 4096  # distinct classes of a classification run
MAX_LABEL_CHARS = 256  # a label name (as the protocol's labels)


def short_repr(v: Any) -> str:
    """A value as an error message quotes it (at most 60 characters)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_int(v: Any) -> int | None:
    """An integer label (an int, or a float holding one, as CSV readers produce), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def default_label_names(n: int) -> tuple[str, ...]:
    return tuple(f"LABEL_{i}" for i in range(n))


def config_label_names(config: dict[str, Any]) -> tuple[str, ...] | None:
    """config.json's label names in id order, when it names its labels (an id2label over 0..n-1
    other than transformers' LABEL_i defaults); None otherwise."""
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        return None
    try:
        items = sorted((int(k), v) for k, v in id2label.items())
    except (TypeError, ValueError):
        return None
    names = tuple(v for _, v in items)
    if [k for k, _ in items] != list(range(len(items))) or not all(isinstance(v, str) for v in names) \
            or len(set(names)) != len(names) or names == default_label_names(len(names)):
        return None
    return names


LabelName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_LABEL_CHARS)]


# A pydantic dataclass: built by the owner from its data, and checked field by field when a rank
# receives it inside the runtime's Facts (JSON arrays become the tuple; strings and the flag are
# taken as they are, never coerced).
@checked_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class LabelSpace:
    """The classes of a classification run, as the owner decided them: id -> name, and whether the
    data's labels are the names (strings) or the ids (integers)."""

    names: Annotated[tuple[LabelName, ...], Field(min_length=1, max_length=MAX_LABELS)]
    by_name: StrictBool

    @field_validator("names")
    @classmethod
    def _distinct(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(names)) != len(names):
            raise ValueError("label names must be distinct")
        return names

    @property
    def num_labels(self) -> int:
        return len(self.names)

    def config_fields(self) -> dict[str, Any]:
        """What config.json gets: every rank builds its head from it, and the export carries it."""
        return {"num_labels": self.num_labels, "id2label": {str(i): n for i, n in enumerate(self.names)},
                "label2id": {n: i for i, n in enumerate(self.names)}}

    def encode(self, values: list, path: str | Path, column: str, n_train: int) -> list[int]:
        """The ids of every row's label (rows from n_train on are the held-out evaluation rows)."""
        def where(row: int) -> str:
            return f"data file {path}: column {column!r} row {row}" + (
                " (held out for evaluation)" if row >= n_train else "")

        if not self.by_name:
            out = []
            for row, v in enumerate(values):
                i = _as_int(v)
                if i is None:
                    raise ValueError(f"{where(row)} has non-integer label {short_repr(v)}")
                if not 0 <= i < self.num_labels:
                    raise ValueError(f"{where(row)} has label {i} outside [0, {self.num_labels})")
                out.append(i)
            return out
        ids = {n: i for i, n in enumerate(self.names)}
        out = []
        for row, v in enumerate(values):
            if v not in ids:
                known = list(self.names[:10]) + (["..."] if len(self.names) > 10 else [])
                raise ValueError(f"{where(row)} has label {short_repr(v)}, which no training row has "
                                 f"(the labels: {known})")
            out.append(ids[v])
        return out


def as_written(values: list) -> list:
    """A label column's values as the file wrote them: a CSV reader (and JSON's true/false) makes
    booleans of "True"/"False", which are names, not integer ids."""
    return [str(v) if isinstance(v, bool) else v for v in values]


def decide_labels(values: list, n_train: int, config: dict[str, Any], head: bool, path: str | Path,
                  column: str) -> LabelSpace:
    """The classes of `values` (every row's label; the first n_train are the training rows) for a
    checkpoint whose config.json is `config` and which does (`head`) or does not hold a
    classification head. ValueError naming the row or the labels otherwise."""
    from xronos.node.models.common import num_labels

    def where(row: int) -> str:
        return f"data file {path}: column {column!r} row {row}"

    first_name = first_int = None
    # A CSV column mixing ids and names is read as text throughout ("1" beside "pos"): there an id
    # written as text counts as an id, so that the mix is refused as it is in a JSON file.
    texts = [isinstance(v, str) and v.strip().lstrip("-").isdigit() for v in values]
    mixed = any(texts) and any(isinstance(v, str) and not t for v, t in zip(values, texts))
    for row, v in enumerate(values):
        if v is None:
            raise ValueError(f"{where(row)} has no label")
        if mixed and texts[row]:
            first_int = row if first_int is None else first_int
        elif isinstance(v, str):
            if not v.strip():
                raise ValueError(f"{where(row)} has an empty label")
            if len(v) > MAX_LABEL_CHARS:
                raise ValueError(f"{where(row)} has a label of {len(v)} characters (at most {MAX_LABEL_CHARS})")
            first_name = row if first_name is None else first_name
        elif _as_int(v) is not None:
            first_int = row if first_int is None else first_int
        else:
            raise ValueError(f"{where(row)} has non-integer label {short_repr(v)}")
        if first_name is not None and first_int is not None:
            raise ValueError(f"{where(max(first_name, first_int))}: the column mixes label names "
                             f"({short_repr(values[first_name])}, row {first_name}) and integer ids "
                             f"({short_repr(values[first_int])}, row {first_int}); use one or the other")
    if first_name is not None:  # "pos" and "pos " would be two classes: a typo, never meant
        alike: dict[str, set[str]] = {}
        for v in values:
            if isinstance(v, str):
                alike.setdefault(v.strip(), set()).add(v)
        twins = next((sorted(s) for s in alike.values() if len(s) > 1), None)
        if twins is not None:
            raise ValueError(f"data file {path}: column {column!r} has labels {', '.join(short_repr(t) for t in twins[:3])} "
                             "that differ only in leading or trailing spaces; a label is taken as written, so "
                             "they would be different classes: make them one")
    n_config = num_labels(config)
    named = config_label_names(config)
    train = values[:n_train]
    if first_name is None:  # integer ids
        n = n_config
        if not head and train:
            top = max(range(len(train)), key=lambda r: _as_int(train[r]))
            n = max(n, _as_int(train[top]) + 1)
            if n > MAX_LABELS:
                raise ValueError(f"{where(top)} has label {n - 1}: at most {MAX_LABELS} classes are supported")
        names = named if named is not None and len(named) == n else default_label_names(n)
        space = LabelSpace(names, by_name=False)
    elif named is not None:  # names, and config.json names its labels: keep its ids
        unknown = sorted(set(train) - set(named))
        if unknown:
            raise ValueError(f"data file {path}: column {column!r} has label(s) {[u[:60] for u in unknown[:5]]} "
                             f"that config.json's id2label does not name (it names {list(named[:10])})")
        space = LabelSpace(named, by_name=True)
    else:  # names: ids in sorted order
        distinct = sorted(set(train))
        if len(distinct) > MAX_LABELS:
            raise ValueError(f"data file {path}: column {column!r} has {len(distinct)} distinct labels in its "
                             f"training rows, more than the {MAX_LABELS} supported (is it the label column?)")
        if head:
            if len(distinct) > n_config:
                raise ValueError(f"data file {path}: column {column!r} has {len(distinct)} distinct labels in "
                                 f"its training rows, but the checkpoint's classification head has {n_config} "
                                 "outputs")
            names = tuple(distinct) + tuple(f"LABEL_{i}" for i in range(len(distinct), n_config))
            if len(set(names)) != len(names):
                raise ValueError(f"data file {path}: column {column!r}: label names {distinct} collide with "
                                 "the head's unnamed outputs LABEL_i")
        else:
            if len(distinct) < 2:
                held = (f" ({n_train} of its {len(values)} rows train, the rest are held out for evaluation: "
                        "a smaller eval fraction leaves more)" if n_train < len(values) else "")
                raise ValueError(f"data file {path}: column {column!r} has {len(distinct)} distinct label(s) "
                                 f"{distinct} in its training rows; classification needs at least 2{held}")
            names = tuple(distinct)
        space = LabelSpace(names, by_name=True)
    space.encode(values, path, column, n_train)  # every row, the evaluation rows included
    return space


def label_head_in_checkpoint(model_dir: str | Path, config: dict[str, Any],
                             allowed_dirs: list | None = None) -> bool:
    """Whether the checkpoint in `model_dir` holds a classification head: any tensor whose shape
    depends on the number of labels (found by building the model on the meta device twice)."""
    from xronos.node.models.loading import SafetensorsSource
    from xronos.node.models.registry import family_for
    from xronos.node.tp.layout import ShardLayout

    family = family_for(config)
    layout = ShardLayout.single(family.sizes(config))

    def shapes(n: int) -> dict[str, tuple[int, ...]]:
        c = {k: v for k, v in config.items() if k not in ("id2label", "label2id")}
        model = family.build(dict(c, num_labels=n), "classify", layout, TPGroup.single())
        return {s.hf_name: s.full_shape for s in model.tensor_specs().values()}

    two, three = shapes(2), shapes(3)
    head = [name for name, shape in two.items() if three.get(name) != shape]
    source = SafetensorsSource(model_dir, allowed_dirs)
    return any(source.resolve(name) is not None for name in head)
