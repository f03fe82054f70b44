"""Job spec files (TOML or YAML), for `xronos job submit` and the gateway's job_dir (Home
Assistant's Start button): the file's keys are a JobSpec, at top level or under a [job] table."""

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
    try:
        return m.JobSpec.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {reason(e)}" for e in exc.errors())
        raise ValueError(f"job spec {path}: {problems}") from None
