"""A job table written before the recipe (version-2 specs, every setting at top level) loads after
the upgrade: `specfile.upgrade_spec` maps each stored spec once, where the table is read."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from xronos.gateway.job import machine as J
from xronos.gateway.job.store import JobStore
from xronos.protocol import messages as m

RECIPE = m.Recipe(model_dir="/m", data_path="/d", task="causal-lm", batch_size=2, seq_len=16, lr=1e-3, max_steps=5,
                  export_dir="/o", weight_decay=0.1, max_grad_norm=None, export_merged=True,
                  lora=m.LoraSpec(r=8, alpha=32.0, targets=["q_proj"]))
FULL = RECIPE.model_copy(update={"lora": None, "export_merged": False})


def _as_version_2(spec: dict) -> dict:
    """How an Xronos before the recipe wrote a JobSpec: flat, LoRA as lora_*, version 2."""
    recipe, lora = dict(spec.pop("recipe")), None
    lora = recipe.pop("lora") or {}
    flat = {**spec, **recipe, "schema_version": 2, "lora_r": lora.get("r"), "lora_alpha": lora.get("alpha", 16.0),
            "lora_dropout": lora.get("dropout", 0.0), "lora_targets": lora.get("targets")}
    return flat


def test_a_table_of_version_2_specs_loads_as_the_same_jobs(tmp_path):
    lora_job = replace(J.Job("j1", m.JobSpec(name="a", owner="n", recipe=RECIPE), 0.0), loss=math.nan)
    full_job = J.Job("j2", m.JobSpec(name="b", owner="n", recipe=FULL, rebalance=False), 0.0)
    store = JobStore(tmp_path)
    store.save({"j1": lora_job, "j2": full_job})
    doc = json.loads(store.path.read_text())
    for job in doc["jobs"]:
        job["spec"] = _as_version_2(job["spec"])
    doc["jobs"][1]["spec"]["lora_alpha"] = 8.0  # a full fine-tune's unused alpha, from before it was checked
    assert "recipe" not in json.dumps(doc)
    store.path.write_text(json.dumps(doc))
    loaded = store.load()
    assert loaded["j1"].spec == lora_job.spec and loaded["j2"].spec == full_job.spec
    assert math.isnan(loaded["j1"].loss)
