"""An asynchronous all-reduce across real Gloo ranks on the virtual clock: the compute a rank does
between launch and wait hides the modelled link, by the predicted amount in virtual seconds, and
the sum is the blocking one's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.node.tp.tp_world import run_world

WORKER = Path(__file__).with_name("overlap_worker.py")


def test_compute_between_launch_and_wait_hides_the_link_in_virtual_time(tmp_path: Path) -> None:
    link_s = 0.020  # 32 KiB among 2 ranks (a ring of 2 moves it once) at 1.6 MB/s, no latency
    job = {"bandwidth_Bps": 32 * 1024 / link_s, "iters": 12, "before": 30, "after": 80}
    run_world(WORKER, 2, job, tmp_path, timeout=180)
    for r in range(2):
        rows = json.loads((tmp_path / f"rank{r}.json").read_text())[4:]  # the estimator's windows filled
        assert all(row["exact"] for row in rows)
        for blocking, launched in zip(rows[0::2], rows[1::2]):
            assert not blocking["overlap"] and launched["overlap"]
            # blocking: before + link + after; launched: before + max(after + the call's CPU, link)
            assert blocking["iteration_s"] == pytest.approx(
                blocking["before_s"] + link_s + blocking["after_s"], abs=2e-3)
            hidden = blocking["iteration_s"] - launched["iteration_s"]
            expected = min(launched["after_s"], link_s)
            assert 0.2 * link_s < launched["after_s"] < link_s  # the case: compute hides part of the link
            assert hidden == pytest.approx(expected, abs=max(1.5e-3, 0.15 * expected)), (blocking, launched)
            assert launched["iteration_s"] >= launched["before_s"] + launched["after_s"]
