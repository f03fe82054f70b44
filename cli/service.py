"""What `xronos gateway` and `xronos node` share before their service starts."""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

C = TypeVar("C")

# sysexits.h EX_CONFIG. The units say RestartPreventExitStatus=78: a config error is reported
# once ("start refused") instead of restart-looping under Restart=on-failure.
EXIT_CONFIG = 78


class ConfigExit(SystemExit):
    pass


def config_or_exit(command: str, load: Callable[[str], C], path: str) -> C:
    """Load the service's config; on any ConfigError print its one line and exit 78."""
    from xronos.common.configfile import ConfigError

    try:
        return load(path)
    except ConfigError as exc:
        print(f"xronos {command}: config error: {exc}", file=sys.stderr, flush=True)
        raise ConfigExit(EXIT_CONFIG) from None
    except OSError as exc:  # e.g. the credential directory vanished between checks
        print(f"xronos {command}: config error: {os.fspath(path)}: {exc}", file=sys.stderr, flush=True)
        raise ConfigExit(EXIT_CONFIG) from None
