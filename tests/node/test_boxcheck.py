"""Work bounded by the box before it starts (node/agent/boxcheck.py, node/box/footprint.py): pure checks of a
profile request's and an assignment's need against a box's cores and memory, and the schema's own
ceilings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xronos.node.agent.boxcheck import Box, assignment_problem_on_box, profile_problem
from xronos.node.box.footprint import RUNTIME_BYTES, estimate, profile_estimate
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

MiB = 1 << 20
TINY = m.ArchSpec(family="gpt2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256,
                  vocab_size=1000, max_positions=256, tie_word_embeddings=True)
BOX = Box(cores=2, available=8 << 30, reserve_mb=512)


def request(**changes) -> m.ProfileRequest:
    key = {"task": "causal-lm", "batch_size": 8, "seq_len": 128}
    key.update({k: changes.pop(k) for k in list(changes) if k in key})
    return m.ProfileRequest(request_id="r", job_id="j", arch=TINY, key=m.ProfileKey(**key), **changes)


def test_a_small_profile_fits():
    assert profile_problem(request(threads=2), BOX) is None


def test_threads_over_the_usable_cores_are_refused_with_both_numbers():
    why = profile_problem(request(threads=3), BOX)
    assert why == "threads 3 asked, but this box has 2 usable cores"


def test_a_batch_whose_activations_exceed_the_box_is_refused_with_need_and_capacity():
    # The request: the schema's largest batch at seq 128 on a 64-wide model took its child past 4 GiB.
    why = profile_problem(request(batch_size=4096, seq_len=128), Box(cores=2, available=4 << 30, reserve_mb=512))
    assert why is not None
    assert why.startswith("batch_size 4096 x seq_len 128: the profile needs about ")
    assert "activations" in why and "output logits" in why
    assert "this box has 3,584 MiB for it (4,096 MiB available, less reserve_mb 512)" in why


def test_the_estimate_counts_what_a_profile_surely_allocates():
    need = estimate(TINY, "causal-lm", 4096, 128, blocks=1)
    tokens = 4096 * 128
    assert need.runtime == RUNTIME_BYTES
    assert need.logits == 4 * 2 * tokens * TINY.vocab_size  # logits and their gradient, fp32
    # One block: its input, norms, Q, K, V, output, the scores and probabilities, the MLP's two widths.
    per_token = 4 * 64 + (2 * 64 + 2 * 64 + 2 * 4 * 128) + 2 * 256
    assert need.activations == 4 * (tokens * per_token + 2 * tokens * 64)
    # A profile's child keeps three widths' transient blocks and runs its heap probes beside it.
    prof = profile_estimate(TINY, "causal-lm", 4096, 128, lora=False)
    assert (prof.activations, prof.logits, prof.states) == (3 * need.activations, 3 * need.logits, need.states)
    lora = profile_estimate(TINY, "causal-lm", 1, 1, lora=True)
    full = profile_estimate(TINY, "causal-lm", 1, 1, lora=False)
    assert full.states == 4 * lora.states  # gradients and both AdamW moments, unless the base is frozen


def test_a_rank_needs_its_shares_only():
    whole = estimate(TINY, "causal-lm", 8, 128)
    half = estimate(TINY, "causal-lm", 8, 128, attn=0.5, mlp=0.5, vocab=0.5)
    assert half.logits * 2 == whole.logits
    assert whole.states / 2 < half.states < whole.states  # the replicated parts in full
    fused = estimate(TINY, "causal-lm", 8, 128, scores=False)  # no dropout: no seq x seq matrices kept
    assert whole.activations - fused.activations == 4 * 2 * 8 * 128 * (2 * 4 * 128)
    with pytest.raises(ValueError, match="attn share"):
        estimate(TINY, "causal-lm", 8, 128, attn=1.5)


def assignment(batch: int, rank: int = 1) -> tuple[m.Assignment, m.JobSpec]:
    spec = m.JobSpec(name="j", owner="n0",
                     recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="causal-lm", batch_size=batch,
                                     seq_len=128, lr=1e-4, max_steps=1, export_dir="/o"))
    a = m.Assignment(job_id="j", plan_version=1, node_id="n1", rank=rank, world_size=2, rendezvous_host="127.0.0.1",
                     rendezvous_port=29500, group_key="ab" * 32,
                     layout=Layout(attn=(2, 2), mlp=(128, 128), vocab=(500, 500)), spec=spec)
    return a, spec


def test_an_assignment_over_the_box_is_refused_and_what_a_replaced_rank_frees_counts():
    a, spec = assignment(4096)
    box = Box(cores=2, available=4 << 30, reserve_mb=512)
    why = assignment_problem_on_box(a, spec, (TINY, "causal-lm"), box)
    assert why is not None and why.startswith("rank 1 of j (batch_size 4096 x seq_len 128, 50% of the attention")
    assert "less reserve_mb 512" in why
    need = estimate(TINY, "causal-lm", 4096, 128, attn=0.5, mlp=0.5, vocab=0.5).total
    assert assignment_problem_on_box(a, spec, (TINY, "causal-lm"), box, freed=need) is None
    small, small_spec = assignment(4)
    assert assignment_problem_on_box(small, small_spec, (TINY, "causal-lm"), box) is None
    assert assignment_problem_on_box(a, spec, None, box) is None  # shape unknown: the child's limits bound it


def test_a_data_parallel_rank_is_checked_at_its_tp_rank_of_its_groups_layout_and_its_rows():
    """With shares the layout is each group's (here a whole replica per rank): rank 1 holds TP rank
    0 of it and trains its group's rows (a 0-row rank counted at one row). Before this, rank 1 of a
    pure data-parallel job raised IndexError, and its node never acked a `dp` plan."""
    a, spec = assignment(4096)
    dp = a.model_copy(update={"layout": Layout(attn=(4,), mlp=(256,), vocab=(1000,)), "shares": [4094, 2]})
    dp = m.Assignment.model_validate(dp.model_dump())
    box = Box(cores=2, available=4 << 30, reserve_mb=512)
    assert assignment_problem_on_box(dp, spec, (TINY, "causal-lm"), box) is None  # 2 rows of a whole replica
    big = m.Assignment.model_validate({**dp.model_dump(), "shares": [2, 4094]})
    why = assignment_problem_on_box(big, spec, (TINY, "causal-lm"), box)
    assert why is not None and why.startswith("rank 1 of j (batch_size 4094 x seq_len 128, 100% of the attention")
    idle = m.Assignment.model_validate({**dp.model_dump(), "shares": [4096, 0]})
    assert assignment_problem_on_box(idle, spec, (TINY, "causal-lm"), box) is None


@pytest.mark.parametrize("field, value", [("threads", 257), ("threads", 4096), ("batch_size", 4097),
                                          ("batch_size", 65536), ("seq_len", 2**17 + 1)])
def test_the_schema_stops_at_what_any_supported_box_can_do(field, value):
    with pytest.raises(ValidationError, match=field):
        request(**{field: value})
    assert request(**{field: {"threads": 256, "batch_size": 4096, "seq_len": 2**17}[field]})
