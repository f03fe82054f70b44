"""One rank of the background-load scenario (`xronos.bench.background_load`): the `xronos run`
rank (static: no control; live: `xronos.cli.liverank`'s policy), plus a marker at the boundary
before `change_at`: rank 0 writes `<signal_dir>/change` and waits (up to a minute) for the bench
to write `<signal_dir>/applied` after changing the box's CPU, so the change falls exactly on that
boundary (the other ranks wait for rank 0 in their next collective)."""

from __future__ import annotations

import time
from pathlib import Path

from xronos.cli.liverank import make_policy
from xronos.node.rank.relayout import LiveRebalance
from xronos.node.runconfig import RunConfig
from xronos.node.rank.lifecycle import LocalFiles, MetricsFile, NoControl, read_settings, run
from xronos.node.rank.spawn import main_process
from xronos.node.rank.tpengine import TPEngine


class BgRankConfig(RunConfig):
    live: bool
    signal_dir: str
    change_at: int


class Marked:
    def __init__(self, inner, cfg: BgRankConfig) -> None:
        self.inner, self.cfg = inner, cfg

    def at_boundary(self, group, step: int):
        if group.rank == 0 and step == self.cfg.change_at:
            d = Path(self.cfg.signal_dir)
            (d / "change").write_text(str(time.time()))
            deadline = time.monotonic() + 60
            while not (d / "applied").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return self.inner.at_boundary(group, step)


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, BgRankConfig, "xronos.bench.bgload_worker")
    engine = TPEngine()
    inner = LiveRebalance(engine, make_policy) if cfg.live else NoControl()
    run(cfg, engine, weights=LocalFiles(cfg.recipe.model_dir), control=Marked(inner, cfg), sink=MetricsFile(progress=False))
    return 0


if __name__ == "__main__":
    main_process(main)
