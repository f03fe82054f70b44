"""The contract for the new kinds of data: `xronos run` with string labels on a checkpoint without
a classification head, and with chat and prompt/completion data (the loss on the answers only),
equals a plain single-process transformers loop whose batches are built here, independently:
labels by sorted names, answer masks by counting the prompt's own tokens (TRL's way)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import runkit
from xronos.cli.main import main
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

LR, STEPS, BATCH, S = 1e-3, 12, 4, runkit.SEQ_LEN
MAX_ABS, MAX_REL = 5e-4, 1e-5
FLAGS = ("--no-shuffle", "--dropout", "0", "--weight-decay", "0")


def _check(out: Path, reference, initial, task: str) -> None:
    exported = runkit.model_class(task).from_pretrained(str(out))
    max_abs, rel = runkit.compare(exported, reference)
    print(f"{out}: max abs {max_abs:.1e}, relative {rel:.1e}")
    assert max_abs <= MAX_ABS and rel <= MAX_REL, (max_abs, rel)
    moved_abs, moved_rel = runkit.compare(initial, reference)
    assert moved_rel > 100 * MAX_REL and moved_abs > MAX_ABS, (moved_abs, moved_rel)  # it trained


def test_string_labels_on_a_checkpoint_without_a_head(tmp_path: Path) -> None:
    """GPT-2 LM checkpoint (no score head) + labels named in the data: 3 classes from the data, ids
    in sorted order, id2label/label2id in the export, training equal to transformers' from the
    same fresh head."""
    from transformers import AutoModelForSequenceClassification, GPT2ForSequenceClassification

    from xronos.node.models.loading import _fill, _generator

    lm = runkit.make_model(tmp_path / "lm", "gpt2", "causal-lm", num_labels=2)
    rng = random.Random(5)
    names = ["sea", "bird", "tree"]
    rows = [{"text": t, "label": rng.choice(names)} for t in runkit.texts(40, 5)]
    data = runkit.write_rows(tmp_path / "d.csv", rows)
    metrics = tmp_path / "m.json"
    layout = Layout(attn=(0, 12), mlp=(96, 4), vocab=(37, 0))
    argv = runkit.run_argv(lm, data, "classify", layout, tmp_path / "out", steps=STEPS, batch_size=BATCH, lr=LR,
                           extra=FLAGS + ("--eval-fraction", "0.2", "--metrics", str(metrics)))
    assert main(argv) == 0

    order = sorted(names)  # bird, sea, tree
    exported = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out"))
    assert exported.config.id2label == dict(enumerate(order))
    assert exported.config.label2id == {n: i for i, n in enumerate(order)} and exported.config.num_labels == 3

    # The reference starts from the same checkpoint and the head xronos draws for a missing tensor.
    ref_dir = tmp_path / "ref"
    start = GPT2ForSequenceClassification.from_pretrained(str(lm), num_labels=3)
    with torch.no_grad():
        _fill(start.score.weight, "normal", start.config.initializer_range, _generator("missing", "score.weight"))
    start.save_pretrained(str(ref_dir))
    runkit.make_tokenizer(ref_dir, "gpt2")
    ids = [{"text": r["text"], "label": order.index(r["label"])} for r in rows]
    reference, tok = runkit.reference_train(ref_dir, ids, "classify", steps=STEPS, batch_size=BATCH, lr=LR, n_train=32)
    _check(tmp_path / "out", reference, runkit.model_class("classify").from_pretrained(str(ref_dir)), "classify")
    loss, accuracy = runkit.reference_eval(reference, tok, ids, "classify", 32, BATCH)
    doc = json.loads(metrics.read_text())
    assert doc["eval_after"]["loss"] == pytest.approx(loss, abs=1e-4)
    assert doc["eval_after"]["accuracy"] == pytest.approx(accuracy)


# --- instruction data ---------------------------------------------------------------------------

def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(runkit.WORDS) for _ in range(rng.randint(lo, hi)))


def _chat_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = 4 if i % 5 == 0 else 2  # some two-answer conversations (the second answer past seq-len is cut)
        msgs = ([{"role": "system", "content": _words(rng, 1, 2)}] if i % 3 == 0 else [])
        msgs += [{"role": ("user", "assistant")[t % 2], "content": _words(rng, 1, 3 if t % 2 == 0 else 6)}
                 for t in range(turns)]
        rows.append({"messages": msgs})
    return rows


def _pc_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _words(rng, 1, 8), "completion": " " + _words(rng, 1, 8)} for _ in range(n)]


def _chat_encoding(tok, row: dict) -> tuple[list[int], list[int]]:
    msgs = row["messages"]

    def ids(m, prompt=False):
        return tok.apply_chat_template(m, tokenize=True, add_generation_prompt=prompt)["input_ids"]

    full = ids(msgs)
    labels = [-100] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            a, b = len(ids(msgs[:i], True)), len(ids(msgs[: i + 1]))
            labels[a:b] = full[a:b]
    return full, labels


def _pc_encoding(tok, row: dict) -> tuple[list[int], list[int]]:
    full = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
    n = len(tok(row["prompt"])["input_ids"])
    return full, [-100] * n + full[n:]


def _batch(tok, rows: list[dict], idx: list[int], encode) -> dict:
    ids, mask, labels = [], [], []
    for i in idx:
        full, lab = encode(tok, rows[i])
        full, lab, pad = full[:S], lab[:S], max(0, S - len(full))
        ids.append(full + [tok.pad_token_id] * pad)
        mask.append([1] * len(full) + [0] * pad)
        labels.append(lab + [-100] * pad)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


INSTRUCT = {
    # name: (family, data format, rows, data suffix, layout)
    "llama-chat-N3-mixed": ("llama", "chat", _chat_rows, ".jsonl", Layout(attn=(0, 2, 6), mlp=(64, 32, 4),
                                                                            vocab=(32, 0, 11))),
    "gpt2-prompt-completion-N2": ("gpt2", "prompt-completion", _pc_rows, ".parquet", (5, 7)),
}


@pytest.mark.parametrize("name", list(INSTRUCT))
def test_instruction_data_trains_on_the_answers_like_transformers(name: str, tmp_path: Path) -> None:
    family, fmt, make_rows, suffix, split = INSTRUCT[name]
    model_dir = runkit.make_model(tmp_path / "model", family, "causal-lm", chat=fmt == "chat")
    rows = make_rows(40, seed=len(name))
    data = runkit.write_rows(tmp_path / f"d{suffix}", rows)
    metrics = tmp_path / "m.json"
    argv = runkit.run_argv(model_dir, data, "causal-lm", split, tmp_path / "out", steps=STEPS, batch_size=BATCH,
                           lr=LR, extra=FLAGS + ("--data-format", fmt, "--metrics", str(metrics)))
    assert main(argv) == 0

    tok = runkit._tokenizer(model_dir)
    encode = _chat_encoding if fmt == "chat" else _pc_encoding
    model = runkit.load_reference_model(model_dir, "causal-lm", tok.pad_token_id)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, answer_tokens, tokens = [], 0, 0
    for idx in runkit.batch_rows(len(rows), BATCH, STEPS, False, 0):
        batch = _batch(tok, rows, idx, encode)
        answer_tokens += int((batch["labels"][:, 1:] != -100).sum())
        tokens += int(batch["attention_mask"][:, 1:].sum())
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert 0 < answer_tokens < tokens  # the prompts were left out of the loss
    doc = json.loads(metrics.read_text())
    assert [i["loss"] for i in doc["ranks"][0]["iterations"]] == pytest.approx(losses, rel=1e-4, abs=1e-5)
    _check(tmp_path / "out", model, runkit.model_class("causal-lm").from_pretrained(str(model_dir)), "causal-lm")

    if fmt == "chat":  # the export carries the template: transformers generates an answer from it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        out_tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
        prompt = out_tok.apply_chat_template([{"role": "user", "content": "red box"}], add_generation_prompt=True,
                                             return_tensors="pt")
        generated = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).generate(
            **prompt, max_new_tokens=3, do_sample=False, pad_token_id=out_tok.eos_token_id)
        assert generated.shape[1] > prompt["input_ids"].shape[1]
