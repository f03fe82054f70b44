"""Which family reads a checkpoint: by config.json's `architectures`, refusing anything else."""

from __future__ import annotations

from typing import Any

from .common import Family, TPModel
from .bert import BertFamily, RobertaFamily
from .gpt2 import GPT2Family
from .llama import LlamaFamily, Qwen2Family, Qwen3Family

FAMILIES: tuple[Family, ...] = (GPT2Family(), BertFamily(), RobertaFamily(), LlamaFamily(), Qwen2Family(),
                                Qwen3Family())


def family_for(config: dict[str, Any]) -> Family:
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError("config.json has no 'architectures' list, so the model family is unknown")
    for arch in archs:
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise ValueError(f"unsupported architecture {', '.join(map(str, archs))} "
                     f"(supported: {', '.join(supported)})")


def family_by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r} (known: {[f.name for f in FAMILIES]})")


def arch_spec(config: dict[str, Any], task: str) -> dict[str, Any]:
    """ArchSpec fields (xronos.protocol.messages.ArchSpec) for a checkpoint's config and task."""
    return family_for(config).arch_spec(config, task)


def config_from_arch(arch: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict with the shape described by ArchSpec fields (random-weight models)."""
    return family_by_name(arch["family"]).config_from_arch(arch)


__all__ = ["FAMILIES", "Family", "TPModel", "family_for", "family_by_name", "arch_spec", "config_from_arch"]
