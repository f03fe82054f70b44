"""The owner's data pipeline: reading CSV/JSON/JSONL, batch order, tokenisation, label checks."""

from __future__ import annotations

import random
from itertools import islice
from pathlib import Path

import pytest
import torch

import runkit
from xronos.node.data import (BatchSource, as_int_labels, batch_order, eval_row_groups, load_columns,
                              split_sizes)
from xronos.node.runconfig import RunConfig
from xronos.protocol.layout import Layout


def _cfg(model_dir: Path, data: Path, task: str, **kw) -> RunConfig:
    base = dict(model_dir=str(model_dir), data_path=str(data), task=task,
                layout=Layout(attn=(12,), mlp=(100,), vocab=(1,)), batch_size=4,  # data only: any one-rank layout
                seq_len=runkit.SEQ_LEN, lr=1e-4, max_steps=5)
    return RunConfig(**{**base, **kw})


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl"])
def test_every_format_reads_the_same_columns(tmp_path: Path, suffix: str) -> None:
    rows = [{"text": t, "label": i % 3} for i, t in enumerate(runkit.texts(7))]
    path = runkit.write_rows(tmp_path / f"d{suffix}", rows)
    cols = load_columns(path, ["text", "label"])
    assert cols == {"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}


def test_missing_column_and_bad_files_are_named(tmp_path: Path) -> None:
    path = runkit.write_rows(tmp_path / "d.jsonl", [{"sentence": "a b", "label": 0}])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['text'\].*sentence"):
        load_columns(path, ["text", "label"])
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_columns(tmp_path / "nope.csv", ["text"])
    (tmp_path / "d.parquet").write_text("x")
    with pytest.raises(ValueError, match=r"d.parquet could not be read as parquet"):
        load_columns(tmp_path / "d.parquet", ["text"])
    (tmp_path / "d.tsv").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported extension '.tsv' \(csv, json, jsonl, parquet\)"):
        load_columns(tmp_path / "d.tsv", ["text"])


def test_labels_must_be_integers_in_range() -> None:
    assert as_int_labels([0, 2, 1.0], "f.csv", "label", 3) == [0, 2, 1]
    with pytest.raises(ValueError, match=r"row 1 has non-integer label 1.5"):
        as_int_labels([0, 1.5], "f.csv", "label", 3)
    with pytest.raises(ValueError, match=r"row 0 has non-integer label 'pos'"):
        as_int_labels(["pos"], "f.csv", "label", 3)
    with pytest.raises(ValueError, match=r"row 2 has label 3 outside \[0, 3\)"):
        as_int_labels([0, 1, 3], "f.csv", "label", 3)


def test_batch_order_consecutive_and_seeded_shuffle() -> None:
    it = batch_order(10, 3, shuffle=False, seed=0)
    got = [next(it) for _ in range(7)]
    # 3 full batches per epoch; the incomplete last one (row 9) is dropped.
    assert got == [(0, [0, 1, 2]), (0, [3, 4, 5]), (0, [6, 7, 8]), (1, [0, 1, 2]), (1, [3, 4, 5]),
                   (1, [6, 7, 8]), (2, [0, 1, 2])]
    a = list(islice(batch_order(10, 3, True, 5), 6))
    assert a == list(islice(batch_order(10, 3, True, 5), 6))  # seeded: reproducible
    assert [e for e, _ in a] == [0, 0, 0, 1, 1, 1]
    gen = torch.Generator().manual_seed(5)
    e0, e1 = torch.randperm(10, generator=gen).tolist(), torch.randperm(10, generator=gen).tolist()
    assert [r for _, r in a] == [e0[0:3], e0[3:6], e0[6:9], e1[0:3], e1[3:6], e1[6:9]]
    assert e0 != e1  # a new permutation per epoch


def test_eval_split_is_the_tail() -> None:
    assert split_sizes(40, 0.0) == (40, 0)
    assert split_sizes(40, 0.2) == (32, 8)
    assert split_sizes(10, 0.01) == (9, 1)  # asked for evaluation: at least one row
    assert eval_row_groups(32, 8, 3) == [[32, 33, 34], [35, 36, 37], [38, 39]]


def test_lm_batches_pad_with_eos_and_ignore_padding(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "m", "gpt2", "causal-lm")
    rows = [{"text": t} for t in ["cat sat", " ".join(["dog"] * 30)] + runkit.texts(6)]
    data = runkit.write_rows(tmp_path / "d.jsonl", rows)
    src = BatchSource(_cfg(model, data, "causal-lm", batch_size=2, shuffle=False), None)
    assert src.tokenizer.pad_token == src.tokenizer.eos_token and src.pad_token_id == 1
    _, b = next(src.train_batches())
    assert b.input_ids.shape == b.attention_mask.shape == b.labels.shape == (2, runkit.SEQ_LEN)
    assert b.attention_mask[0].tolist() == [1, 1] + [0] * (runkit.SEQ_LEN - 2)
    assert b.input_ids[0, 2:].eq(1).all() and b.labels[0, 2:].eq(-100).all()
    assert b.labels[0, :2].tolist() == b.input_ids[0, :2].tolist()
    assert b.attention_mask[1].all()  # truncated to seq-len
    assert b.token_type_ids is None


def test_classify_batches_with_pairs_carry_segment_ids(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "m", "bert", "classify")
    rng = random.Random(0)
    rows = [{"a": t, "b": p, "y": rng.randrange(3)} for t, p in zip(runkit.texts(8), runkit.texts(8, 1))]
    data = runkit.write_rows(tmp_path / "d.csv", rows)
    cfg = _cfg(model, data, "classify", text_column="a", text_pair_column="b", label_column="y",
               shuffle=False, eval_fraction=0.25)
    src = BatchSource(cfg, num_labels=3)
    assert (src.n_train, src.n_eval) == (6, 2)
    _, b = next(src.train_batches())
    assert b.labels.tolist() == [r["y"] for r in rows[:4]]
    assert b.token_type_ids is not None and b.token_type_ids.shape == (4, runkit.SEQ_LEN)
    assert b.token_type_ids.max() == 1  # the second segment is marked
    assert [e.labels.tolist() for e in src.eval_batches()] == [[rows[6]["y"], rows[7]["y"]]]
