"""One rank of a job as `jobrank` runs it, without the node service: its `JobRankConfig` (the job's
RunConfig, shares or not), the engine `jobrank` picks, the owner streaming weights (`jobrank.weights`:
the base checkpoint, or on resume the consolidated checkpoint of `resume_step`), consolidated
checkpoints every `checkpoint_interval` steps. Writes what the tests read: per step, the rows this
rank received (their token ids) and the bytes of training data that reached it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from xronos.node.rank.dpengine import DPEngine
from xronos.node.rank.jobrank import weights
from xronos.node.rank.lifecycle import Checkpoints, run
from xronos.node.rank.tpengine import TPEngine
from xronos.node.runconfig import JobRankConfig


class Seen(DPEngine):
    """The data-parallel engine, noting what the rows channel gave it each step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def step(self, rank, batches, step):
        def spy():
            epoch, got = next(batches)
            ids = None if got.rows is None else got.rows.input_ids.tolist()
            self.seen.append({"step": step, "ids": ids, "total": got.total})
            yield epoch, got

        rec = super().step(rank, spy(), step)
        self.seen[-1]["received"] = rank.data.received
        return rec


def main() -> None:
    job_file, rank = Path(sys.argv[1]), int(sys.argv[2])
    job = json.loads(job_file.read_text())
    cfg = JobRankConfig.model_validate(job["configs"][rank])
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"rendezvous_port": job["port"]})})
    engine = Seen() if cfg.run.shares else TPEngine()
    checkpoints = Checkpoints(cfg.checkpoint_dir, cfg.checkpoint_interval, {"job_id": cfg.job_id, "plan_version": 0})
    run(cfg.run, engine, weights=weights(cfg), checkpoints=checkpoints, start=cfg.resume_step)
    seen = engine.seen if isinstance(engine, Seen) else []
    (Path(job["out"]) / f"seen{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
