"""Issue 11/12 "Bad input" on the gateway side: a profile whose own figures disagree with its
architecture, a report refused at the wire or unusable by the planner (the job leaves that node
out at once, naming the node and the field), and impossible plans naming need and cap per kind."""

import math

import msgpack
import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.job import machine as J
from xronos.gateway.job.planning import plan_job
from xronos.gateway.plan.planner import MiB, InfeasiblePlan
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.profiles import check_report, plan_reports, refused_request_id, screen_report
from xronos.protocol import messages as m
from xronos.protocol.layout import Sizes

SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=8, seq_len=32,
                                 lr=1e-4, max_steps=20, export_dir="/out"),
                 reserve_mb=0)


def rep(node="a", **kw):
    kw.setdefault("units", 8)
    kw.setdefault("num_blocks", 2)
    return synthetic_report(node, **kw)


@pytest.mark.parametrize("update, needle", [
    # The planner would cut 512 MLP columns of a model with 4096: every Assignment then fails.
    (dict(sizes=Sizes(attn=8, mlp=512, vocab=50_000)),
     "field sizes.mlp: node a reports 512 MLP columns, but its arch (gpt2) has 4096"),
    (dict(sizes=Sizes(attn=4, mlp=4096, vocab=50_000)),
     "field sizes.attn: node a reports 4 attention units, but its arch (gpt2) has 8"),
    # The depth multiplies every block's time: 1000 blocks of a 2-block model is a 500x prediction.
    (dict(num_blocks=1000), "field num_blocks: node a reports 1000 blocks, but its arch has num_layers 2"),
])
def test_a_profile_must_agree_with_its_own_architecture(update, needle):
    bad = rep().model_copy(update=update)
    with pytest.raises(ValueError) as err:
        check_report(bad, "a.json")
    assert str(err.value).startswith("a.json: ") and needle in str(err.value), str(err.value)
    # ... also when every report agrees with every other (check_compatible alone let them through).
    with pytest.raises(ValueError, match="field (sizes|num_blocks)"):
        plan_reports([Loaded("a.json", bad), Loaded("b.json", rep("b").model_copy(update=update))], "segment")


def test_screen_report_keeps_a_good_one_and_names_node_and_field_of_a_bad_one():
    good = rep("n1")
    assert screen_report(good) == (good, None)
    lay = good.layers[1].model_copy(update={"segment": "mlp"})  # no partitioned attention layer left
    report, why = screen_report(good.model_copy(update={"layers": [good.layers[0], lay, *good.layers[2:]]}))
    assert report is None and why.startswith("node n1's profile: field layers: no partitioned layer of segment 'attn'")


def test_refused_request_id_is_read_best_effort_and_only_when_it_is_an_id():
    doc = rep("n1").model_dump(mode="json") | {"request_id": "job-1.3"}
    doc["layers"][1]["time_s"] = math.nan  # what the codec refuses
    assert refused_request_id(msgpack.packb(doc)) == "job-1.3"
    for payload in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"request_id": "a/b"}),
                    msgpack.packb({"request_id": 7}), msgpack.packb({"x": 1}), b"x" * (2 * 2**20)):
        assert refused_request_id(payload) is None


def test_profile_of_another_shape_names_the_field_and_both_values():
    job = J.Job("j", SPEC, 0.0, arch=rep().arch)
    why = J.profile_mismatch(job, rep(seq_len=64).model_copy(update={"job_id": "j"}))
    assert why == "its report's seq_len does not match the request (got 64, the job's is 32)"
    why = J.profile_mismatch(job, rep(hidden=512).model_copy(update={"job_id": "j"}))
    assert why == "its report's arch.hidden_size does not match the request (got 512, the job's is 1024)"


def test_a_jobs_over_cap_plan_names_each_nodes_need_cap_and_counts_per_kind():
    profiles = {n: rep(n, memory_available=300 * MiB) for n in ("a", "b")}
    job = J.Job("j", SPEC.model_copy(update={"strategy": "uniform"}), 0.0, profiles=profiles)
    with pytest.raises(ValueError) as err:
        plan_job(job, ("a", "b"), 1, J.Ctx(now=0.0, online=frozenset(("a", "b"))))
    msg = str(err.value)
    assert msg.startswith("the uniform plan exceeds memory caps: a needs ")
    assert "MiB of its 300 MiB cap holding 4 attention units, 2048 MLP columns, 25024 vocabulary rows" in msg
    assert "b needs " in msg and "holding 4 attention units, 2048 MLP columns, 24976 vocabulary rows" in msg


def test_an_owner_that_cannot_hold_even_nothing_is_explained():
    """The owner's data stack and export gather made it 'not even fit the replicated layers' while
    its cap was above the replicated figure shown: the line now says what holding nothing needs."""
    a = rep("a", memory_available=300 * MiB).model_copy(update={"runtime_bytes": 200 * MiB, "owner_bytes": 90 * MiB})
    b = rep("b", memory_available=8192 * MiB).model_copy(update={"runtime_bytes": 200 * MiB})
    with pytest.raises(InfeasiblePlan) as err:
        plan_reports([Loaded("a.json", a), Loaded("b.json", b)], "segment", reserve_mb=0)
    line = next(x for x in str(err.value).splitlines() if x.startswith("  a: "))
    assert "holding nothing it already needs" in line and "(rank 0, the owner: with its data stack" in line
    need = float(line.split("holding nothing it already needs ")[1].split(" MiB")[0])
    assert need > 300 and "cap 300.0 MiB" in line, line


def test_a_profile_without_memory_or_without_times_is_refused_naming_node_and_field():
    """A kind at 0 bytes of weights would be planned as free (caps could not stop this node taking
    all of it); all times 0 would give this node the whole model as 'optimal'."""
    good = rep("n1")
    part = [i for i, lay in enumerate(good.layers) if lay.partitioned and lay.segment == "mlp"]
    layers = [lay.model_copy(update={"weight_bytes": 0}) if i in part else lay for i, lay in enumerate(good.layers)]
    with pytest.raises(ValueError, match=r"a.json: field layers\[\]\.weight_bytes: node n1's partitioned 'mlp' "
                                         r"layers report 0 bytes of weights"):
        check_report(good.model_copy(update={"layers": layers}), "a.json")
    # one partitioned layer without weights of its own (a head tied to the embedding) is fine
    out = next(i for i, lay in enumerate(good.layers) if lay.kind == "out")
    layers = [lay.model_copy(update={"weight_bytes": 0}) if i == out else lay for i, lay in enumerate(good.layers)]
    check_report(good.model_copy(update={"layers": layers}), "a.json")
    layers = [lay.model_copy(update={"time_s": 0.0, "time_samples": [(p, 0.0) for p, _ in lay.time_samples]})
              for lay in good.layers]
    with pytest.raises(ValueError, match=r"a.json: field layers: every time in node n1's profile is 0 s"):
        check_report(good.model_copy(update={"layers": layers}), "a.json")
