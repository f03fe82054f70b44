"""The owner's data pipeline: reading CSV/JSON/JSONL/Parquet, batch order, tokenisation, labels
(integer ids and names, the classes from the data or the head), instruction data (chat and
prompt/completion, the loss on the answers), and what the owner shares with the other ranks."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest
import torch

import runkit
from xronos.node.data.batches import (BatchSource, as_int_labels, batch_order, eval_row_groups, load_columns,
                                      owner_batches, split_sizes)
from xronos.node.data.labels import LabelSpace, decide_labels, label_head_in_checkpoint
from xronos.node.runconfig import RunConfig
from xronos.protocol.recipe import Recipe
from xronos.node.tp.group import TPGroup
from xronos.protocol.layout import Layout


def _cfg(model_dir: Path, data: Path, task: str, **kw) -> RunConfig:
    base = dict(model_dir=str(model_dir), data_path=str(data), task=task,
                layout=Layout(attn=(12,), mlp=(100,), vocab=(1,)), batch_size=4,  # data only: any one-rank layout
                seq_len=runkit.SEQ_LEN, lr=1e-4, max_steps=5)
    return runkit.run_config(**{**base, **kw})


def _recipe(model_dir: Path, data: Path, task: str, **kw) -> Recipe:
    """What the data code reads: the run's recipe."""
    return _cfg(model_dir, data, task, **kw).recipe


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
    (tmp_path / "bad.jsonl").write_text('{"a":1\n')  # the parser's own words, not datasets' wrapper
    with pytest.raises(ValueError, match=r"bad.jsonl could not be read as json: .*JSON parse error: Missing a comma"):
        load_columns(tmp_path / "bad.jsonl", ["text"])
    (tmp_path / "tabs.csv").write_text("text\tlabel\na b\t0\n")
    with pytest.raises(ValueError, match=r"its header is separated by tabs: a CSV file's fields are separated by commas"):
        load_columns(tmp_path / "tabs.csv", ["text", "label"])
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
    src = BatchSource(_recipe(model, data, "causal-lm", batch_size=2, shuffle=False), None)
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
    src = BatchSource(cfg.recipe, num_labels=3)
    assert (src.n_train, src.n_eval) == (6, 2)
    _, b = next(src.train_batches())
    assert b.labels.tolist() == [r["y"] for r in rows[:4]]
    assert b.token_type_ids is not None and b.token_type_ids.shape == (4, runkit.SEQ_LEN)
    assert b.token_type_ids.max() == 1  # the second segment is marked
    assert [e.labels.tolist() for e in src.eval_batches()] == [[rows[6]["y"], rows[7]["y"]]]


# --- Parquet ------------------------------------------------------------------------------------

def test_parquet_reads_like_the_others(tmp_path: Path) -> None:
    rows = [{"text": t, "label": ["neg", "pos"][i % 2]} for i, t in enumerate(runkit.texts(7))]
    path = runkit.write_rows(tmp_path / "d.parquet", rows)
    assert load_columns(path, ["text", "label"]) == {"text": [r["text"] for r in rows],
                                                     "label": [r["label"] for r in rows]}
    chats = [{"messages": [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "dog"}]}]
    path = runkit.write_rows(tmp_path / "c.parquet", chats)
    assert load_columns(path, ["messages"]) == {"messages": [chats[0]["messages"]]}


# --- class labels -------------------------------------------------------------------------------

HEADLESS = {"num_labels": 2}  # transformers' default when config.json says nothing


def test_string_labels_get_sorted_ids_and_name_the_export() -> None:
    values = ["pos", "neg", "neutral", "pos", "neg"]
    space = decide_labels(values, 5, HEADLESS, head=False, path="f.csv", column="y")
    assert space == LabelSpace(("neg", "neutral", "pos"), by_name=True) and space.num_labels == 3
    assert space.encode(values, "f.csv", "y", 5) == [2, 0, 1, 2, 0]
    assert space.config_fields() == {"num_labels": 3, "id2label": {"0": "neg", "1": "neutral", "2": "pos"},
                                     "label2id": {"neg": 0, "neutral": 1, "pos": 2}}
    # The order is the training rows' sorted names, whatever order the rows come in.
    assert decide_labels(values[::-1], 5, HEADLESS, False, "f.csv", "y") == space


def test_a_label_unseen_in_training_is_refused() -> None:
    with pytest.raises(ValueError, match=r"column 'y' row 4 \(held out for evaluation\) has label 'neutral', "
                                         r"which no training row has \(the labels: \['neg', 'pos'\]\)"):
        decide_labels(["pos", "neg", "pos", "neg", "neutral"], 4, HEADLESS, False, "f.csv", "y")
    # Integer ids of a headless checkpoint: the classes are the training rows' (at least config's).
    with pytest.raises(ValueError, match=r"row 4 \(held out for evaluation\) has label 3 outside \[0, 3\)"):
        decide_labels([0, 1, 2, 0, 3], 4, HEADLESS, False, "f.csv", "y")


def test_integer_labels_keep_the_head_or_grow_from_the_data() -> None:
    head3 = {"num_labels": 3}
    space = decide_labels([0, 2, 1.0], 3, head3, head=True, path="f.csv", column="label")
    assert space == LabelSpace(("LABEL_0", "LABEL_1", "LABEL_2"), by_name=False)
    assert space.encode([0, 2, 1.0], "f.csv", "label", 3) == [0, 2, 1]
    with pytest.raises(ValueError, match=r"row 2 has label 3 outside \[0, 3\)"):  # a head has its size
        decide_labels([0, 1, 3], 3, head3, True, "f.csv", "label")
    assert decide_labels([0, 1, 4], 3, head3, False, "f.csv", "label").num_labels == 5  # no head: from the data
    assert decide_labels([0, 1], 2, head3, False, "f.csv", "label").num_labels == 3  # never below config's
    named = {"id2label": {"0": "neg", "1": "pos"}}
    assert decide_labels([1, 0], 2, named, True, "f.csv", "label").names == ("neg", "pos")  # its names kept
    with pytest.raises(ValueError, match=r"row 1 has non-integer label 1.5"):
        decide_labels([0, 1.5], 2, head3, True, "f.csv", "label")
    with pytest.raises(ValueError, match=r"row 0 has non-integer label True"):
        decide_labels([True, 0], 2, head3, True, "f.csv", "label")
    with pytest.raises(ValueError, match=r"row 1 has label 4999: at most 4096 classes"):
        decide_labels([0, 4999], 2, head3, False, "f.csv", "label")


def test_string_labels_against_a_head_and_config_names() -> None:
    head3 = {"num_labels": 3}
    space = decide_labels(["b", "a", "b"], 3, head3, head=True, path="f.csv", column="y")
    assert space.names == ("a", "b", "LABEL_2") and space.num_labels == 3  # the head's size stays
    with pytest.raises(ValueError, match=r"4 distinct labels in its training rows, but the checkpoint's "
                                         r"classification head has 3 outputs"):
        decide_labels(["a", "b", "c", "d"], 4, head3, True, "f.csv", "y")
    named = {"id2label": {"0": "pos", "1": "neg"}, "label2id": {"pos": 0, "neg": 1}}
    space = decide_labels(["neg", "pos"], 2, named, head=True, path="f.csv", column="y")
    assert space.names == ("pos", "neg") and space.encode(["neg", "pos"], "f.csv", "y", 2) == [1, 0]
    with pytest.raises(ValueError, match=r"label\(s\) \['meh'\] that config.json's id2label does not name "
                                         r"\(it names \['pos', 'neg'\]\)"):
        decide_labels(["neg", "meh"], 2, named, True, "f.csv", "y")


def test_bad_label_columns_are_named() -> None:
    with pytest.raises(ValueError, match=r"row 1 has no label"):
        decide_labels(["a", None], 2, HEADLESS, False, "f.csv", "y")
    with pytest.raises(ValueError, match=r"row 1 has an empty label"):
        decide_labels(["a", " "], 2, HEADLESS, False, "f.csv", "y")
    with pytest.raises(ValueError, match=r"row 2: the column mixes label names \('a', row 0\) and integer ids "
                                         r"\(1, row 2\)"):
        decide_labels(["a", "b", 1], 3, HEADLESS, False, "f.csv", "y")
    # a CSV reads such a column as text throughout: an id written as text is still an id beside names
    with pytest.raises(ValueError, match=r"row 1: the column mixes label names \('pos', row 1\) and integer ids "
                                         r"\('1', row 0\)"):
        decide_labels(["1", "pos", "0"], 3, HEADLESS, False, "f.csv", "y")
    assert decide_labels(["0", "1"], 2, HEADLESS, False, "f.csv", "y").names == ("0", "1")  # no name: as before
    with pytest.raises(ValueError, match=r"has 1 distinct label\(s\) \['a'\] in its training rows; classification "
                                         r"needs at least 2"):
        decide_labels(["a", "a"], 2, HEADLESS, False, "f.csv", "y")
    with pytest.raises(ValueError, match=r"needs at least 2 \(1 of its 3 rows train, the rest are held out for "
                                         r"evaluation: a smaller eval fraction leaves more\)"):
        decide_labels(["a", "b", "a"], 1, HEADLESS, False, "f.csv", "y")
    with pytest.raises(ValueError, match=r"row 0 has a label of 300 characters \(at most 256\)"):
        decide_labels(["x" * 300, "a"], 2, HEADLESS, False, "f.csv", "y")
    with pytest.raises(ValueError, match=r"column 'y' has labels 'neg', 'neg ' that differ only in leading or "
                                         r"trailing spaces"):
        decide_labels(["neg", "pos", "neg ", "pos"], 4, HEADLESS, False, "f.csv", "y")


def test_true_and_false_in_a_csv_are_names(tmp_path: Path) -> None:
    """A CSV reader makes booleans of True/False: they are the names the file wrote."""
    from xronos.node.rank.validate import read_config

    lm = runkit.make_model(tmp_path / "lm", "gpt2", "causal-lm", num_labels=2)  # no score head
    (tmp_path / "d.csv").write_text("text,label\n" + "".join(f"{t},{'True' if i % 2 else 'False'}\n"
                                                             for i, t in enumerate(runkit.texts(8))))
    src = owner_batches(_recipe(lm, tmp_path / "d.csv", "classify", shuffle=False, eval_fraction=0.0),
                        read_config(lm))
    assert src.label_space == LabelSpace(("False", "True"), by_name=True)
    _, b = next(src.train_batches())
    assert b.labels.tolist() == [0, 1, 0, 1]


def test_the_head_is_found_in_the_checkpoint(tmp_path: Path) -> None:
    from xronos.node.rank.validate import read_config

    for family, task, head in (("gpt2", "classify", True), ("gpt2", "causal-lm", False),
                               ("llama", "causal-lm", False), ("bert", "classify", True),
                               ("roberta", "classify", True)):
        model = runkit.make_model(tmp_path / f"{family}-{task}", family, task)
        assert label_head_in_checkpoint(model, read_config(model)) is head, (family, task)


def test_the_owner_batches_decide_labels_from_data_and_checkpoint(tmp_path: Path) -> None:
    from xronos.node.rank.validate import read_config

    lm = runkit.make_model(tmp_path / "lm", "gpt2", "causal-lm", num_labels=2)  # no score head
    names = ["cat", "dog", "bird", "fish"]
    rows = [{"text": t, "label": names[i % 4]} for i, t in enumerate(runkit.texts(10))]
    data = runkit.write_rows(tmp_path / "d.csv", rows)
    src = owner_batches(_recipe(lm, data, "classify", shuffle=False, eval_fraction=0.2), read_config(lm))
    assert src.label_space == LabelSpace(("bird", "cat", "dog", "fish"), by_name=True)
    _, b = next(src.train_batches())
    assert b.labels.tolist() == [1, 2, 0, 3]
    assert src.config_fields() == {"pad_token_id": 1, **src.label_space.config_fields()}


def test_the_runtime_shares_the_classes_the_owner_decided(tmp_path: Path) -> None:
    """The one facts mechanism (`runtime.share_facts`): the owner's classes, in config.json as every
    rank builds it and typed beside it."""
    from xronos.node.rank.lifecycle import share_facts

    lm = runkit.make_model(tmp_path / "lm", "gpt2", "causal-lm", num_labels=2)  # no score head
    names = ["cat", "dog", "bird"]
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"text": t, "label": names[i % 3]}
                                                     for i, t in enumerate(runkit.texts(10))])
    facts, src = share_facts(_cfg(lm, data, "classify"), TPGroup.single())
    assert facts.labels == LabelSpace(("bird", "cat", "dog"), by_name=True) == src.label_space
    assert facts.config["num_labels"] == 3 and facts.config["id2label"] == {"0": "bird", "1": "cat", "2": "dog"}
    assert facts.config["label2id"] == {"bird": 0, "cat": 1, "dog": 2}
    assert facts.config["pad_token_id"] == facts.pad_token_id == src.pad_token_id
    lm_facts, _ = share_facts(_cfg(lm, data, "causal-lm"), TPGroup.single())
    assert lm_facts.labels is None and "id2label" not in lm_facts.config


def test_the_facts_travel_as_checked_json() -> None:
    """What a rank receives (the owner's `model_dump(mode="json")`) is checked field by field."""
    from pydantic import ValidationError

    from xronos.node.rank.lifecycle import Facts

    space = LabelSpace(("neg", "pos"), by_name=True)
    config = {"model_type": "gpt2", "pad_token_id": 0, **space.config_fields()}
    facts = Facts(config=config, n_train=10, n_eval=2, pad_token_id=0, token_types=True, labels=space)
    doc = json.loads(json.dumps(facts.model_dump(mode="json")))
    assert Facts.model_validate(doc) == facts
    lm = Facts(config={"pad_token_id": 5}, n_train=10, n_eval=0, pad_token_id=5, token_types=False, labels=None)
    assert Facts.model_validate(json.loads(json.dumps(lm.model_dump(mode="json")))) == lm
    bad = [
        ({**doc, "extra": 1}, "extra"),
        ({**doc, "n_train": -1}, "n_train"),
        ({**doc, "n_train": 2.0}, "n_train"),
        ({**doc, "token_types": 1}, "token_types"),
        ({**doc, "labels": {"names": [], "by_name": True}}, "names"),
        ({**doc, "labels": {"names": ["a", "a"], "by_name": True}}, "distinct"),
        ({**doc, "labels": {"names": ["a", 3], "by_name": True}}, "names"),
        ({**doc, "labels": {"names": ["a", ""], "by_name": True}}, "names"),
        ({**doc, "labels": {"names": ["a", "b"], "by_name": 0}}, "by_name"),
        ({**doc, "labels": {"names": ["a", "b"], "by_name": True, "x": 1}}, "x"),
        ({**doc, "labels": {"names": ["pos", "neg"], "by_name": True}}, r"\['id2label', 'label2id'\] disagree"),
        ({**doc, "pad_token_id": 3}, r"\['pad_token_id'\] disagree"),
    ]
    for d, message in bad:
        with pytest.raises(ValidationError, match=message):
            Facts.model_validate(d)


# --- instruction data ---------------------------------------------------------------------------

def _chat(*turns: str) -> list[dict]:
    """user, assistant, user, assistant, ... messages with these contents."""
    return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]


def _ref_answer_labels(tok, msgs: list[dict], seq_len: int) -> tuple[list[int], list[int]]:
    """Independently of xronos: token ids of the whole conversation, and labels that keep the
    tokens of each assistant turn (from the token counts of the conversation up to the turn with
    the generation prompt, and through it) — TRL's way of masking prompts."""
    def ids(m, prompt=False):
        return tok.apply_chat_template(m, tokenize=True, add_generation_prompt=prompt)["input_ids"]

    full = ids(msgs)
    labels = [-100] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            a, b = len(ids(msgs[:i], True)), len(ids(msgs[: i + 1]))
            assert ids(msgs[: i + 1]) == full[:b]
            labels[a:b] = full[a:b]
    pad = seq_len - len(full)
    return (full + [tok.pad_token_id] * pad)[:seq_len], (labels + [-100] * pad)[:seq_len]


CONVERSATIONS = [_chat("cat sat on the mat", "the dog ran"),
                 [{"role": "system", "content": "be quiet"}] + _chat("red box", "blue box", "old tree", "new tree"),
                 _chat("the sky", " ".join(["sea"] * 40))]  # the answer goes past seq-len: truncated


def test_chat_rows_learn_the_assistant_turns_only(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "m", "llama", "causal-lm", chat=True)
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS] * 2)
    S = 32
    src = BatchSource(_recipe(model, data, "causal-lm", data_format="chat", seq_len=S, batch_size=3,
                           shuffle=False), None)
    _, b = next(src.train_batches())
    for r, msgs in enumerate(CONVERSATIONS):
        ids, labels = _ref_answer_labels(src.tokenizer, msgs, S)
        assert b.input_ids[r].tolist() == ids and b.labels[r].tolist() == labels, r
        assert b.attention_mask[r].tolist() == [int(i < len(src.tokenizer.apply_chat_template(msgs)["input_ids"]))
                                                for i in range(S)]
    # Two answers in row 1, each with its <|im_end|>; the system and user turns are not learned.
    end = src.tokenizer.convert_tokens_to_ids("<|im_end|>")
    learned = [t for t in b.labels[1].tolist() if t != -100]
    assert learned == src.tokenizer("blue box<|im_end|> new tree<|im_end|>", add_special_tokens=False)["input_ids"]
    assert learned.count(end) == 2


def test_the_masked_loss_is_transformers_loss_on_the_answers(tmp_path: Path) -> None:
    """Our labels fed to transformers give the mean cross-entropy over the answer tokens, and the
    TP model's loss (one rank) is that loss."""
    from transformers import AutoModelForCausalLM

    from xronos.node.models.loading import SafetensorsSource, materialize
    from xronos.node.models.registry import family_for
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.rank.validate import read_config

    model = runkit.make_model(tmp_path / "m", "llama", "causal-lm", chat=True)
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS])
    src = BatchSource(_recipe(model, data, "causal-lm", data_format="chat", batch_size=3, shuffle=False), None)
    _, b = next(src.train_batches())
    hf = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    with torch.no_grad():
        out = hf(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        targets = b.labels[:, 1:].reshape(-1)
        keep = targets != -100
        manual = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert 0 < int(keep.sum()) < int(b.attention_mask[:, 1:].sum())  # prompts are left out
    assert float(out.loss) == pytest.approx(float(manual), rel=1e-5)
    config = read_config(model)
    config["pad_token_id"] = src.pad_token_id
    family = family_for(config)
    tp = family.build(config, "causal-lm", ShardLayout.single(family.sizes(config)), TPGroup.single())
    materialize(tp, SafetensorsSource(model)).eval()
    with torch.no_grad():
        assert float(tp(b.input_ids, b.attention_mask, b.labels)) == pytest.approx(float(out.loss), rel=1e-5)


def _bpe_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer (GPT-2/Qwen style: spaces belong to the next token), trained
    here, with ChatML's tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"] + runkit.CHAT_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(runkit.texts(300) + ["Q: A: user assistant system"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", chat_template=runkit.CHAT_TEMPLATE,
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(str(out))


def test_byte_level_bpe_answers_match_token_prefixes(tmp_path: Path) -> None:
    """With a byte-level BPE (offsets trimmed of the leading space), chat and prompt/completion
    labels agree with counting the prompt's own tokens."""
    from transformers import AutoTokenizer

    model = runkit.make_model(tmp_path / "m", "gpt2", "causal-lm")
    _bpe_tokenizer(model)  # replaces the WordLevel tokenizer (the vocabulary is never indexed here)
    tok = AutoTokenizer.from_pretrained(str(model))
    S = 64
    data = runkit.write_rows(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS[:2]])
    src = BatchSource(_recipe(model, data, "causal-lm", data_format="chat", seq_len=S, batch_size=2,
                           shuffle=False), None)
    _, b = next(src.train_batches())
    for r, msgs in enumerate(CONVERSATIONS[:2]):
        tok.pad_token = tok.eos_token
        assert (b.input_ids[r].tolist(), b.labels[r].tolist()) == _ref_answer_labels(tok, msgs, S)

    pairs = [{"prompt": "Q: the cat sat on A:", "completion": " the mat"},
             {"prompt": "Q: red or blue? A:", "completion": " blue"}]
    data = runkit.write_rows(tmp_path / "p.jsonl", pairs)
    src = BatchSource(_recipe(model, data, "causal-lm", data_format="prompt-completion", seq_len=S, batch_size=2,
                           shuffle=False), None)
    _, b = next(src.train_batches())
    for r, row in enumerate(pairs):
        n_prompt = len(tok(row["prompt"])["input_ids"])
        full = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
        assert b.input_ids[r, :len(full)].tolist() == full
        assert b.labels[r].tolist() == [-100] * n_prompt + full[n_prompt:] + [-100] * (S - len(full))
        assert full[-1] == tok.eos_token_id  # the model learns to stop


def test_prompt_completion_rows_learn_the_completion_and_eos(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "m", "llama", "causal-lm")  # BOS added, pad = EOS
    rows = [{"q": "cat sat on", "a": " the mat"}, {"q": "the dog", "a": " ran</s>"}]  # EOS already there
    data = runkit.write_rows(tmp_path / "d.csv", rows)
    src = BatchSource(_recipe(model, data, "causal-lm", data_format="prompt-completion", prompt_column="q",
                           completion_column="a", batch_size=2, shuffle=False), None)
    _, b = next(src.train_batches())
    tok = src.tokenizer
    for r, row in enumerate(rows):
        n_prompt = len(tok(row["q"])["input_ids"])  # with <s>
        full = tok(row["q"] + row["a"].removesuffix("</s>") + "</s>")["input_ids"]
        S = runkit.SEQ_LEN
        assert b.input_ids[r].tolist() == full + [tok.pad_token_id] * (S - len(full))
        assert b.labels[r].tolist() == [-100] * n_prompt + full[n_prompt:] + [-100] * (S - len(full))


def test_instruction_data_refusals(tmp_path: Path) -> None:
    chat_model = runkit.make_model(tmp_path / "chat", "llama", "causal-lm", chat=True)
    plain = runkit.make_model(tmp_path / "plain", "llama", "causal-lm")

    def chat(model: Path, messages, **kw):
        data = runkit.write_rows(tmp_path / "d.jsonl", [{"messages": m} for m in messages])
        return BatchSource(_recipe(model, data, "causal-lm", data_format="chat", batch_size=1, **kw), None)

    good = _chat("cat", "dog")
    with pytest.raises(ValueError, match=r"model dir .*plain: the tokenizer has no chat template, which data "
                                         r"format 'chat' needs"):
        chat(plain, [good])
    cases = [
        ([{"role": "user", "content": "cat"}, {"role": "assistant", "content": "  "}],
         r"row 0 message 1 is an empty assistant answer"),
        ([{"role": "user", "content": "cat"}], r"row 0 has no assistant message"),
        ([{"role": "assistant", "content": "dog"}, {"role": "user", "content": "cat"}],
         r"row 0: its first assistant message \(message 0\) has no user message before it"),
        ([{"role": "robot", "content": "cat"}, {"role": "assistant", "content": "dog"}],
         r"row 0 message 0 has role 'robot'; the roles are \['system', 'user', 'assistant'\]"),
        ([{"role": "user"}, {"role": "assistant", "content": "dog"}],
         r"row 0 message 0 \(user\) has no text content: None"),
        ([{"role": "user", "content": "cat"}, {"role": "assistant", "content": ["dog"]}],
         r"row 0 message 1 \(assistant\) has no text content"),
        ([], r"row 0 must be a non-empty list of \{role, content\} messages"),
        (["cat", "dog"], r"row 0 message 0 is not a \{role, content\} object: 'cat'"),
    ]
    for messages, message in cases:
        with pytest.raises(ValueError, match=message):
            chat(chat_model, [messages])
    # A CSV cell holds text, never a list.
    data = runkit.write_rows(tmp_path / "d.csv", [{"messages": json.dumps(good)}])
    with pytest.raises(ValueError, match=r"row 0 is text, not a list of \{role, content\} messages \(a CSV cell"):
        BatchSource(_recipe(chat_model, data, "causal-lm", data_format="chat", batch_size=1), None)
    # A template that renders the last turn differently cannot locate earlier answers.
    cfg_path = chat_model / "chat_template.jinja"
    cfg_path.write_text("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
                        "{% if loop.last %} sea{% endif %} {% endfor %}"
                        "{% if add_generation_prompt %}assistant{% endif %}")
    with pytest.raises(ValueError, match=r"does not render this conversation turn by turn \(message 1"):
        chat(chat_model, [_chat("cat", "dog", "red", "blue")])
    cfg_path.write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match=r"row 0: the tokenizer's chat template refused the conversation: .*"
                                         r"roles must alternate"):
        chat(chat_model, [good])

    def pc(rows, **kw):
        data = runkit.write_rows(tmp_path / "p.jsonl", rows)
        src = BatchSource(_recipe(plain, data, "causal-lm", data_format="prompt-completion", batch_size=1, **kw), None)
        src.check_all_rows()

    with pytest.raises(ValueError, match=r"row 1 has an empty completion"):
        pc([{"prompt": "cat", "completion": " dog"}, {"prompt": "cat", "completion": ""}])
    with pytest.raises(ValueError, match=r"column 'completion' row 0 is not text: 5"):
        pc([{"prompt": "cat", "completion": 5}])
    with pytest.raises(ValueError, match=r"row 1 has no answer token within the first 16 tokens \(--seq-len\)"):
        pc([{"prompt": "cat", "completion": " dog"}, {"prompt": " ".join(["cat"] * 20), "completion": " dog"}])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt', 'completion'\]"):
        pc([{"text": "cat"}])
    # Plain text data that looks like instruction data: the error says which format it may be.
    data = runkit.write_rows(tmp_path / "m.jsonl", [{"messages": good}])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['text'\].*\(conversations\? data format 'chat', "
                                         r"--data-format chat\)"):
        BatchSource(_recipe(chat_model, data, "causal-lm"), None)
    with pytest.raises(ValueError, match=r"data_format: 'chat' is a causal-lm format"):
        _cfg(chat_model, data, "classify", data_format="chat")
