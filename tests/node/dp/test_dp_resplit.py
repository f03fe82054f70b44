"""A data-parallel run re-splits its batch live: `xronos run --shares .. --reshard-at STEP:shares=..`.

At the boundary before STEP every rank of the real command (one process per rank, Gloo on
loopback) switches to the new rows per group — the owner sends, every rank receives, by them; a
group may go to 0 rows and back — and no weights move. A re-split changes which rank computes
which rows of a batch, never the batch, its loss or its summed gradient: the export equals
single-device transformers training and the uninterrupted run (20 fp32 steps, max abs <= 5e-4,
relative <= 1e-5, the issue's bar), for pure data parallelism (2 groups) and a 2x2 DP×TP mesh at a
lopsided layout. The metrics list every re-split (0 bytes) and the final shares; the export's
evaluation after training is the reference's (the held-out batches follow the final shares).
Bad re-splits are refused before any process starts: tests/cli/test_run_shares.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dpkit
import runkit
from xronos.cli.main import main

STEPS = 20
ROWS, N_EVAL = 44, 9

# name: (--nodes, --shares, --layout or None, the re-splits (step, shares))
CASES = {
    "dp2-2,2": (2, "2,2", None, ((3, (3, 1)), (9, (0, 4)), (14, (2, 2)))),
    "mesh2x2-3,1": (4, "3,1", "attn=0,12;mlp=96,4;vocab=0,37", ((3, (1, 3)), (11, (4, 0)))),
}


def _argv(tmp: Path, model: Path, data: Path, nodes: int, shares: str, layout: str | None, out: str,
          resplits=()) -> list[str]:
    at = [a for step, s in resplits for a in ("--reshard-at", f"{step}:shares={','.join(map(str, s))}")]
    return ["run", "--model", str(model), "--data", str(data), "--task", "causal-lm", "--nodes", str(nodes),
            "--shares", shares, *([f"--layout={layout}"] if layout else []), "--batch-size", str(dpkit.BATCH),
            "--seq-len", str(runkit.SEQ_LEN), "--lr", str(dpkit.LR), "--max-steps", str(STEPS), "--seed", "0",
            "--export", str(tmp / out), "--metrics", str(tmp / f"{out}.json"), "--eval-fraction", "0.2",
            *dpkit.FLAGS, *at]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_live_resplit_equals_the_uninterrupted_run_and_single_device_training(name: str, tmp_path: Path) -> None:
    nodes, shares, layout, resplits = CASES[name]
    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = dpkit.rows(ROWS, seed=7)
    data_file = runkit.write_rows(tmp_path / "data.csv", data)
    assert main(_argv(tmp_path, model_dir, data_file, nodes, shares, layout, "split", resplits)) == 0
    doc = json.loads((tmp_path / "split.json").read_text())
    assert doc["mesh"]["shares"] == list(resplits[-1][1])  # the final split
    old = [int(s) for s in shares.split(",")]
    got = [(r["step"], r["old_shares"], r["new_shares"], r["moved_bytes"]) for r in doc["reshards"]]
    want = []
    for step, new in resplits:
        want.append((step, old, list(new), 0))
        old = list(new)
    assert got == want
    assert [len(r["iterations"]) for r in doc["ranks"]] == [STEPS] * nodes
    assert len({tuple(it["loss"] for it in r["iterations"]) for r in doc["ranks"]}) == 1

    n_train = ROWS - N_EVAL
    reference = dpkit.full_train(model_dir, data, "causal-lm", STEPS, n_train)
    exported = runkit.model_class("causal-lm").from_pretrained(str(tmp_path / "split"))
    print(name, "vs transformers", dpkit.check(exported, reference, runkit.model_class("causal-lm").from_pretrained(
        str(model_dir))))
    tok = runkit._tokenizer(model_dir)
    loss, metric = runkit.reference_eval(reference, tok, data, "causal-lm", n_train, dpkit.BATCH)
    assert doc["eval_after"]["loss"] == pytest.approx(loss, abs=1e-4)
    assert doc["eval_after"]["perplexity"] == pytest.approx(metric, rel=1e-4)
    if name == "dp2-2,2":  # and the run that kept its shares (the re-split is not a different training)
        assert main(_argv(tmp_path, model_dir, data_file, nodes, shares, layout, "kept")) == 0
        max_abs, rel = runkit.compare(exported, runkit.model_class("causal-lm").from_pretrained(str(tmp_path / "kept")))
        assert max_abs <= dpkit.MAX_ABS and rel <= dpkit.MAX_REL, (max_abs, rel)


@pytest.mark.slow
def test_rebalance_re_splits_a_lopsided_data_parallel_run_and_keeps_the_contract(tmp_path: Path) -> None:
    """`--shares 4,0 --rebalance` on two equal ranks: every row on group 0, group 1 idle at every
    gradient all-reduce. Rank 0's policy (the gateway's `Resplitter`, no profile: unit groups) sees
    group 0's time per row, takes the idle group for as fast, and re-splits live; the export still
    equals single-device transformers training."""
    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = dpkit.rows(ROWS, seed=7)
    data_file = runkit.write_rows(tmp_path / "data.csv", data)
    argv = _argv(tmp_path, model_dir, data_file, 2, "4,0", None, "out") + ["--rebalance"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    resplits = doc["rebalance"]["resplits"]
    assert resplits and resplits[0]["old"] == [4, 0] and resplits[0]["new"][1] > 0, doc["rebalance"]
    assert resplits[0]["gain"] > 0.05 and "faster" in resplits[0]["reason"]
    applied = [(r["step"], r["new"]) for r in resplits if r["applied"]]
    assert [(m["step"], m["new_shares"]) for m in doc["reshards"]] == applied and applied
    assert doc["mesh"]["shares"] == applied[-1][1]
    reference = dpkit.full_train(model_dir, data, "causal-lm", STEPS, ROWS - N_EVAL)
    exported = runkit.model_class("causal-lm").from_pretrained(str(tmp_path / "out"))
    dpkit.check(exported, reference, runkit.model_class("causal-lm").from_pretrained(str(model_dir)))
