"""Training data: the owner rank reads the file, decides the labels, orders the batches,
tokenises on demand, and every rank receives each batch as tensors.

Only rank 0 ever builds a `BatchSource` (`owner_batches`); a `BatchChannel` brings each batch to
every rank. What the other ranks must know of the data before they build their model (row counts,
pad token, segment ids, the classes) the rank runtime shares once (`xronos.node.rank.lifecycle.Facts`).
Batches are consecutive rows (no shuffle) or a seeded shuffle with a new permutation per epoch,
always of exactly `batch_size` rows (the last incomplete batch of an epoch is dropped). The
evaluation set is the held-out tail of the file.

Files: CSV, JSON, JSONL or Parquet (read with `datasets`). Formats (`Recipe.data_format`):
"text" (a text column and a pair column), "chat" and "prompt-completion" (`xronos.node.data.instructions`,
which also says how their loss covers the answers only); class labels: `xronos.node.data.labels`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xronos.node.data.instructions import (
    IGNORE_INDEX, answer_labels, as_messages, check_instruction_tokenizer, render_chat, render_prompt_completion,
)
from xronos.node.data.labels import (LabelSpace, as_written, decide_labels, default_label_names,
                                     label_head_in_checkpoint)
from xronos.protocol.recipe import Recipe
from xronos.node.tp.group import TPGroup

_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                "sentencepiece.bpe.model")


def _root_cause(exc: BaseException) -> str:
    """What went wrong, not datasets' wrapper ("An error occurred while generating the dataset"):
    the first cause in the chain that says more (a JSON parse error and its row, a CSV's field
    count), at most 300 characters."""
    seen, at = [], exc
    while at is not None and len(seen) < 8:
        seen.append(at)
        at = at.__cause__ or at.__context__
    says = next((e for e in seen[1:] if str(e).strip()), exc)
    text = str(says).strip() or type(says).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_columns(path: str | Path, columns: list[str],
                 hint: Callable[[list[str]], str] | None = None) -> dict[str, list]:
    """The named columns of a CSV/JSON/JSONL/Parquet file as lists (ValueError naming what is
    missing, plus `hint(the file's columns)`)."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise FileNotFoundError(f"data file {path} is not a file (a CSV, JSON, JSONL or Parquet file)")
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.stat().st_size == 0:
        raise ValueError(f"data file {path} is empty")
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"data file {path}: unsupported extension {path.suffix!r} (csv, json, jsonl, parquet)")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for unparsable files
        if "corresponds to no data" in str(exc):  # a header and no row (datasets' words for it)
            raise ValueError(f"data file {path} has no rows") from None
        raise ValueError(f"data file {path} could not be read as {builder}: {_root_cause(exc)}") from exc
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        sep = next((name for c, name in (("\t", "tabs"), (";", "semicolons"))
                    if len(table.column_names) == 1 and c in table.column_names[0]), None)
        raise ValueError(
            f"data file {path} lacks column(s) {missing}; it has {table.column_names}"
            + (f" (its header is separated by {sep}: a CSV file's fields are separated by commas)" if sep else "")
            + (hint(table.column_names) if hint is not None else "")
        )
    return table.select_columns(columns).to_dict()


def as_int_labels(values: list, path: str | Path, column: str, num_labels: int) -> list[int]:
    """Class labels must be integers in [0, num_labels); name the first row that is not."""
    return LabelSpace(default_label_names(num_labels), by_name=False).encode(values, path, column, len(values))


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


def check_vocabulary(tok, config: dict[str, Any], model_dir: str | Path) -> None:
    """Every id the tokenizer can produce has a row in the model's embedding. A tokenizer with more
    tokens (another model's, or special tokens added without resizing the embeddings) trains on
    ids the vocabulary-parallel embedding and loss have no row for: loss nan, weights unchanged."""
    from xronos.node.models.registry import family_for

    rows = family_for(config).sizes(config).vocab
    top = max(max(tok.get_vocab().values(), default=-1), len(tok) - 1)
    if top >= rows:
        raise ValueError(f"model dir {model_dir}: the tokenizer has {len(tok)} tokens (ids up to {top}, added "
                         f"special tokens included) but config.json vocab_size is {rows}: ids from {rows} on have "
                         "no embedding row (use the model's own tokenizer, or resize its embeddings)")

# --- rows and batches ---------------------------------------------------------------------------

def data_columns(cfg: Recipe) -> list[str]:
    """The columns a run reads, in the order `read_rows` checks them."""
    if cfg.data_format == "chat":
        return [cfg.messages_column]
    if cfg.data_format == "prompt-completion":
        return [cfg.prompt_column, cfg.completion_column]
    cols = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
    return cols + ([cfg.label_column] if cfg.task == "classify" else [])


def _format_hint(cfg: Recipe) -> Callable[[list[str]], str]:
    def hint(have: list[str]) -> str:
        if cfg.data_format == "text" and cfg.task == "causal-lm":
            if "messages" in have:
                return " (conversations? data format 'chat', --data-format chat)"
            if "prompt" in have and "completion" in have:
                return " (data format 'prompt-completion', --data-format prompt-completion)"
        return ""
    return hint


@dataclass(frozen=True)
class Rows:
    """The data file as the owner trains on it, every row checked."""

    texts: list[str]  # "text": the text column; instruction formats: the rendered rows
    pairs: list[str] | None
    answers: list[tuple[tuple[int, int], ...]] | None  # instruction formats: the answers' character spans
    labels: list[int] | None  # classify: every row's class id
    label_space: LabelSpace | None
    n_train: int
    n_eval: int


def read_rows(cfg: Recipe, config: dict[str, Any], head: bool, tokenizer: Any = None) -> Rows:
    """Read and check the rows of cfg.data_path (ValueError naming the file, column and row).
    `config`/`head`: the checkpoint's config.json and whether it holds a classification head (they
    decide the labels); `tokenizer` renders instruction formats (loaded from the model dir if None)."""
    path = cfg.data_path
    cols = data_columns(cfg)
    table = load_columns(path, cols, _format_hint(cfg))
    n_train, n_eval = split_sizes(len(table[cols[0]]), cfg.eval_fraction)
    if cfg.data_format == "text":
        texts = as_texts(table[cfg.text_column], path, cfg.text_column)
        pairs = as_texts(table[cfg.text_pair_column], path, cfg.text_pair_column) if cfg.text_pair_column else None
        labels = space = None
        if cfg.task == "classify":
            values = as_written(table[cfg.label_column])
            space = decide_labels(values, n_train, config, head, path, cfg.label_column)
            labels = space.encode(values, path, cfg.label_column, n_train)
        return Rows(texts, pairs, None, labels, space, n_train, n_eval)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model_dir)
    check_instruction_tokenizer(tokenizer, cfg)
    if cfg.data_format == "chat":
        col, rendered = cfg.messages_column, []
        for row, v in enumerate(table[col]):
            where = f"data file {path}: column {col!r} row {row}"
            rendered.append(render_chat(tokenizer, as_messages(v, where), where))
    else:
        prompts = as_texts(table[cfg.prompt_column], path, cfg.prompt_column)
        empty = next((row for row, c in enumerate(table[cfg.completion_column]) if c is None), None)
        if empty is not None:  # an empty CSV cell reads as None
            raise ValueError(f"data file {path}: row {empty} has an empty completion: there is no answer to learn")
        completions = as_texts(table[cfg.completion_column], path, cfg.completion_column)
        rendered = [render_prompt_completion(tokenizer, p, c, f"data file {path}: row {row}")
                    for row, (p, c) in enumerate(zip(prompts, completions))]
    return Rows([r.text for r in rendered], None, [r.answers for r in rendered], None, None, n_train, n_eval)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # classify [B] long; causal-lm [B, S] long, -100 on padding (and prompts)
    token_type_ids: torch.Tensor | None = None  # [B, S] long, when the tokenizer produces them

    def inputs(self) -> dict[str, torch.Tensor]:
        """As transformers' keyword arguments (token_type_ids only when the tokenizer makes them)."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        return out


class BatchSource:
    """Rows of the data file, tokenised batch by batch (rank 0 only).

    `config`/`head` decide the classes (see `decide_labels`); without `config`, `num_labels` is
    the head's size (`{"num_labels": num_labels}` with a head). The owner of a run builds it with
    `owner_batches`, which looks for the head in the checkpoint."""

    def __init__(self, cfg: Recipe, num_labels: int | None = None, *, config: dict[str, Any] | None = None,
                 head: bool = True):
        self.cfg = cfg
        if config is None:
            config = {"num_labels": num_labels} if num_labels is not None else {}
        self.rows = read_rows(cfg, config, head, None)  # the data file first: fail fast, before the tokenizer
        self.texts, self.pairs, self.labels = self.rows.texts, self.rows.pairs, self.rows.labels
        self.n_train, self.n_eval = self.rows.n_train, self.rows.n_eval
        self.tokenizer = load_tokenizer(cfg.model_dir)

    @property
    def label_space(self) -> LabelSpace | None:
        return self.rows.label_space

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def encode(self, rows: list[int]) -> Batch:
        if self.rows.answers is not None:
            return self._encode_answers(rows)
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

    def _encode_answers(self, rows: list[int]) -> Batch:
        """Instruction rows: labels on the answer tokens only. A row whose answer lies entirely
        beyond seq_len has nothing to learn: refused, naming the row."""
        assert self.rows.answers is not None
        enc = self.tokenizer(
            [self.texts[i] for i in rows],
            truncation=True,
            max_length=self.cfg.seq_len,
            padding="max_length",
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            # A chat template writes the special tokens itself (as apply_chat_template(tokenize=True)).
            add_special_tokens=self.cfg.data_format != "chat",
            return_tensors="pt",
        )
        ids, mask = enc["input_ids"].long(), enc["attention_mask"].long()
        labels = answer_labels(ids, mask, enc["offset_mapping"], enc["special_tokens_mask"],
                               [self.rows.answers[i] for i in rows])
        learned = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)  # the first token is never a target
        if not bool(learned.all()):
            row = rows[int((~learned).nonzero()[0])]
            raise ValueError(f"data file {self.cfg.data_path}: row {row} has no answer token within the first "
                             f"{self.cfg.seq_len} tokens (--seq-len): its prompt fills them; shorten it or "
                             "raise the sequence length")
        types = enc["token_type_ids"].long() if self.has_token_types else None
        return Batch(ids, mask, labels, types)

    def check_all_rows(self, group_size: int = 256) -> None:
        """Tokenise every row once (instruction formats: each must keep an answer token)."""
        if self.rows.answers is None:
            return
        n = self.n_train + self.n_eval
        for start in range(0, n, group_size):
            self.encode(list(range(start, min(start + group_size, n))))

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

    def config_fields(self) -> dict[str, Any]:
        """What config.json gets from the data, on every rank: the tokenizer's pad id (GPT-2/LLaMA
        classifiers pool the last non-pad token) and, for classify, the classes (num_labels,
        id2label, label2id: every rank builds its head from them, and the export carries them)."""
        return {"pad_token_id": self.pad_token_id, **(self.label_space.config_fields() if self.label_space else {})}


def owner_batches(cfg: Recipe, config: dict[str, Any], allowed_dirs: list | None = None) -> BatchSource:
    """The owner's BatchSource for the checkpoint in cfg.model_dir (config.json `config`): the
    classes decided from the data and whether the checkpoint holds a classification head."""
    head = cfg.task == "classify" and label_head_in_checkpoint(cfg.model_dir, config, allowed_dirs)
    source = BatchSource(cfg, config=config, head=head)
    check_vocabulary(source.tokenizer, config, cfg.model_dir)  # the inspection, `xronos run` and the owner rank
    return source


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
    (booked as data time, not as TP communication). The labels' shape is the task's whatever the
    data format: an instruction format only moves its -100s."""

    def __init__(self, cfg: Recipe, group: TPGroup, source: BatchSource | None, token_types: bool):
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
