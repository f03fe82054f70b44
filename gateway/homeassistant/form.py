"""Home Assistant's job form (pure: no I/O): pick a model directory and a data file among what the
owner reports (its NodeCatalog), a task, steps or epochs, the LoRA rank (0: full fine-tune), the
GGUF export, and press Start training; the job is submitted from those values, no spec file.

Every value is checked where it arrives (`set_field`, `with_values`) and the whole form again at
Start (`form_spec`): a path must be one the chosen owner listed (a forged select value is refused,
naming the path and the owner), a number within `hastate.FORM_NUMBERS`; the refusal's text is
what Home Assistant shows. The owner's inspection confines the paths once more when the job is
submitted, as for any job. The discovery of the form's entities is `components`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, get_args

from pydantic import ValidationError

from xronos.common.errtext import problems
from xronos.protocol import hastate
from xronos.protocol import messages as m

Catalogs = Mapping[str, m.NodeCatalog]
_INTS = {k for k in hastate.FORM_NUMBERS if k != "lr"}
# The recipe's names of the form's fields, for the recipe's refusals as the form shows them.
_FORM_NAMES = (("recipe.max_steps", "steps"), ("recipe.epochs", "epochs"), ("max_steps", "steps"),
               ("recipe.export_gguf", "gguf"), ("export_gguf", "gguf"), ("recipe.lora.r", "lora_r"),
               ("recipe.model_dir", "model"), ("recipe.data_path", "data"), ("recipe.", ""))


def owners(catalogs: Catalogs) -> list[str]:
    """Nodes that reported a catalog, in order (the Owner node select's options)."""
    return sorted(catalogs)


def default_owner(form: hastate.JobForm, catalogs: Catalogs) -> hastate.JobForm:
    """The form with an owner when it has none (or its owner's catalog is gone) and one exists."""
    if form.owner in catalogs or not catalogs:
        return form
    return form.model_copy(update={"owner": owners(catalogs)[0], "model": None, "data": None})


def _coerce(field: str, value: Any) -> Any:
    """Home Assistant sends a number as a float when its step is fractional: 3.0 is 3 for an int."""
    if isinstance(value, float) and value.is_integer() and field in _INTS:
        return int(value)
    return value


def with_values(form: hastate.JobForm, values: Mapping[str, Any], catalogs: Catalogs) -> hastate.JobForm:
    """The form with `values` set; ValueError naming each refused field, its value and the limit."""
    data = {**form.model_dump(), **{k: _coerce(k, v) for k, v in values.items()}}
    if "owner" in values and values["owner"] != form.owner:  # another owner: pick among its files
        data["model"], data["data"] = values.get("model"), values.get("data")
    try:
        new = hastate.JobForm.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ValueError(problems(exc.errors())) from None
    for field in ("owner", "model", "data"):
        if field in values:
            _check_path(new, field, catalogs)
    return new


def set_field(form: hastate.JobForm, field: str, value: Any, catalogs: Catalogs) -> hastate.JobForm:
    return with_values(form, {field: value}, catalogs)


def _check_path(form: hastate.JobForm, field: str, catalogs: Catalogs) -> None:
    """`owner` a node with a catalog; `model`/`data` among what that owner listed."""
    if form.owner is None or form.owner not in catalogs:
        known = ", ".join(owners(catalogs)) or "none yet: press Refresh files"
        raise ValueError(f"owner: {form.owner!r} has reported no model directories or data files "
                         f"(nodes that have: {known})")
    if field == "owner":
        return
    value = getattr(form, field)
    if value is None:
        return
    cat = catalogs[form.owner]
    listed = cat.models if field == "model" else cat.data
    if value not in listed:
        kind = "model directory" if field == "model" else "data file"
        raise ValueError(f"{field}: {value[:120]!r} is not a {kind} that owner {form.owner!r} reported in its "
                         f"allowed directories ({', '.join(cat.allowed_dirs)[:200]})")


def _name(model: str, data: str) -> str:
    stem = os.path.splitext(os.path.basename(data))[0]
    text = f"{os.path.basename(model.rstrip('/'))}-{stem}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:64] or "job"


def form_spec(form: hastate.JobForm, catalogs: Catalogs, now: float) -> m.JobSpec:
    """The JobSpec the form describes; ValueError with the reason (nothing is submitted then).
    The export goes to `<owner's first allowed dir>/exports/<name>-<UTC time>`."""
    for field in ("owner", "model", "data"):
        if field != "owner" and getattr(form, field) is None:
            raise ValueError(f"{field}: none chosen: pick one of what owner {form.owner!r} reported")
        _check_path(form, field, catalogs)
    assert form.owner is not None and form.model is not None and form.data is not None
    name = _name(form.model, form.data)
    stamp = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = catalogs[form.owner].allowed_dirs[0].rstrip("/") or "/"
    try:
        recipe = m.Recipe(
            model_dir=form.model, data_path=form.data, task=form.task, data_format=form.data_format,
            batch_size=form.batch_size, seq_len=form.seq_len, lr=form.lr, max_steps=form.steps or None,
            epochs=form.epochs or None, export_dir=f"{root}/exports/{name}-{stamp}",
            lora=m.LoraSpec(r=form.lora_r) if form.lora_r else None,
            export_gguf=None if form.gguf == "none" else form.gguf)
        return m.JobSpec(name=name, owner=form.owner, recipe=recipe)
    except ValidationError as exc:
        text = problems(exc.errors())
        for recipe_name, form_name in _FORM_NAMES:  # the recipe's rules, named as the form names them
            text = text.replace(recipe_name, form_name)
        raise ValueError(text) from None


# --- discovery of the form's entities ----------------------------------------------------------

_LABELS = {"steps": ("Steps", "mdi:counter"), "epochs": ("Epochs", "mdi:repeat"),
           "lora_r": ("LoRA rank to train", "mdi:matrix"), "batch_size": ("Batch size", "mdi:format-list-numbered"),
           "seq_len": ("Sequence length", "mdi:ruler"), "lr": ("Learning rate", "mdi:speedometer")}


def components(dev: str, form: hastate.JobForm, catalogs: Catalogs, state_topic: str,
               set_topic: str) -> dict[str, dict[str, Any]]:
    """The form's selects, numbers and buttons for the gateway's device (discovery `cmps`). The
    Owner, Model and Data selects exist only with options (Home Assistant refuses an empty select);
    Model and Data list the chosen owner's."""
    def select(key: str, name: str, options: list[str], icon: str) -> dict[str, Any]:
        return {"p": "select", "unique_id": f"{dev}_form_{key}", "default_entity_id": f"select.{dev}_form_{key}",
                "name": name, "options": options, "command_topic": set_topic,
                "command_template": f'{{"action": "set", "field": "{key}", "value": {{{{ value | tojson }}}}}}',
                "state_topic": state_topic, "value_template": f"{{{{ value_json.form.{key} }}}}", "icon": icon}

    cmps: dict[str, dict[str, Any]] = {}
    cat = catalogs.get(form.owner) if form.owner else None
    if catalogs:
        cmps["form_owner"] = select("owner", "Owner node", owners(catalogs), "mdi:server")
    if cat is not None and cat.models:
        cmps["form_model"] = select("model", "Model", list(cat.models), "mdi:brain")
    if cat is not None and cat.data:
        cmps["form_data"] = select("data", "Data file", list(cat.data), "mdi:database")
    cmps["form_task"] = select("task", "Job task", list(get_args(m.Task)), "mdi:school-outline")
    cmps["form_data_format"] = select("data_format", "Job data format", list(get_args(m.DataFormat)),
                                      "mdi:message-text-outline")
    cmps["form_gguf"] = select("gguf", "GGUF export", list(get_args(hastate.GGUFChoice)), "mdi:package-down")
    for key, (lo, hi, step) in hastate.FORM_NUMBERS.items():
        name, icon = _LABELS[key]
        cmps[f"form_{key}"] = {
            "p": "number", "unique_id": f"{dev}_form_{key}", "default_entity_id": f"number.{dev}_form_{key}",
            "name": name, "min": lo, "max": hi, "step": step, "mode": "box", "command_topic": set_topic,
            "command_template": f'{{"action": "set", "field": "{key}", "value": {{{{ value }}}}}}',
            "state_topic": state_topic, "value_template": f"{{{{ value_json.form.{key} }}}}", "icon": icon}
    for key, name, payload, icon, extra in (
            ("start_form", "Start training", {"action": "start_form"}, "mdi:rocket-launch", {}),
            ("refresh", "Refresh files", {"action": "refresh"}, "mdi:folder-refresh", {"entity_category": "config"})):
        cmps[key] = {"p": "button", "unique_id": f"{dev}_{key}", "default_entity_id": f"button.{dev}_{key}",
                     "name": name, "command_topic": set_topic, "payload_press": json.dumps(payload), "icon": icon,
                     **extra}
    return cmps
