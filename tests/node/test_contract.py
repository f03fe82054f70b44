"""THE CONTRACT: `xronos run` on N ranks with any split == a plain single-process transformers loop.

Each case runs the real command (real processes, Gloo on loopback, safetensors from disk), loads
the exported directory with plain transformers, and compares every parameter with the reference
loop (same checkpoint, torch AdamW, the same batches built here from the tokenizer). The check can
fail: training moves the weights ~1000x further than the tolerance (asserted too).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import runkit
from xronos.cli.main import main
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

LR, STEPS, BATCH = 1e-4, 20, 4
MAX_ABS, MAX_REL = 5e-4, 1e-5
CONTRACT_FLAGS = ("--no-shuffle", "--dropout", "0", "--weight-decay", "0")


def _rows(n: int, num_labels: int, seed: int, pairs: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = [{"text": t, "label": rng.randrange(num_labels)} for t in runkit.texts(n, seed)]
    if pairs:
        for r, p in zip(rows, runkit.texts(n, seed + 100)):
            r["pair"] = p
    return rows



LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)  # Llama-3.2-1B's numbers, its context cut to 8


def L(attn, mlp, vocab) -> Layout:
    """A per-segment layout, given to `xronos run --layout` (cuts on the run's quanta: 32 MLP
    columns, 32 vocabulary rows; only the last holder of a kind keeps a remainder)."""
    return Layout(attn=attn, mlp=mlp, vocab=vocab)


# name: (family, task, units (head-tied --units) or a Layout (--layout), data suffix, extra model
# kwargs, text pairs). Models: 12 heads (LLaMA 8, or 6 KV heads under GQA), 100 MLP columns, the
# tokenizer's vocabulary (37-39 rows) unless padded by vocab_size. Every mixed case has a rank
# with 0 heads but MLP columns, a rank with heads but 0 vocabulary rows, and kinds lopsided in
# opposite directions.
CASES = {
    "gpt2-lm-N1": ("gpt2", "causal-lm", (12,), ".csv", {}, False),
    "gpt2-cls-N3-1,10,1": ("gpt2", "classify", (1, 10, 1), ".jsonl", {}, False),
    "bert-cls-pairs-N4-3,0,8,1": ("bert", "classify", (3, 0, 8, 1), ".json", {}, True),
    "roberta-cls-N2-5,7": ("roberta", "classify", (5, 7), ".csv", {}, False),
    "llama-lm-N5-1,2,0,3,2": ("llama", "causal-lm", (1, 2, 0, 3, 2), ".jsonl", {}, False),
    "llama-gqa-cls-N3-0,3,3": ("llama", "classify", (0, 3, 3), ".csv", {"gqa": True}, False),
    "gpt2-cls-N2-mixed": ("gpt2", "classify", L((0, 12), (96, 4), (37, 0)), ".csv", {}, False),
    "bert-cls-pairs-N3-mixed": ("bert", "classify", L((9, 0, 3), (0, 64, 36), (0, 32, 7)), ".json", {}, True),
    "llama-gqa-lm-N3-mixed": ("llama", "causal-lm", L((0, 2, 4), (64, 32, 4), (38, 0, 0)), ".jsonl",
                              {"gqa": True}, False),
    "gpt2-lm-N4-mixed": ("gpt2", "causal-lm", L((0, 6, 2, 4), (64, 0, 32, 4), (32, 0, 96, 64)), ".jsonl",
                         {"vocab_size": 192}, False),
    "roberta-cls-N5-mixed": ("roberta", "classify", L((2, 0, 4, 0, 6), (0, 32, 0, 64, 4), (64, 32, 0, 32, 32)),
                             ".csv", {"vocab_size": 160}, False),
    # The LLaMA-style variants (6 KV heads, 100 MLP columns): Llama 3.x and linear RoPE scaling
    # (38 vocabulary rows), Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms, head_dim 8, tied) with
    # their byte-level BPE tokenizer (229 rows).
    "llama3-lm-N3-mixed": ("llama", "causal-lm", L((0, 2, 4), (64, 32, 4), (38, 0, 0)), ".jsonl",
                           {"gqa": True, "rope": LLAMA3_ROPE}, False),
    "llama-linear-cls-N2-mixed": ("llama", "classify", L((0, 8), (96, 4), (38, 0)), ".csv",
                                  {"rope": dict(rope_type="linear", factor=2.0, rope_theta=10000.0)}, False),
    "qwen2-lm-N2-mixed": ("qwen2", "causal-lm", L((0, 6), (96, 4), (229, 0)), ".jsonl", {}, False),
    "qwen2-cls-N3-0,2,4": ("qwen2", "classify", (0, 2, 4), ".csv", {}, False),
    "qwen3-lm-N3-mixed": ("qwen3", "causal-lm", L((4, 0, 2), (0, 64, 36), (0, 32, 197)), ".jsonl", {}, False),
    "qwen3-cls-N2-mixed": ("qwen3", "classify", L((6, 0), (32, 68), (0, 229)), ".json", {}, False),
}


def _check(exported_dir: Path, reference, initial_dir: Path, task: str) -> None:
    exported = runkit.model_class(task).from_pretrained(str(exported_dir))
    assert type(exported).__name__ == type(reference).__name__
    max_abs, rel = runkit.compare(exported, reference)
    print(f"{exported_dir}: max abs {max_abs:.1e}, relative {rel:.1e}")
    assert max_abs <= MAX_ABS and rel <= MAX_REL, (max_abs, rel)
    initial = runkit.model_class(task).from_pretrained(str(initial_dir))
    moved_abs, moved_rel = runkit.compare(initial, reference)
    assert moved_rel > 100 * MAX_REL and moved_abs > MAX_ABS, (moved_abs, moved_rel)  # it trained


@pytest.mark.parametrize("name", list(CASES))
def test_tp_run_equals_single_process_training(name: str, tmp_path: Path) -> None:
    family, task, units, suffix, model_kw, pairs = CASES[name]
    model_dir = runkit.make_model(tmp_path / "model", family, task, **model_kw)
    rows = _rows(44, 3, seed=len(name), pairs=pairs)
    data = runkit.write_rows(tmp_path / f"data{suffix}", rows)
    extra = CONTRACT_FLAGS + (("--text-pair-column", "pair") if pairs else ())
    argv = runkit.run_argv(model_dir, data, task, units, tmp_path / "out", steps=STEPS,
                           batch_size=BATCH, lr=LR, extra=extra)
    assert main(argv) == 0
    reference, _ = runkit.reference_train(model_dir, rows, task, steps=STEPS, batch_size=BATCH, lr=LR)
    _check(tmp_path / "out", reference, model_dir, task)


# MiniLM: 12 heads, 1536 MLP columns, 30522 vocabulary rows.
MINILM_SPLITS = {"N3-1,10,1": (1, 10, 1),
                 "N4-mixed": L((0, 3, 7, 2), (512, 768, 0, 256), (10240, 0, 4096, 16186))}


@pytest.mark.parametrize("split", list(MINILM_SPLITS))
def test_pretrained_minilm_lopsided(tmp_path: Path, split: str) -> None:
    model_dir = runkit.make_minilm_classifier(tmp_path / "minilm", num_labels=2)
    rows = _rows(40, 2, seed=7)
    data = runkit.write_rows(tmp_path / "data.jsonl", rows)
    argv = runkit.run_argv(model_dir, data, "classify", MINILM_SPLITS[split], tmp_path / "out", steps=STEPS,
                           batch_size=BATCH, lr=LR, extra=CONTRACT_FLAGS)
    assert main(argv) == 0
    reference, _ = runkit.reference_train(model_dir, rows, "classify", steps=STEPS, batch_size=BATCH, lr=LR)
    _check(tmp_path / "out", reference, model_dir, "classify")


def test_shuffle_clipping_warmup_decay_eval_and_metrics(tmp_path: Path, capfd) -> None:
    """Beyond the contract's flags: seeded shuffling over 2+ epochs, global-norm clipping (that
    actually clips), warmup, weight decay and the held-out evaluation still match the reference."""
    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    rows = _rows(40, 3, seed=3)
    data = runkit.write_rows(tmp_path / "data.csv", rows)
    metrics = tmp_path / "metrics.json"
    opts = dict(weight_decay=0.01, max_grad_norm=0.05, warmup_steps=5)
    extra = ("--dropout", "0", "--weight-decay", "0.01", "--max-grad-norm", "0.05", "--warmup-steps", "5",
             "--eval-fraction", "0.2", "--metrics", str(metrics))
    argv = runkit.run_argv(model_dir, data, "causal-lm", (4, 8), tmp_path / "out", steps=STEPS,
                           batch_size=BATCH, lr=1e-3, seed=11, extra=extra)
    assert main(argv) == 0
    out = capfd.readouterr().out
    reference, tok = runkit.reference_train(model_dir, rows, "causal-lm", steps=STEPS, batch_size=BATCH,
                                            lr=1e-3, seed=11, shuffle=True, n_train=32, **opts)
    exported = runkit.model_class("causal-lm").from_pretrained(str(tmp_path / "out"))
    max_abs, rel = runkit.compare(exported, reference)
    assert max_abs <= MAX_ABS and rel <= MAX_REL, (max_abs, rel)
    # The same run without clipping ends elsewhere, so the clipping above was exercised.
    unclipped, _ = runkit.reference_train(model_dir, rows, "causal-lm", steps=STEPS, batch_size=BATCH,
                                          lr=1e-3, seed=11, shuffle=True, n_train=32, weight_decay=0.01,
                                          warmup_steps=5)
    assert runkit.compare(unclipped, reference)[1] > 100 * MAX_REL

    doc = json.loads(metrics.read_text())
    ref_loss, ref_ppl = runkit.reference_eval(reference, tok, rows, "causal-lm", 32, BATCH)
    assert doc["eval_after"]["rows"] == 8
    assert doc["eval_after"]["loss"] == pytest.approx(ref_loss, abs=1e-4)
    assert doc["eval_after"]["perplexity"] == pytest.approx(ref_ppl, rel=1e-3)
    initial = runkit.load_reference_model(model_dir, "causal-lm", tok.pad_token_id)
    assert doc["eval_before"]["loss"] == pytest.approx(runkit.reference_eval(initial, tok, rows, "causal-lm", 32, BATCH)[0], abs=1e-4)
    assert [r["summary"]["attn"] for r in doc["ranks"]] == [4, 8]
    for r in doc["ranks"]:
        its = r["iterations"]
        assert [i["step"] for i in its] == list(range(STEPS))
        assert [i["epoch"] for i in its] == [s // 8 for s in range(STEPS)]  # 32 rows / 4 per batch
        assert [i["lr"] for i in its[:6]] == pytest.approx([1e-3 * min(1, (s + 1) / 5) for s in range(6)])
        for i in its:
            assert i["comm_s"] > 0 and i["idle_s"] >= 0 and i["compute_s"] > 0 and i["data_s"] > 0
            assert i["iteration_s"] >= i["compute_s"]
            assert i["peak_rss"] > 0
    # Loss is a replicated value: every rank reports the same one.
    assert [i["loss"] for i in doc["ranks"][0]["iterations"]] == [i["loss"] for i in doc["ranks"][1]["iterations"]]
    assert "idle %" in out and "peak RSS" in out
    assert "eval after training" in out
