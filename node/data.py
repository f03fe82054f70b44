"""Training data: the owner rank reads the file, decides the labels, orders the batches,
tokenises on demand, and every rank receives each batch as tensors.

Only rank 0 ever builds a `BatchSource` (`owner_batches`); a `BatchChannel` brings each batch to
every rank. What the other ranks must know of the data before they build their model (row counts,
pad token, segment ids, the classes) the rank runtime shares once (`xronos.node.runtime.Facts`).
Batches are consecutive rows (no shuffle) or a seeded shuffle with a new permutation per epoch,
always of exactly `batch_size` rows (the last incomplete batch of an epoch is dropped). The
evaluation set is the held-out tail of the file.

Files: CSV, JSON, JSONL or Parquet (read with `datasets`). Formats (`DataConfig.data_format`):
- "text": a text column (and a pair column); classify reads a label column, a causal LM learns
  every token that is not padding.
- "chat" (causal LM): a column of conversations, each a list of {role, content} messages (roles
  system, user, assistant), rendered with the tokenizer's chat template; the loss covers the
  assistant turns' tokens only (their content and the template's end-of-turn marker).
- "prompt-completion" (causal LM): two text columns, concatenated as they are with the tokenizer's
  EOS appended to the completion; the loss covers the completion's tokens only.
Everywhere else the labels are -100, so `TPModel.forward`'s mean is over the answer tokens.

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

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import ConfigDict, Field, StrictBool, StringConstraints, field_validator
from pydantic.dataclasses import dataclass as checked_dataclass

from xronos.node.runconfig import DataConfig
from xronos.node.tp.group import TPGroup

IGNORE_INDEX = -100
_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ROLES = ("system", "user", "assistant")
MAX_LABELS = 4096  # distinct classes of a classification run
MAX_LABEL_CHARS = 256  # a label name (as the protocol's labels)
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                "sentencepiece.bpe.model")


def load_columns(path: str | Path, columns: list[str],
                 hint: Callable[[list[str]], str] | None = None) -> dict[str, list]:
    """The named columns of a CSV/JSON/JSONL/Parquet file as lists (ValueError naming what is
    missing, plus `hint(the file's columns)`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"data file {path}: unsupported extension {path.suffix!r} (csv, json, jsonl, parquet)")
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


# --- class labels -------------------------------------------------------------------------------

def _short(v: Any) -> str:
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
                    raise ValueError(f"{where(row)} has non-integer label {_short(v)}")
                if not 0 <= i < self.num_labels:
                    raise ValueError(f"{where(row)} has label {i} outside [0, {self.num_labels})")
                out.append(i)
            return out
        ids = {n: i for i, n in enumerate(self.names)}
        out = []
        for row, v in enumerate(values):
            if v not in ids:
                known = list(self.names[:10]) + (["..."] if len(self.names) > 10 else [])
                raise ValueError(f"{where(row)} has label {_short(v)}, which no training row has "
                                 f"(the labels: {known})")
            out.append(ids[v])
        return out


def decide_labels(values: list, n_train: int, config: dict[str, Any], head: bool, path: str | Path,
                  column: str) -> LabelSpace:
    """The classes of `values` (every row's label; the first n_train are the training rows) for a
    checkpoint whose config.json is `config` and which does (`head`) or does not hold a
    classification head. ValueError naming the row or the labels otherwise."""
    from xronos.node.models.common import num_labels

    def where(row: int) -> str:
        return f"data file {path}: column {column!r} row {row}"

    first_name = first_int = None
    for row, v in enumerate(values):
        if v is None:
            raise ValueError(f"{where(row)} has no label")
        if isinstance(v, str):
            if not v.strip():
                raise ValueError(f"{where(row)} has an empty label")
            if len(v) > MAX_LABEL_CHARS:
                raise ValueError(f"{where(row)} has a label of {len(v)} characters (at most {MAX_LABEL_CHARS})")
            first_name = row if first_name is None else first_name
        elif _as_int(v) is not None:
            first_int = row if first_int is None else first_int
        else:
            raise ValueError(f"{where(row)} has non-integer label {_short(v)}")
        if first_name is not None and first_int is not None:
            raise ValueError(f"{where(max(first_name, first_int))}: the column mixes label names "
                             f"({_short(values[first_name])}, row {first_name}) and integer ids "
                             f"({_short(values[first_int])}, row {first_int}); use one or the other")
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
                raise ValueError(f"data file {path}: column {column!r} has {len(distinct)} distinct label(s) "
                                 f"{distinct} in its training rows; classification needs at least 2")
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


# --- instruction data (causal LM) ---------------------------------------------------------------

@dataclass(frozen=True)
class Rendered:
    """A row as the model reads it, and the character spans of its answers (what the loss covers)."""

    text: str
    answers: tuple[tuple[int, int], ...]


def check_instruction_tokenizer(tokenizer: Any, cfg: DataConfig) -> None:
    """What an instruction format needs of the tokenizer (ValueError naming the model dir)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"model dir {cfg.model_dir}: data format {cfg.data_format!r} needs a fast tokenizer "
                         "(tokenizer.json), to find which tokens are the answer's")
    if cfg.data_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model dir {cfg.model_dir}: the tokenizer has no chat template, which data format "
                         "'chat' needs (tokenizer_config.json 'chat_template' or chat_template.jinja); give "
                         "the data as prompt/completion columns (data format 'prompt-completion') instead")


def as_messages(value: Any, where: str) -> list[dict[str, str]]:
    """One conversation, checked: a list of {role, content} with text content, a user message
    before the first answer, no empty answer. Only role and content reach the template."""
    if isinstance(value, str):
        raise ValueError(f"{where} is text, not a list of {{role, content}} messages (a CSV cell cannot "
                         "hold one: use JSON, JSONL or Parquet)")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} messages, got {_short(value)}")
    out = []
    for m, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{where} message {m} is not a {{role, content}} object: {_short(msg)}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"{where} message {m} has role {_short(role)}; the roles are {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where} message {m} ({role}) has no text content: {_short(content)}")
        out.append({"role": role, "content": content})
    answers = [i for i, msg in enumerate(out) if msg["role"] == "assistant"]
    if not answers:
        raise ValueError(f"{where} has no assistant message: there is no answer to learn")
    if not any(msg["role"] == "user" for msg in out[: answers[0]]):
        raise ValueError(f"{where}: its first assistant message (message {answers[0]}) has no user message before it")
    for i in answers:
        if not out[i]["content"].strip():
            raise ValueError(f"{where} message {i} is an empty assistant answer")
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Rendered:
    """The conversation through the chat template, with each assistant turn's span: from the end
    of the conversation before it (generation prompt included) to the end of the turn."""
    def render(msgs: list[dict[str, str]], prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except Exception as exc:  # jinja raises what the template raises
            raise ValueError(f"{where}: the tokenizer's chat template refused the conversation: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"{where}: the chat template rendered {type(text).__name__}, not text")
        return text

    full = render(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)) or len(through) == len(before):
            raise ValueError(f"{where}: the tokenizer's chat template does not render this conversation turn "
                             f"by turn (message {i} renders differently when the conversation ends with it), "
                             "so its answer cannot be located; give each answer its own row")
        spans.append((len(before), len(through)))
    return Rendered(full, tuple(spans))


def render_prompt_completion(tokenizer: Any, prompt: str, completion: str, where: str) -> Rendered:
    """Prompt and completion as they are, the tokenizer's EOS appended to the completion (so the
    model learns to stop); the completion and its EOS are the answer."""
    if not completion.strip():
        raise ValueError(f"{where} has an empty completion: there is no answer to learn")
    eos = tokenizer.eos_token
    text = prompt + completion + (eos if eos and not completion.endswith(eos) else "")
    return Rendered(text, ((len(prompt), len(text)),))


def answer_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, offsets: torch.Tensor,
                  special: torch.Tensor, answers: list[tuple[tuple[int, int], ...]]) -> torch.Tensor:
    """[B, S] labels: the id where a token belongs to an answer span, -100 elsewhere. offsets
    [B, S, 2] are the tokens' character spans; a token belongs to a span it overlaps, or, when
    its own span is empty (a byte-level BPE trims a lone space token to nothing), that it starts
    in. `special` [B, S] marks what the tokenizer adds around the text (BOS, ...): never an
    answer, nor is padding."""
    start, end = offsets[..., 0], offsets[..., 1]
    empty = end == start
    hit = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, spans in enumerate(answers):
        for a, e in spans:
            hit[b] |= ((start[b] < e) & (end[b] > a)) | (empty[b] & (start[b] >= a) & (start[b] < e))
    hit &= attention_mask.bool() & ~special.bool()
    return input_ids.masked_fill(~hit, IGNORE_INDEX)


# --- rows and batches ---------------------------------------------------------------------------

def data_columns(cfg: DataConfig) -> list[str]:
    """The columns a run reads, in the order `read_rows` checks them."""
    if cfg.data_format == "chat":
        return [cfg.messages_column]
    if cfg.data_format == "prompt-completion":
        return [cfg.prompt_column, cfg.completion_column]
    cols = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
    return cols + ([cfg.label_column] if cfg.task == "classify" else [])


def _format_hint(cfg: DataConfig) -> Callable[[list[str]], str]:
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


def read_rows(cfg: DataConfig, config: dict[str, Any], head: bool, tokenizer: Any = None) -> Rows:
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
            values = table[cfg.label_column]
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

    def __init__(self, cfg: DataConfig, num_labels: int | None = None, *, config: dict[str, Any] | None = None,
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


def owner_batches(cfg: DataConfig, config: dict[str, Any], allowed_dirs: list | None = None) -> BatchSource:
    """The owner's BatchSource for the checkpoint in cfg.model_dir (config.json `config`): the
    classes decided from the data and whether the checkpoint holds a classification head."""
    head = cfg.task == "classify" and label_head_in_checkpoint(cfg.model_dir, config, allowed_dirs)
    return BatchSource(cfg, config=config, head=head)


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
