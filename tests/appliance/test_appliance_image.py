"""`install.sh --root DIR` prepares a system image whose venv runs at its final path: built here,
then run inside the image (chroot into a Debian 12 tree) where DIR does not exist."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import box as B

REPO = Path(__file__).resolve().parents[2]
reason = B.unavailable() or ("XRONOS_SKIP_BOX=1" if os.environ.get("XRONOS_SKIP_BOX") == "1" else None)
pytestmark = [pytest.mark.box, pytest.mark.skipif(reason is not None, reason=f"image test: {reason}")]


def test_root_image_venv_runs_at_its_final_path(tmp_path):
    base = B.rootfs(log=tmp_path / "debootstrap.log")
    for d in ("upper", "work", "image"):
        (tmp_path / d).mkdir()
    image = tmp_path / "image"
    script = f"""
set -e
mount -t overlay overlay -o lowerdir={base},upperdir={tmp_path}/upper,workdir={tmp_path}/work {image}
bash {REPO}/systemd/install.sh --root {image} --role gateway --source {REPO} >{tmp_path}/install.log 2>&1 \\
    || {{ cat {tmp_path}/install.log; exit 3; }}
echo "--- shebang"; head -1 {image}/opt/xronos/venv/bin/xronos
echo "--- cfg"; cat {image}/opt/xronos/venv/pyvenv.cfg
echo "--- link"; readlink {image}/opt/xronos/venv/bin/python
echo "--- run"; chroot {image} /opt/xronos/venv/bin/xronos --version
chroot {image} /opt/xronos/venv/bin/python -c "import sys, xronos.gateway.service; print(sys.prefix)"
echo "--- again"; bash {REPO}/systemd/install.sh --root {image} --role gateway --source {REPO} >/dev/null 2>&1
chroot {image} /opt/xronos/venv/bin/xronos --version
"""
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    part = lambda name: out.split(f"--- {name}\n", 1)[1].split("\n--- ", 1)[0]  # noqa: E731
    assert part("shebang").strip() in ("#!/opt/xronos/venv/bin/python", "#!/opt/xronos/venv/bin/python3")
    assert str(tmp_path) not in part("cfg") and "home = /usr/bin" in part("cfg")
    assert part("link").strip().startswith("/usr/bin/python3.")
    run = part("run").splitlines()
    assert run[0].startswith("xronos ") and run[1] == "/opt/xronos/venv"
    assert part("again").strip().startswith("xronos ")  # running install.sh --root again still works
