"""A confined model or export directory confines its files too: a symlink in the model directory
must resolve inside allowed_dirs (transformers reads it, the export copies it), and the export
never writes through a link left in the export directory."""

import os

import pytest
import torch

from xronos.node.agent.jobcheck import confined_spec
from xronos.node.models.export import save_hf_dir
from xronos.protocol.messages import JobSpec


def _spec(allowed, export):
    return JobSpec(name="x", owner="n1",
                   recipe=dict(model_dir=str(allowed / "model"), data_path=str(allowed / "d.jsonl"),
                               task="causal-lm", batch_size=1, seq_len=8, lr=1e-3, max_steps=1,
                               export_dir=str(export)))


def test_symlink_in_model_dir_out_of_allowed_is_refused(tmp_path):
    allowed, secret = tmp_path / "allowed", tmp_path / "secret"
    (allowed / "model").mkdir(parents=True)
    (allowed / "d.jsonl").write_text("{}\n")
    secret.write_text("password")
    os.symlink(secret, allowed / "model" / "chat_template.jinja")
    with pytest.raises(ValueError, match="chat_template.jinja.*outside the allowed"):
        confined_spec(_spec(allowed, allowed / "out"), [allowed])


def test_symlink_in_model_dir_inside_allowed_is_fine(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "model").mkdir(parents=True)
    (allowed / "blobs").mkdir()
    (allowed / "blobs" / "c").write_text("{}")
    (allowed / "d.jsonl").write_text("{}\n")
    os.symlink(allowed / "blobs" / "c", allowed / "model" / "config.json")  # the Hugging Face cache layout
    confined_spec(_spec(allowed, allowed / "out"), [allowed])


def test_export_replaces_links_instead_of_writing_through_them(tmp_path):
    victim, src, out = tmp_path / "victim.json", tmp_path / "src", tmp_path / "out"
    victim.write_text("keep")
    src.mkdir()
    (src / "vocab.json").write_text("{}")
    out.mkdir()
    for name in ("config.json", "vocab.json"):
        os.symlink(victim, out / name)
    save_hf_dir(out, {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "causal-lm",
                {"w": torch.ones(1)}, src)
    assert victim.read_text() == "keep"
    assert not (out / "config.json").is_symlink() and (out / "vocab.json").read_text() == "{}"


def test_an_oversized_config_json_is_refused_before_it_is_read(tmp_path):
    from xronos.node.rank.validate import MAX_CONFIG_BYTES, read_config

    (tmp_path / "config.json").write_text("{}")
    assert read_config(tmp_path) == {}
    with open(tmp_path / "config.json", "r+b") as f:  # sparse: no disk spent, and never read whole
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ValueError, match=f"config.json is {MAX_CONFIG_BYTES + 1} bytes; .* at most"):
        read_config(tmp_path)


def test_a_link_planted_while_the_export_is_written_is_replaced_not_followed(tmp_path):
    from xronos.node.models.stage import staged

    victim, out = tmp_path / "victim.json", tmp_path / "out"
    victim.write_text("keep")
    with staged(out) as stage:
        (stage / "config.json").write_text("new")
        os.symlink(victim, out / "config.json")  # after any check an exporter could make
    assert victim.read_text() == "keep"
    assert not (out / "config.json").is_symlink() and (out / "config.json").read_text() == "new"
    assert os.listdir(out) == ["config.json"]


def test_swapping_the_private_directory_does_not_redirect_the_writes(tmp_path):
    from xronos.node.models.stage import STAGE_PREFIX, staged

    victim, out = tmp_path / "victim", tmp_path / "out"
    victim.write_text("keep")
    with staged(out) as stage:
        name = next(n for n in os.listdir(out) if n.startswith(STAGE_PREFIX))
        assert (out / name).stat().st_mode & 0o777 == 0o700
        os.rename(out / name, out / "moved")  # an attacker with write access to `out`
        (out / name).mkdir()
        os.symlink(victim, out / name / "model.safetensors")
        (stage / "model.safetensors").write_text("weights")
    assert victim.read_text() == "keep" and (out / "model.safetensors").read_text() == "weights"


def test_a_failed_export_moves_nothing_and_leaves_no_private_directory(tmp_path):
    from xronos.node.models.stage import staged

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with staged(out) as stage:
            (stage / "config.json").write_text("half")
            raise RuntimeError("disk full")
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_text() == "old"


def test_an_export_directory_swapped_for_a_link_is_refused(tmp_path):
    from xronos.node.models.stage import staged

    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    os.symlink(elsewhere, out)  # e.g. a LoRA export's `merged` planted before the merged model is written
    with pytest.raises(OSError, match="is a symbolic link"):
        with staged(out) as stage:
            (stage / "config.json").write_text("new")
    assert os.listdir(elsewhere) == []


def test_an_export_sweeps_what_a_killed_export_left_and_nothing_else(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    from xronos.node.models import stage as stage_mod

    out, keep = tmp_path / "out", tmp_path / "keep"
    keep.mkdir()
    (keep / "model.safetensors").write_text("someone's")
    out.mkdir()
    os.symlink(keep, out / (stage_mod.STAGE_PREFIX + "planted"))  # a link with our prefix: not ours
    # An export killed mid-write (SIGKILL: no clean-up runs) leaves its private directory, half a file in it.
    code = ("import os, signal, sys; from xronos.node.models.stage import staged\n"
            "with staged(sys.argv[1]) as s:\n"
            "    (s / 'model.safetensors').write_text('half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out)])
    assert proc.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(out) if n.startswith(stage_mod.STAGE_PREFIX) and not n.endswith("planted")]
    assert len(left) == 1 and os.listdir(out / left[0]) == ["model.safetensors"]

    with stage_mod.staged(out) as s:  # younger than a minute: not swept yet (its writer may be about to lock it)
        (s / "a").write_text("1")
    assert left[0] in os.listdir(out)

    monkeypatch.setattr(stage_mod, "SWEEP_MIN_AGE_S", 0.0)
    with stage_mod.staged(out) as outer:
        (outer / "config.json").write_text("outer")
        with stage_mod.staged(out) as inner:  # a second export meanwhile: the outer's directory is locked
            (inner / "b").write_text("2")
        assert (outer / "config.json").read_text() == "outer"
    assert left[0] not in os.listdir(out)
    assert sorted(os.listdir(out)) == [stage_mod.STAGE_PREFIX + "planted", "a", "b", "config.json"]
    assert (keep / "model.safetensors").read_text() == "someone's"
