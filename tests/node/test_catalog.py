"""The owner's report of its allowed directories (node/agent/catalog.py): model directories and data
files on a real temp tree, confined (links out are not listed, a link loop ends), bounded (count,
path length, entries looked at). The node service's publishing: tests/services/test_homeassistant_glue.py."""

from __future__ import annotations

from pathlib import Path

from xronos.node.agent import catalog
from xronos.protocol import messages as m


def _model(d: Path, weights: str | None = "model.safetensors") -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    if weights:
        (d / weights).write_bytes(b"\0" * 8)
    return d


def test_models_and_data_files(tmp_path):
    root = tmp_path / "srv"
    qwen = _model(root / "models" / "qwen")
    sharded = _model(root / "models" / "llama", weights="model-00001-of-00002.safetensors")
    _model(root / "models" / "half", weights=None)  # no weights (yet): neither a model nor data
    (root / "data" / "deep").mkdir(parents=True)
    for name in ("chat.jsonl", "reviews.CSV", "rows.parquet", "deep/qa.json", "notes.txt", ".hidden.csv"):
        (root / "data" / name).write_text("x")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.csv").write_text("x")
    adapter = root / "exports" / "lora"  # a PEFT adapter export: neither a model nor data
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (adapter / name).write_text("{}")
    jobs = root / "jobs"  # the node's own job directories (checkpoints) are not offered
    _model(jobs / "j1" / "checkpoint")
    found = catalog.scan([root], skip=[jobs])
    assert found.models == (str(sharded), str(qwen))
    assert found.data == tuple(str(root / "data" / n) for n in ("chat.jsonl", "deep/qa.json", "reviews.CSV",
                                                                "rows.parquet"))
    assert found.left_out == 0
    # A model directory's own json files are never data, nor is anything below it.
    assert not any("/models/" in p or "/exports/" in p for p in found.data)


def test_data_suffixes_are_the_loaders():
    from xronos.node.data.batches import _BUILDERS

    assert set(catalog.DATA_SUFFIXES) == set(_BUILDERS)


def test_links_out_of_the_allowed_dirs_are_not_listed(tmp_path):
    root, outside = tmp_path / "srv", tmp_path / "home"
    root.mkdir()
    _model(outside / "secret-model")
    (outside / "secret.csv").write_text("x")
    (root / "escape-dir").symlink_to(outside)
    (root / "escape.csv").symlink_to(outside / "secret.csv")
    (root / "model-link").symlink_to(outside / "secret-model")
    inner = _model(tmp_path / "srv" / "real")
    weights_out = _model(root / "weights-out", weights=None)  # weights only through a link out
    (weights_out / "model.safetensors").symlink_to(outside / "secret-model" / "model.safetensors")
    (root / "loop").symlink_to(root)  # a cycle: entered once
    (root / "ok.csv").write_text("x")
    (root / "same.csv").symlink_to(root / "ok.csv")  # a link inside: fine
    found = catalog.scan([root])
    assert found.models == (str(inner),)
    assert found.data == (str(root / "ok.csv"), str(root / "same.csv"))
    assert "secret" not in repr(found)


def test_bounded_in_count_length_and_work(tmp_path):
    root = tmp_path / "srv"
    root.mkdir()
    for i in range(5):
        (root / f"d{i}.csv").write_text("x")
    long = root / ("x" * 120) / ("y" * 120)
    long.mkdir(parents=True)
    (long / "far-too-long-a-path.csv").write_text("x")
    found = catalog.scan([root], cap=3)
    assert found.data == tuple(str(root / f"d{i}.csv") for i in range(3))
    assert found.left_out == 3  # two over the cap, one path over Home Assistant's 255 characters
    assert all(len(p) <= m.CATALOG_PATH_MAX for p in found.data)
    few = catalog.scan([root], max_visits=2)
    assert len(few.data) <= 2 and few.left_out >= 1
    deep = root / "a" / "b" / "c" / "d" / "e"
    deep.mkdir(parents=True)
    (deep / "deep.csv").write_text("x")
    assert str(deep / "deep.csv") not in catalog.scan([root], max_depth=4).data
    assert str(deep / "deep.csv") in catalog.scan([root], max_depth=5).data


def test_a_missing_or_unreadable_dir_is_an_empty_catalog(tmp_path):
    assert catalog.scan([tmp_path / "nope"]) == catalog.Found((), (), 0)

