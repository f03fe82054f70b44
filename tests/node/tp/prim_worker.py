"""One rank of the primitives world: every check compares this rank's sharded result with the
unsharded computation done locally from the same seeded tensors; a failed check exits non-zero."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tp_world import worker_setup

from xronos.node.models.export import gather_full
from xronos.node.models.specs import TensorSpec
from xronos.node.tp.layers import (ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding,
                                   vocab_parallel_cross_entropy)
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.mappings import copy_to_tp


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item() if b.numel() else 0.0), (what, err)


def unit_bounds(total: int, H: int) -> list[int]:
    """H+1 boundaries cutting `total` into H near-equal chunks; the first `total % H` get one more."""
    base, rem = divmod(total, H)
    bounds = [0]
    for u in range(H):
        bounds.append(bounds[-1] + base + (1 if u < rem else 0))
    return bounds


class Cut:
    """The job's units per rank, cutting any size near-evenly on unit boundaries (the paper's
    tied unit) — each check below sizes its own tensors; `layout(mlp=, vocab=)` gives the
    per-segment ShardLayout those sizes need."""

    def __init__(self, units: tuple[int, ...], rank: int) -> None:
        self.units, self.rank, self.H = units, rank, sum(units)

    def slice_of(self, total: int) -> tuple[int, int]:
        b = unit_bounds(total, self.H)
        u0 = sum(self.units[:self.rank])
        return b[u0], b[u0 + self.units[self.rank]]

    def counts(self, total: int) -> tuple[int, ...]:
        b, out, u = unit_bounds(total, self.H), [], 0
        for n in self.units:
            out.append(b[u + n] - b[u])
            u += n
        return tuple(out)

    def layout(self, mlp: int, vocab: int) -> ShardLayout:
        return ShardLayout(self.units, self.counts(mlp), self.counts(vocab), self.rank)


def check_mlp(lay: Cut, group, transposed: bool) -> None:
    g = torch.Generator().manual_seed(1)
    E, I = 6, 10  # I = 10 on H = 4 units: chunks 3, 3, 2, 2
    x = torch.randn(2, 5, E, generator=g)
    W1, b1 = torch.randn(I, E, generator=g), torch.randn(I, generator=g)
    W2, b2 = torch.randn(E, I, generator=g), torch.randn(E, generator=g)
    r = torch.randn(2, 5, E, generator=g)
    ref_x = x.clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (W1, b1, W2, b2)]
    y_ref = F.linear(F.gelu(F.linear(ref_x, ref[0], ref[1])), ref[2], ref[3])
    (y_ref * r).sum().backward()

    c0, c1 = lay.slice_of(I)
    col = ColumnParallelLinear(E, Split.of((c0, c1), I), transposed=transposed)
    row = RowParallelLinear(Split.of((c0, c1), I), E, group, transposed=transposed)
    with torch.no_grad():
        col.weight.copy_(W1[c0:c1].t() if transposed else W1[c0:c1])
        col.bias.copy_(b1[c0:c1])
        row.weight.copy_(W2[:, c0:c1].t() if transposed else W2[:, c0:c1])
        row.bias.copy_(b2)
    xs = x.clone().requires_grad_()
    y = row(F.gelu(col(copy_to_tp(xs, group))))
    (y * r).sum().backward()
    tag = f"mlp transposed={transposed}"
    close(y, y_ref, tag + " forward")
    close(xs.grad, ref_x.grad, tag + " input grad")  # copy_to_tp's backward all-reduce
    gw1 = col.weight.grad.t() if transposed else col.weight.grad
    gw2 = row.weight.grad.t() if transposed else row.weight.grad
    close(gw1, ref[0].grad[c0:c1], tag + " column weight grad")
    close(col.bias.grad, ref[1].grad[c0:c1], tag + " column bias grad")
    close(gw2, ref[2].grad[:, c0:c1], tag + " row weight grad")
    close(row.bias.grad, ref[3].grad, tag + " row bias grad (added once)")


def check_embedding(lay: Cut, group) -> None:
    g = torch.Generator().manual_seed(2)
    V, E, pad = 11, 4, 5  # 11 on 4 units: 3, 3, 3, 2
    W = torch.randn(V, E, generator=g)
    ids = torch.randint(0, V, (3, 7), generator=g)
    ids[0, :3] = pad
    r = torch.randn(3, 7, E, generator=g)
    ref = torch.nn.Embedding(V, E, padding_idx=pad)
    with torch.no_grad():
        ref.weight.copy_(W)
    (ref(ids) * r).sum().backward()
    emb = VocabParallelEmbedding(V, E, lay.layout(mlp=10, vocab=V), group, padding_idx=pad)
    with torch.no_grad():
        emb.weight.copy_(W[emb.vocab_start:emb.vocab_stop])
    out = emb(ids)
    (out * r).sum().backward()
    close(out, ref(ids), "embedding forward")
    close(emb.weight.grad, ref.weight.grad[emb.vocab_start:emb.vocab_stop], "embedding grad (pad row 0)")


def check_cross_entropy(lay: Cut, group) -> None:
    g = torch.Generator().manual_seed(3)
    V, N = 13, 9  # 13 on 4 units: 4, 3, 3, 3
    logits = 3 * torch.randn(N, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[1, 4]] = -100
    v0, v1 = lay.slice_of(V)
    for reduction in ("mean", "sum"):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full, targets, ignore_index=-100, reduction=reduction)
        (2.5 * ref).backward()
        local = logits[:, v0:v1].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, v0, group, reduction=reduction)
        (2.5 * loss).backward()
        close(loss, ref, f"cross-entropy {reduction}")
        close(local.grad, full.grad[:, v0:v1], f"cross-entropy {reduction} grad")
    all_ignored = torch.full((N,), -100)
    loss = vocab_parallel_cross_entropy(logits[:, v0:v1], all_ignored, v0, group)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, all_ignored)), "0/0 like torch"


def check_gather(lay: Cut, group, dst: int) -> None:
    """gather_full of arbitrary tensors with fused (3-segment) and single-segment specs."""
    g = torch.Generator().manual_seed(4)
    full_a = torch.randn(5, 3 * 8, generator=g)  # fused q|k|v columns, 8 per part on 4 units
    full_b = torch.randn(13, 2, generator=g)
    full_c = torch.randn(3, generator=g)
    a0, a1 = lay.slice_of(8)
    specs = {"a": TensorSpec("A", 1, ((a0, a1), (8 + a0, 8 + a1), (16 + a0, 16 + a1)), (5, 24)),
             "b": TensorSpec("B", 0, (lay.slice_of(13),), (13, 2)),
             "c": TensorSpec("C", None, (), (3,))}
    local = {k: s.take(f) for (k, s), f in zip(specs.items(), (full_a, full_b, full_c))}
    out = gather_full(local, specs, lay.layout(mlp=8, vocab=13), group, dst=dst)
    if lay.rank == dst:
        assert set(out) == {"A", "B", "C"}
        for name, f in (("A", full_a), ("B", full_b), ("C", full_c)):
            assert torch.equal(out[name], f), name
    else:
        assert out == {}


def main() -> None:
    job, rank, group = worker_setup(sys.argv)
    lay = Cut(tuple(job["units"]), rank)
    for transposed in (False, True):
        check_mlp(lay, group, transposed)
    check_embedding(lay, group)
    check_cross_entropy(lay, group)
    check_gather(lay, group, dst=job["world"] - 1)
    names = {name for name, _ in group.drain_timings()}
    p2p = "recv" if rank == job["world"] - 1 else "send"  # gather_full: everyone sends to dst
    assert {"all_reduce_sum", "all_reduce_max", p2p} <= names, names
    assert group.timings == []
    t = torch.full((2,), float(rank))
    group.broadcast(t, src=1)
    assert torch.equal(t, torch.ones(2))
    Path(job["out"], f"ok{rank}").write_text("ok")


if __name__ == "__main__":
    main()
