"""Data-parallel meshes on the wire: a plan's and an assignment's batch shares (pure validation)."""

from __future__ import annotations

import pytest

from xronos.protocol import messages as m
from xronos.protocol.layout import Layout, Sizes

from protocol_samples import SPEC  # noqa: E402

SIZES = Sizes(attn=4, mlp=256, vocab=1000)


def _entry(node: str, rank: int, attn: int, mlp: int, vocab: int) -> m.PlanEntry:
    return m.PlanEntry(node_id=node, rank=rank, attn=attn, mlp=mlp, vocab=vocab, predicted_compute_s=0.1,
                       predicted_memory=1e9, memory_cap=2e9)


def _plan(entries, shares, strategy="dp") -> m.Plan:
    return m.Plan(job_id="j", version=1, strategy=strategy, sizes=SIZES, entries=entries, shares=shares,
                  predicted_iteration_s=0.2, ideal_iteration_s=0.2, comm_s=0.01)


def test_mesh_of_maps_ranks_to_groups_and_refuses_an_uneven_cut() -> None:
    assert m.mesh_of(4, None) == 4
    assert m.mesh_of(4, [3, 5]) == 2
    assert m.mesh_of(3, [1, 1, 6]) == 1
    with pytest.raises(ValueError, match=r"shares: 3 ranks cannot form 2 equal data-parallel groups"):
        m.mesh_of(3, [4, 4])


def test_a_data_parallel_plan_holds_whole_replicas_and_its_layout_is_one_groups() -> None:
    plan = _plan([_entry("a", 0, 4, 256, 1000), _entry("b", 1, 4, 256, 1000), _entry("c", 2, 4, 256, 1000)],
                 [5, 0, 3])
    assert plan.tp_size == 1
    assert plan.layout() == Layout(attn=(4,), mlp=(256,), vocab=(1000,))
    mesh = _plan([_entry("a", 0, 1, 64, 400), _entry("b", 1, 3, 192, 600),
                  _entry("c", 2, 1, 64, 400), _entry("d", 3, 3, 192, 600)], [6, 2])
    assert mesh.tp_size == 2 and mesh.layout() == Layout(attn=(1, 3), mlp=(64, 192), vocab=(400, 600))


def test_a_mesh_whose_groups_hold_different_layouts_is_refused() -> None:
    with pytest.raises(ValueError, match="every data-parallel group holds the same layout"):
        _plan([_entry("a", 0, 1, 64, 400), _entry("b", 1, 3, 192, 600),
               _entry("c", 2, 2, 128, 500), _entry("d", 3, 2, 128, 500)], [6, 2])
    with pytest.raises(ValueError, match="entries: 3 ranks cannot form 2"):
        _plan([_entry("a", 0, 4, 256, 1000)] * 1 + [_entry("b", 1, 4, 256, 1000), _entry("c", 2, 4, 256, 1000)],
              [4, 4])


def _assignment(**kw) -> m.Assignment:
    base = dict(job_id="j", plan_version=1, node_id="b", rank=1, world_size=2, rendezvous_host="h",
                rendezvous_port=29500, group_key="0f" * 32, layout=Layout(attn=(12,), mlp=(3072,), vocab=(50257,)),
                spec=SPEC, shares=[5, 3])
    return m.Assignment(**{**base, **kw})


def test_an_assignment_checks_its_shares_against_the_world_and_the_batch() -> None:
    a = _assignment()
    assert a.shares == [5, 3] and m.Assignment.model_validate_json(a.model_dump_json()) == a
    with pytest.raises(ValueError, match=r"shares: \[5, 2\] sum to 7 rows, the batch has 8"):
        _assignment(shares=[5, 2])
    with pytest.raises(ValueError, match="shares: 2 ranks cannot form 3 equal data-parallel groups"):
        _assignment(shares=[5, 2, 1])
    with pytest.raises(ValueError, match="layout: 2 ranks for world_size 2 in data-parallel groups of 1"):
        _assignment(layout=Layout(attn=(6, 6), mlp=(1536, 1536), vocab=(25000, 25257)))
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        _assignment(shares=[9, -1])


def test_a_job_may_ask_for_auto_or_dp_and_a_plan_never_says_auto() -> None:
    assert m.JobSpec(name="j", owner="o", recipe=SPEC.recipe, strategy="auto").strategy == "auto"
    assert m.JobSpec(name="j", owner="o", recipe=SPEC.recipe, strategy="dp").strategy == "dp"
    with pytest.raises(ValueError, match="strategy"):
        _plan([_entry("a", 0, 4, 256, 1000)], None, strategy="auto")
