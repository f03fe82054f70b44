"""A data file or model directory that is not what it should be is named for what it is: a
directory given as the data file, a file as the model directory, an empty file, a header without
rows (datasets' own words for the last two were "An error occurred while generating the dataset"
and 'Instruction "train" corresponds to no data!')."""

from __future__ import annotations

import pytest

from xronos.node.data.batches import load_columns
from xronos.node.rank.validate import read_config


def test_what_is_not_a_data_file_or_has_no_rows_is_named(tmp_path) -> None:
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(FileNotFoundError, match=r"d.csv is not a file \(a CSV, JSON, JSONL or Parquet file\)"):
        load_columns(tmp_path / "d.csv", ["text"])
    (tmp_path / "z.csv").write_text("")
    with pytest.raises(ValueError, match="z.csv is empty"):
        load_columns(tmp_path / "z.csv", ["text"])
    (tmp_path / "h.csv").write_text("text,label\n")
    with pytest.raises(ValueError, match="h.csv has no rows"):
        load_columns(tmp_path / "h.csv", ["text"])
    with pytest.raises(FileNotFoundError, match="missing.csv does not exist"):
        load_columns(tmp_path / "missing.csv", ["text"])


def test_a_file_given_as_the_model_directory_is_named(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="model.safetensors is not a directory"):
        read_config(tmp_path / "model.safetensors")
