"""Pre-flight refusals: every bad input is named before any process is spawned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import runkit
from xronos.node.runconfig import RunConfig
from xronos.node.rank.validate import model_sizes, preflight
from xronos.protocol.layout import Layout, Sizes

# runkit's GPT-2: 12 heads, 100 MLP columns, its words plus 2 special tokens as vocabulary.
SIZES = Sizes(attn=12, mlp=100, vocab=len(runkit.WORDS) + 2)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    return runkit.small_classifier(tmp_path_factory.mktemp("validate"), labels=3, n_rows=10, data="data.jsonl")


def _cfg(model: Path, data: Path, **kw) -> RunConfig:
    base = dict(model_dir=str(model), data_path=str(data), task="classify", batch_size=4,
                seq_len=16, lr=1e-4, max_steps=3)
    try:  # the head-tied layout of the model as it is on disk (tests edit its config)
        sizes = model_sizes(model)
    except (OSError, ValueError):
        sizes = SIZES
    layout = kw.pop("layout", None) or Layout.tied(kw.pop("units", [4, 8]), sizes)
    return runkit.run_config(**{**base, **kw, "layout": layout})


def _copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "copy"))


def _edit_config(model: Path, **changes) -> None:
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def test_a_good_run_passes(good) -> None:
    pre = preflight(_cfg(*good, eval_fraction=0.2), nodes=2)
    assert (pre.family, pre.sizes, pre.num_labels, pre.train_rows, pre.eval_rows) == ("gpt2", SIZES, 3, 8, 2)


def test_model_dir_problems(good, tmp_path: Path) -> None:
    model, data = good
    with pytest.raises(FileNotFoundError, match="model dir .*nowhere does not exist"):
        preflight(_cfg(tmp_path / "nowhere", data), 2)
    m = _copy(model, tmp_path)
    _edit_config(m, architectures=None)
    with pytest.raises(ValueError, match="no 'architectures'"):
        preflight(_cfg(m, data), 2)
    _edit_config(m, architectures=["T5ForConditionalGeneration"])
    with pytest.raises(ValueError, match="unsupported architecture T5ForConditionalGeneration"):
        preflight(_cfg(m, data), 2)
    (m / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        preflight(_cfg(m, data), 2)


def test_layout_must_match_nodes_sizes_and_quanta(good) -> None:
    def lay(attn, mlp, vocab):
        return Layout(attn=attn, mlp=mlp, vocab=vocab)

    v = SIZES.vocab
    with pytest.raises(ValueError, match=r"attn: counts \[4, 7\] sum to 11, but the model has 12 attention units"):
        preflight(_cfg(*good, layout=lay((4, 7), (32, 68), (32, v - 32))), 2)
    with pytest.raises(ValueError, match=r"layout has 3 ranks but the world has 2"):
        preflight(_cfg(*good, layout=lay((4, 4, 4), (32, 32, 36), (32, 0, v - 32))), 2)
    with pytest.raises(ValueError, match=r"mlp: the cut after rank 0 falls at 30, not a multiple of the MLP "
                                         r"columns quantum 32"):
        preflight(_cfg(*good, layout=lay((4, 8), (30, 70), (32, v - 32))), 2)
    with pytest.raises(ValueError, match=r"vocab: counts .* sum to"):
        preflight(_cfg(*good, layout=lay((4, 8), (32, 68), (32, v))), 2)
    with pytest.raises(ValueError):
        _cfg(*good, layout=lay((-1, 13), (32, 68), (32, v - 32)))
    # A rank with no heads but MLP columns, and one with heads but no vocabulary rows, are fine.
    preflight(_cfg(*good, layout=lay((0, 12), (64, 36), (v, 0))), 2)


def test_seq_len_above_the_model_maximum(good) -> None:
    with pytest.raises(ValueError, match="--seq-len 65 exceeds the model's maximum of 64"):
        preflight(_cfg(*good, seq_len=65), 2)


def test_checkpoint_problems(good, tmp_path: Path) -> None:
    model, data = good
    m = _copy(model, tmp_path)
    weights = m / "model.safetensors"
    state = load_file(str(weights))
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="lacks tensor transformer.h.1.mlp.c_fc.weight"):
        preflight(_cfg(m, data), 2)
    _edit_config(m, n_inner=64)
    shutil.copy(model / "model.safetensors", weights)
    with pytest.raises(ValueError, match=r"has shape \[48, 100\], config.json implies \[48, 64\]"):
        preflight(_cfg(m, data), 2)
    _edit_config(m, n_inner=100)
    raw = bytearray(weights.read_bytes())
    raw[8:40] = b"\xff" * 32  # corrupt the JSON header
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="model.safetensors is unreadable"):
        preflight(_cfg(m, data), 2)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        preflight(_cfg(m, data), 2)


def test_tokenizer_missing(good, tmp_path: Path) -> None:
    model, data = good
    m = _copy(model, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (m / f).unlink()
    with pytest.raises(ValueError, match="tokenizer could not be loaded"):
        preflight(_cfg(m, data), 2)


def test_data_problems(good, tmp_path: Path) -> None:
    model, _ = good
    with pytest.raises(FileNotFoundError, match="missing.csv does not exist"):
        preflight(_cfg(model, tmp_path / "missing.csv"), 2)
    d = runkit.write_rows(tmp_path / "d1.csv", [{"sentence": "a", "label": 0}] * 8)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['text'\]"):
        preflight(_cfg(model, d), 2)
    d = runkit.write_rows(tmp_path / "d2.jsonl", [{"text": "a", "label": 0}] * 7 + [{"text": "b", "label": 0.5}])
    with pytest.raises(ValueError, match=r"row 7 has non-integer label 0.5"):
        preflight(_cfg(model, d), 2)
    d = runkit.write_rows(tmp_path / "d3.json", [{"text": "a", "label": i} for i in range(4)])
    with pytest.raises(ValueError, match=r"row 3 has label 3 outside \[0, 3\)"):
        preflight(_cfg(model, d), 2)
    d = runkit.write_rows(tmp_path / "d4.jsonl", [{"text": "a", "label": 0}] * 5)
    with pytest.raises(ValueError, match=r"--batch-size 4 is larger than the 3 training rows .*\(2 rows held out"):
        preflight(_cfg(model, d, eval_fraction=0.4), 2)
    d = runkit.write_rows(tmp_path / "d5.jsonl", [{"text": "a", "label": 0}] * 3 + [{"text": 5, "label": 0}])
    with pytest.raises(ValueError, match=r"column 'text' row 3 is not text: 5"):
        preflight(_cfg(model, d, batch_size=2), 2)
    # causal-lm needs no label column
    d = runkit.write_rows(tmp_path / "d6.jsonl", [{"text": "a b"}] * 4)
    lm = _copy(model, tmp_path)
    assert preflight(_cfg(lm, d, task="causal-lm"), 2).num_labels is None


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> Path:
    """A GPT-2 LM checkpoint: no classification head, so the data says how many labels there are."""
    return runkit.make_model(tmp_path_factory.mktemp("headless") / "gpt2", "gpt2", "causal-lm", num_labels=2)


def test_string_labels_and_num_labels_from_the_data(good, headless, tmp_path: Path) -> None:
    names = ["sky", "sea", "tree", "stone", "river"]
    rows = [{"text": t, "label": names[i % 5]} for i, t in enumerate(runkit.texts(12))]
    data = runkit.write_rows(tmp_path / "d.parquet", rows)
    pre = preflight(_cfg(headless, data, eval_fraction=1 / 6), 2)
    assert pre.num_labels == 5 and pre.labels.names == ("river", "sea", "sky", "stone", "tree")
    assert (pre.train_rows, pre.eval_rows) == (10, 2)
    ints = runkit.write_rows(tmp_path / "i.csv", [{"text": t, "label": i % 7} for i, t in enumerate(runkit.texts(8))])
    assert preflight(_cfg(headless, ints), 2).num_labels == 7  # no head: the training rows' largest id + 1
    # With a head (the good model has 3 outputs) the names must fit it; integer labels stay as they were.
    with pytest.raises(ValueError, match=r"5 distinct labels in its training rows, but the checkpoint's "
                                         r"classification head has 3 outputs"):
        preflight(_cfg(good[0], data), 2)
    with pytest.raises(ValueError, match=r"row 3 has label 3 outside \[0, 3\)"):
        preflight(_cfg(good[0], ints), 2)


def test_a_label_only_in_the_eval_rows_is_refused(headless, tmp_path: Path) -> None:
    rows = [{"text": t, "label": ["sea", "sky"][i % 2]} for i, t in enumerate(runkit.texts(9))]
    rows.append({"text": "a tree", "label": "tree"})
    data = runkit.write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 9 \(held out for evaluation\) has label 'tree', which no training "
                                         r"row has \(the labels: \['sea', 'sky'\]\)"):
        preflight(_cfg(headless, data, eval_fraction=0.2), 2)


def test_instruction_data_is_checked_before_any_process(headless, tmp_path: Path) -> None:
    chat = [{"messages": [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "dog"}]}] * 4
    data = runkit.write_rows(tmp_path / "c.jsonl", chat)
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template, which data format 'chat' needs"):
        preflight(_cfg(headless, data, task="causal-lm", data_format="chat"), 2)
    chat_model = runkit.make_model(tmp_path / "chat", "gpt2", "causal-lm", chat=True)
    assert preflight(_cfg(chat_model, data, task="causal-lm", data_format="chat"), 2).train_rows == 4
    long = chat + [{"messages": [{"role": "user", "content": " ".join(["sea"] * 30)},
                                 {"role": "assistant", "content": "dog"}]}]
    with pytest.raises(ValueError, match=r"row 4 has no answer token within the first 16 tokens"):
        preflight(_cfg(chat_model, runkit.write_rows(tmp_path / "l.jsonl", long), task="causal-lm",
                       data_format="chat"), 2)
    pc = [{"prompt": "cat", "completion": " dog"}] * 3 + [{"prompt": "cat", "completion": ""}]
    with pytest.raises(ValueError, match=r"row 3 has an empty completion"):
        preflight(_cfg(headless, runkit.write_rows(tmp_path / "p.csv", pc), task="causal-lm",
                       data_format="prompt-completion"), 2)
