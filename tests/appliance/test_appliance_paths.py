"""Paths from the network are confined to the allowed directories, after resolving links and '..'."""

from __future__ import annotations

import os

import pytest

from xronos.common.paths import confine_path


def test_inside_is_accepted_and_resolved(tmp_path):
    root = tmp_path / "allowed"
    (root / "models" / "gpt2").mkdir(parents=True)
    assert confine_path(root / "models" / "gpt2", [root]) == (root / "models" / "gpt2").resolve()
    assert confine_path(str(root / "models" / ".." / "out"), [root]) == (root / "out").resolve()
    assert confine_path(root, [root]) == root.resolve()  # the directory itself


def test_dotdot_escape_is_refused_with_a_clear_message(tmp_path):
    root = tmp_path / "allowed"
    root.mkdir()
    with pytest.raises(ValueError) as err:
        confine_path(f"{root}/../../etc/passwd", [root], what="spec.data_path")
    msg = str(err.value)
    assert msg.startswith(f"spec.data_path '{root}/../../etc/passwd' (resolves to ")
    assert f"outside the allowed directories: {root.resolve()}" in msg


def test_symlink_out_is_refused(tmp_path):
    root, outside = tmp_path / "allowed", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(ValueError, match="outside the allowed directories"):
        confine_path(root / "link" / "data.jsonl", [root])


def test_prefix_sibling_is_not_inside(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data2").mkdir()
    with pytest.raises(ValueError, match="outside"):
        confine_path(tmp_path / "data2" / "x", [tmp_path / "data"])


def test_relative_and_empty_refused(tmp_path):
    with pytest.raises(ValueError, match="must be an absolute path under one of"):
        confine_path("models/gpt2", [tmp_path])
    with pytest.raises(ValueError, match="not a valid path"):
        confine_path("", [tmp_path])
    with pytest.raises(ValueError, match=r"\(none configured\)"):
        confine_path(tmp_path, [])
