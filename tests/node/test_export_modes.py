"""Every file Xronos writes for the user — an export (the full model, a LoRA adapter and its merged
model, the tokenizer copies) and a consolidated checkpoint — is created as an ordinary file is:
0666 less the umask. safetensors' `save_file` creates 0600 files, which the service's group (the
README's promise: membership of `xronos` is enough to read an export) could not read."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runkit  # noqa: E402

from xronos.node.rank.checkpoint import save_checkpoint  # noqa: E402
from xronos.node.models.adapters import save_lora_exports  # noqa: E402
from xronos.node.models.export import gather_full, save_hf_dir  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.models.stage import ordinary_mode, umask  # noqa: E402
from xronos.node.rank.optim import adamw  # noqa: E402
from xronos.node.rank.optstate import allocate_state  # noqa: E402
from xronos.node.tp.group import TPGroup  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402
from xronos.node.tp.lora import add_lora  # noqa: E402
from xronos.protocol.messages import LoraSpec  # noqa: E402

TASK = "causal-lm"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return runkit.make_model(tmp_path_factory.mktemp("modes") / "gpt2", "gpt2", TASK)


@pytest.fixture
def mask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _model(model_dir: Path, lora_r: int | None):
    config = json.loads((model_dir / "config.json").read_text())
    family = family_for(config)
    layout = ShardLayout.single(family.sizes(config))
    model = family.build(config, TASK, layout, TPGroup.single())
    settings = family.lora_settings(LoraSpec(r=lora_r, alpha=8.0) if lora_r else None)
    modules = add_lora(model, settings) if settings is not None else []
    materialize(model, SafetensorsSource(model_dir))
    return config, layout, model, settings, modules


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode))
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mask", [0o027, 0o022, 0o077], indirect=True, ids=oct)
def test_exports_and_checkpoints_are_created_with_the_umask_mode(model_dir, tmp_path, mask):
    want = oct(0o666 & ~mask)  # 0o640 under the unit's UMask=0027: the group reads it
    assert umask() == mask
    config, layout, model, _, _ = _model(model_dir, None)
    state = gather_full(model, model.tensor_specs(), layout, TPGroup.single())
    save_hf_dir(tmp_path / "full", config, TASK, state, model_dir)

    config, layout, model, settings, modules = _model(model_dir, 4)
    state = gather_full(model, model.tensor_specs(), layout, TPGroup.single())
    save_lora_exports(tmp_path / "lora", config, TASK, state, settings, modules, model_dir, merged=True)

    config, layout, model, _, _ = _model(model_dir, None)
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    allocate_state(opt)
    save_checkpoint(tmp_path / "ckpt", model, model.tensor_specs(), layout, TPGroup.single(), opt, config, TASK,
                    {"step": 1, "epoch": 0, "plan_version": 1})

    modes = _modes(tmp_path)
    for must in ("full/model.safetensors", "full/tokenizer.json", "full/config.json",
                 "lora/adapter_model.safetensors", "lora/adapter_config.json", "lora/merged/model.safetensors",
                 "ckpt/model.safetensors", "ckpt/optimizer.safetensors", "ckpt/state.json"):
        assert must in modes, sorted(modes)
    assert {f: m for f, m in modes.items() if m != want} == {}


def test_ordinary_mode_refuses_a_link(tmp_path):
    """A path handed to the helper is not followed through a link (it changes only our own files)."""
    target = tmp_path / "secret"
    target.write_text("x")
    target.chmod(0o600)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        ordinary_mode(tmp_path / "link", 0o644)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
