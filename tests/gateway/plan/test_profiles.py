"""ProfileReport files -> cost-model inputs; every refusal names the file and the field."""

import json
import math

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.plan.commmodel import comm_time, tp_comm_volume
from xronos.gateway.plan.costmodel import layout_shares, node_cost, predict_time
from xronos.gateway.plan.planner import MiB
from xronos.gateway.plan.compatible import Loaded, check_compatible
from xronos.gateway.plan.profiles import check_report, load_report, memory_cap, node_profile, plan_message, plan_reports
from xronos.protocol.messages import Plan


def write(path, report=None, **edits):
    data = (report or synthetic_report("n0", units=8, num_blocks=2)).model_dump(mode="json")
    for dotted, value in edits.items():
        target, keys = data, dotted.split("__")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        target[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    path.write_text(json.dumps(data))  # json.dumps writes NaN/Infinity as the profiler's json would
    return path


def test_roundtrip_and_conversion(tmp_path):
    report = synthetic_report("n0", units=8, num_blocks=2)
    loaded = load_report(write(tmp_path / "a.json", report))
    assert loaded == report
    prof = node_profile(loaded)
    assert prof.node_id == "n0" and prof.num_blocks == 2
    assert [l.name for l in prof.layers] == [l.name for l in report.layers]
    attn = prof.layers[1]
    assert attn.partitioned and attn.time_samples == tuple(tuple(s) for s in report.layers[1].time_samples)
    assert [l.segment for l in prof.layers] == ["vocab", "attn", "mlp", None, None]
    # synthetic partitioned layers cost 0.002 + work * p: the affine fit recovers it exactly, and
    # the intercept is paid at any share (with half the blocks' norms, 2 x 0.002 / 2, in a block kind)
    cost = node_cost(prof)
    assert cost.attn.fixed_s == pytest.approx(0.002 + 2 * 0.002) and cost.mlp.fixed_s == pytest.approx(0.006)
    assert cost.vocab.fixed_s == pytest.approx(0.002)
    assert cost.attn.icpt_s == cost.mlp.icpt_s == cost.vocab.icpt_s == 0.0


def test_heap_slack_is_optional_and_reaches_the_cost_model(tmp_path):
    """A report from before profiler version 7 (no heap_slack_bytes) reads as 0 (not measured);
    a measured one reaches the node's cost."""
    report = synthetic_report("n0", units=8, num_blocks=2)
    doc = report.model_dump(mode="json")
    doc.pop("heap_slack_bytes")
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_report(tmp_path / "old.json").heap_slack_bytes == 0
    new = load_report(write(tmp_path / "new.json", report, heap_slack_bytes=300 * MiB))
    assert node_cost(node_profile(new)).heap_slack == 300 * MiB
    # version 8: the growth per block (B = 2 here) and the smaller width's holes, as shares
    small = report.sizes.model_copy(update={"attn": 2})
    v8 = load_report(write(tmp_path / "v8.json", report, heap_slack_bytes=300 * MiB, heap_slack_block_bytes=50 * MiB,
                           heap_slack_small_bytes=200 * MiB, heap_slack_small_counts=small.model_dump()))
    cost = node_cost(node_profile(v8))
    assert cost.heap_slack == 350 * MiB and cost.small_slack == 250 * MiB
    assert node_profile(v8).heap_small[0] == {"attn": 2 / report.sizes.attn, "mlp": 1.0, "vocab": 1.0}
    too_many = report.sizes.model_copy(update={"mlp": report.sizes.mlp + 1})
    with pytest.raises(ValueError, match="field heap_slack_small_counts.mlp"):
        check_report(report.model_copy(update={"heap_slack_small_counts": too_many}), "x")


def test_memory_cap_is_available_minus_reserve():
    r = synthetic_report("n0", memory_available=1000 * MiB)
    assert memory_cap(r, 200) == 800 * MiB
    assert memory_cap(r, 5000) == 0.0
    with pytest.raises(ValueError, match="reserve_mb"):
        memory_cap(r, -1)


def test_a_nodes_own_reserve_is_kept_whatever_the_jobs():
    """node.toml's reserve_mb travels as Capabilities.reserve_bytes: the larger reserve wins."""
    r = synthetic_report("n0", memory_available=1000 * MiB)
    r = r.model_copy(update={"capabilities": r.capabilities.model_copy(update={"reserve_bytes": 300 * MiB})})
    assert memory_cap(r, 200) == 700 * MiB  # the node's 300 over the job's 200
    assert memory_cap(r, 400) == 600 * MiB
    assert memory_cap(r, 0) == 700 * MiB


@pytest.mark.parametrize("edits, field", [
    ({"schema_version": 3}, "field schema_version: unknown schema version 3"),
    ({"layers__1__time_s": math.nan}, "field layers[1].time_s"),
    ({"layers__1__time_s": -0.5}, "field layers[1].time_s"),
    ({"layers__2__time_samples__0__1": math.inf}, "field layers[2].time_samples[0][1]"),
    ({"layers__2__time_samples__0__1": -1.0}, "field layers[2].time_samples[0][1]"),
    ({"layers__2__time_samples__0__0": 1.5}, "field layers[2].time_samples[0][0]"),
    ({"layers__2__time_samples": [[1.0, 0.1], [1.0, 0.1]]}, "field layers[2].time_samples"),
    ({"layers__2__time_samples": [[1.0, 0.1]]}, "layers[2]"),
    ({"layers__0__weight_bytes": -4}, "field layers[0].weight_bytes"),
    ({"sizes__attn": 0}, "field sizes.attn"),
    ({"layers": []}, "field layers"),
    ({"heap_slack_bytes": -1}, "field heap_slack_bytes"),
    ({"capabilities__memory_available": "lots"}, "field capabilities.memory_available"),
    # A profile that does not time every segment kind, or puts one in the wrong place.
    ({"layers__2__partitioned": False, "layers__2__segment": None, "layers__2__time_samples": []},
     "field layers: no partitioned layer of segment 'mlp'"),
    ({"layers__1__segment": "vocab"}, "field layers[1].segment: a partitioned blk layer ('attn') cannot follow 'vocab'"),
    ({"layers__0__segment": "mlp"}, "field layers[0].segment"),
    ({"layers__1__segment": "heads"}, "field layers[1].segment"),
])
def test_bad_report_names_file_and_field(tmp_path, edits, field):
    path = write(tmp_path / "bad.json", **edits)
    with pytest.raises(ValueError) as err:
        load_report(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_unreadable_files(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="junk.json: not valid JSON"):
        load_report(tmp_path / "junk.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="list.json: expected a JSON object"):
        load_report(tmp_path / "list.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_report(tmp_path / "missing.json")


def loaded(name, **kw):
    kw.setdefault("units", 8)
    kw.setdefault("num_blocks", 2)
    return Loaded(f"{name}.json", synthetic_report(kw.pop("node_id", name), **kw))


@pytest.mark.parametrize("other, field", [
    (dict(hidden=512), "field arch.hidden_size: 512 differs from 1024 in a.json"),
    (dict(batch_size=4), "field batch_size"),
    (dict(seq_len=64), "field seq_len"),
    (dict(task="causal-lm"), "field task"),
    (dict(units=4), "field arch.num_heads"),
    (dict(num_blocks=3), "field num_blocks"),
    (dict(node_id="a"), "field node_id: duplicate node id 'a'"),
])
def test_incompatible_reports_refused(other, field):
    with pytest.raises(ValueError) as err:
        check_compatible([loaded("a"), loaded("b", **other)])
    assert "b.json" in str(err.value) and field in str(err.value)


@pytest.mark.parametrize("job, field", [
    (dict(batch_size=4), "field batch_size: node b was profiled at batch_size 8, but the job runs 4"),
    (dict(seq_len=64), "field seq_len: node b was profiled at seq_len 32, but the job runs 64"),
    (dict(task="causal-lm"), "field task"),
])
def test_profiles_of_another_shape_than_the_jobs_refused(job, field):
    with pytest.raises(ValueError) as err:
        plan_reports([loaded("b")], "segment", **job)
    assert "b.json" in str(err.value) and field in str(err.value)
    plan_reports([loaded("b")], "segment", batch_size=8, seq_len=32, task="classify")


def test_bad_numbers_refused_in_plan_reports_too():
    """The gateway hands plan_reports reports that came over MQTT (already schema-checked):
    the numbers the schema lets through are checked there too, naming the node."""
    r = synthetic_report("n9", units=8, num_blocks=2)
    lay = r.layers[1].model_copy(update={"time_samples": [(0.5, 0.1), (0.5, 0.1)]})
    bad = r.model_copy(update={"layers": [r.layers[0], lay, *r.layers[2:]]})
    with pytest.raises(ValueError, match=r"node n9: field layers\[1\].time_samples: .* distinct shares"):
        plan_reports([Loaded("node n9", bad)], "segment")


def test_zero_nodes_refused():
    with pytest.raises(ValueError, match="profiles: .* none"):
        check_compatible([])


def test_plan_reports_adds_comm_and_makes_a_plan_message():
    items = [loaded("a", slowness=1.0), loaded("b", slowness=3.0)]
    res = plan_reports(items, "segment", bandwidth_Bps=1e8, latency_s=1e-4)
    r0 = items[0].report
    vol = tp_comm_volume(r0.arch.hidden_size, r0.batch_size, r0.seq_len, r0.num_blocks, r0.task)
    assert res.comm_s == pytest.approx(comm_time(vol, 2, 1e8, 1e-4)) and res.comm_s > 0
    for k in ("attn", "mlp", "vocab"):
        assert res.counts(k)[0] > res.counts(k)[1]  # the faster node takes more of every kind
    assert res.rows[0].predicted_compute_s == predict_time(node_cost(node_profile(r0)), layout_shares(res.layout, 0))
    msg = plan_message(res, "job1", 3)
    assert isinstance(msg, Plan) and msg.version == 3 and msg.strategy == "segment"
    assert msg.layout() == res.layout
    assert [e.predicted_compute_s for e in msg.entries] == [r.predicted_compute_s for r in res.rows]
    assert Plan.model_validate_json(msg.model_dump_json()) == msg
    assert plan_reports(items[:1], "paper").comm_s == 0.0  # one node: no all-reduce
    for strategy in ("paper", "uniform"):
        assert plan_message(plan_reports(items, strategy), "j").strategy == strategy


def _with_collectives(r, seconds=0.004, small=0.001, nbytes=None):
    from xronos.protocol.messages import CollectiveProfile

    act = 4 * r.batch_size * r.seq_len * r.arch.hidden_size
    return r.model_copy(update={"collectives": CollectiveProfile(
        nbytes=act if nbytes is None else nbytes, seconds=seconds, small_bytes=4, small_seconds=small, repeats=5)})


@pytest.mark.parametrize("edits, field", [
    ({"collectives__seconds": math.nan}, "field collectives.seconds"),
    ({"collectives__small_seconds": -1.0}, "field collectives.small_seconds"),
    ({"collectives__launched_seconds": math.inf, "collectives__launched_small_seconds": 1e-4},
     "field collectives.launched_seconds"),
    ({"collectives__nbytes": 4 * 8 * 64 * 1024}, "field collectives.nbytes: node n0 probed all-reduces of "
                                                   "2097152 bytes, but the activation of batch 8 x seq 32"),
    ({"collectives__small_bytes": 10**9}, "field collectives: small_bytes: must be below nbytes"),
    # Missing layers: no embedding, no output layer, a layer twice.
    ({"layers__0__kind": "blk", "layers__0__segment": "attn"}, "field layers"),
    ({"layers__4__kind": "blk"}, "field layers: no 'out' layer"),
    ({"layers__3__name": "mlp"}, "field layers: layer 'mlp' appears 2 times"),
])
def test_bad_collectives_and_missing_layers_name_file_and_field(tmp_path, edits, field):
    report = _with_collectives(synthetic_report("n0", units=8, num_blocks=2))
    path = write(tmp_path / "bad.json", report, **edits)
    with pytest.raises(ValueError) as err:
        load_report(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_measured_collectives_enter_the_plans_communication():
    """A node whose CPU needs longer for an all-reduce than the link sets the plan's comm term;
    where the link is slower, the link does (and a report without the probe counts the link)."""
    from xronos.gateway.plan.commmodel import node_comm

    a, b = loaded("a"), loaded("b")
    slow = Loaded("b.json", _with_collectives(b.report, seconds=0.050, small=0.010))
    fast = Loaded("a.json", _with_collectives(a.report, seconds=0.0002, small=0.0001))
    r0 = a.report
    vol = tp_comm_volume(r0.arch.hidden_size, r0.batch_size, r0.seq_len, r0.num_blocks, r0.task)
    link = comm_time(vol, 2, 1e9, 1e-5)
    res = plan_reports([fast, slow], "segment", bandwidth_Bps=1e9, latency_s=1e-5)
    c = node_comm(slow.report.collectives.nbytes, 0.050, 4, 0.010, parallel=2)  # synthetic: 4 cores
    per_call = vol.nbytes / vol.count
    assert res.comm_s == pytest.approx(vol.count * (c.fixed_s + c.per_byte_s * per_call)) and res.comm_s > link
    assert plan_reports([fast, b], "segment", bandwidth_Bps=1e9, latency_s=1e-5).comm_s == pytest.approx(link)
    assert plan_reports([a, b], "segment", bandwidth_Bps=1e9, latency_s=1e-5).comm_s == pytest.approx(link)


def test_a_launched_calls_probe_becomes_the_nodes_in_flight_cost_and_its_absence_the_blocking_one():
    from xronos.gateway.plan.commmodel import node_comm
    from xronos.gateway.plan.profiles import collective_cost

    r = _with_collectives(loaded("a").report, seconds=0.004, small=0.001)
    before = collective_cost(r)
    assert before.launched is None and before.in_flight() is before  # a report from before the probe
    probed = r.model_copy(update={"collectives": r.collectives.model_copy(
        update={"launched_seconds": 0.009, "launched_small_seconds": 0.002})})
    c = collective_cost(probed)
    assert (c.fixed_s, c.per_byte_s) == (before.fixed_s, before.per_byte_s)  # the blocking line stays
    # per rank, measured per rank: two ranks side by side whatever the node's cores
    assert c.in_flight() == node_comm(r.collectives.nbytes, 0.009, 4, 0.002, parallel=2)


def test_a_launched_probe_gives_both_its_points_or_neither():
    from xronos.protocol.messages import CollectiveProfile

    with pytest.raises(ValueError, match="launched_seconds and launched_small_seconds: give both or neither"):
        CollectiveProfile(nbytes=1024, seconds=0.001, small_bytes=4, small_seconds=1e-4, repeats=3,
                          launched_seconds=0.002)


def test_time_falling_with_width_is_named_not_refused():
    from xronos.gateway.plan.profiles import falling_times

    report = synthetic_report("n0", units=8, num_blocks=2)
    assert falling_times(report) == []  # rising times, as every real profile's
    i = next(i for i, lay in enumerate(report.layers) if lay.partitioned and lay.segment == "mlp")
    lay = report.layers[i]
    # 4 ms at a quarter, 3 ms at the whole: 25 % faster at four times the width. A 10 % dip is noise.
    disturbed = lay.model_copy(update={"time_samples": [(0.25, 0.004), (0.5, 0.0036), (1.0, 0.003)]})
    noisy = lay.model_copy(update={"time_samples": [(0.25, 0.004), (0.5, 0.0037), (1.0, 0.0036)]})
    for bad, want in ((disturbed, 1), (noisy, 0)):
        layers = list(report.layers)
        layers[i] = bad
        got = falling_times(report.model_copy(update={"layers": layers}))
        assert len(got) == want
    check_report(report.model_copy(update={"layers": [*report.layers[:i], disturbed, *report.layers[i + 1:]]}), "x")
    (text,) = falling_times(report.model_copy(update={"layers": [*report.layers[:i], disturbed,
                                                                 *report.layers[i + 1:]]}))
    assert f"layer {lay.name!r} took 4.000 ms at share 0.25 but 3.000 ms at share 1" in text
    assert "node n0" in text and "MLP columns" in text
