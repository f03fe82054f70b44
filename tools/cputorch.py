"""The pip arguments that make `make`'s venv take the CPU-only torch: `python3 tools/cputorch.py`
prints them on one line (the Makefile splices them into its `pip install`), and says on stderr
where torch will come from.

On x86_64 Linux, PyPI's torch is the CUDA build: 502 MiB, plus 2.05 GiB of nvidia-* and triton
wheels (torch 2.13.0, cp311), for boxes that have no GPU. The CPU-only build (183 MiB) is on the
CPU index. Its version is the locked one with the local label `+cpu`, and it is *required* by that
name (`torch==2.13.0+cpu`), not merely preferred: pip can then take nothing else, wherever it
looks. The CPU index is added as an extra index when it answers; where it cannot be reached (a
machine that sees only a mirror), it is left out rather than retried for minutes, and pip's own
configured index or find-links must hold the CPU build — or the install fails, naming it. Never
the CUDA build in silence. Elsewhere (aarch64: PyPI's wheel is CPU-only; macOS) no arguments.

XRONOS_TORCH_INDEX (as `systemd/install.sh`): another CPU index (a mirror), or `none` for none.
Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10.0


def locked_torch(lock_text: str) -> str:
    """torch's version in requirements.lock (`torch==X`); ValueError if it is not pinned there."""
    found = re.findall(r"^torch==([0-9][^\s;#+]*)\s*$", lock_text, flags=re.M)
    if len(found) != 1:
        raise ValueError(f"requirements.lock must pin torch exactly once as torch==VERSION, found {found}")
    return found[0]


def pip_args(system: str, machine: str, version: str, index: str, reachable: bool) -> list[str]:
    """The arguments for this platform (pure: `reachable` says whether `index` answered)."""
    if system != "Linux" or machine not in ("x86_64", "amd64", "AMD64"):
        return []
    args = [f"torch=={version}+cpu"]
    if index != "none" and reachable:
        args += ["--extra-index-url", index]
    return args


def answers(index: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Does the index serve torch's project page (PEP 503: <index>/torch/)?"""
    if index == "none":
        return False
    try:
        with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", default=str(Path(__file__).resolve().parents[1] / "requirements.lock"))
    ap.add_argument("--machine", default=platform.machine(), help="default: this machine's (uname -m)")
    ap.add_argument("--system", default=platform.system(), help="default: this machine's (uname -s)")
    args = ap.parse_args(argv)
    index = os.environ.get("XRONOS_TORCH_INDEX") or CPU_INDEX
    version = locked_torch(Path(args.lock).read_text())
    wanted = pip_args(args.system, args.machine, version, index, True)
    if not wanted:
        print(f"torch {version} from pip's index ({args.system} {args.machine}: its wheel is CPU-only)",
              file=sys.stderr)
        return 0
    out = pip_args(args.system, args.machine, version, index, answers(index))
    if "--extra-index-url" in out:
        print(f"torch {version}+cpu from {index}", file=sys.stderr)
    else:
        why = "XRONOS_TORCH_INDEX=none" if index == "none" else f"{index} cannot be reached"
        print(f"torch {version}+cpu from pip's configured index or find-links ({why}); without it there, "
              "the install stops: the CUDA build is never taken instead", file=sys.stderr)
    print(" ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
