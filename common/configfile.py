"""Loading a service's TOML config into a pydantic model, with errors a person can act on.

Every failure is a `ConfigError` whose message names the file, the dotted key and the reason, e.g.
`/etc/xronos/node.toml: broker.port: Input should be less than 65536 (got 70000)`. A service
loads its config before it connects anywhere, so a bad file exits non-zero with that one line.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import AfterValidator, ConfigDict, Field

from .errtext import reason, where
from .logsetup import is_secret_key

M = TypeVar("M", bound=pydantic.BaseModel)
B = TypeVar("B", bound=pydantic.BaseModel)
CREDENTIAL_NAME = "mqtt_password"  # LoadCredential=mqtt_password:/etc/xronos/mqtt_password


class ConfigError(ValueError):
    """A config file that cannot be used; the message names file, key and reason."""


def _dotted(loc: tuple[Any, ...]) -> str:
    return where(loc, "(top level)")


def _reason(err: Mapping[str, Any]) -> str:
    key = str(err["loc"][-1]) if err["loc"] else ""
    if err["type"] == "extra_forbidden":
        if is_secret_key(key):
            return ("secrets are not accepted in a config file; put the password in a file of its "
                    "own and name it with password_file (or use the systemd credential "
                    f"{CREDENTIAL_NAME})")
        return "unknown key"
    if err["type"] == "missing":
        return "required key is missing"
    msg = reason(err)
    if key and is_secret_key(key):
        return msg  # never echo a secret back into a log or a terminal
    shown = repr(err.get("input"))
    return f"{msg} (got {shown[:77] + '...' if len(shown) > 80 else shown})"


def format_validation_error(path: str | os.PathLike[str], exc: pydantic.ValidationError) -> str:
    return "; ".join(f"{os.fspath(path)}: {_dotted(tuple(e['loc']))}: {_reason(e)}"
                     for e in exc.errors())


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except PermissionError:
        raise ConfigError(f"{p}: config file is not readable (permission denied)") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text: {exc}") from None


def validate_config(model: type[M], data: Mapping[str, Any], path: str | os.PathLike[str]) -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from None


def load_toml_model(model: type[M], path: str | os.PathLike[str]) -> M:
    """Read TOML at `path` and validate it as `model`; ConfigError on any problem."""
    return validate_config(model, read_toml(path), path)


def credential_password_file(env: Mapping[str, str] | None = None) -> Path | None:
    """$CREDENTIALS_DIRECTORY/mqtt_password if systemd handed us that credential, else None."""
    env = os.environ if env is None else env
    directory = env.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    candidate = Path(directory) / CREDENTIAL_NAME
    return candidate if candidate.is_file() else None


def _check_absolute(p: Path) -> Path:
    if not p.is_absolute():
        raise ValueError(f"must be an absolute path, got {str(p)!r}")
    return p


def _check_topic_prefix(value: str) -> str:
    bad = set(value) & {"+", "#", "\0"}
    if not value or bad or value.startswith("/") or value.endswith("/") or "//" in value:
        raise ValueError(f"{value!r} is not a usable topic prefix (no wildcards, no empty levels)")
    return value


# TOML has no path type: paths arrive as strings, so these fields are the only lax ones.
AbsPath = Annotated[Path, Field(strict=False), AfterValidator(_check_absolute)]
TopicPrefix = Annotated[str, AfterValidator(_check_topic_prefix)]
Identifier = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,64}$")]
LogLevel = Literal["debug", "info", "warning", "error"]
STRICT_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)


_BROKER_FILES = ("password_file", "tls_ca", "tls_cert", "tls_key")


def finish_broker(broker: B, path: str | os.PathLike[str], key: str = "broker",
                  env: Mapping[str, str] | None = None) -> B:
    """Apply the credential default for password_file and check every named file is readable.

    With a username but no password_file, systemd's `LoadCredential=mqtt_password:...` (exposed as
    $CREDENTIALS_DIRECTORY/mqtt_password) is used when present. The password is read only at
    connect time, by the transport; here we only make sure it will be there.
    """
    if getattr(broker, "username", None) and getattr(broker, "password_file", None) is None:
        found = credential_password_file(env)
        if found is not None:
            broker = broker.model_copy(update={"password_file": found})
    check_broker_files(broker, path, key)
    return broker


def check_broker_files(broker: pydantic.BaseModel, path: str | os.PathLike[str], key: str = "broker",
                       names: tuple[str, ...] = _BROKER_FILES) -> None:
    """ConfigError naming the config file and field of the first of `names` that cannot be read."""
    for name in names:
        value = getattr(broker, name, None)
        if value is None:
            continue
        try:
            with open(value, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{os.fspath(path)}: {key}.{name}: cannot read {os.fspath(value)!r}: "
                              f"{exc.strerror}") from None
