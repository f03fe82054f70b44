"""One rank of `xronos run`: `python -m xronos.node.rank.localrank CONFIG.json` (a RunConfig as JSON).

A thin caller of the rank runtime (`xronos.node.rank.lifecycle`): our TP engine (or with shares the
data-parallel one, `xronos.node.rank.dpengine`), every rank reading its
own slices of the local checkpoint, no control source (or, with `--reshard-at`, the forced
re-shards or re-splits: `relayout.ScheduledReshards`), and a metrics file — rank 0 prints the per-rank summary
and writes the metrics JSON (`--metrics`) and the export. (`--rebalance` runs the same from
`xronos.cli.liverank`, which adds the live policy of the gateway plane.)
"""

from __future__ import annotations

from xronos.node.rank.relayout import ScheduledReshards
from xronos.node.runconfig import RunConfig
from xronos.node.rank.lifecycle import LocalFiles, MetricsFile, read_settings, run
from xronos.node.rank.spawn import main_process
from xronos.node.rank.tpengine import TPEngine
from xronos.node.rank.dpengine import DPEngine


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, RunConfig, "xronos.node.rank.localrank")
    if cfg.rebalance:
        raise ValueError("rebalance: the live policy is composed by `python -m xronos.cli.liverank`, not this entry")
    control = ScheduledReshards(cfg.reshard_at, cfg.layout) if cfg.reshard_at else None
    engine = DPEngine() if cfg.shares else TPEngine()  # shares: a data-parallel mesh (node/rank/dpengine.py)
    run(cfg, engine, weights=LocalFiles(cfg.recipe.model_dir), control=control, sink=MetricsFile(progress=cfg.progress))
    return 0


if __name__ == "__main__":
    main_process(main)
