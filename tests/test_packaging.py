"""What `pip install` puts on a box is every room of the source tree.

pyproject.toml lists the import packages by hand (the top-level folders map to `xronos.*`), and
an editable install — every test's — finds a package left off that list anyway; an installed box
does not. `node/dp` was left off for a release: jobs that chose data parallelism failed on the box
with "No module named 'xronos.node.dp'" while every editable test passed."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_of_the_tree_is_installed() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    dirs = conf["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages without a folder: {sorted(listed - found)}"
