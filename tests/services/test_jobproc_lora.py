"""A LoRA job's data plane, without MQTT: rank processes as the node service starts them.

The consolidated checkpoint holds the adapters (and the trained head) with their AdamW moments,
unsharded, and neither the frozen base nor moments for it; a job cut at its checkpoint and resumed under
another per-segment layout ends where the uninterrupted one does; the export is a PEFT adapter
directory that peft loads onto the base, plus the merged model transformers loads by itself, both
computing the same logits; an adapter-only export (gathering the trained tensors alone) writes
the same adapters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from jobkit import job_spec, make_case, runkit, start_ranks, wait_ranks
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

# runkit's GPT-2: 12 heads, 100 MLP columns, 37 vocabulary rows; lopsided, with 0-unit ranks.
FIRST = Layout(attn=(0, 7, 5), mlp=(64, 0, 36), vocab=(32, 0, 5))
RESUMED = Layout(attn=(3, 0, 4, 5), mlp=(0, 32, 64, 4), vocab=(0, 32, 0, 5))
LORA = dict(lora_r=4, lora_alpha=8.0, lora_targets=["c_attn", "c_proj", "c_fc"], export_merged=True)


def _logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def test_lora_job_checkpoint_resume_under_another_layout_and_exports(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=20, checkpoint_interval=10, lr=1e-3, **LORA)
    events = wait_ranks(start_ranks(tmp_path, spec, FIRST))
    assert events[0][-1].kind == "completed", events[0][-3:]

    ckpt = tmp_path / "ckpt"
    with safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:
        moments = set(f.keys())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        weights = set(f.keys())
    adapters = {k for k in weights if ".lora_" in k}
    assert len(adapters) == 2 * 4 * 2  # A and B of c_attn, attn.c_proj, c_fc, mlp.c_proj in 2 layers
    trained = adapters | {"score.weight"}
    assert weights == trained  # the frozen base is not saved again: a resume reads it from the base
    assert moments == {f"{m}.{k}" for m in ("exp_avg", "exp_avg_sq") for k in trained}  # no base moments

    # The resumed run exports the adapters only: the owner gathers the trained tensors alone, and
    # they are the ones the merged export's gather of the whole model wrote.
    spec2 = job_spec(model, data, tmp_path / "export2", max_steps=20, checkpoint_interval=10, lr=1e-3,
                     **{**LORA, "export_merged": False})
    events = wait_ranks(start_ranks(tmp_path, spec2, RESUMED, resume_step=10, version=2))
    assert [e.step for e in events[0] if e.kind == "metrics"] == list(range(11, 21))
    assert not (tmp_path / "export2" / "merged").exists()
    a = load_file(str(tmp_path / "export" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "export2" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and "base_model.model.score.weight" in a
    max_abs = max(float((a[k] - b[k]).abs().max()) for k in a)
    diff = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(v.double().pow(2).sum()) for v in a.values()) ** 0.5
    assert max_abs <= 5e-4 and diff / norm <= 1e-5, (max_abs, diff / norm)

    # peft loads the adapter onto the base; the merged model needs no peft; both compute alike.
    tok = AutoTokenizer.from_pretrained(str(model))
    batch = dict(tok(runkit.texts(1, seed=5)[0], return_tensors="pt"))
    base = AutoModelForSequenceClassification.from_pretrained(str(model))
    before = _logits(base, batch)
    peft_logits = _logits(PeftModel.from_pretrained(base, str(tmp_path / "export")), batch)
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "export" / "merged"))
    merged_logits = _logits(merged, batch)
    assert float((peft_logits - merged_logits).abs().max()) <= 1e-5 * max(1.0, float(peft_logits.abs().max()))
    assert float((peft_logits - before).abs().max()) > 1e-3  # the adapters changed the model
