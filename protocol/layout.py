"""The per-segment shard layout: how many attention units, MLP columns and vocabulary rows each rank holds.

Megatron-style TP has a barrier at every row-parallel "reduce" and every "copy", so each segment
kind is balanced on its own (ARCHITECTURE.md, "Tensor parallelism, concretely"):

    attn   whole attention units: heads, or KV-head groups (one KV head with its query heads) under GQA
    mlp    columns of the intermediate dimension
    vocab  rows of the vocabulary (embedding and a vocabulary-parallel LM head)

Rank r holds the contiguous range [sum(counts[:r]), sum(counts[:r+1])) of each kind; any count may be
0. The same layout applies to every transformer block. Cuts between ranks fall on multiples of the
kind's quantum (the MLP and vocabulary cut at `QUANTA` columns/rows, measured with
`python -m xronos.bench.quantum`: narrower multiples run the GEMMs' edge kernels), so only the rank
that ends a dimension may hold a count that is not a multiple of it.

Pure data and arithmetic, no torch: the gateway plans with it, the node builds its shard from it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from xronos.common.errtext import reason, where

Kind = Literal["attn", "mlp", "vocab"]
KINDS: tuple[Kind, ...] = ("attn", "mlp", "vocab")
NOUN = {"attn": "attention units", "mlp": "MLP columns", "vocab": "vocabulary rows"}
# bench/results/quantum.md: multiples of 8 kept the GEMMs within 1-2 % of the multiples of 128 on
# this x86 machine; 32 also covers 16-float AVX-512 vectors and NEON's 4-float ones.
QUANTA: dict[str, int] = {"attn": 1, "mlp": 32, "vocab": 32}

_FROZEN = ConfigDict(frozen=True, strict=True, extra="forbid")


def _tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


# Bounded where they arrive (a Layout travels in every Assignment): counts fit any dimension of a
# model this product plans, and a world has at most 256 ranks (protocol.messages.MAX_NODES).
MAX_COUNT = 2**31 - 1
MAX_RANKS = 256
_COUNT = re.compile(r"-?[0-9]+")  # a count as `--layout` takes it (negatives refused by value)
Counts = Annotated[tuple[Annotated[int, Field(ge=0, le=MAX_COUNT)], ...], BeforeValidator(_tuple),
                   Field(max_length=MAX_RANKS)]


class LayoutError(ValueError):
    """A layout that does not fit the model or the world (names the kind and the numbers)."""


class Sizes(BaseModel):
    """The model's total per kind (the same in every block)."""

    model_config = _FROZEN
    attn: Annotated[int, Field(gt=0, le=MAX_COUNT)]
    mlp: Annotated[int, Field(gt=0, le=MAX_COUNT)]
    vocab: Annotated[int, Field(gt=0, le=MAX_COUNT)]

    def total(self, kind: str) -> int:
        return getattr(self, _kind(kind))

    def quanta(self, kind: str, quanta: dict[str, int] = QUANTA) -> int:
        """How many quanta the kind has (the planner's integer units; the last may be partial)."""
        return math.ceil(self.total(kind) / quanta[kind])

    def describe(self) -> str:
        return ", ".join(f"{self.total(k)} {NOUN[k]}" for k in KINDS)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise LayoutError(f"unknown segment kind {kind!r} (kinds: {', '.join(KINDS)})")
    return kind


class Layout(BaseModel):
    """Counts per rank of each kind; all three lists are world-size long."""

    model_config = _FROZEN
    attn: Counts
    mlp: Counts
    vocab: Counts

    @model_validator(mode="after")
    def _same_world(self) -> Layout:
        lengths = {k: len(getattr(self, k)) for k in KINDS}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"layout: every kind needs one count per rank, got lengths {lengths}")
        if lengths["attn"] == 0:
            raise ValueError("layout: needs at least one rank")
        return self

    @property
    def world_size(self) -> int:
        return len(self.attn)

    def counts(self, kind: str) -> tuple[int, ...]:
        return getattr(self, _kind(kind))

    def range(self, kind: str, rank: int) -> tuple[int, int]:
        """[start, stop) of `kind` held by `rank`."""
        counts = self.counts(kind)
        if not 0 <= rank < len(counts):
            raise LayoutError(f"rank {rank} outside a world of {len(counts)} ranks")
        start = sum(counts[:rank])
        return start, start + counts[rank]

    def share(self, kind: str, rank: int) -> float:
        counts = self.counts(kind)
        return counts[rank] / sum(counts) if sum(counts) else 0.0

    def describe(self) -> str:
        return "; ".join(f"{k} " + "/".join(str(c) for c in self.counts(k)) for k in KINDS)

    def to_text(self) -> str:
        """The `xronos run --layout` form (`parse` reads it back)."""
        return ";".join(f"{k}=" + ",".join(str(c) for c in self.counts(k)) for k in KINDS)

    def check(self, sizes: Sizes, *, world_size: int | None = None,
              quanta: dict[str, int] | None = QUANTA) -> None:
        """Refuse a layout that does not cover the model exactly, has the wrong world size, or cuts
        a kind off its quantum (`quanta=None` skips the quantum: engine-level layouts)."""
        if world_size is not None and self.world_size != world_size:
            raise LayoutError(f"layout has {self.world_size} ranks but the world has {world_size}")
        for k in KINDS:
            counts, total = self.counts(k), sizes.total(k)
            if sum(counts) != total:
                raise LayoutError(f"{k}: counts {list(counts)} sum to {sum(counts)}, but the model has "
                                  f"{total} {NOUN[k]}" + (" (heads; KV-head groups under GQA)" if k == "attn" else ""))
            q = 1 if quanta is None else quanta[k]
            cut = 0
            for r, c in enumerate(counts[:-1]):
                cut += c
                if cut % q and cut != total:
                    raise LayoutError(f"{k}: the cut after rank {r} falls at {cut}, not a multiple of "
                                      f"the {NOUN[k]} quantum {q} (only the last holder of a kind may "
                                      f"hold a remainder)")

    @classmethod
    def single(cls, sizes: Sizes) -> Layout:
        """Everything on one rank: the unsharded model."""
        return cls(attn=(sizes.attn,), mlp=(sizes.mlp,), vocab=(sizes.vocab,))

    @classmethod
    def from_quanta(cls, attn: Sequence[int], mlp_quanta: Sequence[int], vocab_quanta: Sequence[int],
                    sizes: Sizes, quanta: dict[str, int] = QUANTA) -> Layout:
        """A layout from counts in quanta (the planner's units): cuts at multiples of the quantum,
        the dimension's remainder going to whoever holds its end."""
        return cls(attn=tuple(attn), mlp=_cut(mlp_quanta, sizes.mlp, quanta["mlp"]),
                   vocab=_cut(vocab_quanta, sizes.vocab, quanta["vocab"]))

    @classmethod
    def tied(cls, units: Sequence[int], sizes: Sizes, quanta: dict[str, int] | None = QUANTA) -> Layout:
        """The paper's partition unit: rank r's MLP and vocabulary shares follow its share of the
        attention units (cut at the nearest quantum; exact with `quanta=None`)."""
        units = tuple(units)
        if any(u < 0 for u in units) or sum(units) != sizes.attn:
            raise LayoutError(f"attn: units {list(units)} must be >= 0 and sum to the model's "
                              f"{sizes.attn} attention units")

        def follow(total: int, q: int) -> tuple[int, ...]:
            cuts, acc = [0], 0
            for u in units:
                acc += u
                c = total if acc == sizes.attn else min(total, q * round(total * acc / sizes.attn / q))
                cuts.append(max(c, cuts[-1]))
            return tuple(b - a for a, b in zip(cuts, cuts[1:]))

        qm = 1 if quanta is None else quanta["mlp"]
        qv = 1 if quanta is None else quanta["vocab"]
        return cls(attn=units, mlp=follow(sizes.mlp, qm), vocab=follow(sizes.vocab, qv))

    @classmethod
    def from_data(cls, raw: object) -> Layout:
        """A layout from decoded JSON (a checkpoint's state.json, a re-shard order); LayoutError
        naming the kind, the rank and the value instead of pydantic's multi-line report."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = []
            for e in exc.errors(include_url=False):
                at = where(e["loc"])
                got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
                problems.append(f"{at + ': ' if at else ''}{reason(e)}{got}")
            raise LayoutError("; ".join(problems)) from None

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`attn=4,6,6;mlp=1024,1536,1536;vocab=...` (the `xronos run --layout` form). Items are
        separated by `;` or whitespace; whitespace around `=` and `,` is allowed."""
        parts: dict[str, tuple[int, ...]] = {}
        # "attn = 4, 8" means "attn=4,8": glue the separators before splitting on whitespace.
        glued = re.sub(r"\s*([=,])\s*", r"\1", text)
        for item in filter(None, (p.strip() for p in re.split(r"[;\s]+", glued))):
            key, sep, value = item.partition("=")
            if not sep or key not in KINDS:
                raise LayoutError(f"--layout: expected kind=c1,c2,... with kind in {', '.join(KINDS)}, "
                                  f"got {item!r}")
            if key in parts:
                raise LayoutError(f"--layout: {key} given twice")
            values = value.split(",")
            # ASCII digits only: int() would also take "6_0" (60), "+6" and other scripts' digits.
            if not value or not all(_COUNT.fullmatch(v) for v in values):
                raise LayoutError(f"--layout: {key} must be comma-separated integers (one count of "
                                  f"{NOUN[key]} per rank), got {value!r}")
            if any(len(v.lstrip("-")) > 10 for v in values):  # beyond MAX_COUNT (and int()'s digit limit)
                raise LayoutError(f"--layout: {key} counts must be in 0..{MAX_COUNT}, got {value[:80]!r}")
            counts = tuple(int(v) for v in values)
            if any(c < 0 for c in counts):
                raise LayoutError(f"--layout: {key} counts must be >= 0, got {list(counts)}")
            if any(c > MAX_COUNT for c in counts):
                raise LayoutError(f"--layout: {key} counts must be in 0..{MAX_COUNT}, got {list(counts)}")
            parts[key] = counts
        missing = [k for k in KINDS if k not in parts]
        if missing:
            raise LayoutError(f"--layout: missing {', '.join(missing)} (give all of {', '.join(KINDS)})")
        lengths = {k: len(v) for k, v in parts.items()}
        if len(set(lengths.values())) != 1:
            raise LayoutError(f"--layout: every kind needs one count per rank, got lengths {lengths}")
        if lengths["attn"] > MAX_RANKS:
            raise LayoutError(f"--layout: {lengths['attn']} ranks, at most {MAX_RANKS}")
        return cls(**parts)


def _cut(counts: Sequence[int], total: int, q: int) -> tuple[int, ...]:
    if any(c < 0 for c in counts) or sum(counts) != math.ceil(total / q):
        raise LayoutError(f"quanta {list(counts)} must be >= 0 and sum to {math.ceil(total / q)} "
                          f"(= ceil({total} / {q}))")
    cuts, acc = [0], 0
    for c in counts:
        acc += c
        cuts.append(min(total, acc * q))
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))
