"""The contract survives live re-sharding: `xronos run` forced to re-shard at step 7 and again at
step 14 (`--reshard-at`) exports the model single-device transformers training gives (20 fp32
steps, max abs <= 5e-4, relative <= 1e-5), for every family; the metrics say when and what moved.
Reuses test_contract's models, data, reference loop and check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runkit
from test_contract import BATCH, CONTRACT_FLAGS, LR, STEPS, L, _check, _rows
from xronos.cli.main import main

pytestmark = pytest.mark.slow

# name: (family, task, model kwargs, start layout, layout from step 7, layout from step 14). Models
# as test_contract's: 12 heads (6 KV heads for LLaMA GQA and the Qwens), 100 MLP columns; cuts on
# the run's 32-column/row quanta. Every move takes whole kinds to and from ranks holding 0.
CASES = {
    "gpt2-lm-N3": ("gpt2", "causal-lm", {"vocab_size": 96}, L((4, 4, 4), (32, 32, 36), (32, 32, 32)),
                   L((0, 12, 0), (100, 0, 0), (0, 0, 96)), L((6, 0, 6), (0, 64, 36), (64, 32, 0))),
    "bert-cls-N2": ("bert", "classify", {}, L((6, 6), (64, 36), (32, 7)), L((12, 0), (0, 100), (0, 39)),
                    L((1, 11), (96, 4), (39, 0))),
    "roberta-cls-N4": ("roberta", "classify", {"vocab_size": 160}, L((3, 3, 3, 3), (32, 32, 32, 4), (64, 32, 32, 32)),
                       L((0, 6, 0, 6), (0, 0, 64, 36), (160, 0, 0, 0)), L((2, 2, 8, 0), (32, 64, 0, 4), (32, 32, 64, 32))),
    "llama-gqa-lm-N3": ("llama", "causal-lm", {"gqa": True}, L((2, 2, 2), (32, 32, 36), (32, 6, 0)),
                        L((0, 2, 4), (64, 32, 4), (38, 0, 0)), L((6, 0, 0), (0, 0, 100), (0, 32, 6))),
    "qwen2-lm-N2": ("qwen2", "causal-lm", {}, L((3, 3), (64, 36), (128, 101)), L((0, 6), (96, 4), (229, 0)),
                    L((5, 1), (0, 100), (32, 197))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reshard_at_7_and_14_keeps_the_contract(name: str, tmp_path: Path) -> None:
    family, task, model_kw, start, at7, at14 = CASES[name]
    model_dir = runkit.make_model(tmp_path / "model", family, task, **model_kw)
    rows = _rows(44, 3, seed=len(name))
    data = runkit.write_rows(tmp_path / "data.jsonl", rows)
    metrics = tmp_path / "metrics.json"
    extra = CONTRACT_FLAGS + ("--reshard-at", f"7:{at7.to_text()}", "--reshard-at", f"14:{at14.to_text()}",
                              "--metrics", str(metrics))
    argv = runkit.run_argv(model_dir, data, task, start, tmp_path / "out", steps=STEPS, batch_size=BATCH, lr=LR,
                           extra=extra)
    assert main(argv) == 0
    reference, _ = runkit.reference_train(model_dir, rows, task, steps=STEPS, batch_size=BATCH, lr=LR)
    _check(tmp_path / "out", reference, model_dir, task)

    doc = json.loads(metrics.read_text())
    moves = doc["reshards"]
    assert [(m["step"], m["old"], m["new"]) for m in moves] == [
        (7, start.to_text(), at7.to_text()), (14, at7.to_text(), at14.to_text())]
    assert all(m["seconds"] > 0 and m["moved_bytes"] > 0 and m["reason"].startswith("--reshard-at") for m in moves)
    for r, rank in enumerate(doc["ranks"]):
        its = rank["iterations"]
        assert [i["step"] for i in its if i["reshard_s"] > 0] == [7, 14]
        assert rank["summary"]["attn"] == at14.attn[r]  # the summary states the final layout


def test_reshard_with_shuffle_clipping_warmup_decay_and_eval(tmp_path: Path) -> None:
    """What else a move must carry: the LR schedule mid-warm-up, the global-norm clip (its
    replicated set), weight decay, the shuffled data order and the evaluation after training."""
    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    rows = _rows(40, 3, seed=3)
    data = runkit.write_rows(tmp_path / "data.csv", rows)
    metrics = tmp_path / "metrics.json"
    opts = dict(weight_decay=0.01, max_grad_norm=0.05, warmup_steps=9)
    extra = ("--dropout", "0", "--weight-decay", "0.01", "--max-grad-norm", "0.05", "--warmup-steps", "9",
             "--eval-fraction", "0.2", "--metrics", str(metrics),
             "--reshard-at", "3:attn=12,0;mlp=0,100;vocab=0,37", "--reshard-at", "11:attn=1,11;mlp=96,4;vocab=32,5")
    argv = runkit.run_argv(model_dir, data, "causal-lm", (4, 8), tmp_path / "out", steps=STEPS,
                           batch_size=BATCH, lr=1e-3, seed=11, extra=extra)
    assert main(argv) == 0
    reference, tok = runkit.reference_train(model_dir, rows, "causal-lm", steps=STEPS, batch_size=BATCH,
                                            lr=1e-3, seed=11, shuffle=True, n_train=32, **opts)
    exported = runkit.model_class("causal-lm").from_pretrained(str(tmp_path / "out"))
    max_abs, rel = runkit.compare(exported, reference)
    assert max_abs <= 5e-4 and rel <= 1e-5, (max_abs, rel)
    doc = json.loads(metrics.read_text())
    ref_loss, _ = runkit.reference_eval(reference, tok, rows, "causal-lm", 32, BATCH)
    assert doc["eval_after"]["loss"] == pytest.approx(ref_loss, abs=1e-4)
    assert [i["lr"] for i in doc["ranks"][0]["iterations"][:10]] == pytest.approx(
        [1e-3 * min(1, (s + 1) / 9) for s in range(10)])
    assert [m["step"] for m in doc["reshards"]] == [3, 11]
