"""The overlap model (`gateway.plan.overlapcost`) by hand-computed cases, and the planner carrying a
TP candidate's overlap mode into the Plan (`choose.with_overlap`, `auto.choice_message`). Pure."""

from __future__ import annotations

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.plan.auto import choice_message
from xronos.gateway.plan.choose import choose
from xronos.gateway.plan.commmodel import NodeComm
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.overlapcost import FULL_CHUNK_FIXED, MODES, OFF, OverlapMode, TPShape, best_mode, mode_of, predict_modes
from xronos.gateway.plan.profiles import cost_inputs
from xronos.protocol.messages import Overlap, Plan

ACT = 1000.0  # bytes of one activation all-reduce
BW = ACT / 0.04  # so that one all-reduce between two nodes takes 0.04 s (no latency)
SEG = {"attn": 0.3, "mlp": 0.3, "vocab": 0.0, "out": 0.0}  # one block: 0.3 s per stage
FULL = TPShape(ACT, blocks=1, task="classify", rows=4, trains_weights=True)


def _modes(shape=FULL, seg=SEG, n=2, fixed=1e-12, modes=MODES):
    preds = predict_modes(seg, 1.0, shape, n, bandwidth_Bps=BW, latency_s=0.0, chunk_fixed=fixed, modes=modes)
    return {p.mode.label: p for p in preds}


def test_off_is_the_plan_as_it_is():
    p = _modes()["off"]
    assert p.saved_s == 0 and p.iteration_s == 1.0 and p.chunk_overhead_s == 0


def test_backward_overlap_hides_each_regions_all_reduce_behind_its_weight_gradients():
    # Full fine-tuning: per stage of 0.3 s, forward 0.1, the weight gradients 0.1 (the column
    # layers' and the row layer's, left late), the rest of backward 0.1. Off, a region's backward
    # is 0.1 + 0.1 + 0.04; with bwd 0.1 + max(0.1, 0.04): 0.04 saved per region, two regions.
    assert _modes()["bwd"].saved_s == pytest.approx(0.08)
    assert _modes()["bwd"].iteration_s == pytest.approx(0.92)


def test_the_row_layers_late_weight_gradients_widen_the_window():
    # An all-reduce of 0.08 s: longer than the column layers' weight gradients alone (0.05) but
    # shorter than the region's all (0.1): bwd hides all of it, 0.08 per region.
    slow = predict_modes(SEG, 1.0, FULL, 2, bandwidth_Bps=ACT / 0.08, latency_s=0.0, chunk_fixed=1e-12)
    assert {p.mode.label: p for p in slow}["bwd"].saved_s == pytest.approx(0.16)


def test_forward_chunks_pipeline_each_chunks_all_reduce_behind_the_next_chunks_compute():
    # c2, no chunk overhead: chunk-stages of 0.05 s compute and 0.02 s link. Forward: compute
    # 0-0.05 (link to 0.07), 0.05-0.10 (link to 0.12), then the MLP stage 0.10-0.15 (link to 0.17)
    # and 0.15-0.20 (link to 0.22): 0.22 against 2 x (0.1 + 0.04) = 0.28. Backward the same way,
    # stages reversed, 0.1 of compute per chunk-stage (its input and weight gradients): the MLP's
    # 0-0.1 (link to 0.12) and 0.1-0.2 (to 0.22), attention's 0.2-0.3 and 0.3-0.4, the last link to
    # 0.42, against 2 x (0.2 + 0.04) = 0.48. Saved: 0.06 + 0.06.
    p = _modes()["c2"]
    assert p.saved_s == pytest.approx(0.12) and p.chunk_overhead_s == pytest.approx(0.0, abs=1e-9)


def test_chunked_backward_hides_a_link_longer_than_the_weight_gradients():
    # An all-reduce of 0.16 s per activation (0.08 per chunk), LoRA (no weight gradient: bwd hides
    # nothing): per chunk-stage, forward 0.075 and backward 0.075 of compute, 0.08 of link. The
    # link is the bottleneck: forward 0.075 + 4 x 0.08 = 0.395, backward the same, against
    # 2 x (0.15 + 0.16) = 0.62 each way. Saved: 2 x 0.225.
    lora = TPShape(ACT, blocks=1, task="classify", rows=4, trains_weights=False)
    preds = predict_modes(SEG, 1.0, lora, 2, bandwidth_Bps=ACT / 0.16, latency_s=0.0, chunk_fixed=1e-12)
    by = {p.mode.label: p for p in preds}
    assert by["bwd"].saved_s == pytest.approx(0.0, abs=1e-9)
    assert by["c2"].saved_s == pytest.approx(0.45)


def test_chunks_cost_compute_by_the_fixed_share_and_can_lose():
    # Half of each chunk's time paid whatever its rows: two chunks cost 1.5 x the blocks' compute.
    p = _modes(fixed=0.5)
    assert p["c2"].chunk_overhead_s == pytest.approx(0.3)
    assert p["c2"].saved_s < 0 < p["bwd"].saved_s
    assert best_mode(list(p.values())).mode.label == "bwd"


def test_lora_has_no_weight_gradient_to_hide_behind():
    lora = TPShape(ACT, blocks=1, task="causal-lm", rows=4, trains_weights=False)
    p = _modes(shape=lora)
    assert p["bwd"].saved_s == pytest.approx(0.0)
    assert p["c2"].saved_s > 0  # forward chunking still pipelines the forward all-reduces
    costly = _modes(shape=lora, fixed=0.5)  # ... unless chunks cost more compute than they hide
    assert best_mode(list(costly.values())).mode == OFF  # bwd ties with off: the tie goes to off


def test_a_chunks_fixed_share_is_the_lora_profiles_own_and_a_full_fine_tunes_the_measured_constant():
    lora = TPShape(ACT, blocks=1, task="classify", rows=4, trains_weights=False)
    def overhead(shape, rows_fixed):
        preds = predict_modes(SEG, 1.0, shape, 2, bandwidth_Bps=BW, latency_s=0.0, rows_fixed=rows_fixed)
        return {p.mode.label: p.chunk_overhead_s for p in preds}["c2"]
    assert overhead(lora, 0.25) == pytest.approx(0.25 * 0.6)  # the blocks' 0.6 s, once more a quarter
    # a full fine-tune's probe is mostly its AdamW step, paid once: the constant instead
    assert overhead(FULL, 0.35) == overhead(FULL, None) == overhead(lora, None) == pytest.approx(FULL_CHUNK_FIXED * 0.6)


def test_one_node_and_chunks_past_the_rows_are_not_offered():
    assert list(_modes(n=1)) == ["off"]
    two_rows = TPShape(ACT, blocks=1, task="classify", rows=2, trains_weights=True)
    assert list(_modes(shape=two_rows)) == ["off", "bwd", "c2"]


def test_a_free_link_gains_nothing_and_chunking_only_costs():
    p = predict_modes(SEG, 1.0, FULL, 2, bandwidth_Bps=1e30, latency_s=0.0, chunk_fixed=0.2)
    by = {x.mode.label: x for x in p}
    assert by["bwd"].saved_s == pytest.approx(0.0) and by["c2"].saved_s < 0 and by["c4"].saved_s < by["c2"].saved_s


def test_a_launched_call_is_charged_what_the_profile_measured_for_one_beside_compute():
    # The nodes' CPU per call: blocking 1 ms fixed, launched beside compute 10 ms fixed (no per-byte
    # part). A blocking call's CPU is under the link's 0.04 s and changes nothing; a launched one is
    # paid on top of the compute that hides it. bwd: each region's weight gradients (0.1) plus the
    # call's 0.01 still cover the link, so it saves 0.04 - 0.01 per region, not 0.04.
    from xronos.gateway.plan.commmodel import NodeComm

    blocking = NodeComm(fixed_s=1e-3, per_byte_s=0.0)
    launched = NodeComm(fixed_s=1e-3, per_byte_s=0.0, launched=NodeComm(fixed_s=1e-2, per_byte_s=0.0))

    def by(cpu):
        preds = predict_modes(SEG, 1.0, FULL, 2, bandwidth_Bps=BW, latency_s=0.0, chunk_fixed=1e-12,
                              node_cpu=[cpu, cpu])
        return {p.mode.label: p for p in preds}

    old, new = by(blocking), by(launched)
    assert old["off"].iteration_s == new["off"].iteration_s == 1.0  # nothing launched: unchanged
    assert old["bwd"].saved_s == pytest.approx(2 * (0.04 - 1e-3))  # charged as a blocking call
    assert new["bwd"].saved_s == pytest.approx(2 * (0.04 - 1e-2))
    # c2 launches eight calls (four a pass), each charged on the compute: 8 x 9 ms more than before
    assert new["c2"].iteration_s - old["c2"].iteration_s == pytest.approx(8 * 9e-3, abs=2e-3)
    # a profile from before the probe (no `launched`): a launched call costs what a blocking one does
    assert blocking.in_flight() is blocking and launched.in_flight() is launched.launched


@pytest.mark.parametrize("label", ["x", "c1", "c", "c-2", "2", "on"])
def test_a_bad_mode_label_is_refused_naming_it(label):
    with pytest.raises(ValueError, match=f"overlap mode '{label}': off, bwd or cN"):
        mode_of(label)
    assert mode_of("c3") == OverlapMode(True, 3) and mode_of("bwd") == OverlapMode(True, 1) and mode_of("off") == OFF


def test_each_node_pays_its_own_launched_calls_beside_its_own_compute():
    # Two nodes: A computes 0.3 s a stage and launches a call for nothing, B computes half as much
    # and pays 0.05 s a call beside it. As one lane (the slowest node paying the costliest call)
    # c2's forward chunk-stage costs 0.05 + 0.05; per node, max(0.05, 0.025 + 0.05) = 0.075.
    free, costly = NodeComm(0.0, 0.0), NodeComm(0.05, 0.0)  # fixed_s: one ring step for two nodes
    seg_a = dict(SEG)
    seg_b = {k: v / 2 for k, v in SEG.items()}
    kw = dict(bandwidth_Bps=1e30, latency_s=0.0, chunk_fixed=1e-12, modes=(OFF, OverlapMode(True, 2)))

    def both(cpu, segs):
        one = {p.mode.label: p for p in predict_modes(seg_a, 1.0, FULL, 2, node_cpu=cpu, **kw)}
        per = {p.mode.label: p for p in predict_modes(seg_a, 1.0, FULL, 2, node_cpu=cpu, node_seg=segs, **kw)}
        return one, per

    one, per = both([free, costly], [seg_a, seg_b])
    assert per["off"].iteration_s == one["off"].iteration_s == 1.0  # blocking calls: the plan as it is
    assert per["c2"].iteration_s < one["c2"].iteration_s
    # the costly node is also the slowest: one lane is exact
    one, per = both([costly, free], [seg_a, seg_b])
    assert per["c2"].iteration_s == pytest.approx(one["c2"].iteration_s)
    with pytest.raises(ValueError, match="node_seg: 1 nodes' segment times for 2 nodes"):
        predict_modes(seg_a, 1.0, FULL, 2, node_seg=[seg_a], **kw)


# -- the planner ----------------------------------------------------------------------------------

SLOW = 100e6 / 8


def _inputs(n: int = 3):
    items = [Loaded(f"n{i}.json", synthetic_report(f"n{i}", slowness=1 + 0.5 * i, units=16, num_blocks=4))
             for i in range(n)]
    ins = cost_inputs(items, reserve_mb=0, bandwidth_Bps=SLOW)
    r = items[0].report
    shape = TPShape(4.0 * r.batch_size * r.seq_len * r.arch.hidden_size, r.num_blocks, r.task, r.batch_size, True)
    return ins, shape


def _choose(ins, shape, strategy="segment", **kw):
    return choose(list(ins.nodes), ins.sizes, list(ins.caps), ins.volume, ins.comm_s, ins.profile_rows,
                  ins.profile_rows, strategy, bandwidth_Bps=SLOW, shape=shape, **kw)


def test_the_planner_keeps_the_fastest_mode_and_the_plan_carries_it():
    ins, shape = _inputs()
    off = _choose(ins, shape).winner
    on = _choose(ins, shape, overlap="on").winner
    assert off.overlap is None and on.overlap is not None and on.overlap.mode.on
    assert on.iteration_s == pytest.approx(off.iteration_s - on.overlap.saved_s) and on.iteration_s < off.iteration_s
    assert on.label.startswith("segment (TP over 3), overlap ") and on.tp.layout == off.tp.layout
    msg = choice_message(_choose(ins, shape, overlap="on"), "j")
    assert msg.overlap == Overlap(backward=True, chunks=on.overlap.mode.chunks)
    assert msg.predicted_iteration_s == pytest.approx(on.iteration_s)
    assert msg.ideal_iteration_s == off.tp.ideal_iteration_s  # the bound stays the one without overlap
    assert Plan.model_validate_json(msg.model_dump_json()) == msg
    forced = _choose(ins, shape, overlap="on", chunks=2).winner
    assert forced.overlap.mode == OverlapMode(True, 2)
    assert choice_message(_choose(ins, shape), "j").overlap is None


def test_auto_overlap_picks_off_when_nothing_gains_and_refuses_chunks_past_the_batch():
    ins, shape = _inputs()
    frozen = TPShape(shape.act_bytes, shape.blocks, shape.task, shape.rows, trains_weights=False)
    # LoRA on a fast link: chunking only adds compute, bwd hides nothing: auto keeps every all-reduce blocking
    fast = choose(list(ins.nodes), ins.sizes, list(ins.caps), ins.volume, 0.0, ins.profile_rows, ins.profile_rows,
                  "segment", bandwidth_Bps=1e30, latency_s=0.0, shape=frozen, overlap="auto").winner
    assert fast.overlap is None
    from xronos.gateway.plan.choose import trial_modes
    assert trial_modes(fast)[0] == OFF  # a trial then starts without overlap, the plan's own mode
    with pytest.raises(ValueError, match=r"chunks 9 leaves a chunk without a row: the batch has 8 rows"):
        _choose(ins, shape, overlap="on", chunks=9)
    with pytest.raises(ValueError, match="overlap must be auto, off or on, got 'yes'"):
        _choose(ins, shape, overlap="yes")


def test_a_segment_plan_chooses_its_layout_and_chunks_together():
    # The slowest node pays 3 ms for each call it launches beside compute, the others nothing: the
    # layout planned for c2 moves attention and MLP off it, predicted faster than c2 on the layout
    # planned without overlap (`joint=False`, the bench's `@off`); the plan carries that layout,
    # and the ideal bound stays the one without overlap.
    ins, shape = _inputs()
    cpu = [NodeComm(0.0, 0.0, launched=NodeComm(0.0, 0.0))] * 2 + [NodeComm(0.0, 0.0, launched=NodeComm(0.003, 0.0))]
    kept = _choose(ins, shape, overlap="on", chunks=2, node_cpu=cpu, joint=False).winner
    joint = _choose(ins, shape, overlap="on", chunks=2, node_cpu=cpu).winner
    assert kept.tp.layout == _choose(ins, shape).winner.tp.layout and "planned for it" not in kept.label
    assert joint.label == "segment (TP over 3), overlap c2 (a layout planned for it)"
    assert joint.tp.layout.mlp[2] < kept.tp.layout.mlp[2] and joint.tp.layout.attn[2] < kept.tp.layout.attn[2]
    assert joint.iteration_s < kept.iteration_s
    assert joint.tp.ideal_iteration_s == kept.tp.ideal_iteration_s and not joint.tp.optimal
    assert joint.tp.rows[2].predicted_compute_s < kept.tp.rows[2].predicted_compute_s
    msg = choice_message(_choose(ins, shape, overlap="on", chunks=2, node_cpu=cpu), "j")
    assert msg.layout() == joint.tp.layout and msg.overlap == Overlap(backward=True, chunks=2)
    assert msg.predicted_iteration_s == pytest.approx(joint.iteration_s)
    # nothing to gain from moving: the layout planned without overlap is kept
    free = [NodeComm(0.0, 0.0, launched=NodeComm(0.0, 0.0))] * 3
    assert _choose(ins, shape, overlap="on", chunks=2, node_cpu=free).winner.tp.layout == kept.tp.layout
    # a forced baseline's layout is its own: uniform is never re-planned
    uni = _choose(ins, shape, strategy="uniform", overlap="on", chunks=2, node_cpu=cpu).winner
    assert "planned for it" not in uni.label
    # `auto` keeps c2 on its own layout; its trial measures the modes there, and a kept `off` moves
    # the ranks to the layout planned without overlap (its own)
    from xronos.gateway.plan.auto import with_trial

    auto = _choose(ins, shape, overlap="auto", node_cpu=cpu)
    assert auto.winner.overlap.mode == OverlapMode(True, 2) and "planned for it" in auto.winner.label
    assert dict(auto.winner.own_layouts)[OFF] == kept.tp.layout
    trial = with_trial(choice_message(auto, "j"), auto, 10_000).trial
    labels = [OverlapMode(x.backward, x.chunks).label for x in trial.modes]
    assert labels[0] == "c2" and "off" in labels
    assert trial.layout_for(labels.index("off")) == kept.tp.layout and trial.layout_for(0) is None
    # each mode's forecast once kept: c2's the plan's; off's the plan without overlap, its rows included
    assert trial.forecasts[0].iteration_s == pytest.approx(auto.winner.iteration_s)
    # and what it does not hide (the plan's comm_s with the mode, as the ranks measure it)
    assert trial.forecasts[0].comm_s == pytest.approx(auto.winner.comm_s) == choice_message(auto, "j").comm_s
    assert trial.forecast("off").comm_s == pytest.approx(kept.tp.comm_s)
    off = trial.forecast("off")
    assert off.iteration_s == pytest.approx(kept.tp.predicted_iteration_s)
    assert off.compute_s == pytest.approx([r.predicted_compute_s for r in kept.tp.rows])
    assert off.memory == pytest.approx([r.predicted_memory for r in kept.tp.rows])
    assert all(f.compute_s is None for f, x in zip(trial.forecasts, trial.layouts) if x is None)


def test_relayout_refuses_a_layout_of_another_world_or_model():
    from xronos.gateway.plan.planner import relayout
    from xronos.protocol.layout import Layout

    ins, shape = _inputs()
    base = _choose(ins, shape).winner.tp
    two = Layout(attn=[8, 8], mlp=[2048, 2048], vocab=[25000, 25000])
    with pytest.raises(ValueError, match="relayout: a layout of 2 ranks"):
        relayout(base, list(ins.nodes), list(ins.caps), two)
    again = relayout(base, list(ins.nodes), list(ins.caps), base.layout)
    assert again.rows == base.rows and again.predicted_iteration_s == base.predicted_iteration_s


def test_a_plan_that_chose_its_mode_measures_the_likeliest_modes_first():
    # `auto`: the chosen mode first, then the next predicted fastest on its layout, off among them;
    # `on`: overlapping modes only; a forced chunk count: nothing to choose, no trial; and the
    # trial only in a run at least TRIAL_MIN_RUN times its length.
    from xronos.gateway.plan.auto import TRIAL_MIN_RUN, with_trial
    from xronos.gateway.plan.choose import trial_modes

    ins, shape = _inputs()
    auto = _choose(ins, shape, overlap="auto")
    modes = trial_modes(auto.winner)
    assert len(modes) == 3 and modes[0] == auto.winner.overlap.mode and OFF in modes
    ranked = [q.iteration_s for q in auto.winner.ranked[1:]]
    assert ranked == sorted(ranked) and {q.mode for q in auto.winner.ranked} == set(MODES)
    msg = choice_message(auto, "j")
    steps = 2 + 4 * 3
    planned = with_trial(msg, auto, TRIAL_MIN_RUN * steps)
    assert [OverlapMode(x.backward, x.chunks) for x in planned.trial.modes] == list(modes)
    assert planned.trial.steps == steps and planned.overlap == msg.overlap
    assert Plan.model_validate_json(planned.model_dump_json()) == planned
    assert with_trial(msg, auto, TRIAL_MIN_RUN * steps - 1).trial is None  # too short a run
    on = _choose(ins, shape, overlap="on")
    assert OFF not in trial_modes(on.winner) and len(trial_modes(on.winner)) == 3
    assert trial_modes(_choose(ins, shape, overlap="on", chunks=2).winner) == ()
    assert trial_modes(_choose(ins, shape).winner) == ()  # overlap off: no modes predicted
    from xronos.cli.plan import render_choice  # `xronos plan --overlap auto` says what a job would try

    line = render_choice(auto).splitlines()[-1]
    assert line.startswith(f"overlap trial: a job of at least {TRIAL_MIN_RUN * steps} steps measures "
                           f"{', '.join(x.label for x in modes)} against each other in its first {steps} and keeps")
    assert "overlap trial" not in render_choice(_choose(ins, shape, overlap="on", chunks=2))
