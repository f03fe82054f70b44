"""Issue 12 "Bad input", a profile's provenance and completeness: a report records the job settings
it was taken under (LoRA or not, weight decay, clipping), the planner refuses a set of reports
taken under different settings and a report taken under other settings than the job's, and a
report without the block's replicated remainder (blk.rest); each refusal names node or file and
the field."""

import json

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.job import machine as J
from xronos.gateway.job.planning import plan_job
from xronos.gateway.plan.compatible import Loaded, check_compatible, job_settings
from xronos.gateway.plan.profiles import check_report, load_report, plan_reports, screen_report
from xronos.protocol import messages as m

def key(**kw) -> m.ProfileKey:
    return m.ProfileKey(task="classify", batch_size=8, seq_len=32, **kw)


ADAPTERS = m.LoraSpec(r=8, targets=["c_proj", "c_attn"], dropout=0.05)
FULL = m.ProfileSettings.of_key(key())
LORA = m.ProfileSettings.of_key(key(lora=ADAPTERS))
SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=8, seq_len=32,
                                 lr=1e-4, max_steps=20, export_dir="/out"),
                 reserve_mb=0)


def with_recipe(spec: m.JobSpec, **changes) -> m.JobSpec:
    return spec.model_copy(update={"recipe": m.Recipe(**{**spec.recipe.model_dump(), **changes})})


def rep(node="a", settings=FULL, **kw):
    kw.setdefault("units", 8)
    kw.setdefault("num_blocks", 2)
    return synthetic_report(node, **kw).model_copy(update={"settings": settings})


def loaded(*reports):
    return [Loaded(f"{r.node_id}.json", r) for r in reports]


# --- the report records its settings -------------------------------------------------------------

def test_a_report_without_settings_reads_as_unrecorded_not_as_the_defaults(tmp_path):
    doc = rep(settings=LORA).model_dump(mode="json")
    (tmp_path / "new.json").write_text(json.dumps(doc))
    assert load_report(tmp_path / "new.json").settings == LORA
    doc.pop("settings")  # as an Xronos from before the settings were echoed wrote it
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_report(tmp_path / "old.json").settings is None


@pytest.mark.parametrize("edit, needle", [
    # Every field is required once settings are recorded: a half-recorded set is not read as defaults.
    (lambda s: s.pop("lora"), "field settings.lora: Field required"),
    (lambda s: s["lora"].pop("r"), "field settings.lora.r: Field required"),  # adapters without a rank
    (lambda s: s.update(weight_decay=-1.0), "field settings.weight_decay"),
    (lambda s: s.update(clip=1), "field settings.clip"),  # strict: 1 is not true
])
def test_recorded_settings_are_read_strictly(tmp_path, edit, needle):
    doc = rep(settings=LORA).model_dump(mode="json")
    edit(doc["settings"])
    (tmp_path / "a.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        load_report(tmp_path / "a.json")
    assert str(err.value).startswith(f"{tmp_path / 'a.json'}: {needle}"), str(err.value)
    assert "Value error" not in str(err.value)


def test_settings_of_a_request_or_spec_take_one_form():
    # The targets' order trains nothing else; alpha only scales the adapters' output.
    assert LORA.lora == m.LoraShape(r=8, targets=["c_attn", "c_proj"], dropout=0.05)
    assert m.ProfileSettings.of_key(key(lora=ADAPTERS.model_copy(update={"alpha": 64.0}))) == LORA
    spec = with_recipe(SPEC, lora=ADAPTERS)
    assert job_settings(spec) == LORA
    assert job_settings(with_recipe(SPEC, max_grad_norm=None, weight_decay=0.01)) == FULL.model_copy(
        update={"clip": False, "weight_decay": 0.01})
    req = m.ProfileRequest(request_id="r", job_id="j", arch=rep().arch, key=spec.recipe.profile_key())
    assert m.ProfileSettings.of_key(req.key) == LORA


@pytest.mark.parametrize("changes", [
    dict(lora=ADAPTERS, weight_decay=0.01),
    dict(max_grad_norm=None),
])
def test_the_request_the_gateway_sends_is_recorded_as_the_jobs_settings(changes):
    """What a node echoes (the profiler's ProfileSettings.of its request) equals what the gateway
    checks against (job_settings of the spec): a correct node's report is never refused."""
    from xronos.gateway.job.effects import messages

    spec = with_recipe(SPEC, **changes)
    job = J.Job("j", spec, 0.0, arch=rep().arch)
    ((req, _),) = list(messages(J.Profile("j", (("j.1", "a"),)), job, None, (0, 0)))
    assert isinstance(req, m.ProfileRequest)
    assert m.ProfileSettings.of_key(req.key) == job_settings(spec)


# --- a set of reports: one job's settings ------------------------------------------------------

@pytest.mark.parametrize("other, needle", [
    (LORA, "b.json: field settings.lora: node b was profiled at lora LoRA rank 8, but a.json at None (full fine-tuning)"),
    (FULL.model_copy(update={"weight_decay": 0.01}), "b.json: field settings.weight_decay: node b was profiled "
                                                     "at weight_decay 0.01, but a.json at 0.0"),
    (FULL.model_copy(update={"clip": False}), "b.json: field settings.clip: node b was profiled at clip False"),
    (None, "b.json: field settings: node b's profile does not record the job settings it was taken under"),
])
def test_a_mix_of_settings_is_refused_naming_file_and_field(other, needle):
    with pytest.raises(ValueError) as err:
        check_compatible(loaded(rep("a"), rep("b", settings=other)))
    assert str(err.value).startswith(needle), str(err.value)
    with pytest.raises(ValueError, match="field settings"):  # plan_reports (xronos plan) too
        plan_reports(loaded(rep("a"), rep("b", settings=other)), "segment")


def test_one_jobs_settings_plan_together():
    plan_reports(loaded(rep("a", settings=LORA), rep("b", settings=LORA)), "segment")
    reordered = LORA.model_copy(update={"lora": LORA.lora.model_copy(update={"targets": ["c_proj", "c_attn"]})})  # the same targets
    check_compatible(loaded(rep("a", settings=LORA), rep("b", settings=reordered)))
    check_compatible(loaded(rep("a", settings=None), rep("b", settings=None)))  # nothing known: as before


def test_a_report_under_other_settings_than_the_jobs_is_refused():
    with pytest.raises(ValueError) as err:
        plan_reports(loaded(rep("a", settings=LORA), rep("b")), "segment", settings=LORA)
    assert str(err.value).startswith("b.json: field settings.lora: node b was profiled at lora None (full "
                                     "fine-tuning), but the job runs LoRA rank 8; profile it again"), str(err.value)
    other = LORA.model_copy(update={"lora": LORA.lora.model_copy(update={"targets": ["c_fc"]})})
    with pytest.raises(ValueError, match="a.json: field settings.lora.targets: node a was profiled at "
                                         r"lora.targets \['c_fc'\], but the job runs \['c_attn', 'c_proj'\]"):
        check_compatible(loaded(rep("a", settings=other)), settings=LORA)
    # A report that records none answered the job's own request, which carried the settings.
    check_compatible(loaded(rep("a", settings=LORA), rep("b", settings=None)), settings=LORA)


def test_the_gateway_leaves_out_a_node_profiled_under_other_settings():
    spec = with_recipe(SPEC, lora=ADAPTERS)
    job = J.Job("j", spec, 0.0, arch=rep().arch)
    full = rep("a").model_copy(update={"job_id": "j"})
    assert J.profile_mismatch(job, full) == ("its report's settings.lora does not match the request (got None "
                                            "(full fine-tuning), the job's is LoRA rank 8)")
    assert J.profile_mismatch(job, full.model_copy(update={"settings": LORA})) is None
    assert J.profile_mismatch(job, full.model_copy(update={"settings": None})) is None  # an older node's
    decayed = LORA.model_copy(update={"weight_decay": 0.1})
    assert "settings.weight_decay" in J.profile_mismatch(job, full.model_copy(update={"settings": decayed}))
    # ... and the job's planner refuses it too (a profile kept from before the job's settings changed)
    job = J.Job("j", spec, 0.0, profiles={"a": rep("a", settings=LORA), "b": full.model_copy(update={"node_id": "b"})})
    with pytest.raises(ValueError, match="node b: field settings.lora: node b was profiled at lora None"):
        plan_job(job, ("a", "b"), 1, J.Ctx(now=0.0, online=frozenset(("a", "b"))))


# --- the block's replicated remainder ---------------------------------------------------------

def test_a_profile_without_the_blocks_replicated_remainder_is_refused():
    good = rep("n1")
    assert [(lay.kind, lay.partitioned) for lay in good.layers].count(("blk", False)) == 1
    bad = good.model_copy(update={"layers": [lay for lay in good.layers if lay.partitioned or lay.kind != "blk"]})
    with pytest.raises(ValueError) as err:
        check_report(bad, "n1.json")
    assert str(err.value).startswith("n1.json: field layers: node n1's profile has no replicated 'blk' layer "
                                     "(blk.rest"), str(err.value)
    report, why = screen_report(bad)  # over the bus: the node is left out, named
    assert report is None and why.startswith("node n1's profile: field layers: node n1's profile has no replicated")
    with pytest.raises(ValueError, match="field layers: node n1's profile has no replicated 'blk' layer"):
        plan_reports(loaded(bad), "segment")
