"""The state machine's effects as wire messages (`xronos.gateway.job.effects`): pure, no bus. What each
effect yields, to which topic parameters, in order; the service glue tests cover the publishing."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest

from xronos.gateway.job import machine as J
from xronos.gateway.job.effects import messages
from xronos.gateway.registry import NodeInfo
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout, Sizes

SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d", task="causal-lm", batch_size=2, seq_len=16,
                                 lr=1e-3, max_steps=5, export_dir="/o", weight_decay=0.1, max_grad_norm=None))
ARCH = m.ArchSpec(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=1000, max_positions=128, tie_word_embeddings=False)
PLAN = m.Plan(job_id="j1", version=3, strategy="segment", sizes=Sizes(attn=2, mlp=128, vocab=1000),
              entries=[m.PlanEntry(node_id=n, rank=r, attn=1, mlp=64, vocab=500, predicted_compute_s=0.1,
                                   predicted_memory=1e6, memory_cap=1e9) for r, n in enumerate(("a", "b"))],
              predicted_iteration_s=0.1, ideal_iteration_s=0.1, comm_s=0.0)
JOB = replace(J.Job("j1", SPEC, 0.0), arch=ARCH)
CAPS = m.Capabilities(node_id="a", hostname="a", arch="x86_64", cpu_model="c", cores=4, memory_total=1 << 30,
                      memory_available=1 << 29, torch_version=None, data_host="10.0.0.5", sent_at=1.0)
PORTS = (29600, 29699)


def test_an_answer_carries_its_models_as_json_to_the_requests_name():
    (msg, params), = messages(J.Respond("job/submit", "t1", True, {"job_id": "j1", "plan": PLAN}), None, {}, PORTS)
    assert params == {"name": "job/submit"}
    assert msg.status == "ok" and msg.transaction == "t1" and msg.data["plan"] == PLAN.model_dump(mode="json")
    (msg, _), = messages(J.Respond("job/pause", None, False, None, "no"), None, {}, PORTS)
    assert msg.status == "error" and msg.error == "no" and msg.data is None


def test_an_inspection_and_profile_requests_go_to_each_node_with_the_jobs_settings():
    (msg, params), = messages(J.Inspect("j1", "a", "j1.1"), JOB, {}, PORTS)
    assert params == {"node_id": "a"} and msg.spec == SPEC and msg.request_id == "j1.1"
    out = list(messages(J.Profile("j1", (("j1.2", "a"), ("j1.3", "b"))), JOB, {}, PORTS))
    assert [p for _, p in out] == [{"node_id": "a"}, {"node_id": "b"}]
    assert [r.request_id for r, _ in out] == ["j1.2", "j1.3"]
    assert all(r.arch == ARCH and r.key == SPEC.recipe.profile_key() and r.key.weight_decay == 0.1
               and r.key.clip is False for r, _ in out)


@pytest.mark.parametrize("reg,host", [({"a": NodeInfo("a", True, CAPS)}, "10.0.0.5"), ({}, "127.0.0.1")])
def test_assignments_name_the_owners_address_and_the_plan_versions_port(reg, host):
    out = list(messages(J.Assign("j1", PLAN, 4), JOB, reg, PORTS))
    port = 29600 + (zlib.crc32(b"j1") + 3) % 100
    assert [p for _, p in out] == [{"node_id": "a"}, {"node_id": "b"}]
    assert all(a.rendezvous_host == host and a.rendezvous_port == port and a.resume_step == 4
               and a.layout == PLAN.layout() and a.world_size == 2 for a, _ in out)
    assert [a.rank for a, _ in out] == [0, 1]


def test_every_rank_of_a_plan_gets_one_fresh_group_key_which_no_repr_shows():
    keys = [{a.group_key for a, _ in messages(J.Assign("j1", PLAN, 0), JOB, {}, PORTS)} for _ in range(2)]
    assert all(len(k) == 1 for k in keys) and keys[0] != keys[1]  # one per world, drawn anew each time
    (a, _), _ = messages(J.Assign("j1", PLAN, 0), JOB, {}, PORTS)
    assert a.group_key not in repr(a) and a.group_key not in str(a)


def test_controls_go_to_every_node_and_a_reshard_order_to_the_owner_alone():
    out = list(messages(J.Control("j1", 3, ("a", "b"), "pause"), JOB, {}, PORTS))
    assert [(type(c), p) for c, p in out] == [(m.JobPause, {"node_id": "a"}), (m.JobPause, {"node_id": "b"})]
    layout = Layout(attn=(1, 1), mlp=(32, 96), vocab=(500, 500))
    (order, params), = messages(J.Reshard("j1", 3, "a", 9, layout, "faster"), JOB, {}, PORTS)
    assert params == {"node_id": "a"} and order == m.JobReshard(job_id="j1", plan_version=3, at_step=9,
                                                                layout=layout, reason="faster")


def test_messages_are_made_lazily_one_at_a_time():
    """The service publishes each before the next is made (as it did before `effects` existed): a
    message that cannot be built stops the effect after those already sent."""
    bad = replace(JOB, arch=None)
    out = messages(J.Profile("j1", (("j1.2", "a"),)), bad, {}, PORTS)  # nothing made yet
    with pytest.raises(AssertionError):
        next(out)
    out = messages(J.Control("j1", 3, ("a", "b"), "cancel"), JOB, {}, PORTS)
    assert next(out)[1] == {"node_id": "a"} and next(out)[1] == {"node_id": "b"}
