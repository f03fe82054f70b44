"""The pipeline baseline trains the same function as single-device transformers: equal gradients,
in full fine-tuning and with LoRA adapters (against peft's LoRA layers on the whole model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from xronos.bench.pp_plan import InfeasiblePipeline, plan_pipeline
from xronos.bench.pp_worker import PPRankConfig
from xronos.node.rank.local import spawn_ranks
from xronos.bench.workloads import write_checkpoint

from benchkit import TINY, _data, _reference


@pytest.mark.slow
@pytest.mark.parametrize("family, spans", [
    ("llama", [(0, 2), (2, 4), (4, 6)]),
    ("gpt2", [(0, 3), (3, 6)]),
    ("roberta", [(0, 1), (1, 5), (5, 6)]),
    ("bert", [(0, 4), (4, 6)]),
    ("qwen2", [(0, 3), (3, 6)]),
])
def test_pipeline_gradients_equal_single_device(tmp_path: Path, family: str, spans) -> None:
    model_dir = write_checkpoint(tmp_path / "model", TINY[family])
    data = _data(tmp_path / "data.jsonl")
    cfg = PPRankConfig(recipe=dict(task="classify", model_dir=str(model_dir), data_path=str(data), batch_size=8,
                                   seq_len=16, lr=1e-3, max_steps=1, eval_fraction=0.0, max_grad_norm=None),
                       micro_batches=4, spans=spans, metrics_path=str(tmp_path / "m.json"),
                       grads_dir=str(tmp_path / "grads"), gloo_timeout_s=60)
    spawn_ranks("xronos.bench.pp_worker", [cfg] * len(spans), timeout_s=240)
    ref_loss, ref = _reference(model_dir, data)
    got: dict[str, torch.Tensor] = {}
    for r in range(len(spans)):
        part = load_file(str(tmp_path / "grads" / f"grads-rank{r}.safetensors"))
        assert not set(part) & set(got), "a tensor is owned by two stages"
        got.update(part)
    assert set(got) == set(ref), (sorted(set(ref) - set(got)), sorted(set(got) - set(ref)))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    last = json.loads((tmp_path / "m.json").read_text())["ranks"][-1]["iterations"][0]
    assert last["loss"] == pytest.approx(ref_loss, rel=1e-5)


def _lora_reference(model_dir: Path, data: Path, targets: list[str], steps: int) -> tuple[list[float], dict]:
    """Single-device transformers with peft's LoRA layers, the adapters drawn as the TP engine draws
    them, the head trained: the losses of `steps` AdamW steps and the last step's gradients."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForSequenceClassification

    from xronos.node.data.batches import BatchSource
    from xronos.node.models.loading import fresh_tensor
    from xronos.node.rank.optim import adamw
    from xronos.node.runconfig import RunConfig
    from xronos.protocol.layout import Layout

    run = RunConfig(recipe=dict(model_dir=str(model_dir), data_path=str(data), task="classify", batch_size=8,
                                seq_len=16, lr=1e-3, max_steps=steps, seed=0, eval_fraction=0.0, max_grad_norm=None),
                    layout=Layout(attn=(1,), mlp=(1,), vocab=(1,)))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir))
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8.0, target_modules=targets,
                                       fan_in_fan_out=model.config.model_type == "gpt2"), model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            hf = n.replace(".default.", ".")
            if ".lora_A." in n:
                p.copy_(fresh_tensor(hf, tuple(p.shape), "uniform", p.shape[1] ** -0.5))
            p.requires_grad_(".lora_" in n or n.split(".")[0] in ("score", "classifier"))
    model.train()
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, batches = [], BatchSource(run.recipe, 2).train_batches()
    for step in range(steps):
        _, b = next(batches)
        kw = {"token_type_ids": b.token_type_ids} if b.token_type_ids is not None else {}
        loss = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels, **kw).loss
        loss.backward()
        losses.append(float(loss))
        if step < steps - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("family, spans, targets", [
    ("llama", [(0, 1), (1, 4), (4, 6)], ["q_proj", "v_proj"]),  # a first stage with the frozen embedding alone
    ("gpt2", [(0, 3), (3, 6)], ["c_attn"]),  # Conv1D: peft's fan_in_fan_out
])
def test_pipeline_lora_trains_what_peft_trains_on_one_device(tmp_path: Path, family: str, spans, targets) -> None:
    """Two steps (the second after an AdamW step, so the adapters' A gradients are not zero): the
    pipeline's losses and last gradients equal peft's on the whole model."""
    model_dir = write_checkpoint(tmp_path / "model", TINY[family])
    data = _data(tmp_path / "data.jsonl")
    cfg = PPRankConfig(recipe=dict(task="classify", model_dir=str(model_dir), data_path=str(data), batch_size=8,
                                   seq_len=16, lr=1e-3, max_steps=2, eval_fraction=0.0, max_grad_norm=None,
                                   lora=dict(r=4, alpha=8.0, targets=targets)),
                       micro_batches=4, spans=spans, metrics_path=str(tmp_path / "m.json"),
                       grads_dir=str(tmp_path / "grads"), grads_step=1, gloo_timeout_s=60)
    spawn_ranks("xronos.bench.pp_worker", [cfg] * len(spans), timeout_s=240)
    ref_losses, ref = _lora_reference(model_dir, data, targets, 2)
    got: dict[str, torch.Tensor] = {}
    for r in range(len(spans)):
        path = tmp_path / "grads" / f"grads-rank{r}.safetensors"
        part = load_file(str(path)) if path.stat().st_size > 16 else {}
        assert not set(part) & set(got), "a tensor is owned by two stages"
        got.update(part)
    assert set(got) == set(ref), (sorted(set(ref) - set(got)), sorted(set(got) - set(ref)))
    assert any(".lora_A." in n for n in ref) and all(".lora_" in n or n.split(".")[0] in ("score", "classifier")
                                                    for n in ref)
    for name, g in ref.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    iters = json.loads((tmp_path / "m.json").read_text())["ranks"][-1]["iterations"]
    assert [it["loss"] for it in iters] == pytest.approx(ref_losses, rel=1e-5)


def test_dp_puts_more_layers_on_the_faster_device_and_respects_memory() -> None:
    L = 10  # emb, 8 blocks, out
    fast, slow = [0.01] * L, [0.02] * L
    plan = plan_pipeline([fast, slow], [1.0] * L, [0.0] * L, [0.0] * L, caps=[100, 100], micro_batches=8)
    sizes = {s.device: s.stop - s.start for s in plan.stages}
    assert sizes[0] > sizes[1] and sum(sizes.values()) == L
    assert [s.start for s in plan.stages][0] == 0 and plan.stages[-1].stop == L
    # Cap the fast device to 3 layers: the split must follow the cap.
    plan = plan_pipeline([fast, slow], [1.0] * L, [0.0] * L, [0.0] * L, caps=[3, 100], micro_batches=8)
    assert {s.device: s.stop - s.start for s in plan.stages}[0] <= 3
    with pytest.raises(InfeasiblePipeline, match="no pipeline cut fits"):
        plan_pipeline([fast, slow], [1.0] * L, [0.0] * L, [0.0] * L, caps=[3, 3], micro_batches=8)


def test_transient_memory_counts_once_per_stage() -> None:
    L = 4
    times = [[0.01] * L, [0.01] * L]
    # Each layer 1 byte resident and 2 transient: a stage of k layers needs k + 2 bytes.
    plan = plan_pipeline(times, [1.0] * L, [0.0] * L, [0.0] * L, caps=[4, 4], micro_batches=2,
                         transient_memory=[2.0] * L)
    assert sorted(s.stop - s.start for s in plan.stages) == [2, 2] and all(s.memory == 4 for s in plan.stages)
    with pytest.raises(InfeasiblePipeline):
        plan_pipeline(times, [1.0] * L, [0.0] * L, [0.0] * L, caps=[3, 3], micro_batches=2,
                      transient_memory=[2.0] * L)


def test_dp_matches_exhaustive_search() -> None:
    """Per device order the DP finds the smallest bottleneck; the plan is the best order's."""
    import itertools

    from xronos.bench.pp_plan import _plan_in_order

    rng = random.Random(3)
    for _ in range(30):
        N, L = rng.randrange(1, 4), rng.randrange(2, 7)
        times = [[rng.uniform(0.1, 1) for _ in range(L)] for _ in range(N)]
        mem, act, comm = [rng.uniform(1, 3) for _ in range(L)], [rng.uniform(0, 0.5) for _ in range(L)], \
            [rng.uniform(0, 0.2) for _ in range(L)]
        caps = [rng.uniform(3, 12) for _ in range(N)]
        cands = []
        for order in itertools.permutations(range(N)):
            got = _plan_in_order(order, times, mem, act, comm, caps, 4)
            best = _brute(order, times, mem, act, comm, caps, 4)
            assert (got is None) == (best is None)
            if got is not None:
                assert got.bottleneck_s == pytest.approx(best)
                cands.append(got.predicted_iteration_s)
        if cands:
            plan = plan_pipeline(times, mem, act, comm, caps, micro_batches=4)
            assert plan.predicted_iteration_s == pytest.approx(min(cands))
        else:
            with pytest.raises(InfeasiblePipeline):
                plan_pipeline(times, mem, act, comm, caps, micro_batches=4)


def _brute(order, times, mem, act, comm, caps, M):
    """Smallest bottleneck over every contiguous cut in this device order (empty stages allowed)."""
    import itertools

    N, L = len(order), len(mem)
    best = None
    for cuts in itertools.combinations_with_replacement(range(L + 1), N - 1):
        bounds = [0, *cuts, L]
        worst, ok = 0.0, True
        for pos, d in enumerate(order):
            j, l = bounds[pos], bounds[pos + 1]
            if j == l:
                continue
            t = sum(times[d][j:l]) + (comm[l - 1] if l < L else 0)
            if sum(mem[j:l]) + min(M, N - pos) * sum(act[j:l]) > caps[d]:
                ok = False
                break
            worst = max(worst, t)
        if ok and (best is None or worst < best):
            best = worst
    return best


def test_the_layer_profile_reads_the_virtual_clock_of_an_emulated_box(tmp_path: Path, monkeypatch) -> None:
    """On the virtual clock a layer's time is its burst's CPU time over the box's speed (here a
    fake thread clock: 10 ms of CPU per burst, a box worth half a core), not the host's wall time."""
    import itertools

    from xronos.bench.pp_profile import profile_layers
    from xronos.node import emulate
    from xronos.node.emulate.vclock import Box, VirtualClock

    model_dir = write_checkpoint(tmp_path / "model", TINY["llama"])
    cpu = itertools.count(0.0, 0.01)
    monkeypatch.setenv("XRONOS_PROFILE_PAUSE_S", "0")
    emulate.reset_for_tests(VirtualClock(Box(host_cores=0.5), thread_time=lambda: next(cpu)))
    try:
        prof = profile_layers(str(model_dir), 2, 8, iters=3, warmup=1)
    finally:
        emulate.reset_for_tests()
    assert prof["times"] == pytest.approx([0.02] * 3) and prof["step_times"] == pytest.approx([0.02] * 3)
    wall = profile_layers(str(model_dir), 2, 8, iters=3, warmup=1)  # no emulated box: wall seconds
    assert all(0 < t < 1 for t in wall["times"]) and wall["times"] != pytest.approx([0.02] * 3)
