"""One rank of a run: `python -m xronos.node.worker CONFIG.json` (a RunConfig as JSON).

Joins the Gloo group, trains, then rank 0 collects every rank's per-iteration numbers (as one
float tensor per rank — no pickle), prints the per-rank summary and writes the metrics JSON.
A failure anywhere raises: this process exits non-zero, and its peers' next collective fails or
times out after `gloo_timeout_s`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from xronos.node.metrics import IterationRecord, format_table, summarize
from xronos.node.runconfig import RunConfig
from xronos.node.tp.group import TPGroup
from xronos.node.trainer import RankResult, run_rank


def join(cfg: RunConfig) -> TPGroup:
    if cfg.world_size == 1:
        return TPGroup.single(trace=True)  # traced: a lone rank still splits its compute by kind
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{cfg.rendezvous_host}:{cfg.rendezvous_port}",
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.gloo_timeout_s),
    )
    return TPGroup(dist.group.WORLD, cfg.rank, cfg.world_size)


def leave() -> None:
    """Tear the Gloo group down together. A rank that destroys its group while a peer's pair still
    has traffic in flight can abort that peer (SIGABRT, "terminate called without an active
    exception"), which the launcher then reports as a failed run."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def gather_records(records: list[IterationRecord], group: TPGroup) -> list[list[IterationRecord]]:
    """Every rank's records, on every rank (same number of iterations everywhere)."""
    mine = torch.tensor([r.as_row() for r in records], dtype=torch.float64)
    if group.world_size == 1:
        return [records]
    parts = group.all_gather(mine, timed=False)  # reporting, not training
    return [[IterationRecord.from_row(row) for row in p.tolist()] for p in parts]


def report(cfg: RunConfig, result: RankResult, group: TPGroup) -> None:
    per_rank = gather_records(result.records, group)
    if cfg.rank != 0:
        return
    summaries = [summarize(r, cfg.layout, recs) for r, recs in enumerate(per_rank)]
    print(format_table(summaries), flush=True)
    for name, ev in (("before", result.eval_before), ("after", result.eval_after)):
        if ev is not None:
            metric = f"accuracy {ev.accuracy:.4f}" if ev.accuracy is not None else f"perplexity {ev.perplexity:.3f}"
            print(f"eval {name} training: loss {ev.loss:.4f}, {metric} ({ev.rows} rows)", flush=True)
    if cfg.metrics_path is not None:
        doc = {
            "config": cfg.model_dump(exclude={"rank", "rendezvous_host", "rendezvous_port"}),
            "eval_before": asdict(result.eval_before) if result.eval_before else None,
            "eval_after": asdict(result.eval_after) if result.eval_after else None,
            "ranks": [
                {"summary": asdict(s), "iterations": [asdict(r) for r in recs]}
                for s, recs in zip(summaries, per_rank)
            ],
        }
        Path(cfg.metrics_path).write_text(json.dumps(doc, indent=1))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.node.worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = RunConfig.read(Path(argv[1]))
    torch.set_num_threads(cfg.threads)
    group = join(cfg)
    # On an exception we exit at once: peers find out from their next collective.
    result = run_rank(cfg, group)
    report(cfg, result, group)
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
