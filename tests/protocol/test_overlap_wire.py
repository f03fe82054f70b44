"""A plan's overlap of its all-reduces on the wire (`Overlap` on Plan and Assignment; a job's
`overlap`/`chunks`): bad values refused naming the field, the batch and the count (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xronos.protocol import messages as m
from xronos.protocol.layout import Layout, Sizes

from protocol_samples import SPEC  # noqa: E402

LAYOUT = Layout(attn=(4, 8), mlp=(1024, 2048), vocab=(20000, 30257))


def _assignment(**kw) -> m.Assignment:
    base = dict(job_id="j", plan_version=1, node_id="b", rank=1, world_size=2, rendezvous_host="h",
                rendezvous_port=29500, group_key="0f" * 32, layout=LAYOUT, spec=SPEC)
    return m.Assignment(**{**base, **kw})


def test_an_assignment_carries_the_overlap_and_refuses_a_chunk_without_a_row() -> None:
    batch = SPEC.recipe.batch_size
    a = _assignment(overlap=m.Overlap(backward=True, chunks=batch))
    assert m.Assignment.model_validate_json(a.model_dump_json()) == a
    assert _assignment().overlap is None  # an older gateway's assignment: every all-reduce blocks
    with pytest.raises(ValidationError, match=rf"overlap: chunks {batch + 1} leaves a chunk without a row: the "
                                              rf"batch has {batch} rows"):
        _assignment(overlap=m.Overlap(backward=True, chunks=batch + 1))
    with pytest.raises(ValidationError, match="a data-parallel assignment"):
        _assignment(overlap=m.Overlap(backward=True), layout=Layout(attn=(12,), mlp=(3072,), vocab=(50257,)),
                    shares=[batch, 0])


@pytest.mark.parametrize("chunks", [0, -1, m.MAX_CHUNKS + 1, 2.5, "2", True])
def test_a_chunk_count_that_is_not_a_positive_integer_in_bounds_is_refused(chunks) -> None:
    with pytest.raises(ValidationError, match="chunks"):
        m.Overlap(backward=True, chunks=chunks)


def test_a_job_asks_for_overlap_and_chunks_only_with_on_and_within_its_batch() -> None:
    batch = SPEC.recipe.batch_size
    data = SPEC.model_dump()
    assert SPEC.overlap == "off" and SPEC.chunks is None
    assert m.JobSpec.model_validate({**data, "overlap": "on", "chunks": batch}).chunks == batch
    with pytest.raises(ValidationError, match="chunks: 2 chunks need overlap 'on', not 'auto'"):
        m.JobSpec.model_validate({**data, "overlap": "auto", "chunks": 2})
    with pytest.raises(ValidationError, match=rf"chunks: chunks {batch + 1} leaves a chunk without a row: the batch "
                                              rf"has {batch} rows"):
        m.JobSpec.model_validate({**data, "overlap": "on", "chunks": batch + 1})
    with pytest.raises(ValidationError, match="overlap"):
        m.JobSpec.model_validate({**data, "overlap": "yes"})
    with pytest.raises(ValidationError, match="overlap: 'on' overlaps a tensor-parallel plan's all-reduces; "
                                              "strategy 'dp' has none"):
        m.JobSpec.model_validate({**data, "overlap": "on", "strategy": "dp"})


def test_a_data_parallel_plan_does_not_overlap() -> None:
    entry = m.PlanEntry(node_id="a", rank=0, attn=4, mlp=256, vocab=1000, predicted_compute_s=0.1,
                        predicted_memory=1e9, memory_cap=2e9)
    with pytest.raises(ValidationError, match="overlap: a data-parallel plan"):
        m.Plan(job_id="j", version=1, strategy="dp", sizes=Sizes(attn=4, mlp=256, vocab=1000), entries=[entry],
               shares=[8], predicted_iteration_s=0.2, ideal_iteration_s=0.2, comm_s=0.01,
               overlap=m.Overlap(backward=True))


OFF, BWD = m.Overlap(backward=False, chunks=1), m.Overlap(backward=True)


def test_a_trial_names_two_to_four_distinct_modes_and_its_bounds() -> None:
    t = m.OverlapTrial(modes=[BWD, OFF, m.Overlap(backward=True, chunks=2)])
    assert t.steps == 2 + 4 * 3 and [m.overlap_label(x) for x in t.modes] == ["bwd", "off", "c2"]
    assert m.overlap_label(None) == "off"
    with pytest.raises(ValidationError, match=r"modes: each mode once, got \['bwd', 'bwd'\]"):
        m.OverlapTrial(modes=[BWD, BWD])
    for modes in ([BWD], [BWD, OFF, *(m.Overlap(backward=True, chunks=c) for c in (2, 3, 4))]):
        with pytest.raises(ValidationError, match="modes"):
            m.OverlapTrial(modes=modes)
    for bad in ({"rounds": 0}, {"rounds": 17}, {"after": -1}, {"after": 65}, {"rounds": 2.0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            m.OverlapTrial(modes=[BWD, OFF], **bad)


def test_an_assignment_trial_starts_with_its_overlap_and_fits_the_batch() -> None:
    batch = SPEC.recipe.batch_size
    a = _assignment(overlap=BWD, trial=m.OverlapTrial(modes=[BWD, OFF]))
    assert m.Assignment.model_validate_json(a.model_dump_json()) == a
    assert _assignment(trial=m.OverlapTrial(modes=[OFF, BWD])).trial is not None  # no overlap: off first
    with pytest.raises(ValidationError, match=r"trial: the first mode \(off\) must be the plan's overlap \(bwd\)"):
        _assignment(overlap=BWD, trial=m.OverlapTrial(modes=[OFF, BWD]))
    with pytest.raises(ValidationError, match=rf"trial: chunks {batch + 1} leaves a chunk without a row"):
        _assignment(trial=m.OverlapTrial(modes=[OFF, m.Overlap(backward=True, chunks=batch + 1)]))
    with pytest.raises(ValidationError, match="trial: a data-parallel plan"):
        _assignment(layout=Layout(attn=(12,), mlp=(3072,), vocab=(50257,)), shares=[batch, 0],
                    trial=m.OverlapTrial(modes=[OFF, BWD]))


def test_a_trials_layouts_are_one_per_mode_the_first_the_plans_and_of_its_world() -> None:
    other = Layout(attn=(8, 4), mlp=(2048, 1024), vocab=(30257, 20000))
    t = m.OverlapTrial(modes=[OFF, BWD], layouts=[None, other])
    assert t.layout_for(1) == other and t.layout_for(0) is None and m.OverlapTrial(modes=[OFF, BWD]).layout_for(1) is None
    assert m.Assignment.model_validate_json(_assignment(trial=t).model_dump_json()).trial == t
    with pytest.raises(ValidationError, match=r"layouts: one per mode \(2\), got 1"):
        m.OverlapTrial(modes=[OFF, BWD], layouts=[None])
    with pytest.raises(ValidationError, match=r"layouts: the first mode runs on the plan's layout \(None\)"):
        m.OverlapTrial(modes=[OFF, BWD], layouts=[other, None])
    three = Layout(attn=(4, 4, 4), mlp=(1024, 1024, 1024), vocab=(20000, 20000, 10257))
    with pytest.raises(ValidationError, match="trial: the layout for bwd has 3 ranks, the plan 2"):
        _assignment(trial=m.OverlapTrial(modes=[OFF, BWD], layouts=[None, three]))
    entries = [m.PlanEntry(node_id=n, rank=r, attn=LAYOUT.attn[r], mlp=LAYOUT.mlp[r], vocab=LAYOUT.vocab[r],
                           predicted_compute_s=0.1, predicted_memory=1e9, memory_cap=2e9) for r, n in enumerate("ab")]
    plan = dict(job_id="j", version=1, strategy="segment", sizes=Sizes(attn=12, mlp=3072, vocab=50257),
                entries=entries, predicted_iteration_s=0.2, ideal_iteration_s=0.2, comm_s=0.01)
    assert m.Plan(**plan, trial=t).trial == t
    short = Layout(attn=(8, 4), mlp=(2048, 1000), vocab=(30257, 20000))
    with pytest.raises(ValidationError, match="trial: the layout for bwd: "):
        m.Plan(**plan, trial=m.OverlapTrial(modes=[OFF, BWD], layouts=[None, short]))


def test_a_trials_forecasts_are_one_per_mode_with_per_rank_figures_only_for_a_layout_of_its_own() -> None:
    other = Layout(attn=(8, 4), mlp=(2048, 1024), vocab=(30257, 20000))
    f = [m.ModeForecast(iteration_s=0.3), m.ModeForecast(iteration_s=0.25, compute_s=[0.2, 0.1], memory=[1e9, 5e8])]
    t = m.OverlapTrial(modes=[OFF, BWD], layouts=[None, other], forecasts=f)
    assert t.forecast("bwd") == f[1] and t.forecast("off") == f[0] and t.forecast("c2") is None
    assert m.OverlapTrial(modes=[OFF, BWD]).forecast("bwd") is None
    assert m.Assignment.model_validate_json(_assignment(trial=t).model_dump_json()).trial == t
    with pytest.raises(ValidationError, match=r"forecasts: one per mode \(2\), got 1"):
        m.OverlapTrial(modes=[OFF, BWD], forecasts=f[:1])
    with pytest.raises(ValidationError, match="forecasts: bwd runs on the plan's layout, whose entries give its compute_s"):
        m.OverlapTrial(modes=[OFF, BWD], forecasts=f)
    with pytest.raises(ValidationError, match="forecasts: bwd's memory has 1 ranks, its layout 2"):
        m.OverlapTrial(modes=[OFF, BWD], layouts=[None, other],
                       forecasts=[f[0], m.ModeForecast(iteration_s=0.25, memory=[1e9])])
    with pytest.raises(ValidationError, match="iteration_s"):
        m.ModeForecast(iteration_s=float("nan"))
