"""Helpers for the services tests: the engine's test kit (tiny checkpoints, reference loop) and
rank processes of a job started directly, without MQTT."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))

import runkit  # noqa: E402  (tests/node/runkit.py: tiny real checkpoints, reference training)

from xronos.node.rank.messages import RankEvent  # noqa: E402
from xronos.node.rank.process import RankProcess, child_env  # noqa: E402
from xronos.node.rank.local import free_port  # noqa: E402
from xronos.node.runconfig import JobRankConfig, RunConfig  # noqa: E402
from xronos.node.rank.validate import model_sizes  # noqa: E402
from xronos.protocol.layout import Layout  # noqa: E402
from xronos.protocol.messages import JobSpec  # noqa: E402

__all__ = ["runkit", "make_case", "job_spec", "start_ranks", "wait_ranks"]


def make_case(tmp: Path, rows: int = 40, family: str = "gpt2") -> tuple[Path, Path]:
    """A tiny classify checkpoint (H = 12) and a labelled CSV."""
    model = runkit.make_model(tmp / "model", family, "classify", num_labels=2)
    data = runkit.write_rows(tmp / "data.csv", [{"text": t, "label": i % 2}
                                                  for i, t in enumerate(runkit.texts(rows))])
    return model, data


_JOB_KEYS = {"name", "owner", "strategy", "checkpoint_interval", "nodes", "reserve_mb", "rebalance", "overlap", "chunks"}


def job_spec(model: Path, data: Path, export: Path, owner: str = "n0", lora: dict | None = None, **kw) -> dict:
    """A JobSpec's JSON form; `kw` are the job's own keys or its recipe's (sorted here), `lora` the
    recipe's LoRA part."""
    recipe = {"model_dir": str(model), "data_path": str(data), "task": "classify", "text_column": "text",
              "text_pair_column": None, "label_column": "label", "batch_size": 4, "seq_len": runkit.SEQ_LEN,
              "lr": 1e-4, "epochs": None, "max_steps": 6, "eval_fraction": 0.2, "export_dir": str(export), "seed": 3,
              "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": None, "dropout": 0.0, "lora": lora}
    spec = {"name": "t", "owner": owner, "strategy": "segment", "checkpoint_interval": 3, "nodes": None,
            "reserve_mb": 0, "schema_version": 3}
    lora_kw = {k.removeprefix("lora_"): kw.pop(k) for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
               if k in kw}
    if lora_kw:  # as the recipe's LoRA part
        lora = {**(lora or {}), **{("r" if k == "r" else k): v for k, v in lora_kw.items()}}
    recipe["lora"] = lora
    recipe.update({k: v for k, v in kw.items() if k not in _JOB_KEYS})
    return {**spec, **{k: v for k, v in kw.items() if k in _JOB_KEYS}, "recipe": recipe}


def start_ranks(tmp: Path, spec: dict, units, *, resume_step: int = 0,
                version: int = 1, ckpt: Path | None = None) -> list[RankProcess]:
    """`units`: the head-tied units per rank (a list) or a protocol Layout."""
    port = free_port()
    procs = []
    layout = units if isinstance(units, Layout) else Layout.tied(units, model_sizes(spec["recipe"]["model_dir"]))
    for rank in range(layout.world_size):
        # Only the owner has model and data: the other ranks get paths that do not exist.
        elsewhere = {"model_dir": "/nonexistent/model", "data_path": "/nonexistent/d.csv"}
        own = spec if rank == 0 else {**spec, "recipe": {**spec["recipe"], **elsewhere}}
        job = JobSpec.model_validate_json(json.dumps(own))
        run = RunConfig.for_job(job, layout=layout, rank=rank, host="127.0.0.1", port=port, threads=1,
                                gloo_timeout_s=60.0)
        cfg = JobRankConfig(job_id="j", plan_version=version, node_id=f"n{rank}", run=run,
                            checkpoint_interval=job.checkpoint_interval, resume_step=resume_step,
                            checkpoint_dir=str(ckpt or tmp / "ckpt") if rank == 0 else None)
        procs.append(RankProcess(tmp / f"v{version}-rank{rank}", cfg, child_env(1, "lo")))
    return procs


def wait_ranks(procs: list[RankProcess], timeout: float = 240.0) -> list[list[RankEvent]]:
    events: list[list[RankEvent]] = [[] for _ in procs]
    deadline = time.monotonic() + timeout
    while not all(p.finished() for p in procs):
        for i, p in enumerate(procs):
            events[i] += p.drain()
        if time.monotonic() > deadline:
            for p in procs:
                p.kill(0)
            raise TimeoutError("ranks did not finish: " + " | ".join(p.tail(600) for p in procs))
        time.sleep(0.1)
    for i, p in enumerate(procs):
        events[i] += p.drain()
    return events
