"""Training data: the owner rank reads the file, orders the batches, tokenises on demand, and
every rank receives each batch as tensors.

Only rank 0 ever builds a `BatchSource`; a `BatchChannel` brings each batch to every rank. Batches
are consecutive rows (no shuffle) or a seeded shuffle with a new permutation per epoch, always of
exactly `batch_size` rows (the last incomplete batch of an epoch is dropped). The evaluation set is
the held-out tail of the file.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from xronos.node.runconfig import DataConfig
from xronos.node.tp.group import TPGroup

IGNORE_INDEX = -100
_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json"}
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                "sentencepiece.bpe.model")


def load_columns(path: str | Path, columns: list[str]) -> dict[str, list]:
    """The named columns of a CSV/JSON/JSONL file as lists (ValueError naming what is missing)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"data file {path}: unsupported extension {path.suffix!r} (csv, json, jsonl)")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for unparsable files
        raise ValueError(f"data file {path} could not be read as {builder}: {exc}") from exc
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(
            f"data file {path} lacks column(s) {missing}; it has {table.column_names}"
        )
    return table.select_columns(columns).to_dict()


def as_int_labels(values: list, path: str | Path, column: str, num_labels: int) -> list[int]:
    """Class labels must be integers in [0, num_labels); name the first row that is not."""
    out = []
    for row, v in enumerate(values):
        ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok and isinstance(v, float) and v.is_integer():
            v, ok = int(v), True
        if not ok:
            raise ValueError(f"data file {path}: column {column!r} row {row} has non-integer label {v!r}")
        if not 0 <= v < num_labels:
            raise ValueError(
                f"data file {path}: column {column!r} row {row} has label {v} outside [0, {num_labels})"
            )
        out.append(v)
    return out


def split_sizes(rows: int, eval_fraction: float) -> tuple[int, int]:
    """(train rows, eval rows): the eval set is the tail, at least one row when asked for."""
    n_eval = max(1, round(rows * eval_fraction)) if eval_fraction > 0 else 0
    return rows - n_eval, n_eval


def batch_order(n_rows: int, batch_size: int, shuffle: bool, seed: int) -> Iterator[tuple[int, list[int]]]:
    """Endless (epoch, row indices) of full batches; one torch.Generator seeded once, a new
    permutation per epoch."""
    per_epoch = n_rows // batch_size
    assert per_epoch > 0, "validated: batch size <= train rows"
    gen = torch.Generator().manual_seed(seed)
    epoch = 0
    while True:
        order = torch.randperm(n_rows, generator=gen) if shuffle else torch.arange(n_rows)
        for b in range(per_epoch):
            yield epoch, order[b * batch_size : (b + 1) * batch_size].tolist()
        epoch += 1


def load_tokenizer(model_dir: str | Path):
    """The model directory's tokenizer, with EOS as the pad token when it has none."""
    from transformers import AutoTokenizer

    # transformers quietly builds an empty tokenizer from config.json alone; refuse that.
    if not any((Path(model_dir) / f).is_file() for f in _VOCAB_FILES):
        raise ValueError(f"model dir {model_dir}: tokenizer could not be loaded: none of {list(_VOCAB_FILES)}")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ValueError(f"model dir {model_dir}: tokenizer could not be loaded: {exc}") from exc
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"model dir {model_dir}: tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return tok


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # classify [B] long; causal-lm [B, S] long, -100 on padding
    token_type_ids: torch.Tensor | None = None  # [B, S] long, when the tokenizer produces them

    def inputs(self) -> dict[str, torch.Tensor]:
        """As transformers' keyword arguments (token_type_ids only when the tokenizer makes them)."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        return out


class BatchSource:
    """Rows of the data file, tokenised batch by batch (rank 0 only)."""

    def __init__(self, cfg: DataConfig, num_labels: int | None):
        self.cfg = cfg
        cols = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
        if cfg.task == "classify":
            cols.append(cfg.label_column)
        table = load_columns(cfg.data_path, cols)
        self.texts = as_texts(table[cfg.text_column], cfg.data_path, cfg.text_column)
        self.pairs = (
            as_texts(table[cfg.text_pair_column], cfg.data_path, cfg.text_pair_column)
            if cfg.text_pair_column
            else None
        )
        self.labels = None
        if cfg.task == "classify":
            assert num_labels is not None
            self.labels = as_int_labels(table[cfg.label_column], cfg.data_path, cfg.label_column, num_labels)
        self.n_train, self.n_eval = split_sizes(len(self.texts), cfg.eval_fraction)
        self.tokenizer = load_tokenizer(cfg.model_dir)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def encode(self, rows: list[int]) -> Batch:
        enc = self.tokenizer(
            [self.texts[i] for i in rows],
            [self.pairs[i] for i in rows] if self.pairs is not None else None,
            truncation=True,
            max_length=self.cfg.seq_len,
            padding="max_length",
            return_tensors="pt",
        )
        ids, mask = enc["input_ids"].long(), enc["attention_mask"].long()
        if self.labels is not None:
            labels = torch.tensor([self.labels[i] for i in rows], dtype=torch.long)
        else:
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        types = enc["token_type_ids"].long() if self.has_token_types else None
        return Batch(ids, mask, labels, types)

    @property
    def has_token_types(self) -> bool:
        """Whether this tokenizer feeds segment ids to the model (as transformers would)."""
        return "token_type_ids" in self.tokenizer.model_input_names

    def train_batches(self, start: int = 0) -> Iterator[tuple[int, Batch]]:
        """(epoch, batch) from batch number `start` on (a resumed run tokenises none before it)."""
        order = batch_order(self.n_train, self.cfg.batch_size, self.cfg.shuffle, self.cfg.seed)
        for epoch, rows in itertools.islice(order, start, None):
            yield epoch, self.encode(rows)

    def eval_batches(self) -> Iterator[Batch]:
        for rows in eval_row_groups(self.n_train, self.n_eval, self.cfg.batch_size):
            yield self.encode(rows)


def eval_row_groups(n_train: int, n_eval: int, batch_size: int) -> list[list[int]]:
    """The tail rows in batches of batch_size, the last one possibly shorter."""
    starts = range(n_train, n_train + n_eval, batch_size)
    return [list(range(s, min(s + batch_size, n_train + n_eval))) for s in starts]


def as_texts(values: list, path: str | Path, column: str) -> list[str]:
    """Text columns must hold strings; name the first row that does not."""
    for row, v in enumerate(values):
        if not isinstance(v, str):
            raise ValueError(f"data file {path}: column {column!r} row {row} is not text: {v!r}")
    return values


class BatchChannel:
    """Batches from rank 0 (its `source`) to every rank. Every rank knows the shapes (from the
    settings and the shared facts), so only the tensors travel; the broadcasts are tagged `data`
    (booked as data time, not as TP communication)."""

    def __init__(self, cfg: DataConfig, group: TPGroup, source: BatchSource | None, token_types: bool):
        self.cfg, self.group, self.source, self.token_types = cfg, group, source, token_types

    def _recv(self, rows: int, batch: Batch | None) -> Batch:
        S = self.cfg.seq_len
        if batch is None:
            shape_lbl = (rows,) if self.cfg.task == "classify" else (rows, S)
            batch = Batch(
                torch.empty(rows, S, dtype=torch.long),
                torch.empty(rows, S, dtype=torch.long),
                torch.empty(shape_lbl, dtype=torch.long),
                torch.empty(rows, S, dtype=torch.long) if self.token_types else None,
            )
        with self.group.segment("data"):
            for t in (batch.input_ids, batch.attention_mask, batch.labels, batch.token_type_ids):
                if t is not None:
                    self.group.broadcast(t, src=0)
        return batch

    def train(self, n_train: int, start: int = 0) -> Iterator[tuple[int, Batch]]:
        """(epoch, batch) of every step from step `start` on."""
        if self.source is not None:
            for epoch, b in self.source.train_batches(start):
                yield epoch, self._recv(self.cfg.batch_size, b)
        else:
            per_epoch = n_train // self.cfg.batch_size
            for step in itertools.count(start):
                yield step // per_epoch, self._recv(self.cfg.batch_size, None)

    def eval(self, n_train: int, n_eval: int) -> Iterator[Batch]:
        src = self.source.eval_batches() if self.source is not None else None
        for rows in eval_row_groups(n_train, n_eval, self.cfg.batch_size):
            yield self._recv(len(rows), next(src) if src is not None else None)
