"""`xronos.protocol.messages` is the one import point of the wire's types, though they are defined
in its parts (`msgtypes`, `msgnode`, `msgjob`, `msgstate`, `msgrequest`): every public name of a
part is there, as the same object, and every topic's payload is named there."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from xronos.protocol import messages as m
from xronos.protocol.topics import ENTRIES, _classes

PARTS = ("msgtypes", "msgnode", "msgjob", "msgstate", "msgrequest", "msgcatalog")


def _defined(path: Path) -> list[str]:
    """The public names a module's own top-level statements define (not those it imports)."""
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


@pytest.mark.parametrize("part", PARTS)
def test_every_public_name_of_a_part_is_exported_by_messages(part: str) -> None:
    mod = importlib.import_module(f"xronos.protocol.{part}")
    own = _defined(Path(mod.__file__))
    assert own, part
    missing = [n for n in own if getattr(m, n, None) is not getattr(mod, n)]
    assert missing == [], f"{part}: not in xronos.protocol.messages: {missing}"
    assert set(own) <= set(m.__all__)


def test_messages_exports_only_what_it_imports() -> None:
    assert sorted(n for n in m.__all__ if not hasattr(m, n)) == []
    assert len(set(m.__all__)) == len(m.__all__)


def test_every_topic_payload_of_ours_is_named_in_messages() -> None:
    for entry in ENTRIES:
        for cls in _classes(entry):
            if cls.__module__.startswith("xronos.protocol.msg"):
                assert getattr(m, cls.__name__) is cls, (entry.key, cls)
