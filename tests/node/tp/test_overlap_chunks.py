"""Chunking's settings, its exactness and its backward schedule in a world of one (in process;
across real Gloo ranks: tests/node/models/test_overlap_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from xronos.node.models.loading import init_random
from xronos.node.models.registry import family_by_name
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.overlap import check_chunks

ARCH = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, vocab_size=61,
            max_positions=64, num_labels=None, tie_word_embeddings=False)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_a_chunk_count_that_is_not_a_positive_integer_is_refused_naming_it_and_the_batch(bad):
    with pytest.raises(ValueError, match=rf"chunks must be a positive integer, got {bad!r} \(batch size 8\)"):
        check_chunks(bad, 8)


def test_a_chunk_count_that_leaves_a_chunk_without_a_row_is_refused():
    assert check_chunks(8, 8) == 8 and check_chunks(1, 1) == 1
    with pytest.raises(ValueError, match="chunks 9 leaves a chunk without a row: the batch has 8 rows"):
        check_chunks(9, 8)


def _model(family: str, group: TPGroup):
    fam = family_by_name(family)
    config = fam.config_from_arch({**ARCH, "family": family, "num_kv_heads": ARCH["num_heads"]
                                   if family == "gpt2" else ARCH["num_kv_heads"]})
    layout = ShardLayout.single(fam.sizes(config))
    return init_random(fam.build(config, "causal-lm", layout, group), seed=3)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_chunked_forward_and_backward_are_the_unchunked_ones(family):
    ids = torch.randint(1, ARCH["vocab_size"], (5, 7), generator=torch.Generator().manual_seed(0))
    out = {}
    for chunks in (1, 2, 5):
        group = TPGroup.single()
        model = _model(family, group)
        group.chunks = chunks
        loss = model(ids, labels=ids)
        loss.backward()
        out[chunks] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    for chunks in (2, 5):
        torch.testing.assert_close(out[chunks][0], out[1][0], rtol=1e-6, atol=1e-7)
        for name, g in out[1][1].items():
            torch.testing.assert_close(out[chunks][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    group = TPGroup.single()
    model = _model(family, group)
    group.chunks = 6
    with pytest.raises(ValueError, match="chunks 6 leaves a chunk without a row: the batch has 5 rows"):
        model(ids, labels=ids)
    for bad in (0, "2"):
        group.chunks = bad
        with pytest.raises(ValueError, match=rf"chunks must be a positive integer, got {bad!r} \(batch size 5\)"):
            model(ids, labels=ids)


@pytest.mark.parametrize("family,targets,regions", [("qwen3", ("q_proj", "v_proj", "down_proj"), 4),
                                                     ("gpt2", ("c_fc",), 3)])
def test_a_chunked_lora_pass_gives_the_adapters_the_unchunked_gradients(family, targets, regions):
    """LoRA: the embeddings frozen (the pass's input needs no gradient: `_ChunkedPass`'s anchor),
    the adapters' A's entering their regions as passengers of the chunk's cell; GPT-2's first
    attention region has nothing to train, so its cells launch no all-reduce."""
    from xronos.node.tp.lora import LoraSettings, add_lora, trainable_names

    ids = torch.randint(1, ARCH["vocab_size"], (4, 7), generator=torch.Generator().manual_seed(4))
    out = {}
    for chunks in (1, 2, 4):
        group = TPGroup.single()
        model = _model(family, group)
        add_lora(model, LoraSettings(r=4, alpha=8.0, targets=targets))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("lora_A", "lora_B")):  # add_lora leaves them to the loader
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        group.chunks = chunks
        launched = []
        launch = group.all_reduce_async
        group.all_reduce_async = lambda t, *a, **k: launched.append(t.numel()) or launch(t, *a, **k)
        loss = model(ids, labels=ids)
        loss.backward()
        # a region all-reduce per chunk where something before or in it trains
        assert len(launched) == (regions * chunks if chunks > 1 else 0), launched
        out[chunks] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        assert sorted(out[chunks][1]) == sorted(trainable_names(model))
    for chunks in (2, 4):
        torch.testing.assert_close(out[chunks][0], out[1][0], rtol=1e-6, atol=1e-7)
        for name, g in out[1][1].items():
            assert g is not None and out[chunks][1][name] is not None, name
            torch.testing.assert_close(out[chunks][1][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family,chunks", [("gpt2", 2), ("llama", 3), ("qwen3", 2)])
def test_the_backward_all_reduces_of_one_chunk_travel_while_the_next_chunk_computes(family, chunks):
    """Domino's backward (`overlap._Tape`): every block region's input-gradient all-reduce is
    launched asynchronously and waited for only after the other chunks' stage backward launched
    theirs: `chunks` of them in flight, waited in launch order, and the model's own compute
    between a launch and its wait."""
    group = TPGroup.single()
    model = _model(family, group)
    group.chunks = chunks
    log: list[tuple[str, int]] = []
    launch = group.all_reduce_async

    def logged(t, *a, **k):
        i = sum(1 for e in log if e[0] == "launch")
        log.append(("launch", i))
        pending = launch(t, *a, **k)
        wait = pending.wait

        def waited():
            log.append(("wait", i))
            return wait()

        pending.wait = waited
        return pending

    group.all_reduce_async = logged
    # a row layer's weight gradient: the model's compute, between the all-reduces
    for name, p in model.named_parameters():
        if name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight", "o_proj.weight", "down_proj.weight")):
            p.register_hook(lambda g: log.append(("compute", -1)))
    ids = torch.randint(1, ARCH["vocab_size"], (5, 7), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).backward()
    launches = [i for e, i in log if e == "launch"]
    waits = [i for e, i in log if e == "wait"]
    assert len(launches) == 2 * ARCH["num_layers"] * chunks  # attention and MLP of every block, per chunk
    assert waits == launches  # in launch order, each once
    in_flight, peak = 0, 0
    for e, _ in log:
        in_flight += {"launch": 1, "wait": -1}.get(e, 0)
        peak = max(peak, in_flight)
    assert peak == chunks
    for i in launches[:-chunks]:  # between a launch and its wait, the next chunk's stage computed
        a, b = log.index(("launch", i)), log.index(("wait", i))
        assert ("compute", -1) in log[a:b] and ("launch", i + 1) in log[a:b], log[a:b]


def test_a_chunked_backward_frees_each_stages_activations_as_it_goes():
    """Once a chunk's stage has run the rest of its backward, the pass holds nothing of it (the
    cell's input, residual leaf and output): backward's peak is autograd's own, not every stage's
    input kept to the end."""
    chunks = 2
    group = TPGroup.single()
    model = _model("gpt2", group)
    group.chunks = chunks
    ids = torch.randint(1, ARCH["vocab_size"], (4, 7), generator=torch.Generator().manual_seed(5))
    loss = model(ids, labels=ids)
    seen, todo, tape = set(), [loss.grad_fn], None
    while todo and tape is None:  # the pass's node in the graph, to look at its cells
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        tape = getattr(node, "tape", None)
        todo += [f for f, _ in node.next_functions]
    assert tape is not None
    stages = len(tape.cells)
    alive: list[int] = []
    launch = group.all_reduce_async

    def counted(t, *a, **k):
        alive.append(sum(cell.x is not None for row in tape.cells for cell in row))
        return launch(t, *a, **k)

    group.all_reduce_async = counted
    loss.backward()
    assert len(alive) == stages * chunks
    for k, n_alive in enumerate(alive):
        s, c = stages - 1 - k // chunks, k % chunks
        # the rows not reached yet and this one, and of the row after it the chunks still flying
        assert n_alive == (s + 1) * chunks + (chunks - c - 1 if s + 1 < stages else 0), (k, alive)


class _Late:
    """What late_weight_linear needs of a group: the queue of late weight gradients."""

    def __init__(self) -> None:
        self.late: list = []
        self.late_task = -1


@pytest.mark.parametrize("transposed", [False, True])
def test_a_late_weight_gradient_is_autograds_once_backward_ends(transposed):
    from xronos.node.tp.overlap import late_weight_linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 6, generator=gen, requires_grad=True)
    w0 = torch.randn((6, 5) if transposed else (5, 6), generator=gen)
    ref_w = w0.clone().requires_grad_(True)
    ref = torch.nn.functional.linear(x, ref_w.t() if transposed else ref_w)
    (ref * ref).sum().backward()
    ref_dx, x.grad = x.grad, None

    w = w0.clone().requires_grad_(True)
    group = _Late()
    for _ in range(2):  # the second pass accumulates onto the first's, as autograd does
        y = late_weight_linear(x, w, group, transposed)
        assert y.shape == (3, 4, 5)
        (y * y).sum().backward()  # no region ran the queue: the end of backward did
        assert group.late == []
    torch.testing.assert_close(x.grad, 2 * ref_dx)
    torch.testing.assert_close(w.grad, 2 * ref_w.grad)


def test_a_rank_holding_none_of_a_row_layer_leaves_an_empty_gradient():
    from xronos.node.tp.overlap import late_weight_linear

    x = torch.randn(2, 3, 0, requires_grad=True)  # a 0-unit rank's input: [..., 0]
    w = torch.randn(5, 0, requires_grad=True)
    group = _Late()
    y = late_weight_linear(x, w, group, False)
    assert torch.equal(y, torch.zeros(2, 3, 5))
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (5, 0) and x.grad.shape == (2, 3, 0)


def test_a_backward_pass_that_raised_leaves_nothing_for_the_next():
    from xronos.node.tp.overlap import late_weight_linear

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    w = torch.randn(5, 6, generator=gen, requires_grad=True)
    group = _Late()
    y = late_weight_linear(Boom.apply(x), w, group, False)
    with pytest.raises(RuntimeError, match="boom"):
        y.sum().backward()  # the row layer queued its weight gradient, then the pass raised
    assert len(group.late) == 1 and w.grad is None
    late_weight_linear(x, w, group, False).sum().backward()
    assert group.late == []
    torch.testing.assert_close(w.grad, torch.ones(4, 5).t() @ x)  # this pass's alone


def test_a_frozen_weight_leaves_nothing_late():
    from xronos.node.tp.overlap import late_weight_linear

    x = torch.randn(2, 6, requires_grad=True)
    w = torch.randn(5, 6)
    group = _Late()
    late_weight_linear(x, w, group, False).sum().backward()
    assert group.late == [] and w.grad is None and x.grad is not None
