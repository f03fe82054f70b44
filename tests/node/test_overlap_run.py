"""`xronos run --overlap` == single-device training: the overlap of the all-reduces with compute
(the input-gradient all-reduces beside the weight gradients; chunks) reaches the ranks
through the run's config and changes only the timing. Each case runs the real command on a
lopsided layout and compares every exported parameter with the plain transformers (+ peft) loop,
as tests/node/test_contract.py and tests/node/dp/test_dp_run.py do; the metrics show the
asynchronous all-reduces ran. Evaluation runs unchunked: the last held-out batch (2 rows) is
shorter than the c4 case's 4 chunks, and the held-out loss must match the reference's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent / d) for d in ("dp", "models")]
import dpkit  # noqa: E402
import runkit  # noqa: E402

from xronos.cli.main import main  # noqa: E402
from xronos.protocol.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, ROWS, N_EVAL = 20, 42, 10  # the held-out tail: batches of 4, 4 and 2 rows

# name: (family, task, layout, --overlap, LoRA targets or None)
CASES = {
    "gpt2-lm-N3-c4": ("gpt2", "causal-lm", Layout(attn=(0, 6, 6), mlp=(64, 32, 4), vocab=(32, 0, 5)), "c4", None),
    "llama-cls-N2-bwd": ("llama", "classify", Layout(attn=(2, 6), mlp=(96, 4), vocab=(38, 0)), "bwd", None),
    "qwen3-lm-N2-c2-lora": ("qwen3", "causal-lm", Layout(attn=(4, 2), mlp=(32, 68), vocab=(0, 229)), "c2",
                            ("q_proj", "v_proj", "down_proj")),
    "bert-cls-N4-c2": ("bert", "classify", Layout(attn=(3, 0, 8, 1), mlp=(0, 64, 32, 4), vocab=(32, 7, 0, 0)), "c2",
                       None),
    "llama-lm-N5-c3": ("llama", "causal-lm", Layout(attn=(1, 2, 0, 3, 2), mlp=(32, 0, 32, 32, 4),
                                                     vocab=(0, 32, 6, 0, 0)), "c3", None),
    # an overlap trial: the modes take turns step by step, then the kept one runs (node/rank/trial.py)
    "gpt2-lm-N3-trial": ("gpt2", "causal-lm", Layout(attn=(0, 6, 6), mlp=(64, 32, 4), vocab=(32, 0, 5)),
                         "c2,off,bwd", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_run_equals_single_device_training(name: str, tmp_path: Path) -> None:
    family, task, layout, mode, targets = CASES[name]
    model_dir = runkit.make_model(tmp_path / "model", family, task)
    data = dpkit.rows(ROWS, seed=len(name))
    n_train = ROWS - N_EVAL
    start, lr = model_dir, dpkit.LR
    if targets is not None:
        peft = dpkit.lora_model(model_dir, task, family, targets, seed=len(name))
        start, lr = dpkit.lora_start(peft, model_dir, tmp_path / "start"), 1e-3
    metrics = tmp_path / "metrics.json"
    argv = runkit.run_argv(start, runkit.write_rows(tmp_path / "data.csv", data), task, layout, tmp_path / "out",
                           steps=STEPS, batch_size=dpkit.BATCH, lr=lr,
                           extra=(*dpkit.FLAGS, "--eval-fraction", str(N_EVAL / ROWS), "--metrics", str(metrics),
                                  "--overlap-trial" if "," in mode else "--overlap", mode))
    if targets is not None:
        argv += ["--lora-r", str(dpkit.R), "--lora-alpha", str(dpkit.ALPHA), "--lora-targets", ",".join(targets),
                 "--export-merged"]
    assert main(argv) == 0
    doc = json.loads(metrics.read_text())
    first = mode.split(",")[0]
    assert doc["config"]["overlap"] == {"backward": True, "chunks": int(first[1:]) if first[0] == "c" else 1}
    assert doc["async_allreduces"] > 0  # the overlapped path ran
    if "," in mode:  # every mode timed, one kept from the trial's end (2 warm-up steps, 1 + 3 rounds of 3)
        trial = doc["overlap_trial"]
        assert list(trial["seconds"]) == mode.split(",") and all(v > 0 for v in trial["seconds"].values())
        assert trial["kept"] in mode.split(",") and trial["from_step"] == 14
    initial = runkit.model_class(task).from_pretrained(str(model_dir))
    if targets is None:
        reference = dpkit.full_train(model_dir, data, task, STEPS, n_train)
        exported = runkit.model_class(task).from_pretrained(str(tmp_path / "out"))
    else:
        reference = dpkit.lora_train(peft, model_dir, data, task, STEPS, lr, n_train=n_train)
        exported = runkit.model_class(task).from_pretrained(str(tmp_path / "out" / "merged"))
    print(name, dpkit.check(exported, reference, initial))
    tok = runkit._tokenizer(model_dir)
    loss, _ = runkit.reference_eval(reference, tok, data, task, n_train, dpkit.BATCH)
    assert doc["eval_after"]["rows"] == N_EVAL and doc["eval_after"]["loss"] == pytest.approx(loss, abs=1e-4)


def test_a_trial_that_keeps_a_mode_with_its_own_layout_moves_there_and_still_equals_single_device(tmp_path):
    """Four one-row chunks are far slower than none on this small model, so the trial keeps `off`,
    whose own layout (`OverlapTrial.layouts`) is another: the ranks move there live (weights and
    AdamW state) at the next boundary, and the run still reproduces single-device training."""
    from xronos.node.rank.local import launch_local
    from xronos.protocol.messages import Overlap, OverlapTrial

    start, other = Layout(attn=(0, 6, 6), mlp=(64, 32, 4), vocab=(32, 0, 5)), \
        Layout(attn=(4, 4, 4), mlp=(32, 64, 4), vocab=(0, 32, 5))
    model_dir = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = dpkit.rows(ROWS, seed=7)
    metrics, out = tmp_path / "metrics.json", tmp_path / "out"
    c4, off = Overlap(backward=True, chunks=4), Overlap(backward=False, chunks=1)
    cfg = runkit.run_config(model_dir=str(model_dir), data_path=str(runkit.write_rows(tmp_path / "data.csv", data)),
                            task="causal-lm", batch_size=dpkit.BATCH, seq_len=runkit.SEQ_LEN, lr=dpkit.LR,
                            max_steps=STEPS, seed=0, shuffle=False, dropout=0.0, weight_decay=0.0,
                            eval_fraction=N_EVAL / ROWS, export_dir=str(out), layout=start, threads=1,
                            metrics_path=str(metrics), progress=False, overlap=c4,
                            trial=OverlapTrial(modes=[c4, off], layouts=[None, other]))
    launch_local(cfg, 3, echo_rank0=False)
    doc = json.loads(metrics.read_text())
    assert doc["overlap_trial"]["kept"] == "off" and doc["overlap_trial"]["from_step"] == 2 + 4 * 2, doc["overlap_trial"]
    (move,) = doc["reshards"]
    assert move["step"] == 10 and move["reason"] == "overlap trial kept off: the layout planned for it"
    assert move["new"] == other.to_text() and move["moved_bytes"] > 0
    reference = dpkit.full_train(model_dir, data, "causal-lm", STEPS, ROWS - N_EVAL)
    exported = runkit.model_class("causal-lm").from_pretrained(str(out))
    print(dpkit.check(exported, reference, runkit.model_class("causal-lm").from_pretrained(str(model_dir))))
