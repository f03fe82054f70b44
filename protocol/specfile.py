"""Job spec files (TOML or YAML), for `xronos job submit` and the gateway's job_dir (Home
Assistant's Start button): the file's keys are a JobSpec, at top level or under a [job] table.

A spec of schema version 2 (before the recipe: every training setting at top level, LoRA as
`lora_r`, `lora_alpha`, ...) still reads: `upgrade_spec` maps it to version 3, here and for the
gateway's job table written by an earlier version, and nowhere else.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from xronos.common.errtext import reason

from . import messages as m

MAX_SPEC_BYTES = 64 * 1024
# YAML 1.1 (PyYAML) reads `lr: 1e-4` as the string "1e-4"; YAML 1.2 and TOML read a number.
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


def _yaml_load(text: str):
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return yaml.load(text, Loader=Loader)  # noqa: S506  (a SafeLoader subclass)
SUFFIXES = (".toml", ".yaml", ".yml")


def _yaml_problem(exc: Exception) -> str:
    """The problem and where, without PyYAML's quote of the offending line: the message goes to a
    retained Home Assistant state and the log, and the line may hold anything."""
    problem = getattr(exc, "problem", None) or type(exc).__name__
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


_LORA = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_targets": "targets"}
_LORA_DEFAULTS = {"alpha": 16.0, "dropout": 0.0, "targets": None}  # a version-2 spec's, always written out
_JOB_KEYS = set(m.JobSpec.model_fields) - {"recipe"}


def upgrade_spec(doc: dict, *, stored: bool = False) -> dict:
    """A job spec document as schema version 3. A version-2 document (no `recipe`, its settings at
    top level) becomes the job's own keys plus `recipe`, the `lora_*` keys its `recipe.lora`;
    anything else is returned as it is, for the model to judge. `stored`: the document comes from
    this gateway's own job table, where a full fine-tune may carry a LoRA alpha or dropout it never
    used (a table written before those were checked): they are dropped, as the job ran without."""
    if "recipe" in doc or doc.get("schema_version", 2) != 2:
        return doc
    out = {k: v for k, v in doc.items() if k in _JOB_KEYS and k != "schema_version"}
    recipe = {k: v for k, v in doc.items() if k not in _JOB_KEYS and k not in _LORA}
    # Written-out defaults are no request for LoRA; anything else without lora_r is refused below
    # (recipe.lora.r: required), as version 2 refused it.
    lora = {_LORA[k]: v for k, v in doc.items() if k in _LORA and v != _LORA_DEFAULTS.get(_LORA[k])}
    if lora.get("r") is None and (stored or not lora):
        lora = {}
    if lora:
        recipe["lora"] = {k: v for k, v in lora.items() if v is not None}
    return {**out, "recipe": recipe}


def _problem(e: dict) -> str:
    """One validation error; a version-3 spec with a recipe setting left at top level is told
    where it goes."""
    loc = ".".join(map(str, e["loc"])) or "spec"
    if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
        key = str(e["loc"][0])
        if key in m.Recipe.model_fields:
            return f"{loc}: a training setting: move it into the recipe (recipe.{key}, a [recipe] table)"
        if key in _LORA:
            return f"{loc}: a LoRA setting: move it into the recipe's LoRA table (recipe.lora.{_LORA[key]})"
    return f"{loc}: {reason(e)}"


def load_spec(path: str | Path) -> m.JobSpec:
    """A job spec from TOML (.toml) or YAML (.yaml/.yml); errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job spec {path}: no such file")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"job spec {path}: expected a .toml, .yaml or .yml file")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise ValueError(f"job spec {path}: larger than {MAX_SPEC_BYTES} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"job spec {path}: cannot read: {exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            doc = _yaml_load(text)
        else:
            doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"job spec {path}: {exc}") from None
    except Exception as exc:  # yaml.YAMLError
        raise ValueError(f"job spec {path}: not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"job spec {path}: expected a table of settings")
    doc = doc.get("job", doc)  # either top-level keys or a [job] table
    if not isinstance(doc, dict):
        raise ValueError(f"job spec {path}: expected a table of settings under [job]")
    try:
        return m.JobSpec.model_validate(upgrade_spec(doc))
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise ValueError(f"job spec {path}: {problems}") from None
