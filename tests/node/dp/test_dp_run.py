"""`xronos run --shares` == single-device transformers (+ peft) training, over real rank processes.

Each case runs the real command (one process per rank, Gloo on loopback, the owner reading and
tokenising the data and sending each rank its group's rows): pure data parallelism (`--nodes` =
groups, the whole model on every rank) with uneven shares and a 0 share, and DP×TP meshes (two
groups of two ranks, each group at the same lopsided per-segment layout), for a causal LM and a
classifier, full and LoRA (`--export-merged`: the merged model is compared). The export is
loaded with plain transformers and compared with the reference loop (same checkpoint, torch
AdamW, the same batches built from the tokenizer): max abs <= 5e-4, relative <= 1e-5 after 20
fp32 steps; the weights moved far beyond that (asserted). The held-out tail (9 rows: batches of 4,
4 and 1, each evaluated by one group) is evaluated before and after training as the reference
model evaluates it. XRONOS_DP_FULL=1 adds more families.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import dpkit
import runkit
from xronos.cli.main import main

pytestmark = pytest.mark.slow

STEPS = 20
ROWS, N_EVAL = 44, 9  # --eval-fraction 0.2 holds out the last 9 rows
LORA_LR = 1e-3  # adapters move little at 1e-4: the check that they trained needs a larger rate

# name: (family, task, LoRA targets or None, --nodes, --shares, --layout of each group or None)
CASES = {
    "gpt2-lm-full-dp3-2,0,2": ("gpt2", "causal-lm", None, 3, "2,0,2", None),
    "bert-cls-lora-dp3-0,3,1": ("bert", "classify", ("query", "value"), 3, "0,3,1", None),
    "gpt2-lm-full-mesh2x2-3,1": ("gpt2", "causal-lm", None, 4, "3,1", "attn=0,12;mlp=96,4;vocab=0,37"),
    "llama-cls-lora-mesh2x2-0,4": ("llama", "classify", ("q_proj", "v_proj", "down_proj"), 4, "0,4",
                                   "attn=6,2;mlp=32,68;vocab=38,0"),
    # N = 5 and N = 1 (a one-group "mesh": no DDP at all, the whole batch)
    "gpt2-cls-lora-dp5-1,0,1,1,1": ("gpt2", "classify", ("c_attn", "c_fc"), 5, "1,0,1,1,1", None),
    "qwen3-lm-full-dp1-4": ("qwen3", "causal-lm", None, 1, "4", None),
}
FULL = {
    "roberta-cls-full-dp2-1,3": ("roberta", "classify", None, 2, "1,3", None),
    "qwen2-lm-lora-dp2-4,0": ("qwen2", "causal-lm", ("q_proj", "v_proj"), 2, "4,0", None),
    "qwen3-cls-full-mesh2x2-2,2": ("qwen3", "classify", None, 4, "2,2", "attn=6,0;mlp=32,68;vocab=0,229"),
    "llama-lm-lora-mesh3x1-1,0,3": ("llama", "causal-lm", ("q_proj", "v_proj"), 3, "1,0,3", None),
}
if os.environ.get("XRONOS_DP_FULL") == "1":
    CASES = {**CASES, **FULL}


@pytest.mark.parametrize("name", list(CASES))
def test_data_parallel_run_equals_single_device_training(name: str, tmp_path: Path) -> None:
    family, task, targets, nodes, shares, layout = CASES[name]
    model_dir = runkit.make_model(tmp_path / "model", family, task)
    data = dpkit.rows(ROWS, seed=len(name))
    n_train = ROWS - N_EVAL
    data_file = runkit.write_rows(tmp_path / "data.csv", data)
    lr = dpkit.LR
    start = model_dir
    if targets is not None:
        peft = dpkit.lora_model(model_dir, task, family, targets, seed=len(name))
        start = dpkit.lora_start(peft, model_dir, tmp_path / "start")
        lr = LORA_LR
    argv = ["run", "--model", str(start), "--data", str(data_file), "--task", task, "--nodes", str(nodes),
            "--shares", shares, *([f"--layout={layout}"] if layout else []), "--batch-size", str(dpkit.BATCH),
            "--seq-len", str(runkit.SEQ_LEN), "--lr", str(lr), "--max-steps", str(STEPS), "--seed", "0",
            "--export", str(tmp_path / "out"), "--metrics", str(tmp_path / "metrics.json"), "--eval-fraction", "0.2",
            *dpkit.FLAGS]
    if targets is not None:
        argv += ["--lora-r", str(dpkit.R), "--lora-alpha", str(dpkit.ALPHA), "--lora-targets", ",".join(targets),
                 "--export-merged"]
    assert main(argv) == 0
    tok = runkit._tokenizer(model_dir)
    initial = runkit.model_class(task).from_pretrained(str(model_dir))
    before = runkit.reference_eval(initial if targets is None else peft, tok, data, task, n_train, dpkit.BATCH)
    if targets is None:
        reference = dpkit.full_train(model_dir, data, task, STEPS, n_train)
        exported = runkit.model_class(task).from_pretrained(str(tmp_path / "out"))
    else:
        reference = dpkit.lora_train(peft, model_dir, data, task, STEPS, lr, n_train=n_train)
        exported = runkit.model_class(task).from_pretrained(str(tmp_path / "out" / "merged"))
    print(name, dpkit.check(exported, reference, initial))
    doc = json.loads((tmp_path / "metrics.json").read_text())
    groups = [int(s) for s in shares.split(",")]
    assert doc["mesh"] == {"tp": nodes // len(groups), "shares": groups, "sync": "overlap"}
    assert [len(r["iterations"]) for r in doc["ranks"]] == [STEPS] * nodes
    losses = {tuple(it["loss"] for it in r["iterations"]) for r in doc["ranks"]}
    assert len(losses) == 1  # every rank reports the global batch's loss
    after = runkit.reference_eval(reference, tok, data, task, n_train, dpkit.BATCH)
    for when, (loss, metric) in (("before", before), ("after", after)):
        got = doc[f"eval_{when}"]
        assert got["rows"] == N_EVAL and got["loss"] == pytest.approx(loss, abs=1e-4), (when, got, loss)
        assert got["accuracy" if task == "classify" else "perplexity"] == pytest.approx(metric, rel=1e-4)


@pytest.mark.parametrize("clip", [(), ("--max-grad-norm", "1.0")], ids=["unclipped", "clipped"])
def test_a_diverging_data_parallel_run_stops_every_rank_at_one_step_and_exports_nothing(tmp_path, capfd, clip):
    """As test_nonfinite's TP run: learning rate and weight decay 100 overflow fp32 in about ten
    steps. The loss checked is the global batch's (all-reduced) and the clipped norm the TP group's
    over the summed gradient, the same on every rank (so all stop at the same step, by
    construction): the run exits non-zero naming the step, with a 0-share rank among its ranks,
    and nothing is exported."""
    import re

    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data_file = runkit.write_rows(tmp_path / "data.jsonl", [{"text": t} for t in runkit.texts(24)])
    out = tmp_path / "out"
    argv = ["run", "--model", str(model_dir), "--data", str(data_file), "--task", "causal-lm", "--nodes", "3",
            "--shares", "2,0,2", "--batch-size", "4", "--seq-len", str(runkit.SEQ_LEN), "--lr", "100",
            "--weight-decay", "100", "--max-steps", "20", "--seed", "0", "--export", str(out), *clip]
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert "JobFault" in err and re.search(r"step \d+: the (loss|gradient norm|gradient) is (nan|inf|-inf), "
                                           r"not finite", err), err[-3000:]
    assert not out.exists()
