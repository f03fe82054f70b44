"""The types every control-plane message is built of: the bounded field types, the bounds and the
`Message` base (one frozen, strict pydantic model per message). Re-exported by
`xronos.protocol.messages`, the one import point of the wire's types.

Strict mode means no coercion ("3" is not 3, true is not 1); the codec validates decoded
JSON/msgpack with `strict=True`. The only wire form strict mode would refuse is a tuple arriving
as a list (neither JSON nor msgpack has tuples), so tuple fields accept a list of the right length.
Sizes are bytes, times are seconds (float), timestamps are Unix seconds.

Nothing from the network is trusted, so every field is bounded here, where it arrives: integers
have ranges (none beyond 2**53, so every value survives msgpack, JSON and float arithmetic),
floats are finite unless a non-finite value means something (a diverged loss), every string has a
maximum length and must be valid Unicode (a lone UTF-16 surrogate, which JSON can carry but no
encoder can send on, is refused with the field named), lists and dicts have maximum sizes, and
identifiers (node, job and request ids) are plain `[A-Za-z0-9_][A-Za-z0-9_.-]*`, safe as a topic
level and as a file name.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

# 2: the per-segment layout (Assignment.layout, Plan entries per kind, ProfileReport.sizes).
# Data parallelism (a plan's and an assignment's batch `shares`, strategies `auto` and `dp`) added
# fields without bumping it: an older node refuses an assignment carrying `shares` by name (every
# message forbids unknown fields), while every stored profile and job table stays readable. So did
# overlap (a plan's and an assignment's `overlap`, a job's `overlap` and `chunks`).
SCHEMA_VERSION = 2

Task = Literal["classify", "causal-lm"]
# A plan's strategy: how the nodes share the work. `segment`, `paper` and `uniform` are tensor
# parallelism over every node (one group); `dp` is data parallelism, each node a whole replica
# taking its share of every batch (a mesh of one-rank TP groups).
Strategy = Literal["segment", "paper", "uniform", "dp"]
# What a job may ask for: a strategy, or `auto` (the planner's fastest feasible one).
JobStrategy = Literal["auto", "segment", "paper", "uniform", "dp"]
DataFormat = Literal["text", "chat", "prompt-completion"]
GGUFType = Literal["f32", "f16", "q8_0"]  # a GGUF export's tensor type (xronos.node.models.gguf)
Phase = Literal[
    "queued", "profiling", "planning", "assigning", "running",
    "paused", "recovering", "completed", "failed", "cancelled",
]
# --- bounds --------------------------------------------------------------------------------------
MAX_INT = 2**53  # every integer on the wire: exact in JSON/float, encodable in msgpack
MAX_NODES = 256  # nodes of one plan, ranks of one job
MAX_ID = 128
MAX_TEXT = 4096  # free text: errors, reasons, details
MAX_PATH = 4096
MAX_SECONDS = 1e7  # ~115 days: any duration a message reports
MAX_PERCENT = 1e6  # a prediction error in percent (10,000x off is still a number, not noise)
MAX_TIMESTAMP = 1e11  # Unix seconds (year ~5138)
MAX_BYTES = float(2**60)  # memory sizes as floats
MAX_EVENTS = 50

_SURROGATE = re.compile("[\ud800-\udfff]")
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def valid_text(value: Any) -> Any:
    """Refuse text no encoder can send on: a lone UTF-16 surrogate (JSON's "\\ud800" decodes to
    one; msgpack and UTF-8 cannot carry it). Runs before the str validation, so the error says why."""
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        if bad:
            raise ValueError(f"not valid Unicode: lone surrogate U+{ord(bad.group()):04X} at index {bad.start()}")
    return value


def _valid_id(value: str) -> str:
    if not _ID.fullmatch(value):
        shown = value[:40].encode("ascii", "backslashreplace").decode()
        raise ValueError(f"must be [A-Za-z0-9_][A-Za-z0-9_.-]* (a topic level and a file name), got {shown!r}")
    return value


def _path_text(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path may not contain NUL")
    return value


def Text(max_length: int = MAX_TEXT, min_length: int = 0) -> Any:  # noqa: N802 (a type factory)
    """A bounded, valid-Unicode string type."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), BeforeValidator(valid_text)]


def Int(ge: int | None = 0, le: int = MAX_INT, *, gt: int | None = None) -> Any:  # noqa: N802
    """A bounded int (`gt=0` for a positive one: its error says "greater than 0", as before)."""
    return Annotated[int, Field(ge=None if gt is not None else ge, gt=gt, le=le)]


def Float(ge: float | None = None, le: float | None = None, *, gt: float | None = None,
          lt: float | None = None) -> Any:  # noqa: N802
    """A finite float with bounds (strict mode still accepts an int within them)."""
    return Annotated[float, Field(ge=ge, le=le, gt=gt, lt=lt, allow_inf_nan=False)]


NonNegInt = Int()
PosInt = Int(gt=0)
Count = Int(le=2**31 - 1)  # steps, epochs, versions, context switches
NonNegFloat = Float(ge=0, le=MAX_BYTES)
Seconds = Float(ge=0, le=MAX_SECONDS)
Timestamp = Float(ge=0, le=MAX_TIMESTAMP)
Bytes = Int(le=2**50)  # memory and sizes in bytes (1 PiB)
ByteFloat = Float(ge=0, le=MAX_BYTES)
Rank = Int(le=MAX_NODES - 1)
WorldSize = Int(gt=0, le=MAX_NODES)
Ratio = Float(ge=0, le=1)
# A metric that may legitimately be NaN or infinite (a diverged loss, its perplexity).
Metric = float
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID), BeforeValidator(valid_text), AfterValidator(_valid_id)]
Name = Text(256, min_length=1)
Label = Text(256)  # column names, metric names, short labels
Host = Text(255)
PathText = Annotated[str, Field(min_length=1, max_length=MAX_PATH), BeforeValidator(valid_text),
                     AfterValidator(_path_text)]
Dim = Int(gt=0, le=2**20)  # a model dimension (hidden, intermediate, heads, layers, positions)
Text256 = Text(256)
Text4k = Text(MAX_TEXT)
Event = Text(1024)
Temperature = Float(ge=-273.15, le=1000)
Layers = Int(gt=0, le=1024)
# What any supported box can do (a node refuses more than its own usable cores, node/agent/boxcheck.py):
# no edge CPU has 256 cores, no CPU fine-tune a batch of 4096 rows or a sequence of 2**17 tokens.
Threads = Int(gt=0, le=256)
Heads = Int(gt=0, le=4096)
Vocab = Int(gt=0, le=2**23)
Positions = Int(gt=0, le=2**22)
Labels = Int(gt=0, le=2**16)
Cores = Int(gt=0, le=65536)
BatchSize = Int(gt=0, le=4096)
SeqLen = Int(gt=0, le=2**17)
UnitCount = Int(le=2**20)
Decay = Float(ge=0, le=100)
LayerName = Text(128, min_length=1)
Column = Text(256, min_length=1)
LearningRate = Float(gt=0, le=100)
Epochs = Int(gt=0, le=10**6)
Steps = Int(gt=0, le=10**9)
StepCount = Int(le=10**9)
Fraction = Float(ge=0, lt=1)
Megabytes = Int(le=2**30)
Seed = Int(le=2**32 - 1)
GradNorm = Float(gt=0, le=1e9)
HostName = Text(255, min_length=1)
Eta = Float(ge=0, le=MAX_INT)
Percent = Float(ge=0, le=MAX_PERCENT)
Code = Text(64, min_length=1)
TopicText = Text(1024)
LoraRank = Int(gt=0, le=65536)
LoraAlpha = Float(gt=0, le=1e6)
LoraTarget = Text(64, min_length=1)


def _list_to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


Sample = Annotated[tuple[Ratio, Seconds], BeforeValidator(_list_to_tuple)]


class Message(BaseModel):
    # ser_json_inf_nan="constants": a diverged loss (NaN) must survive a JSON round trip.
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", ser_json_inf_nan="constants")
    schema_version: Literal[2] = 2
