"""Jobs over meshes: checkpoints written under one mesh resume under another, and each rank receives
only its rows.

Every run is a job's ranks as `jobrank` runs them (tests/node/dp/dp_job_worker.py: real processes,
the owner streaming each rank its slices, consolidated checkpoints every 10 steps), 20 fp32 steps,
clipping on. A causal LM, full fine-tune:
  A  a 2x2 DP×TP mesh, rows 3,1, lopsided layout      (checkpoint at 10; uninterrupted)
  C  plain TP on 2 ranks                               (checkpoint at 10; uninterrupted)
  B  pure DP on 3 ranks, rows 2,0,2, from A's checkpoint at 10    (mesh -> DP)
  D  a 2x2 mesh, rows 0,4, another layout, from C's checkpoint at 10 (TP -> mesh)
A equals transformers; C, B and D equal A. A classifier under LoRA: DP on 3 ranks (1,0,3) with a
checkpoint, resumed on plain TP. And the rows: in A and B every rank received exactly its group's
rows of each batch (the token ids of the reference tokenisation), a 0-share rank nothing at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

import dpkit
import runkit
from tp_world import run_world
from xronos.node.rank.checkpoint import read_meta
from xronos.node.runconfig import JobRankConfig
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dp_job_worker.py")
STEPS, INTERVAL, CLIP = 20, 10, 0.5
MESH_A = Layout(attn=(0, 12), mlp=(96, 4), vocab=(0, 37))  # GPT-2 test model: 12 heads, 100 columns, 37 rows
MESH_D = Layout(attn=(8, 4), mlp=(32, 68), vocab=(32, 5))
TP2 = Layout(attn=(4, 8), mlp=(64, 36), vocab=(32, 5))


def job(root: Path, name: str, model: Path, data: Path, task: str, layout: Layout, shares, *, resume_from=None,
        lr: float = dpkit.LR, lora: tuple[str, ...] | None = None) -> Path:
    """Run one job's ranks; returns its export directory."""
    cfg = runkit.run_config(model_dir=str(model), data_path=str(data), task=task, batch_size=dpkit.BATCH,
                            seq_len=runkit.SEQ_LEN, lr=lr, max_steps=STEPS, seed=0, shuffle=False, dropout=0.0,
                            weight_decay=0.0, max_grad_norm=CLIP, export_dir=str(root / name / "out"),
                            layout=layout, shares=shares, progress=False,
                            **({"lora_r": dpkit.R, "lora_alpha": dpkit.ALPHA, "lora_targets": list(lora),
                                "export_merged": True} if lora else {}))
    ckpt = resume_from if resume_from is not None else root / name / "ckpt"
    configs = [JobRankConfig(job_id="j", plan_version=0, node_id=f"n{r}", run=cfg.for_rank(r),
                             checkpoint_interval=INTERVAL, resume_step=INTERVAL if resume_from else 0,
                             checkpoint_dir=str(ckpt) if r == 0 else None).model_dump(mode="json")
               for r in range(cfg.world_size)]
    run_world(WORKER, cfg.world_size, {"configs": configs}, root / name, timeout=300)
    return root / name / "out"


def seen(root: Path, name: str, n: int) -> list[list[dict]]:
    return [json.loads((root / name / f"seen{r}.json").read_text()) for r in range(n)]


def check_rows(runs: list[list[dict]], shares: tuple[int, ...], tp: int, batches: list[list[list[int]]]) -> None:
    """Rank r got rows [sum(shares[:g]), sum(shares[:g+1])) of each batch (g = r // tp) and nothing
    else: its non-owner bytes are exactly those rows' three tensors and the count."""
    for r, steps in enumerate(runs):
        g = r // tp
        a, b = sum(shares[:g]), sum(shares[:g + 1])
        assert [s["step"] for s in steps] == list(range(len(batches) - len(steps), len(batches)))
        for s in steps:
            want = batches[s["step"]][a:b]
            assert s["ids"] == (want or None), (r, s["step"])
            assert (s["total"] > 0) == (a < b)
        if r > 0:  # the owner tokenised the batch itself; every other rank got only its rows
            per_step = 8 + 3 * (b - a) * runkit.SEQ_LEN * 8 if b > a else 0  # ids, mask, labels; the count
            assert steps[-1]["received"] == per_step * len(steps), (r, steps[-1]["received"])


def test_resume_onto_other_meshes_and_rows_per_rank(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = dpkit.rows(44, seed=5)
    data_file = runkit.write_rows(tmp_path / "data.csv", data)
    a = job(tmp_path, "A", model, data_file, "causal-lm", MESH_A, (3, 1))
    c = job(tmp_path, "C", model, data_file, "causal-lm", TP2, None)
    b = job(tmp_path, "B", model, data_file, "causal-lm", Layout.single(_sizes(model)), (2, 0, 2),
            resume_from=tmp_path / "A" / "ckpt")
    d = job(tmp_path, "D", model, data_file, "causal-lm", MESH_D, (0, 4), resume_from=tmp_path / "C" / "ckpt")
    meta = read_meta(tmp_path / "A" / "ckpt")
    assert meta["step"] == INTERVAL and meta["shares"] == [3, 1] and Layout.from_data(meta["layout"]) == MESH_A
    assert read_meta(tmp_path / "C" / "ckpt")["step"] == INTERVAL
    reference, tok = runkit.reference_train(model, data, "causal-lm", steps=STEPS, batch_size=dpkit.BATCH, lr=dpkit.LR,
                                            max_grad_norm=CLIP)
    unclipped, _ = runkit.reference_train(model, data, "causal-lm", steps=STEPS, batch_size=dpkit.BATCH, lr=dpkit.LR)
    # clipping bites (far beyond the tolerance): the global norm over the mesh is checked
    assert runkit.compare(unclipped, reference)[1] > 20 * dpkit.MAX_REL
    initial = runkit.model_class("causal-lm").from_pretrained(str(model))
    load = runkit.model_class("causal-lm").from_pretrained
    dpkit.check(load(str(a)), reference, initial)
    for other in (c, b, d):
        max_abs, rel = runkit.compare(load(str(other)), load(str(a)))
        assert max_abs <= dpkit.MAX_ABS and rel <= dpkit.MAX_REL, (other, max_abs, rel)
    batches = [runkit._encode(tok, data, idx, "causal-lm", runkit.SEQ_LEN)["input_ids"].tolist()
               for idx in runkit.batch_rows(len(data), dpkit.BATCH, STEPS, False, 0)]
    check_rows(seen(tmp_path, "A", 4), (3, 1), 2, batches)
    check_rows(seen(tmp_path, "B", 3), (2, 0, 2), 1, batches)  # steps 10..19 (resumed)


def _sizes(model: Path):
    from xronos.node.rank.validate import model_sizes

    return model_sizes(str(model))


def test_lora_checkpoint_from_data_parallel_resumes_on_tensor_parallel(tmp_path: Path) -> None:
    model = runkit.make_model(tmp_path / "model", "bert", "classify")
    targets = ("query", "value")
    peft = dpkit.lora_model(model, "classify", "bert", targets, seed=3)
    start = dpkit.lora_start(peft, model, tmp_path / "start")
    data = dpkit.rows(44, seed=9)
    data_file = runkit.write_rows(tmp_path / "data.csv", data)
    lr = 1e-3
    single = Layout.single(_sizes(start))
    a = job(tmp_path, "A", start, data_file, "classify", single, (1, 0, 3), lr=lr, lora=targets)
    b = job(tmp_path, "B", start, data_file, "classify", Layout.tied([5, 7], _sizes(start)), None, lr=lr, lora=targets,
            resume_from=tmp_path / "A" / "ckpt")
    saved = load_file(str(tmp_path / "A" / "ckpt" / "model.safetensors"))
    assert saved and all("lora_" in k or "classifier" in k for k in saved)  # the trained tensors only
    reference = dpkit.lora_train(peft, model, data, "classify", STEPS, lr, max_grad_norm=CLIP)
    load = runkit.model_class("classify").from_pretrained
    dpkit.check(load(str(a / "merged")), reference, load(str(model)))
    max_abs, rel = runkit.compare(load(str(b / "merged")), load(str(a / "merged")))
    assert max_abs <= dpkit.MAX_ABS and rel <= dpkit.MAX_REL, (max_abs, rel)
