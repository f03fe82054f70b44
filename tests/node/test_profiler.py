"""Profiler: a valid, plausible ProfileReport on tiny models; the cache; the memory instruments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.profiles import parse_report, plan_reports
from xronos.node.measure import profiler as prof
from xronos.node.measure.memprobe import AllocTrace, SavedTensorMeter, mark, state_bytes, storage_key
from xronos.node.measure.timeline import find_regions
from xronos.node.models.shapes import shape
from xronos.protocol.layout import Sizes
from xronos.protocol.messages import LoraShape, LoraSpec, ProfileKey, ProfileReport, ProfileSettings

B, S = 2, 16
FULL = ProfileSettings(weight_decay=0.0, clip=True, lora=None)
TINY = shape("tiny-gpt2", "classify")  # hidden 64, 4 heads, MLP 256, vocab 500, 2 blocks
E, I, V, P, H = 64, 256, 500, 128, 4


@pytest.fixture(scope="module")
def reports() -> dict[str, ProfileReport]:
    torch.set_num_threads(1)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(prof.HEAP_ENV, "always")  # the heap probes too, which a tiny model on a big host skips
        for task in ("classify", "causal-lm"):
            config = prof.config_for(arch=shape("tiny-gpt2", task))
            out[task] = prof.profile(config, task, B, S, threads=1, iters=3, warmup=1)
    return out


def _params(name: str, task: str) -> int:
    """Parameter count of each profiled layer, from the shape alone."""
    return {
        "emb": V * E + P * E,
        "blk.attn": E * 3 * E + 3 * E + E * E + E,
        "blk.mlp": E * I + I + I * E + E,
        "blk.rest": 4 * E,
        "out": 2 * E + (2 * E if task == "classify" else 0),
    }[name]


@pytest.mark.parametrize("task", ["classify", "causal-lm"])
def test_report_is_valid_and_plausible(reports: dict[str, ProfileReport], task: str) -> None:
    r = reports[task]
    assert r.sizes.attn == H and r.num_blocks == 2 and r.task == task
    assert (r.batch_size, r.seq_len, r.threads) == (B, S, 1)
    assert r.arch.hidden_size == E and r.capabilities.cores >= 1
    assert r.settings == FULL  # the job settings it was taken under, recorded
    layers = {lay.name: lay for lay in r.layers}
    assert set(layers) == {"emb", "blk.attn", "blk.mlp", "blk.rest", "out"}
    assert [lay.kind for lay in r.layers] == ["emb", "blk", "blk", "blk", "out"]
    expect_part = {"emb": True, "blk.attn": True, "blk.mlp": True, "blk.rest": False,
                   "out": task == "causal-lm"}  # the LM head is vocab-parallel, a class head replicated
    for name, lay in layers.items():
        assert lay.partitioned == expect_part[name], name
        assert lay.time_s > 0, name
        if lay.partitioned:
            # Shares of the layer's own kind: heads 4, 2, 1 of 4; MLP columns 256, 128, 64 of
            # 256; vocabulary rows 500, 256, 128 of 500 (multiples of the 32-row quantum).
            expect = {"attn": [1.0, 0.5, 0.25], "mlp": [1.0, 0.5, 0.25], "vocab": [1.0, 256 / 500, 128 / 500]}
            assert lay.segment == ("vocab" if name in ("emb", "out") else name.split(".")[1]), name
            assert [p for p, _ in lay.time_samples] == pytest.approx(expect[lay.segment]), name
            assert all(t > 0 for _, t in lay.time_samples)
            assert lay.time_samples[0][1] == lay.time_s
        else:
            assert lay.segment is None
        # Weights, grads, exp_avg, exp_avg_sq: at least 4 fp32 copies of every parameter.
        assert lay.weight_bytes >= 16 * _params(name, task), name
        assert lay.activation_bytes > 0, name
    # Activations a shape implies must be among the saved tensors:
    assert layers["blk.mlp"].activation_bytes >= 4 * B * S * I  # the activation fed to c_proj
    assert layers["blk.rest"].activation_bytes >= 4 * B * S * E  # the block input, saved by ln_1
    assert layers["blk.attn"].activation_bytes >= 4 * 3 * B * S * E  # q, k, v
    # The heap's holes: measured at full width and at the smallest profiled width (counts of it)
    assert r.heap_slack_small_counts is not None
    assert r.heap_slack_small_counts.model_dump() == prof.widths(r.sizes)[-1]
    assert min(r.heap_slack_bytes, r.heap_slack_block_bytes, r.heap_slack_small_bytes) >= 0
    # Peak-memory terms: each layer's largest tensor at full width (loading's buffer), the warm
    # process without a model (Python + torch alone are > 100 MiB), the owner's data stack.
    assert layers["emb"].load_bytes == 4 * V * E  # the word embedding, larger than the positions
    assert layers["blk.mlp"].load_bytes == 4 * E * I and layers["blk.attn"].load_bytes == 4 * E * 3 * E
    assert 100 << 20 < r.runtime_bytes < 4 << 30
    for name, lay in layers.items():  # weights only; M_w adds grads and two moments (all trained)
        assert lay.param_bytes == 4 * _params(name, task) and lay.weight_bytes >= 4 * lay.param_bytes, name
    assert r.owner_bytes >= 0
    assert r.profile_seconds > 0


def test_report_round_trips_and_plans(reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    r = reports["classify"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(r.model_dump(mode="json")))
    again = parse_report(json.loads(path.read_text()), str(path))
    assert again == r
    other = r.model_copy(update={"node_id": "other"})
    result = plan_reports([Loaded("a", r), Loaded("b", other)], "segment", reserve_mb=0, batch_size=B, seq_len=S)
    assert sum(row.units for row in result.rows) == H
    assert sum(row.mlp for row in result.rows) == I and sum(row.vocab for row in result.rows) == V
    assert result.optimal


def test_cache_hit_does_not_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = prof.config_for(arch=TINY)
    first = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path,
                         node_id="n1", job_id="j1")
    assert len(list(tmp_path.glob("profile-*.json"))) == 1

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("profiled again despite a cached report")

    monkeypatch.setattr(prof, "ProfilingSet", boom)
    second = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path,
                          node_id="n1", job_id="j2", request_id="r2")
    assert second.layers == first.layers and second.created_at == first.created_at
    assert (second.job_id, second.request_id) == ("j2", "r2")
    assert second.settings == first.settings == FULL
    # An entry cached before the report recorded its settings (no PROFILER_VERSION bump for it) is
    # served with this request's: the key holds them, so they are the ones it was measured under.
    (entry,) = tmp_path.glob("profile-*.json")
    doc = json.loads(entry.read_text())
    doc.pop("settings")
    entry.write_text(json.dumps(doc))
    third = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path)
    assert third.settings == FULL and third.layers == first.layers
    # Another batch shape is another profile.
    with pytest.raises(AssertionError, match="profiled again"):
        prof.profile(config, "classify", B + 1, S, threads=1, iters=2, cache_dir=tmp_path)


def test_a_box_too_small_for_the_profiling_set_is_refused_before_it_is_built() -> None:
    """A model whose one-block set alone exceeds the box would page it until the OOM killer picks
    something: refused with the figures, before a tensor is allocated."""
    from xronos.node.box.capabilities import probe
    from xronos.node.measure.profset import ProfileTooLarge, floor_bytes

    one_block = prof.one_block_config(prof.config_for(arch=TINY))
    n = sum(_params(name, "classify") for name in ("emb", "blk.attn", "blk.mlp", "blk.rest", "out"))
    assert floor_bytes(one_block, "classify", lora=False) == (16 * n, n)  # weights, grads, 2 moments
    assert floor_bytes(one_block, "classify", lora=True) == (4 * n, n)  # a frozen base: weights only
    small = probe("n7", "127.0.0.1").model_copy(update={"memory_available": 16 * n - 1})
    with pytest.raises(ProfileTooLarge, match=rf"needs at least .* MiB .*{n:,} parameters.*node n7 has 1.4 MiB available"):
        prof.profile(prof.config_for(arch=TINY), "classify", B, S, threads=1, capabilities=small, node_id="n7")


def test_bad_input_is_refused() -> None:
    config = prof.config_for(arch=TINY)
    with pytest.raises(ValueError, match="batch_size"):
        prof.profile(config, "classify", 0, S)
    with pytest.raises(TypeError, match="seq_len"):
        prof.profile(config, "classify", B, 8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_positions"):
        prof.profile(config, "classify", B, P + 1)
    with pytest.raises(ValueError, match="architecture"):
        prof.profile({"architectures": ["NopeModel"]}, "classify", B, S)
    with pytest.raises(ValueError, match="exactly one"):
        prof.config_for()
    with pytest.raises(FileNotFoundError, match="config.json"):
        prof.config_for(model_dir="/nonexistent")


def test_widths_and_regions() -> None:
    gpt2m = prof.widths(Sizes(attn=16, mlp=4096, vocab=50257))
    assert gpt2m == [dict(attn=16, mlp=4096, vocab=50257), dict(attn=8, mlp=2048, vocab=25120),
                     dict(attn=4, mlp=1024, vocab=12576)]  # MLP and vocabulary at multiples of 32
    assert [w["attn"] for w in prof.widths(Sizes(attn=2, mlp=256, vocab=500))] == [2, 1, 1]
    # One KV head: attention has one width, the other kinds still three.
    one = prof.widths(Sizes(attn=1, mlp=256, vocab=500))
    assert [w["attn"] for w in one] == [1, 1, 1] and [w["mlp"] for w in one] == [256, 128, 64]
    # Sizes off the quantum: the whole width first, then multiples of 32 (at least one quantum).
    odd = prof.widths(Sizes(attn=12, mlp=100, vocab=37))
    assert [w["mlp"] for w in odd] == [100, 64, 32] and [w["vocab"] for w in odd] == [37, 32, 32]
    # Nothing left to vary: a single run.
    assert prof.widths(Sizes(attn=1, mlp=32, vocab=20)) == [dict(attn=1, mlp=32, vocab=20)]

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(4)
            self.attn = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.out = nn.ModuleDict(dict(dense=nn.Linear(4, 4), norm=nn.LayerNorm(4)))

    blk = Blk()
    part = {id(blk.attn[0].weight), id(blk.attn[1].weight), id(blk.out["dense"].weight)}
    assert set(find_regions(blk, part)) == {"attn", "out.dense"}  # norms stay replicated


# --- the instruments on plain modules ---


def test_saved_tensor_meter_counts_storages_once_without_params() -> None:
    lin = nn.Linear(32, 64)
    x = torch.randn(8, 32, requires_grad=True)
    meter = SavedTensorMeter({storage_key(p) for p in lin.parameters()})
    with meter():
        y = torch.relu(lin(x))
        z = y.view(-1) * 2.0  # scalar mul saves nothing; y's view shares its storage
        z.sum().backward()
    # linear saves its input x (the weight is excluded); relu saves its output y.
    assert meter.by_region == {"blk.rest": 4 * 8 * 32 + 4 * 8 * 64}


def test_alloc_trace_temporary_peak() -> None:
    x = torch.randn(256, 1024)  # 1 MiB
    with AllocTrace() as trace:
        with mark("phase"):
            y = (x * 2.0).sum()  # x * 2 is a 1 MiB temporary, freed at once
        with mark("kept"):
            keep = x * 3.0  # allocated and alive at the end: not a temporary
    assert float(y) != 0 and keep.numel() == x.numel()
    assert trace.temp_bytes("xr::phase") >= 1 << 20
    assert trace.temp_bytes("xr::kept") < 1 << 20
    assert trace.temp_bytes("xr::phase", skip=("xr::phase",)) == 0


def test_state_bytes_after_adamw_step() -> None:
    lin = nn.Linear(10, 20)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(3, 10)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in lin.parameters())
    assert state_bytes(lin.parameters(), opt) == 16 * n  # param, grad, exp_avg, exp_avg_sq
    assert state_bytes(lin.parameters(), None) == 8 * n


def test_profile_in_child_process(tmp_path: Path) -> None:
    """The node service's path: the report comes from a child process, ids and capabilities kept,
    and a failing child is an error carrying what it printed."""
    from xronos.node.box.capabilities import probe
    from xronos.node.measure.profilechild import ProfileJob, profile_in_child

    caps = probe("n7", "127.0.0.1")
    job = ProfileJob(config=prof.config_for(arch=TINY), key=ProfileKey(task="classify", batch_size=B, seq_len=S),
                     threads=1, iters=2, node_id="n7", request_id="req-1", job_id="job-1", capabilities=caps,
                     cache_dir=str(tmp_path / "cache"))
    report = profile_in_child(job)
    assert (report.node_id, report.request_id, report.job_id) == ("n7", "req-1", "job-1")
    assert report.capabilities == caps and report.sizes.attn == H
    assert len(list((tmp_path / "cache").glob("profile-*.json"))) == 1
    with pytest.raises(RuntimeError, match="max_positions"):
        profile_in_child(job.model_copy(update={"key": job.key.model_copy(update={"seq_len": P + 1})}))
    # A box too small for the profiling set: the refusal's sentence, not a traceback.
    tiny_box = caps.model_copy(update={"memory_available": 1024})
    with pytest.raises(RuntimeError, match="^profiling this model needs at least") as err:
        profile_in_child(job.model_copy(update={"capabilities": tiny_box, "cache_dir": None}))
    assert "Traceback" not in str(err.value)


def test_pause_at_skipped_collectives_is_left_out_of_layer_times() -> None:
    """The profiled rank sleeps where training waits in a collective (so that a CFS quota refills
    as it does for a training rank), and that sleep is not booked to any layer."""
    from xronos.node.measure.profset import ProfilingSet
    from xronos.node.tp.group import TPGroup
    from xronos.protocol.layout import Layout

    g = TPGroup.alone(2, pause_s=0.01)
    g.all_reduce(torch.ones(3))
    g.all_reduce(torch.ones(3), timed=False)  # measurement/control collectives do not pause
    assert 0.01 <= g.paused_s < 0.05
    with pytest.raises(ValueError, match="pause_s"):
        TPGroup.alone(2, pause_s=-1.0)

    torch.set_num_threads(1)
    config = prof.one_block_config(prof.config_for(arch=shape("tiny-gpt2", "classify")))
    layout = Layout(attn=(H, 0), mlp=(I, 0), vocab=(V, 0))
    plain = ProfilingSet(config, "classify", layout, B, S, 0, True)
    paused = ProfilingSet(config, "classify", layout, B, S, 0, True, pause_s=0.02)
    try:
        for ps in (plain, paused):
            ps.iteration()
        a = min(sum(plain.iteration().values()) for _ in range(3))
        b = min(sum(paused.iteration().values()) for _ in range(3))
        # Every emb/attn/mlp reduce, both backward copies and the step pause 20 ms: >= 100 ms per
        # iteration, none of it in the layers' times.
        assert paused.group.paused_s >= 4 * 5 * 0.02
        assert b < a + 0.05, (a, b)
    finally:
        plain.close()
        paused.close()
    assert prof.collective_pause_s() > 0


def test_without_clipping_the_trainers_finite_check_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that does not clip still reads every gradient once per step (the trainer's inf/nan
    look): the profile times that read with each layer, as it times the clipping pass."""
    from xronos.node.measure import profset
    from xronos.protocol.layout import Layout

    seen: list[int] = []
    real = profset.all_finite
    monkeypatch.setattr(profset, "all_finite", lambda grads: seen.append(len(grads)) or real(grads))
    torch.set_num_threads(1)
    config = prof.one_block_config(prof.config_for(arch=shape("tiny-gpt2", "classify")))
    ps = profset.ProfilingSet(config, "classify", Layout(attn=(H, 0), mlp=(I, 0), vocab=(V, 0)), B, S, 0, False)
    try:
        ps.iteration()
        assert len(seen) == len(ps.opts) and all(n > 0 for n in seen)  # every trained layer, once
        seen.clear()
        clipped = profset.ProfilingSet(config, "classify", Layout(attn=(H, 0), mlp=(I, 0), vocab=(V, 0)), B, S, 0,
                                       True)
        clipped.iteration()
        clipped.close()
        assert seen == []  # clipping reads the gradients for their norm instead
    finally:
        ps.close()


def test_pause_on_each_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The virtual clock's profile pauses too (a thread that slept computes its next burst slower,
    and training sleeps at every collective); a paced one does not (its pacer sleeps already)."""
    import types

    import xronos.node.emulate as emulate

    monkeypatch.delenv("XRONOS_PROFILE_PAUSE_S", raising=False)
    monkeypatch.setattr(emulate, "process_clock", lambda: types.SimpleNamespace(name="virtual"))
    assert prof.collective_pause_s() == prof.DEFAULT_PAUSE_S
    monkeypatch.setenv("XRONOS_PROFILE_PAUSE_S", "0")
    assert prof.collective_pause_s() == 0.0  # measuring its effect
    monkeypatch.setattr(emulate, "process_clock", lambda: types.SimpleNamespace(name="wall"))
    monkeypatch.delenv("XRONOS_PROFILE_PAUSE_S")
    assert prof.collective_pause_s() == 0.0


def test_report_carries_the_collective_probe(reports: dict[str, ProfileReport]) -> None:
    """Two real Gloo ranks in the profiling process all-reduced the job's [B, S, E] activation."""
    for r in reports.values():
        c = r.collectives
        assert c is not None and c.nbytes == 4 * B * S * E and c.small_bytes == 4
        assert 0 < c.small_seconds < 1 and 0 < c.seconds < 1 and c.repeats >= 1


def test_report_carries_the_iteration_at_fewer_rows(reports: dict[str, ProfileReport]) -> None:
    """The full-width set's plain iteration at a quarter of the batch (here 1 of 2 rows) beside the
    batch's: fewer rows take less time, and not less than nothing."""
    assert prof.probe_rows(1) is None and prof.probe_rows(2) == 1 and prof.probe_rows(16) == 4
    for r in reports.values():
        p = r.rows_probe
        assert p is not None and p.rows == 1
        assert 0 < p.seconds < 1.5 * p.full_seconds  # a median of few iterations on a shared host: loose
    with pytest.raises(ValueError, match=r"rows_probe.rows: must be below batch_size \(2\), got 2"):
        ProfileReport.model_validate(r.model_dump() | {"rows_probe": {"rows": 2, "seconds": 0.1, "full_seconds": 0.2}})


def test_one_optimizer_step_over_every_parameter_shared_by_count() -> None:
    """Timing steps one AdamW over all parameters, as the trainer does, and books each layer its
    parameter-count share: every parameter once, shares summing to the model."""
    from xronos.node.measure.profset import ProfilingSet
    from xronos.protocol.layout import Layout

    torch.set_num_threads(1)
    config = prof.one_block_config(prof.config_for(arch=shape("tiny-gpt2", "classify")))
    ps = ProfilingSet(config, "classify", Layout(attn=(H, 0), mlp=(I, 0), vocab=(V, 0)), B, S, 0, True)
    try:
        params = [p for g in ps.opt_all.param_groups for p in g["params"]]
        assert len({id(p) for p in params}) == len(params) == len(list(ps.model.parameters()))
        assert sum(ps.numel.values()) == sum(p.numel() for p in ps.model.parameters())
        assert ps.numel["blk.mlp"] == _params("blk.mlp", "classify")
        secs = ps.iteration()
        assert set(secs) >= set(ps.groups) and all(v > 0 for v in secs.values())
        assert all(p.grad is None for p in params)  # zero_grad(set_to_none) as the trainer
    finally:
        ps.close()


def test_hook_overhead_comes_out_of_the_block_layers_only() -> None:
    med = {"emb": 0.010, "blk.attn": 0.006, "blk.mlp": 0.012, "blk.rest": 0.002, "out": 0.001}
    # Hooked iterations: 0.030 s CPU, 0.060 s wall (a half-core quota); without hooks 0.029 s CPU.
    out = prof.without_hook_overhead(med, [(0.060, 0.030)] * 3, [(0.058, 0.029)] * 3)
    over = 0.001 * 2  # 1 ms of CPU at 2 wall seconds per CPU second
    assert out["emb"] == med["emb"] and out["out"] == med["out"]
    assert sum(out[k] for k in med if k.startswith("blk")) == pytest.approx(0.020 - over)
    assert out["blk.mlp"] / out["blk.attn"] == pytest.approx(2.0)  # shared in proportion
    assert prof.without_hook_overhead(med, [(0.06, 0.029)], [(0.06, 0.030)]) == med  # no measurable cost
    assert prof.without_hook_overhead(med, [(1.0, 1.0)], [(0.0, 0.0)])["blk.mlp"] == pytest.approx(0.006)  # bounded


def test_on_the_virtual_clock_the_plain_iteration_sizes_the_layers() -> None:
    """The hooks give the split, the plain iteration (cut only at the collectives) the total."""
    med = {"emb": 0.010, "blk.attn": 0.006, "blk.mlp": 0.012, "blk.rest": 0.002, "out": 0.001}
    out = prof.to_plain_total(med, [(0.0434, 0.05), (0.0420, 0.05), (0.0500, 0.05)])  # median 0.0434
    assert sum(out.values()) == pytest.approx(0.0434)
    assert all(out[k] / med[k] == pytest.approx(0.0434 / 0.031) for k in med)  # every layer alike
    assert prof.to_plain_total(med, []) == med  # nothing to size it by


def test_lora_profile_is_its_own_and_counts_a_frozen_base(reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    """A LoRA job's profiling set trains the adapters on a frozen base: the frozen layers' weight
    memory is their weights alone (no gradient, no AdamW moments), the adapters and the trained
    head keep all four; and its cache entry is not full fine-tuning's."""
    r = 4
    config = prof.config_for(arch=TINY)
    lora = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path,
                        lora=LoraSpec(r=r, targets=["c_attn", "c_proj", "c_fc"]))
    assert lora.settings == ProfileSettings(weight_decay=0.0, clip=True,
                                            lora=LoraShape(r=r, targets=["c_attn", "c_fc", "c_proj"]))
    full = {layer.name: layer for layer in reports["classify"].layers}
    got = {layer.name: layer for layer in lora.layers}
    adapters = {"blk.attn": (r * E + 3 * E * r) + (r * E + E * r), "blk.mlp": (r * E + I * r) + (r * I + E * r)}
    for name in ("emb", "blk.rest"):  # frozen: fp32 weights only
        assert got[name].weight_bytes == 4 * _params(name, "classify") == full[name].weight_bytes // 4
    for name, n in adapters.items():  # frozen base + adapters with gradient and two moments
        assert got[name].weight_bytes == 4 * _params(name, "classify") + 16 * n, name
    # ln_f frozen, the classification head (score [2, E]) trained
    assert got["out"].weight_bytes == 4 * 2 * E + 16 * 2 * E and full["out"].weight_bytes == 16 * 4 * E
    assert len(list(tmp_path.glob("profile-*.json"))) == 1
    prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("profile-*.json"))) == 2  # full fine-tuning: another entry
    with pytest.raises(ValueError, match=r"\['q_proj'\] not in model family 'gpt2'"):
        prof.profile(config, "classify", B, S, threads=1, iters=2, lora=LoraSpec(r=r, targets=["q_proj"]))


def test_alloc_trace_peak_is_the_highest_level_above_the_start() -> None:
    x = torch.randn(256, 1024)  # 1 MiB, before the window: not counted
    with AllocTrace() as trace:
        a = x * 2.0  # +1 MiB
        b = (a * 3.0).sum()  # +1 MiB temporary on top: the peak, 2 MiB
        del a
        c = x + 1.0  # +1 MiB after a was freed: level 1 MiB again
    assert float(b) != 0 and c.numel() == x.numel()
    assert 2 << 20 <= trace.peak_bytes() < (2 << 20) + (64 << 10)


_SLACK_CHILD = """
import json, sys, torch
from xronos.node.measure import heapprobe, memwatch, profiler as prof
from xronos.node.models.shapes import shape
torch.set_num_threads(1)
config = prof.config_for(arch=shape("tiny-gpt2", "classify"))
layout = {"attn": (4, 0), "mlp": (256, 0), "vocab": (500, 0)}
if sys.argv[1] == "hole":
    big = torch.ones(128 << 18)  # 128 MiB in the heap (mmap off), then a block above it pins the top
    pin = torch.ones(1 << 18)
    del big  # a 128 MiB free hole below the top, resident; the tiny model fills a small part
doc = heapprobe.measure(config, "classify", layout, 2, 16, blocks=1)
print(json.dumps({"slack": doc.get("slack", 0), "heap": memwatch.heap()}))
"""


def test_heap_slack_sees_a_free_hole_in_the_heap() -> None:
    """Under the ranks' allocator setting a freed block below the heap's top stays a free hole; the
    heap probe's slack (span minus in-use peak over the trainer's iteration) grows by it."""
    import subprocess
    import sys

    from xronos.node.rank.spawn import rank_env
    from xronos.node.measure import allocator

    def child(env: dict[str, str], hole: bool) -> dict:
        out = subprocess.run([sys.executable, "-c", _SLACK_CHILD, "hole" if hole else "none"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    env = rank_env(1) | allocator.ENV  # the ranks' setting even where XRONOS_MALLOC=glibc is set
    base = child(env, False)
    if not base["heap"]:
        pytest.skip("no glibc mallinfo2 here")
    holed = child(env, True)
    assert 0 <= base["slack"] < 16 << 20  # a tiny model: a few MiB at most
    # what the process allocates next (the model, torch's profiler: ~26 MiB) is carved from the
    # hole; the rest of it stays free and resident
    assert 96 << 20 <= holed["slack"] - base["slack"] <= 130 << 20
    # glibc's default mmaps a 128 MiB block and unmaps it when freed: no hole, no slack
    plain = {k: v for k, v in env.items() if k not in allocator.ENV} | {"XRONOS_MALLOC": "glibc"}
    assert child(plain, True)["slack"] - child(plain, False)["slack"] < 4 << 20


def test_memory_counts_no_temporary_for_adamws_moments() -> None:
    """The fused AdamW has no update buffer, and its moments exist before the step (as the trainer
    allocates them at build): created inside the traced step they made every trained layer's M_t
    exactly its parameters' bytes (the gradients freed after the moments arrived). Without the
    clipping pass (whose float64 chunks are a real temporary) the larger layers' M_t is below it."""
    from xronos.node.measure.profset import ProfilingSet
    from xronos.protocol.layout import Layout

    config = prof.one_block_config(prof.config_for(arch=shape("tiny-gpt2", "classify")))
    ps = ProfilingSet(config, "classify", Layout(attn=(4, 0), mlp=(256, 0), vocab=(500, 0)), B, S, 0, False)
    try:
        ps.iteration()
        mem = ps.memory()
        for key in ("emb", "blk.mlp"):
            assert 0 <= mem[key][2] < ps.param_bytes(key), key
    finally:
        ps.close()



def test_heap_probes_run_only_where_memory_can_bind() -> None:
    """The whole model's training state (every block's M_w + M_a, the largest M_t, the runtime) three
    times over against the box's memory: MiniLM's ~0.9 GiB on a 23 GiB host skips them, the
    same on a 2 GiB box runs them."""
    mib = 1 << 20
    layers = [("emb", 180 * mib, 2 * mib, 40 * mib), ("blk", 28 * mib, 6 * mib, 4 * mib), ("out", 1 * mib, 0, 1 * mib)]
    full = 180 * mib + 2 * mib + 6 * (34 * mib) + 1 * mib + 40 * mib + 300 * mib  # 727 MiB
    assert not prof.heap_can_bind(layers, 6, 300 * mib, 23 << 30)
    assert prof.heap_can_bind(layers, 6, 300 * mib, 2 << 30)
    assert prof.heap_can_bind(layers, 6, 300 * mib, 3 * full + 1) is False
    assert prof.heap_can_bind(layers, 6, 300 * mib, 3 * full - 1) is True


def test_a_profile_without_heap_probes_skips_them_and_its_cache_entry_is_measured_again_where_they_matter(
        tmp_path, monkeypatch) -> None:
    config = prof.config_for(arch=shape("tiny-gpt2", "classify"))
    first = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path)
    assert first.heap_slack_bytes == 0 and first.heap_slack_small_counts is None  # a tiny model, a big host
    again = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path)
    assert again.created_at == first.created_at  # served from the cache
    monkeypatch.setenv(prof.HEAP_ENV, "always")
    probed = prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1, cache_dir=tmp_path)
    assert probed.created_at != first.created_at and probed.heap_slack_small_counts is not None
    monkeypatch.setenv(prof.HEAP_ENV, "sometimes")
    with pytest.raises(ValueError, match="XRONOS_PROFILE_HEAP must be auto or always"):
        prof.profile(config, "classify", B, S, threads=1, iters=2, warmup=1)


def test_two_passes_on_the_virtual_clock_keep_each_widths_faster_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the window minimum the widths are timed twice, the second pass in reverse order, and
    each width keeps the pass whose iteration was the shorter, all its layers (a slow phase of the
    host inflating a whole width's set, as on bench.choice's overlap-demo profiles, is dropped)."""
    import types

    import xronos.node.emulate as emulate
    from xronos.node.measure import readings

    box = types.SimpleNamespace(estimator="min")
    monkeypatch.setattr(emulate, "process_clock", lambda: types.SimpleNamespace(name="virtual", box=box))
    assert readings.profile_passes() == 2
    box.estimator = "med"
    assert readings.profile_passes() == 1
    monkeypatch.setattr(emulate, "process_clock", lambda: None)
    assert readings.profile_passes() == 1

    # On the wall clock, with two passes forced: the first pass's widths read three times slower.
    kept: list[dict[str, float]] = []
    real = prof.without_hook_overhead

    def sized(med, hooked, plain):
        out = real(med, hooked, plain)
        if len(kept) < 3:
            out = {k: 3 * v for k, v in out.items()}
        kept.append(out)
        return out

    monkeypatch.setattr(prof, "profile_passes", lambda: 2)
    monkeypatch.setattr(prof, "without_hook_overhead", sized)
    said: list[str] = []
    torch.set_num_threads(1)
    report = prof.profile(prof.config_for(arch=TINY), "classify", B, S, threads=1, iters=2, warmup=1,
                          progress=said.append)
    assert len(kept) == 6 and any("pass 2 of 2" in s for s in said)
    # passes: widths 0, 1, 2, then 2, 1, 0; each width's samples are its second pass's
    second = {0: kept[5], 1: kept[4], 2: kept[3]}
    for layer in report.layers:
        if layer.partitioned:
            assert [t for _, t in layer.time_samples] == [second[i][layer.name] for i in range(3)]
        assert layer.time_s == second[0][layer.name]
