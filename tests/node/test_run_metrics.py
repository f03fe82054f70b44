"""Pure parts of the run: the idle/communication split, records, summaries, LR schedule, clipping."""

from __future__ import annotations

import pytest

from xronos.protocol.layout import Layout
import torch

from xronos.node.rank.metrics import IterationRecord, Rusage, comm_and_idle, format_table, summarize
from xronos.node.tp.group import TPGroup
from xronos.node.rank.tpengine import clip_global_grad_norm, lr_factor


def test_idle_is_own_time_beyond_the_fastest_rank_per_collective() -> None:
    # 3 ranks, 2 collectives. Rank 1 is the straggler at the first, rank 0 at the second.
    per_rank = torch.tensor([[0.50, 0.01], [0.02, 0.30], [0.40, 0.02]], dtype=torch.float64)
    assert comm_and_idle(per_rank, 0) == pytest.approx((0.03, 0.48))
    assert comm_and_idle(per_rank, 1) == pytest.approx((0.03, 0.29))
    assert comm_and_idle(per_rank, 2) == pytest.approx((0.03, 0.39))
    assert comm_and_idle(torch.zeros(1, 0, dtype=torch.float64), 0) == (0.0, 0.0)


def _rec(step: int, it: float, idle: float) -> IterationRecord:
    return IterationRecord(step=step, epoch=0, loss=1.5, lr=1e-4, iteration_s=it, compute_s=it - idle - 0.1,
                           comm_s=0.1, idle_s=idle, data_s=0.0, voluntary_ctx_switches=3,
                           involuntary_ctx_switches=1, peak_rss=1000 + step)


def test_records_travel_as_float_rows() -> None:
    r = _rec(7, 0.5, 0.2)
    back = IterationRecord.from_row(r.as_row())
    assert back == r and isinstance(back.step, int) and isinstance(back.peak_rss, int)


def test_summary_skips_the_warmup_iteration() -> None:
    recs = [_rec(0, 9.0, 5.0), _rec(1, 1.0, 0.25), _rec(2, 1.0, 0.25)]
    lay = Layout(attn=(4, 8), mlp=(0, 100), vocab=(64, 236))
    s = summarize(1, lay, recs)
    assert (s.attn, s.mlp, s.vocab, s.iterations) == (8, 100, 236, 3)
    assert (s.iteration_s, s.idle_s, s.idle_ratio) == (pytest.approx(1.0), pytest.approx(0.25), pytest.approx(0.25))
    assert (s.voluntary_ctx_switches, s.involuntary_ctx_switches, s.peak_rss) == (9, 3, 1002)
    table = format_table([summarize(0, lay, recs), s])
    assert table.splitlines()[0].split()[:4] == ["rank", "attn", "mlp", "vocab"]
    assert table.splitlines()[2].split()[:4] == ["1", "8", "100", "236"]


def test_rusage_counts_context_switches() -> None:
    ru = Rusage()
    for _ in range(50):
        torch.ones(1)  # noqa: B018 - some work
    vol, invol = ru.delta()
    assert vol >= 0 and invol >= 0
    assert Rusage.peak_rss() > 10 * 2**20


def test_peak_rss_is_the_process_own_not_its_parents() -> None:
    """A rank spawned by a big process reports its own peak (ru_maxrss would report the parent's
    RSS at fork: Linux keeps it across fork + exec)."""
    import subprocess
    import sys

    big = torch.ones(128 * 2**20 // 4)  # 128 MiB resident in this (the parent) process
    code = "from xronos.node.rank.metrics import Rusage; print(Rusage.peak_rss())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert Rusage.peak_rss() > child + 100 * 2**20 > 100 * 2**20, (Rusage.peak_rss(), child)
    del big


def test_linear_warmup_then_constant() -> None:
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 0) == 1.0


def test_clipping_on_one_rank_equals_torch_clip_grad_norm() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 6)
    for m in (a, b):
        (m(x) ** 2).sum().backward()
    total = clip_global_grad_norm(a, {"bias"}, 0.1, TPGroup.single())
    expected = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    assert total == pytest.approx(float(expected), rel=1e-6) and total > 0.1
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)
