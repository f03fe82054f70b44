"""Home Assistant's job form (gateway/homeassistant/form.py), pure: each value checked where it arrives, the
whole form again into a JobSpec, and every refusal naming the field, the value and the limit."""

from __future__ import annotations

import pytest

from xronos.gateway.homeassistant import form as haform
from xronos.protocol import hastate
from xronos.protocol import messages as m

CAT = {"pi5": m.NodeCatalog(node_id="pi5", allowed_dirs=["/srv/xronos", "/mnt/usb"],
                            models=["/srv/xronos/models/qwen2.5-0.5b", "/mnt/usb/gpt2"],
                            data=["/srv/xronos/data/chat.jsonl", "/mnt/usb/reviews.csv"], scanned_at=1.0),
       "n100": m.NodeCatalog(node_id="n100", allowed_dirs=["/data"], models=["/data/llama"], data=[],
                             scanned_at=1.0)}
NOW = 1_764_928_800.0  # 2025-12-05 10:00:00 UTC


def form(**kw) -> hastate.JobForm:
    base = dict(owner="pi5", model="/srv/xronos/models/qwen2.5-0.5b", data="/srv/xronos/data/chat.jsonl",
                data_format="chat")
    return hastate.JobForm(**{**base, **kw})


def test_the_form_becomes_a_job_spec():
    spec = haform.form_spec(form(steps=50, lora_r=16), CAT, NOW)
    r = spec.recipe
    assert (spec.owner, r.model_dir, r.data_path) == ("pi5", "/srv/xronos/models/qwen2.5-0.5b",
                                                      "/srv/xronos/data/chat.jsonl")
    assert (r.task, r.data_format, r.max_steps, r.epochs, r.lora.r) == ("causal-lm", "chat", 50, None, 16)
    assert (r.batch_size, r.seq_len, r.lr) == (4, 128, 2e-4)
    assert spec.name == "qwen2.5-0.5b-chat"
    assert r.export_dir == "/srv/xronos/exports/qwen2.5-0.5b-chat-20251205-100000"  # the owner's first dir
    full = haform.form_spec(form(lora_r=0, steps=0, epochs=2, task="classify", data_format="text",
                                 model="/mnt/usb/gpt2", data="/mnt/usb/reviews.csv"), CAT, NOW).recipe
    assert (full.lora, full.max_steps, full.epochs, full.task) == (None, None, 2, "classify")


@pytest.mark.parametrize("values, want", [
    ({"model": "/etc"}, "model: '/etc' is not a model directory that owner 'pi5' reported in its allowed directories "
                        "(/srv/xronos, /mnt/usb)"),
    ({"data": "/srv/xronos/../../etc/shadow.csv"}, "data: '/srv/xronos/../../etc/shadow.csv' is not a data file"),
    ({"data": "/data/llama"}, "is not a data file that owner 'pi5' reported"),  # another node's path
    ({"owner": "ghost"}, "owner: 'ghost' has reported no model directories or data files (nodes that have: n100, pi5)"),
    ({"steps": 2_000_000}, "steps: Input should be less than or equal to 1000000"),
    ({"steps": -1}, "steps: Input should be greater than or equal to 0"),
    ({"lora_r": 4096}, "lora_r: Input should be less than or equal to 1024"),
    ({"lr": 5.0}, "lr: Input should be less than or equal to 1"),
    ({"lr": float("nan")}, "lr: Input should be a finite number"),
    ({"steps": "10"}, "steps: Input should be a valid integer"),  # strict: no text for a number
    ({"steps": 2.5}, "steps: Input should be a valid integer"),
    ({"gguf": "q4_k_m"}, "gguf: Input should be 'none', 'f32', 'f16' or 'q8_0'"),
    ({"task": "translate"}, "task: Input should be 'classify' or 'causal-lm'"),
])
def test_bad_values_are_refused_naming_field_value_and_limit(values, want):
    with pytest.raises(ValueError) as err:
        haform.with_values(form(), values, CAT)
    assert want in str(err.value)


def test_an_integral_float_is_an_int_and_another_owner_unchooses_the_files():
    assert haform.set_field(form(), "steps", 300.0, CAT).steps == 300  # HA sends 300.0 for a box of step 1
    moved = haform.set_field(form(), "owner", "n100", CAT)
    assert (moved.owner, moved.model, moved.data) == ("n100", None, None)
    assert haform.with_values(form(), {"owner": "n100", "model": "/data/llama"}, CAT).model == "/data/llama"


@pytest.mark.parametrize("changes, want", [
    ({"model": None}, "model: none chosen"),
    ({"steps": 0, "epochs": 0}, "epochs/steps: at least one must be set"),
    ({"task": "classify"}, "data_format: 'chat' is a causal-lm format (the loss covers the answer tokens), not one for task 'classify'"),
    ({"gguf": "f16", "task": "classify", "data_format": "text"}, "gguf: 'f16' asked of task 'classify'; llama.cpp runs language models, so GGUF export is for task 'causal-lm'"),
])
def test_a_form_that_cannot_make_a_job_is_refused_at_start(changes, want):
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        haform.form_spec(form(**changes), CAT, NOW)


def test_a_path_the_owner_no_longer_lists_is_refused_at_start():
    """The owner removed the file (or a forged catalog came and went): checked again at Start."""
    gone = {"pi5": CAT["pi5"].model_copy(update={"data": []})}
    with pytest.raises(ValueError, match="data: '/srv/xronos/data/chat.jsonl' is not a data file"):
        haform.form_spec(form(), gone, NOW)
    with pytest.raises(ValueError, match="owner: 'pi5' has reported no model"):
        haform.form_spec(form(), {}, NOW)


def test_gguf_goes_to_the_spec_field_when_the_spec_has_one():
    assert haform.form_spec(form(gguf="q8_0"), CAT, NOW).recipe.export_gguf == "q8_0"
    assert haform.form_spec(form(gguf="none"), CAT, NOW).recipe.export_gguf is None


def test_default_owner():
    assert haform.default_owner(hastate.JobForm(), CAT).owner == "n100"
    assert haform.default_owner(hastate.JobForm(), {}).owner is None
    assert haform.default_owner(form(), CAT) == form()
