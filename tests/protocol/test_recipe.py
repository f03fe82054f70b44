"""The training recipe, typed once (protocol/recipe.py): invalid combinations refused in one place
each, a job spec's schema version, and version-2 spec files mapped where they are read."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from xronos.protocol import messages as m
from xronos.protocol.specfile import load_spec, upgrade_spec

BASE = dict(model_dir="/m", data_path="/d.jsonl", task="causal-lm", batch_size=4, seq_len=32, lr=1e-4, max_steps=10,
            export_dir="/out")


def _errors(exc: pytest.ExceptionInfo) -> list[tuple[str, str]]:
    return [(".".join(map(str, e["loc"])), e["msg"]) for e in exc.value.errors()]


def test_lora_options_cannot_be_written_down_without_a_rank():
    with pytest.raises(ValidationError) as exc:
        m.Recipe(**BASE, lora={"alpha": 32.0, "targets": ["q_proj"]})
    assert _errors(exc) == [("lora.r", "Field required")]
    lora = m.Recipe(**BASE, lora={"r": 8, "alpha": 32.0}).lora
    assert (lora.r, lora.alpha, lora.dropout, lora.targets) == (8, 32.0, 0.0, None)
    with pytest.raises(ValidationError, match="export_merged: set without lora"):
        m.Recipe(**BASE, export_merged=True)


@pytest.mark.parametrize("change, want", [
    ({"task": "classify", "data_format": "chat"}, "data_format: 'chat' is a causal-lm format"),
    ({"task": "classify", "export_gguf": "q8_0"}, "export_gguf: 'q8_0' asked of task 'classify'"),
    ({"max_steps": None}, "epochs/max_steps: at least one must be set"),
])
def test_each_rule_across_fields_is_the_recipes(change, want):
    with pytest.raises(ValidationError, match=want):
        m.Recipe(**{**BASE, **change})
    # and so the job spec's and the profile's: one place
    with pytest.raises(ValidationError, match=want):
        m.JobSpec(name="j", owner="o", recipe={**BASE, **change})


def test_the_profile_key_is_the_recipes():
    r = m.Recipe(**BASE, weight_decay=0.1, max_grad_norm=None, lora={"r": 4, "alpha": 8.0, "targets": ["v_proj", "q_proj"]})
    key = r.profile_key()
    assert (key.task, key.batch_size, key.seq_len, key.weight_decay, key.clip) == ("causal-lm", 4, 32, 0.1, False)
    assert key.lora == r.lora  # alpha included: the profiler trains the job's very adapters
    settings = m.ProfileSettings.of_key(key)  # what a report records: the targets sorted, no alpha
    assert (settings.lora, settings.clip) == (m.LoraShape(r=4, targets=["q_proj", "v_proj"]), False)


def test_the_job_spec_is_version_3_and_refuses_a_version_2_message():
    spec = m.JobSpec(name="j", owner="o", recipe=BASE)
    assert spec.schema_version == m.SPEC_VERSION == 3
    old = {"schema_version": 2, "name": "j", "owner": "o", **BASE}
    with pytest.raises(ValidationError) as exc:  # a sender of another version: named, not guessed at
        m.JobSpec.model_validate_json(json.dumps(old))
    assert ("schema_version", "Input should be 3") in _errors(exc)
    assert m.JobSpec.model_validate(upgrade_spec(old)) == spec


def _write(path, text):
    path.write_text(text)
    return path


def test_a_version_2_spec_file_still_reads(tmp_path):
    v2 = ('name = "j"\nowner = "o"\nmodel_dir = "/m"\ndata_path = "/d.jsonl"\ntask = "causal-lm"\nbatch_size = 4\n'
          'seq_len = 32\nlr = 1e-4\nmax_steps = 10\nexport_dir = "/out"\nreserve_mb = 256\n'
          'lora_r = 8\nlora_alpha = 32.0\nlora_targets = ["q_proj"]\nexport_merged = true\n')
    v3 = ('name = "j"\nowner = "o"\nreserve_mb = 256\n[recipe]\nmodel_dir = "/m"\ndata_path = "/d.jsonl"\n'
          'task = "causal-lm"\nbatch_size = 4\nseq_len = 32\nlr = 1e-4\nmax_steps = 10\nexport_dir = "/out"\n'
          'export_merged = true\n[recipe.lora]\nr = 8\nalpha = 32.0\ntargets = ["q_proj"]\n')
    old, new = load_spec(_write(tmp_path / "v2.toml", v2)), load_spec(_write(tmp_path / "v3.toml", v3))
    assert old == new and new.recipe.lora.alpha == 32.0 and new.reserve_mb == 256
    yaml = load_spec(_write(tmp_path / "v2.yaml", v2.replace(" = ", ": ").replace('"', "")))
    assert yaml == new


def test_a_version_2_spec_with_lora_options_but_no_rank_is_refused_naming_it(tmp_path):
    v2 = ('name = "j"\nowner = "o"\nmodel_dir = "/m"\ndata_path = "/d"\ntask = "causal-lm"\nbatch_size = 4\n'
          'seq_len = 32\nlr = 1e-4\nmax_steps = 10\nexport_dir = "/out"\nlora_alpha = 8.0\n')
    with pytest.raises(ValueError, match=r"recipe\.lora\.r: Field required"):
        load_spec(_write(tmp_path / "v2.toml", v2))
    # The defaults a version-2 spec always wrote out are no request for LoRA.
    full = load_spec(_write(tmp_path / "full.toml", v2.replace("lora_alpha = 8.0", "lora_alpha = 16.0")))
    assert full.recipe.lora is None


def test_a_version_3_spec_with_a_setting_left_at_top_level_is_told_where_it_goes(tmp_path):
    text = ('name = "j"\nowner = "o"\nbatch_size = 4\nlora_r = 8\n[recipe]\nmodel_dir = "/m"\ndata_path = "/d"\n'
            'task = "causal-lm"\nseq_len = 32\nlr = 1e-4\nmax_steps = 10\nexport_dir = "/out"\n')
    with pytest.raises(ValueError) as exc:
        load_spec(_write(tmp_path / "v3.toml", text))
    assert "batch_size: a training setting: move it into the recipe (recipe.batch_size" in str(exc.value)
    assert "lora_r: a LoRA setting: move it into the recipe's LoRA table (recipe.lora.r)" in str(exc.value)


def test_a_stored_version_2_spec_of_a_full_fine_tune_loads_without_its_unused_lora_options():
    """A gateway's job table written before the alpha and dropout were checked: its jobs ran as
    full fine-tunes, and the gateway must not refuse to start over them."""
    old = {"schema_version": 2, "name": "j", "owner": "o", **BASE, "lora_r": None, "lora_alpha": 8.0,
           "lora_dropout": 0.1, "lora_targets": None, "export_merged": False}
    assert m.JobSpec.model_validate(upgrade_spec(old, stored=True)).recipe.lora is None
    with pytest.raises(ValidationError, match="Field required"):
        m.JobSpec.model_validate(upgrade_spec(old))
