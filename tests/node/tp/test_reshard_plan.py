"""The re-shard transfer plan (pure): applied to full tensors without a network, every rank ends
with exactly the slices the new layout gives it, for every family and lopsided layouts."""

from __future__ import annotations

import pytest
import torch

from xronos.node.models.registry import family_by_name
from xronos.node.tp.reshard import specs_per_rank, transfer_plan
from xronos.protocol.layout import Layout, LayoutError


def arch(family: str, **kw) -> dict:
    base = dict(family=family, hidden_size=24, num_layers=2, num_heads=6, num_kv_heads=6, intermediate_size=70,
                vocab_size=41, max_positions=32, num_labels=None, tie_word_embeddings=True)
    return {**base, **kw}


# (family, task, arch overrides); sizes: 6 attention units (3 KV groups under GQA), 70 MLP columns, 41 rows.
MODELS = {
    "gpt2-lm": ("gpt2", "causal-lm", {}),
    "gpt2-cls": ("gpt2", "classify", dict(num_labels=3)),
    "gpt2-lm-untied": ("gpt2", "causal-lm", dict(tie_word_embeddings=False)),
    "bert-cls": ("bert", "classify", dict(num_labels=3)),
    "roberta-cls": ("roberta", "classify", dict(num_labels=2)),
    "llama-lm": ("llama", "causal-lm", dict(tie_word_embeddings=False)),
    "llama-gqa-cls": ("llama", "classify", dict(num_kv_heads=3, num_labels=3)),
    "qwen3-lm": ("qwen3", "causal-lm", dict(num_kv_heads=3)),
}

# Layouts per world size as (attn, mlp, vocab) counts; attention totals are filled per model.
LAYOUTS = {
    2: [((6, 0), (0, 70), (41, 0)), ((0, 6), (70, 0), (0, 41)), ((1, 5), (64, 6), (9, 32))],
    3: [((2, 2, 2), (24, 23, 23), (14, 14, 13)), ((0, 1, 5), (70, 0, 0), (1, 0, 40)), ((4, 2, 0), (3, 60, 7), (0, 41, 0))],
    4: [((1, 2, 3, 0), (10, 20, 30, 10), (0, 20, 0, 21)), ((0, 0, 6, 0), (35, 0, 0, 35), (10, 10, 10, 11))],
}


def _fit(counts: tuple[int, ...], total: int) -> tuple[int, ...]:
    """Scale a 6-unit attention split to `total` units (3 under GQA), keeping zeros where they are."""
    if total == 6:
        return counts
    out = [c * total // 6 for c in counts]
    out[max(range(len(out)), key=lambda i: counts[i])] += total - sum(out)
    return tuple(out)


def _model(name: str):
    family_name, task, kw = MODELS[name]
    family = family_by_name(family_name)
    return family, family.config_from_arch(arch(family_name, **kw)), task


def _layouts(family, config, world):
    units = family.num_units(config)
    return [Layout(attn=_fit(a, units), mlp=m, vocab=v) for a, m, v in LAYOUTS[world]]


def simulate(plan, old_specs, new_specs, full):
    """What every rank holds after the plan, computed from the old local parts alone."""
    world = len(old_specs)
    old_local = [{n: s.take(full[n]) for n, s in old_specs[r].items() if s.dim is not None} for r in range(world)]
    out = []
    for dst in range(world):
        mine = {n: torch.full(s.local_shape, float("nan")) for n, s in new_specs[dst].items() if s.dim is not None}
        for src in range(world):
            for p in plan.pieces(src, dst):
                mine[p.name].narrow(p.dim, p.dst_off, p.length).copy_(
                    old_local[src][p.name].narrow(p.dim, p.src_off, p.length))
        out.append(mine)
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_ends_with_its_new_slices(name, world):
    family, config, task = _model(name)
    layouts = _layouts(family, config, world)
    specs = [specs_per_rank(family, config, task, lay) for lay in layouts]
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.full_shape, generator=g) for n, s in specs[0][0].items()}
    for i, old in enumerate(specs):
        for j, new in enumerate(specs):
            plan = transfer_plan(old, new)
            got = simulate(plan, old, new, full)
            for r in range(world):
                for n, t in got[r].items():
                    assert torch.equal(t, new[r][n].take(full[n])), (name, i, j, r, n)
            if i == j:
                assert plan.moved_elements() == 0  # nothing moves when the layout stays
            else:
                assert plan.moved_elements() > 0
            partitioned = sum(t.numel() for n, t in full.items() if old[0][n].dim is not None)
            assert plan.moved_elements() + plan.kept_elements() == partitioned


def test_only_the_changed_part_moves():
    """Moving 32 MLP columns from rank 0 to rank 1 sends just those columns of each MLP tensor."""
    family, config, task = _model("gpt2-lm")
    a = Layout(attn=(3, 3), mlp=(64, 6), vocab=(20, 21))
    b = Layout(attn=(3, 3), mlp=(32, 38), vocab=(20, 21))
    plan = transfer_plan(specs_per_rank(family, config, task, a), specs_per_rank(family, config, task, b))
    assert plan.pieces(1, 0) == ()
    moved = plan.pieces(0, 1)
    assert {p.name.split(".", 3)[-1] for p in moved} == {"mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight"}
    assert all((p.start, p.length, p.src_off, p.dst_off) == (32, 32, 32, 0) for p in moved)
    hidden, layers = 24, 2
    assert plan.moved_elements() == layers * 32 * (hidden + 1 + hidden)


def test_plans_between_different_models_or_worlds_are_refused():
    family, config, task = _model("gpt2-lm")
    two = specs_per_rank(family, config, task, Layout(attn=(3, 3), mlp=(64, 6), vocab=(20, 21)))
    three = specs_per_rank(family, config, task, Layout(attn=(2, 2, 2), mlp=(32, 32, 6), vocab=(20, 20, 1)))
    with pytest.raises(LayoutError, match="2 ranks before, 3 after"):
        transfer_plan(two, three)
    f2, c2, t2 = _model("llama-lm")
    other = specs_per_rank(f2, c2, t2, Layout(attn=(3, 3), mlp=(64, 6), vocab=(20, 21)))
    with pytest.raises(LayoutError, match="differ between the layouts"):
        transfer_plan(two, other)


def test_a_ranks_peak_during_the_move_is_its_new_part_and_its_pieces_in_flight():
    """Rank 1 receives 32 MLP columns: it allocates its whole new part of every partitioned tensor
    (what it keeps and what comes) and the incoming pieces' buffer; with AdamW's two moments, three
    times that."""
    from xronos.node.rank.optim import adamw
    from xronos.node.rank.optstate import allocate_state
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.tp.reshard import move_peak_bytes

    family, config, task = _model("gpt2-lm")
    a = Layout(attn=(3, 3), mlp=(64, 6), vocab=(20, 21))
    b = Layout(attn=(3, 3), mlp=(32, 38), vocab=(20, 21))
    plan = transfer_plan(specs_per_rank(family, config, task, a), specs_per_rank(family, config, task, b))
    model = family.build(config, task, ShardLayout.of(a, 1), TPGroup.alone(2, 1))
    fresh, incoming, outgoing = plan.elements(0, 1) + plan.elements(1, 1), plan.elements(0, 1), plan.elements(1, 0)
    assert outgoing == 0
    assert move_peak_bytes(plan, model, None, 1) == 4 * (fresh + incoming)
    opt = adamw(model.parameters(), lr=1e-3)
    allocate_state(opt)
    assert move_peak_bytes(plan, model, opt, 1) == 3 * 4 * (fresh + incoming)


def test_moving_tensor_by_tensor_frees_as_it_goes_and_the_peak_is_one_tensor_not_a_second_shard():
    """With one tensor per exchange the rank holds, at worst, the new parts of the tensors done, less
    their old parts, and one tensor's new part and pieces in flight: never more than in one exchange,
    never less than the largest tensor's share or the shard's growth."""
    from xronos.node.rank.optim import adamw
    from xronos.node.rank.optstate import allocate_state
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.tp.reshard import move_batches, move_peak_bytes

    family, config, task = _model("gpt2-lm")
    a = Layout(attn=(6, 0), mlp=(70, 0), vocab=(41, 0))  # rank 1 starts empty and ends with most of it
    b = Layout(attn=(1, 5), mlp=(6, 64), vocab=(1, 40))
    plan = transfer_plan(specs_per_rank(family, config, task, a), specs_per_rank(family, config, task, b))

    def built(rank: int):
        model = family.build(config, task, ShardLayout.of(a, rank), TPGroup.alone(2, rank))
        opt = adamw(model.parameters(), lr=1e-3)
        allocate_state(opt)
        return model, opt

    model1, opt1 = built(1)
    assert move_batches(plan, model1, opt1) == [list(plan.shapes)]  # a small model: one exchange
    assert move_batches(plan, model1, opt1, batch_bytes=1) == [[n] for n in plan.shapes]
    # rank 1 holds nothing partitioned before: it ends with its new part whichever way, but has one
    # tensor's pieces in flight at a time instead of all of them
    new1 = 3 * 4 * plan.elements(0, 1)
    flights = [3 * 4 * sum(plan.piece_elements(p) for p in plan.pieces(0, 1) if p.name == n) for n in plan.shapes]
    whole1 = move_peak_bytes(plan, model1, opt1, 1)
    one1 = move_peak_bytes(plan, model1, opt1, 1, batch_bytes=1)
    assert whole1 == 2 * new1
    assert new1 <= one1 <= new1 + max(flights) and one1 < whole1
    # rank 0 gives most of its shard away: in one exchange it holds its new part beside all it sends;
    # tensor by tensor, at worst a tensor's worth, less the old parts already freed (the first tensor:
    # nothing freed yet)
    model0, opt0 = built(0)
    whole0, one0 = move_peak_bytes(plan, model0, opt0, 0), move_peak_bytes(plan, model0, opt0, 0, batch_bytes=1)
    assert whole0 == 3 * 4 * (plan.elements(0, 0) + plan.elements(0, 1))
    assert flights[0] <= one0 <= max(flights) + max(3 * 4 * plan.piece_elements(p) for p in plan.pieces(0, 0))
    assert one0 < whole0 / 10, (one0, whole0)


def test_a_move_a_rank_has_no_room_for_is_refused_naming_the_rank_and_the_figures():
    from xronos.node.rank.relayout import check_room, memory_room
    from xronos.node.tp.group import TPGroup

    group = TPGroup.single()
    check_room(group, 10 << 20, 11 << 20, 5)  # fits: nothing happens
    with pytest.raises(LayoutError, match=r"re-shard at step 5: rank 0 would need 12 MiB more .* room for 11 MiB"):
        check_room(group, 12 << 20, 11 << 20, 5)
    assert memory_room() > 0
