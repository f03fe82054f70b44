"""`make demo`/`make test` take the CPU-only torch on x86_64 Linux (the CUDA build on PyPI is 2.5 GiB
of wheels for boxes without a GPU): `torch==<locked>+cpu` is required by name, from the CPU index
when it answers and from pip's own index/find-links when it does not; aarch64 is left as it was.
Checked on the Makefile's own recipe (`make -n`: nothing is run or downloaded), against a local
index that answers and a port where nothing listens."""

from __future__ import annotations

import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cputorch", ROOT / "tools" / "cputorch.py")
cputorch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cputorch)

VERSION = cputorch.locked_torch((ROOT / "requirements.lock").read_text())


def test_the_arguments_per_platform():
    idx = cputorch.CPU_INDEX
    assert cputorch.pip_args("Linux", "x86_64", "2.13.0", idx, True) == [
        "torch==2.13.0+cpu", "--extra-index-url", idx]
    assert cputorch.pip_args("Linux", "x86_64", "2.13.0", idx, False) == ["torch==2.13.0+cpu"]
    assert cputorch.pip_args("Linux", "x86_64", "2.13.0", "none", True) == ["torch==2.13.0+cpu"]
    assert cputorch.pip_args("Linux", "aarch64", "2.13.0", idx, True) == []
    assert cputorch.pip_args("Darwin", "x86_64", "2.13.0", idx, True) == []
    with pytest.raises(ValueError, match="pin torch exactly once"):
        cputorch.locked_torch("numpy==2.0\ntorch>=2\n")


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 503 index on loopback that has a torch page."""
    root = tmp_path_factory.mktemp("index")
    (root / "simple" / "torch").mkdir(parents=True)
    (root / "simple" / "torch" / "index.html").write_text("<html><body></body></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/simple"
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pip_line(index: str, machine: str) -> tuple[str, str]:
    """The venv's `pip install` line as `make` would run it, and what make said on stderr."""
    if shutil.which("make") is None:
        pytest.skip("no make on PATH")
    env = {**os.environ, "XRONOS_TORCH_INDEX": index}
    done = subprocess.run(["make", "-n", "-B", ".venv/.installed", f"XRONOS_UNAME_M={machine}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = [ln for ln in done.stdout.splitlines() if " -m pip install " in ln]
    assert len(lines) == 1, done.stdout
    return lines[0], done.stderr


def test_make_takes_the_cpu_build_from_the_cpu_index_when_it_answers(index):
    line, err = _pip_line(index, "x86_64")
    assert f" torch=={VERSION}+cpu --extra-index-url {index} " in line, line
    assert f"torch {VERSION}+cpu from {index}" in err


def test_make_still_requires_the_cpu_build_when_the_index_cannot_be_reached():
    unreachable = f"http://127.0.0.1:{_closed_port()}/simple"
    line, err = _pip_line(unreachable, "x86_64")
    assert f" torch=={VERSION}+cpu " in line and "--extra-index-url" not in line, line
    assert "cannot be reached" in err and "the CUDA build is never taken" in err


def test_make_on_aarch64_is_as_before(index):
    line, _ = _pip_line(index, "aarch64")
    assert "torch" not in line and "--extra-index-url" not in line, line
