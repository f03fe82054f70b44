"""Cost model against hand-computed Eq. 6-10 cases, the affine fit and the communication term."""

import math
import subprocess
from dataclasses import astuple
import sys

import pytest

from xronos.gateway.plan.commmodel import CommVolume, comm_time, tp_comm_volume
from xronos.gateway.plan.costmodel import (
    LayerCost, NodeProfile, fit_affine, fit_error, kind_time, layer_time, node_cost, predict_time, segment_times,
    time_at,
)
from xronos.gateway.plan.memorymodel import memory_at, predict_memory


def layer(name, kind, part, t, mw, ma, mt, samples=(), segment=None):
    return LayerCost(name, kind, part, t, tuple(samples), mw, ma, mt, segment)


# B = 2; embedding partitioned (vocab), one attention and one MLP layer per block, a replicated
# norm in the block and a replicated classification head. Attention's samples are exactly
# 0.025 + 0.3 s, the MLP's 0.05 + 0.5 s.
PROFILE = NodeProfile("n0", 2, (
    layer("emb", "emb", True, 0.4, 100, 10, 50, [(0.5, 0.2), (1.0, 0.4)], "vocab"),
    layer("attn", "blk", True, 0.325, 200, 40, 80, [(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)], "attn"),
    layer("mlp", "blk", True, 0.55, 400, 60, 90, [(0.25, 0.175), (0.5, 0.3), (1.0, 0.55)], "mlp"),
    layer("ln", "blk", False, 0.05, 8, 4, 30),
    layer("head", "out", False, 0.2, 60, 6, 70),
))
SH = {"attn": 0.25, "mlp": 0.5, "vocab": 0.75}


def test_segments_by_hand():
    node = node_cost(PROFILE, fit="affine")
    # The block remainder (2 x 0.05) splits between the attention and the MLP segment.
    # no load_bytes; transient bytes of one block, M_a + M_t + gradients (no param_bytes: M_w / 4):
    # 40 + 80 + 50; then the activations (M_a) and the gradients in M_w (M_w / 4), B = 2 blocks
    # The partitioned layers' intercepts (2 x 0.025 and 2 x 0.05) are paid at any share: in fixed_s.
    assert astuple(node.attn) == pytest.approx((0.05 + 2 * 0.025, 0.0, 2 * 0.3, 2 * 240, 80, 0, 170, 2 * 40, 2 * 50))
    assert node.mlp.fixed_s == pytest.approx(0.05 + 0.1) and node.mlp.icpt_s == 0.0
    assert node.mlp.slope_s == pytest.approx(1.0) and node.mlp.mem_slope == 2 * 460
    assert astuple(node.vocab) == pytest.approx((0.0, 0.0, 0.4, 110, 50, 0, 85, 10, 25))  # exactly linear: intercept 0
    assert (node.act_repl, node.grad_repl) == pytest.approx((2 * 4 + 6, 2 * 2 + 15))
    assert (node.const_s, node.mem_repl, node.temp_repl) == (0.2, 2 * 12 + 66, 70)
    seg = segment_times(node, SH)
    assert seg["attn"] == pytest.approx(0.05 + 0.05 + 0.6 * 0.25)
    assert seg["mlp"] == pytest.approx(0.05 + 0.1 + 1.0 * 0.5)
    assert seg["vocab"] == pytest.approx(0.4 * 0.75)
    assert seg["out"] == 0.2
    assert predict_time(node, SH) == pytest.approx(sum(seg.values()))
    # A node with none of a kind still runs the replicated part of that kind's segment, and its
    # partitioned layers on empty weights (the intercept).
    none = segment_times(node, {"attn": 0.0, "mlp": 0.5, "vocab": 0.75})
    assert none["attn"] == pytest.approx(0.05 + 0.05)


def test_eq6_7_linear_time_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # p = 1/4 on every kind (the paper's tied unit): 0.25*0.4 + 0.2 + 2*(0.25*(0.325+0.55) + 0.05)
    assert time_at(node, 0.25) == pytest.approx(0.1 + 0.2 + 2 * (0.25 * 0.875 + 0.05))
    assert time_at(node, 1.0) == pytest.approx(0.4 + 0.2 + 2 * (0.875 + 0.05))
    assert time_at(node, 0.0) == pytest.approx(0.2 + 2 * 0.05)


def test_eq8_9_10_memory_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # Per kind: M_w + M_a scale with the kind's own share; M_t is the largest buffer, not a sum.
    # attn 0.25: 2*240*0.25 = 120; mlp 0.5: 2*460*0.5 = 460; vocab 0.75: 110*0.75 = 82.5;
    # replicated: 2*(8+4) + 66 = 90; M_t = max(70, 30, 80*0.25, 90*0.5, 50*0.75) = 70.
    # Less the smaller of the activations A and the gradients G (M_w / 4), never resident together:
    # A = 2*4 + 6 + 2*40*0.25 + 2*60*0.5 + 10*0.75 = 101.5; G = 2*2 + 15 + 100*0.25 + 200*0.5 + 25*0.75 = 162.75
    assert predict_memory(node, SH) == pytest.approx(120 + 460 + 82.5 + 90 + 70 - 101.5)
    # Whole model: M_t = max(70, 80, 90, 50) = 90; A = 14 + 80 + 120 + 10 = 224 < G = 19 + 100 + 200 + 25
    assert memory_at(node, 1.0) == pytest.approx(480 + 920 + 110 + 90 + 90 - 224)
    assert memory_at(node, 0.0) == pytest.approx(90 + 70 - 14)


def test_activations_and_gradients_count_the_larger_not_both():
    """Backward frees each block's activations as it makes its gradients: the peak holds all of
    the larger, never both (heapprobe's in-use peaks grew by M_w per block, mem-peak-v10.md)."""
    from dataclasses import replace

    grads_heavy = node_cost(PROFILE)  # G > A at any share
    acts_heavy = replace(grads_heavy, attn=replace(grads_heavy.attn, act_slope=400.0, mem_slope=2 * 200 + 400))
    for node in (grads_heavy, acts_heavy):
        for sh in (SH, {"attn": 1.0, "mlp": 0.0, "vocab": 0.0}, {"attn": 0.0, "mlp": 1.0, "vocab": 1.0}):
            acts = node.act_repl + sum(node.kind(k).act_slope * sh[k] for k in SH)
            grads = node.grad_repl + sum(node.kind(k).grad_slope * sh[k] for k in SH)
            both = predict_memory(replace(node, act_repl=0, grad_repl=0, **{
                k: replace(node.kind(k), act_slope=0.0, grad_slope=0.0) for k in SH}), sh)
            assert predict_memory(node, sh) == pytest.approx(both - min(acts, grads))
    # An activation-heavy attention at full share: A (14 + 400) > G (19 + 100): G is what is dropped.
    full_attn = {"attn": 1.0, "mlp": 0.0, "vocab": 0.0}
    plain = replace(acts_heavy, act_repl=0, grad_repl=0, attn=replace(acts_heavy.attn, act_slope=0, grad_slope=0))
    assert predict_memory(acts_heavy, full_attn) == pytest.approx(predict_memory(plain, full_attn) - (19 + 100))


def test_affine_intercept_is_paid_at_any_share():
    """A node with no heads runs the attention's layers on empty weights: it pays their intercept
    (every op dispatched, zeros all-reduced) and not their slope."""
    node = node_cost(PROFILE, fit="affine")
    assert node.attn.fixed_s == pytest.approx(0.05 + 2 * 0.025) and node.attn.icpt_s == 0.0
    assert kind_time(node.attn, 0.0) == pytest.approx(0.05 + 0.05)
    assert kind_time(node.attn, 0.5) == pytest.approx(0.05 + 0.05 + 0.3)
    assert layer_time(PROFILE.layers[1], 0.0) == pytest.approx(0.025)  # the same for one layer
    # Memory does not depend on the time fit.
    assert predict_memory(node, SH) == predict_memory(node_cost(PROFILE, "linear"), SH)


def test_time_and_memory_monotone_in_each_share():
    for fit in ("affine", "linear"):
        node = node_cost(PROFILE, fit)
        for k in ("attn", "mlp", "vocab"):
            t = [predict_time(node, {**SH, k: s / 16}) for s in range(17)]
            m = [predict_memory(node, {**SH, k: s / 16}) for s in range(17)]
            assert t == sorted(t) and m == sorted(m)


def test_segment_labels_are_checked():
    bad = NodeProfile("nX", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)], "vocab"),))
    with pytest.raises(ValueError, match="nX: partitioned layer 'attn': segment 'vocab' cannot be in a block"):
        node_cost(bad)
    unlabelled = NodeProfile("nY", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)]),))
    with pytest.raises(ValueError, match="nY: partitioned layer 'attn' has no segment kind"):
        node_cost(unlabelled)
    # The embedding and the head follow the vocabulary when unlabelled.
    ok = NodeProfile("nZ", 1, (layer("emb", "emb", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)]),))
    assert node_cost(ok).vocab.slope_s > 0


def test_single_width_kind_uses_the_one_time():
    # A kind of one unit (a single KV head) can only be held whole: samples all at share 1.
    one = NodeProfile("n1", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(1.0, 0.3), (1.0, 0.32)], "attn"),))
    node = node_cost(one)
    assert kind_time(node.attn, 1.0) == pytest.approx(0.31)


@pytest.mark.parametrize("samples, expected", [
    ([(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)], (0.025, 0.3)),  # exact affine
    ([(0.5, 1.0), (1.0, 0.8)], (0.9, 0.0)),  # decreasing: slope clamped, flat at the mean
    ([(0.5, 0.1), (1.0, 0.5)], (0.0, 0.44)),  # negative intercept: refit through the origin
])
def test_fit_affine_nonnegative_least_squares(samples, expected):
    alpha, beta = fit_affine(samples)
    assert (alpha, beta) == pytest.approx(expected)
    assert alpha >= 0 and beta >= 0


def test_fit_affine_needs_two_widths():
    with pytest.raises(ValueError, match="2 distinct widths"):
        fit_affine([(1.0, 0.3), (1.0, 0.31)])
    bad = NodeProfile("nX", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.3), (0.5, 0.31)], "attn"),))
    with pytest.raises(ValueError, match="nX, layer attn"):
        node_cost(bad, "affine")
    node_cost(bad, "linear")  # the paper's model needs only time_s


def test_fit_error_shows_affine_gain():
    lay = layer("mlp", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1.0, 0.3)])  # 0.1 + 0.2 p
    err = fit_error(lay, [(0.25, 0.15)])
    assert err.linear == pytest.approx(50.0)  # 0.25 * 0.3 = 0.075 vs 0.15
    assert err.affine == pytest.approx(0.0)


def test_comm_volume_megatron_counts():
    act = 2 * 8 * 64 * 4
    v = tp_comm_volume(hidden_size=64, batch_size=2, seq_len=8, num_blocks=3, task="classify")
    assert v == CommVolume(count=1 + 4 * 3, nbytes=float(act * 13))
    lm = tp_comm_volume(hidden_size=64, batch_size=2, seq_len=8, num_blocks=3, task="causal-lm")
    assert lm == CommVolume(count=13 + 4, nbytes=float(act * 14 + 3 * 2 * 8 * 4))


def test_comm_time_ring_model():
    v = CommVolume(count=13, nbytes=53248.0)
    assert comm_time(v, 4, [1e6, 2e6], 1e-3) == pytest.approx(13e-3 + 2 * 3 / 4 * 53248 / 1e6)
    assert comm_time(v, 1, 1e6, 1e-3) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        comm_time(v, 2, [0.0])
    with pytest.raises(ValueError, match="latency"):
        comm_time(v, 2, 1e6, math.nan)


def test_bad_shares_and_fit():
    node = node_cost(PROFILE)
    with pytest.raises(ValueError, match="share of mlp"):
        predict_time(node, {"attn": 0.5, "mlp": 1.5, "vocab": 0.1})
    with pytest.raises(ValueError, match="share of vocab"):
        predict_memory(node, {"attn": 0.5, "mlp": 0.5})
    with pytest.raises(ValueError, match="fit"):
        node_cost(PROFILE, "quadratic")


def test_gateway_modules_do_not_import_torch():
    code = ("import sys; import xronos.gateway.plan.costmodel, xronos.gateway.plan.planner, "
            "xronos.gateway.plan.profiles; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_peak_adds_the_runtime_and_loadings_largest_buffer():
    """peak = runtime + Eq. 8 + max(replicated largest tensor, max_k largest_k * s_k)."""
    from dataclasses import replace

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    node = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000), fit="affine")
    assert (node.mem_runtime, node.load_repl) == (1000, 120)
    assert (node.vocab.load_slope, node.attn.load_slope, node.mlp.load_slope) == (400, 100, 300)
    base = predict_memory(node_cost(PROFILE), SH)
    # vocab at 0.75 holds the largest buffer (300 B), above the replicated 120 and the MLP's 150
    assert predict_memory(node, SH) == pytest.approx(base + 1000 + 300)
    # at share 0 of every kind only the replicated buffer remains
    zero = {k: 0.0 for k in SH}
    assert predict_memory(node, zero) == pytest.approx(predict_memory(node_cost(PROFILE), zero) + 1000 + 120)


def test_heap_slack_scales_with_the_blocks_transient_bytes_and_shares_the_loading_buffers_room():
    """H = heap_slack * W(s) / W(1), W = one block's M_a + M_t + gradients by kind share
    (replicated: 1; the vocabulary's left out); the peak adds max(L, H): loading's buffer and
    training's holes are the same free space."""
    from dataclasses import replace

    from xronos.gateway.plan.memorymodel import heap_slack

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    plain = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000))
    node = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000, heap_slack=5470))
    # W(1), one block (not times B = 2): attn 40 + 80 + 200/4 = 170, mlp 60 + 90 + 400/4 = 250,
    # ln 4 + 30 + 8/4 = 36, head 6 + 70 + 60/4 = 91: 547; the vocabulary's 85 is not in the scale
    assert node.work_repl == 36 + 91
    assert (node.vocab.work_slope, node.attn.work_slope, node.mlp.work_slope) == (85, 170, 250)
    assert heap_slack(node, {k: 1.0 for k in SH}) == pytest.approx(5470)
    w = 127 + 170 * 0.25 + 250 * 0.5  # 294.5 at SH
    assert heap_slack(node, SH) == pytest.approx(10 * w)
    assert heap_slack(node, {**SH, "vocab": 0.0}) == heap_slack(node, SH)  # a rank without vocabulary rows
    load = 300  # vocab's 400 at 0.75: below H, which replaces it
    assert predict_memory(node, SH) == pytest.approx(predict_memory(plain, SH) - load + 10 * w)
    # H below the loading buffer: the buffer's room holds the holes, nothing is added
    small = replace(node, heap_slack=100.0)
    assert heap_slack(small, SH) < load
    assert predict_memory(small, SH) == predict_memory(plain, SH)
    # a profile that did not measure the heap (heap_slack 0) predicts as before
    assert heap_slack(plain, SH) == 0.0
    # monotone in every share
    for k in SH:
        m = [predict_memory(node, {**SH, k: s / 8}) for s in range(9)]
        assert m == sorted(m)


def test_heap_slack_grows_by_the_measured_per_block_holes_with_depth():
    """The profile measures the holes at one block and what each further block adds; a node of B
    blocks holds heap_slack + (B - 1) x heap_slack_block at full width, scaled to its shares alike."""
    from xronos.gateway.plan.memorymodel import heap_slack

    full = {k: 1.0 for k in SH}
    for blocks in (1, 2, 5):
        node = node_cost(NodeProfile("n0", blocks, PROFILE.layers, runtime_bytes=1000, heap_slack=400,
                                     heap_slack_block=100))
        assert node.heap_slack == 400 + (blocks - 1) * 100
        assert heap_slack(node, full) == pytest.approx(400 + (blocks - 1) * 100)
        one = node_cost(NodeProfile("n0", blocks, PROFILE.layers, runtime_bytes=1000, heap_slack=400))
        assert heap_slack(node, SH) / heap_slack(one, SH) == pytest.approx((400 + (blocks - 1) * 100) / 400)


def test_heap_slack_goes_between_the_two_measured_widths_and_is_flat_below_the_smaller():
    """With the profile's second width (version 8), H is linear in W(s) between the two measured
    points and the smaller width's holes below it (never scaled down towards 0); depth adds the
    same (B - 1) x per block at both."""
    from dataclasses import replace

    from xronos.gateway.plan.memorymodel import heap_slack

    quarter = {k: 0.25 for k in SH}
    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    node = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000, heap_slack=5470, heap_slack_block=100,
                                 heap_small=(quarter, 2000.0)))
    # W(1) = 547, W(quarter) = 127 + (170 + 250) / 4 = 232 (see the test above); B = 2: +100 each
    assert node.heap_slack == 5570 and node.small_slack == 2100 and node.small_work == pytest.approx(232)
    assert heap_slack(node, {k: 1.0 for k in SH}) == pytest.approx(5570)
    assert heap_slack(node, quarter) == pytest.approx(2100)
    assert heap_slack(node, {k: 0.0 for k in SH}) == pytest.approx(2100)  # below the smaller width: flat
    w = 127 + 170 * 0.25 + 250 * 0.5
    assert heap_slack(node, SH) == pytest.approx(2100 + 3470 * (w - 232) / (547 - 232))
    # proportional scaling would have given 5570 * 127 / 547 = 1293 at no share: less than measured
    assert heap_slack(replace(node, small_work=0.0), {k: 0.0 for k in SH}) < 2100
    # a smaller width that measured more holes than the full one (noise) keeps its own: monotone
    noisy = replace(node, small_slack=6000.0)
    m = [heap_slack(noisy, {k: s / 8 for k in SH}) for s in range(9)]
    assert m == sorted(m) and min(m) == 6000.0


def test_owner_peak_is_the_higher_of_training_with_its_data_stack_and_the_export():
    from dataclasses import replace

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    node = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000, owner_bytes=50), fit="affine")
    # whole weights: M_w / 4 summed at share 1 (blocks twice); largest tensor: 400
    assert node.weights_full == pytest.approx((100 + 2 * 200 + 2 * 400 + 2 * 8 + 60) / 4)
    assert node.largest_full == 400
    owner = replace(node, owner=True)
    # gradients and activations are freed before the export: M_a is 10 + 2 x (40 + 60 + 4) + 6 of 1600
    assert node.act_fraction == pytest.approx(224 / 1600)
    # the largest peer slice received: the rest of each kind's largest tensor (vocab 400, attn 100,
    # mlp 300), at the most
    for sh, received in ((SH, max(400 * 0.25, 100 * 0.75, 300 * 0.5)), ({k: 0.0 for k in SH}, 400),
                         ({k: 1.0 for k in SH}, 0)):
        train = predict_memory(node, sh)
        model = node.mem_repl + sum(node.kind(k).mem_slope * sh[k] for k in SH)
        # ... held at its largest where the weights kept grow slower than it shrinks (monotone in shares)
        kept = 1 - node.grad_fraction - node.act_fraction
        lb = {"vocab": 400, "attn": 100, "mlp": 300}
        received = max(lb[k] - min(lb[k], node.kind(k).mem_slope * kept) * sh[k] for k in SH)
        export = 1000 + kept * model + node.weights_full + received
        assert predict_memory(owner, sh) == pytest.approx(50 + max(train, export))
    # a profile that did not measure the process keeps Eq. 8 for the owner as well
    old = replace(node_cost(PROFILE), owner=True)
    assert predict_memory(old, SH) == predict_memory(node_cost(PROFILE), SH)


def test_planner_holds_the_owner_to_its_cap():
    """Rank 0's plan row carries the owner's peak, and a cap between the two predictions moves
    work off the owner rather than exceed it."""
    from dataclasses import replace

    from xronos.gateway.plan.planner import plan
    from xronos.protocol.layout import Sizes

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    node = node_cost(NodeProfile("n", 2, layers, runtime_bytes=1000, owner_bytes=50))
    nodes = [replace(node, node_id=f"n{i}") for i in range(2)]
    sizes = Sizes(attn=4, mlp=128, vocab=256)
    free = plan(nodes, sizes, "segment", [1e9, 1e9], 0.0)
    even_owner = free.rows[0].predicted_memory
    assert even_owner > free.rows[1].predicted_memory  # the owner holds more at the same shares
    cap = even_owner - 1
    tight = plan(nodes, sizes, "segment", [cap, 1e9], 0.0)
    assert tight.rows[0].predicted_memory <= cap
    assert tight.rows[0].predicted_memory == pytest.approx(
        predict_memory(replace(nodes[0], owner=True), tight.rows[0].shares))


def test_a_jobs_checkpoints_add_both_moments_to_the_owners_export():
    from dataclasses import replace

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    owner = replace(node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000, owner_bytes=50)), owner=True)
    ckpt = replace(owner, checkpoints=True)
    zero = {k: 0.0 for k in SH}
    # at share 0 the export dominates: the checkpoint adds two more copies of the whole weights
    assert predict_memory(ckpt, zero) == pytest.approx(predict_memory(owner, zero) + 2 * owner.weights_full)
    assert predict_memory(replace(ckpt, owner=False), zero) == predict_memory(replace(owner, owner=False), zero)


def test_an_adapter_only_export_gathers_the_trained_tensors_alone():
    """LoRA without the merged model: the owner gathers the adapters (and a head), not the frozen
    base, and assembles nothing larger than them."""
    from dataclasses import replace

    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    owner = replace(node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000, owner_bytes=50)), owner=True,
                    trained_full=30.0)
    adapters = replace(owner, export_all=False)
    for sh in (SH, {k: 0.0 for k in SH}):
        train = predict_memory(replace(owner, owner=False), sh)
        model = owner.mem_repl + sum(owner.kind(k).mem_slope * sh[k] for k in SH)
        # gathered, and the largest received slice: no more than the trained bytes
        export = 1000 + (1 - owner.grad_fraction - owner.act_fraction) * model + 30.0 + 30.0
        assert predict_memory(adapters, sh) == pytest.approx(50 + max(train, export))
        assert predict_memory(adapters, sh) <= predict_memory(owner, sh)
    # a job's checkpoint still gathers the trained tensors with both moments
    zero = {k: 0.0 for k in SH}
    assert predict_memory(replace(adapters, checkpoints=True), zero) >= predict_memory(adapters, zero)


def test_plan_reports_export_merged_matters_for_lora_profiles_only():
    from xronos.bench.plan_speed import synthetic_report
    from xronos.gateway.plan.compatible import Loaded
    from xronos.gateway.plan.profiles import plan_reports

    def report(n: str, trained: float):  # M_w = params + 3 x the trained bytes (AdamW's moments, gradients)
        r = synthetic_report(n, units=8, num_blocks=2)
        layers = [lay.model_copy(update={"param_bytes": int(lay.weight_bytes / (1 + 3 * trained))})
                  for lay in r.layers]
        return Loaded(n, r.model_copy(update={"layers": layers, "runtime_bytes": 100 << 20}))

    full = [report(n, 1.0) for n in ("a", "b")]
    lora = [report(n, 0.01) for n in ("a", "b")]  # a LoRA profile: the base frozen but a sliver
    owner = lambda loaded, **kw: plan_reports(loaded, "uniform", **kw).rows[0].predicted_memory  # noqa: E731
    assert owner(lora) < owner(lora, export_merged=True)  # adapter-only: the frozen base is not gathered
    assert owner(full) == pytest.approx(owner(full, export_merged=True))  # full fine-tuning: the same


def test_a_run_without_export_leaves_the_owner_its_data_stack_only():
    from dataclasses import replace

    owner = replace(node_cost(NodeProfile("n0", 2, PROFILE.layers, runtime_bytes=1000, owner_bytes=50)), owner=True)
    plain = replace(owner, owner=False)
    for sh in (SH, {k: 0.0 for k in SH}):
        assert predict_memory(replace(owner, exports=False), sh) == pytest.approx(predict_memory(plain, sh) + 50)
        assert predict_memory(owner, sh) >= predict_memory(replace(owner, exports=False), sh)


def test_frozen_layers_count_in_the_export_but_not_in_the_checkpoint():
    """With param_bytes, a frozen layer (M_w = its weights: a LoRA job's base) adds to the export's
    whole weights but not to the trained bytes a checkpoint gathers with their moments."""
    from dataclasses import replace

    frozen = {"emb", "attn", "mlp"}  # their M_w is weights alone; ln and head are trained (4 x)
    layers = tuple(replace(lay, load_bytes=10,
                           param_bytes=lay.weight_bytes if lay.name in frozen else lay.weight_bytes / 4)
                   for lay in PROFILE.layers)
    node = node_cost(NodeProfile("n0", 2, layers, runtime_bytes=1000))
    assert node.weights_full == pytest.approx(100 + 2 * 200 + 2 * 400 + 2 * 8 / 4 + 60 / 4)
    assert node.trained_full == pytest.approx(2 * 8 / 4 + 60 / 4)
    resident = 110 + 2 * 240 + 2 * 460 + 2 * 12 + 66
    assert node.grad_fraction == pytest.approx(node.trained_full / resident)
    owner = replace(node, owner=True)
    zero = {k: 0.0 for k in SH}
    base = 1000 + (1 - node.grad_fraction - node.act_fraction) * node.mem_repl + 10
    train = predict_memory(node, zero)
    assert predict_memory(owner, zero) == pytest.approx(max(train, base + node.weights_full))
    ckpt_only = replace(owner, exports=False, checkpoints=True)
    assert predict_memory(ckpt_only, zero) == pytest.approx(max(train, base + 3 * node.trained_full))


def test_node_comm_from_the_probe_and_comm_time_takes_the_slower_of_link_and_cpu():
    from xronos.gateway.plan.commmodel import CommVolume, NodeComm, comm_per_node, comm_time, node_comm

    c = node_comm(nbytes=1004, seconds=0.011, small_bytes=4, small_seconds=0.001)
    # The probe's two ranks took turns on one core: one rank pays half of its per-byte time...
    assert c.per_byte_s == pytest.approx(0.5e-5) and c.fixed_s == pytest.approx(0.001 - 4e-5)
    assert node_comm(1004, 0.011, 4, 0.001, parallel=2).per_byte_s == pytest.approx(1e-5)  # ...or all, side by side
    # One rank of a ring of N: 2(N-1) steps, 2(N-1)/N of the tensor sent and received.
    assert c.allreduce_s(1000, 2) == pytest.approx(c.fixed_s + 0.005)
    assert c.allreduce_s(1000, 4) == pytest.approx(3 * c.fixed_s + 0.0075)
    assert c.allreduce_s(1000, 1) == 0.0
    with pytest.raises(ValueError, match="parallel"):
        node_comm(1004, 0.011, 4, 0.001, parallel=3)
    vol = CommVolume(count=10, nbytes=10_000.0)
    link = comm_time(vol, 2, 1e9, 1e-6)
    assert comm_time(vol, 2, 1e9, 1e-6, [c]) == pytest.approx(10 * c.allreduce_s(1000, 2))
    assert comm_time(vol, 2, 1e9, 1e-6, [c]) > link
    assert comm_time(vol, 2, 1e3, 1e-6, [c]) == pytest.approx(comm_time(vol, 2, 1e3, 1e-6))  # link-bound
    assert comm_time(vol, 1, 1e9, 1e-6, [c]) == 0.0
    fast = NodeComm(fixed_s=0.0, per_byte_s=0.0)
    assert comm_per_node(vol, 2, [c, fast, None]) == [pytest.approx(10 * c.allreduce_s(1000, 2)), 0.0, None]
    with pytest.raises(ValueError, match="collectives.seconds"):
        node_comm(1004, float("nan"), 4, 0.001)
    with pytest.raises(ValueError, match="small_bytes"):
        node_comm(4, 0.01, 4, 0.001)


def test_the_planners_memory_is_the_cost_models_at_every_quantum_with_deep_holes():
    """model.Problem.mem mirrors predict_memory term by term (it is what the planner holds
    against a cap): at B = 6 with holes measured at both widths and their growth with depth — so
    that the holes, not loading's buffer, set max(L, H) on the narrow ranks — for the owner and a
    peer, at every count of quanta of every kind."""
    import itertools
    from dataclasses import replace

    from xronos.gateway.plan.memorymodel import heap_slack
    from xronos.gateway.plan.model import Problem
    from xronos.protocol.layout import Sizes

    quarter = {k: 0.25 for k in SH}
    layers = tuple(replace(lay, load_bytes=lb) for lay, lb in zip(PROFILE.layers, (400, 100, 300, 8, 120)))
    node = node_cost(NodeProfile("n", 6, layers, runtime_bytes=1000, owner_bytes=50, heap_slack=900,
                                 heap_slack_block=150, heap_small=(quarter, 500.0)))
    nodes = [replace(node, node_id="n0", owner=True), replace(node, node_id="n1")]
    sizes = Sizes(attn=4, mlp=128, vocab=256)
    quanta = {"attn": 1, "mlp": 32, "vocab": 64}
    pb = Problem(nodes, sizes, [1e9, 1e9], quanta)
    seen_holes = False
    for d, w in itertools.product(range(2), itertools.product(range(5), range(5), range(5))):
        shares = {"attn": w[0] / 4, "mlp": w[1] * 32 / 128, "vocab": w[2] * 64 / 256}
        assert pb.mem(d, w) == pytest.approx(predict_memory(nodes[d], shares), rel=1e-12)
        load = max([node.load_repl] + [node.kind(k).load_slope * shares[k] for k in SH])
        seen_holes |= heap_slack(node, shares) > load
    assert seen_holes
