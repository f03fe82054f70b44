"""One rank of an MQTT-driven job: `python -m xronos.node.jobproc CONFIG.json`, spawned by the node
service (so its control loop stays responsive and a cancel can free all the memory by killing it).

The training step is the local trainer's (`xronos run`): same batches, seeds, optimizer and
schedule, so a job and a local run of the same spec and plan export the same model. What a job
adds: the owner (rank 0) shares config.json and streams every rank its weight slices (other nodes
need no model files); a control flag broadcast by the owner before every iteration, so all ranks
pause, resume or stop at the same iteration boundary; consolidated checkpoints and resume from one
(under a possibly different plan); and events to the parent as JSON lines on an inherited pipe.
Parent → child: JSON lines on stdin ({"action": "pause"|"resume"|"cancel"}); EOF means the parent
died, and so does this process (as it does through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from xronos.node.checkpoint import CheckpointSource, check_saved_layout, load_moments, read_meta, save_checkpoint
from xronos.node.data import BatchSource, batch_order, owner_source, share_facts
from xronos.node.jobcheck import total_steps
from xronos.node.metrics import Rusage
from xronos.node.models.export import gather_full, save_hf_dir
from xronos.node.models.loading import SafetensorsSource
from xronos.node.models.registry import family_for
from xronos.node.runconfig import RunConfig
from xronos.node.streaming import load_shard, share_json
from xronos.node.tp.group import TPGroup
from xronos.node.optim import adamw
from xronos.node.tp.layout import ShardLayout
from xronos.protocol.layout import Layout
from xronos.node.trainer import BatchChannel, evaluate, lr_factor, train_step
from xronos.node.validate import read_config
from xronos.node.worker import join, leave

GO, PAUSE, STOP = 0, 1, 2


class JobProcConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    job_id: str
    plan_version: int
    node_id: str
    spec: dict[str, Any]  # the JobSpec (JSON form); the owner's paths already confined
    run: RunConfig  # rank, layout, rendezvous, and the training settings from the JobSpec
    resume_step: int = 0
    checkpoint_dir: str | None = None  # owner only
    allowed_dirs: list[str] | None = None  # the node's; the base checkpoint's files must lie inside them
    events_fd: int


def spec_run_config(spec: dict[str, Any], *, layout: Layout, rank: int, host: str, port: int,
                    threads: int, gloo_timeout_s: float) -> RunConfig:
    """The RunConfig a JobSpec means (a job always shuffles with its seed, like `xronos run`).
    max_steps is a placeholder: the job's length depends on the data, which only the owner has."""
    return RunConfig(
        model_dir=spec["model_dir"], data_path=spec["data_path"], task=spec["task"], layout=layout,
        batch_size=spec["batch_size"], seq_len=spec["seq_len"], lr=spec["lr"], max_steps=1,
        seed=spec["seed"], shuffle=True, dropout=spec["dropout"], weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_grad_norm"], warmup_steps=spec["warmup_steps"],
        text_column=spec["text_column"], text_pair_column=spec["text_pair_column"],
        label_column=spec["label_column"], **_data_fields(spec), threads=threads,
        eval_fraction=spec["eval_fraction"],
        export_dir=spec["export_dir"], gloo_timeout_s=gloo_timeout_s, progress=False, rank=rank,
        rendezvous_host=host, rendezvous_port=port)


def _data_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """The JobSpec's data format and its columns (defaults where a spec predates them)."""
    defaults = {"data_format": "text", "messages_column": "messages", "prompt_column": "prompt",
                "completion_column": "completion"}
    return {k: spec.get(k, v) for k, v in defaults.items()}


class Events:
    """JSON lines to the parent."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self._out.write(json.dumps({"type": kind, **fields}) + "\n")


class Control:
    """The parent's latest wish, read from stdin on a thread; the owner broadcasts it each step."""

    def __init__(self, events: Events) -> None:
        self.code, self.paused, self.events = GO, False, events
        self.changed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            action = json.loads(line).get("action")
            self.code = {"pause": PAUSE, "resume": GO, "cancel": STOP}.get(action, self.code)
            self.changed.set()
        os._exit(137)  # stdin closed: the node service is gone, and this rank with it

    def sync(self, group: TPGroup) -> int:
        """Agree on GO or STOP for the next iteration, holding every rank here while paused. The
        broadcast is untimed: it is not part of the training step."""
        while True:
            flag = torch.tensor([self.code if group.rank == 0 else GO], dtype=torch.int64)
            group.broadcast(flag, src=0, timed=False)
            code = int(flag)
            if code == PAUSE:
                if not self.paused:
                    self.paused = True
                    self.events.emit("status", status="paused")
                self.changed.wait(0.5)  # heartbeat: keeps peers inside their Gloo timeout
                self.changed.clear()
                continue
            if self.paused:
                self.paused = False
                self.events.emit("status", status="running")
            return code


class _ResumedBatches:
    """The owner's BatchSource, continuing the batch order at `start` without tokenising the rest."""

    def __init__(self, source: BatchSource, start: int) -> None:
        self.source, self.start = source, start

    def train_batches(self):
        cfg = self.source.cfg
        order = batch_order(self.source.n_train, cfg.batch_size, cfg.shuffle, cfg.seed)
        for epoch, rows in itertools.islice(order, self.start, None):
            yield epoch, self.source.encode(rows)

    def eval_batches(self):
        return self.source.eval_batches()


def _eval_fields(ev: Any) -> dict[str, Any]:
    if ev is None:
        return {}
    if ev.accuracy is not None:
        return {"metric": ev.accuracy, "name": "accuracy", "loss": ev.loss}
    return {"metric": ev.perplexity, "name": "perplexity", "loss": ev.loss}


def train(job: JobProcConfig, group: TPGroup, events: Events, control: Control) -> None:
    cfg, owner, k = job.run, job.run.rank == 0, job.resume_step
    resume = read_meta(job.checkpoint_dir) if owner and k > 0 and job.checkpoint_dir else None
    if owner and k > 0 and (resume is None or resume["step"] != k):
        raise ValueError(f"no checkpoint at step {k} in {job.checkpoint_dir} (found {resume and resume['step']})")
    config = share_json(group, read_config(cfg.model_dir) if owner else None)
    family = family_for(config)
    if resume is not None:  # saved under any layout of this model; resumed under cfg.layout
        check_saved_layout(resume, family.sizes(config))
    source = owner_source(cfg, config, job.allowed_dirs) if owner else None
    facts = share_facts(group, source, cfg.task)  # row counts, pad id, segment ids, the classes
    n_train, n_eval, token_types = facts.n_train, facts.n_eval, facts.token_types
    config.update(facts.config_fields())
    steps = total_steps(job.spec, n_train)

    torch.manual_seed(cfg.seed)
    layout = ShardLayout.of(cfg.layout, cfg.rank)
    model = family.build(config, cfg.task, layout, group, dropout=cfg.dropout)
    specs = model.tensor_specs()
    opt_holder: list[torch.optim.AdamW] = []

    def moments(src) -> None:
        opt_holder.append(adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay))
        if k > 0:
            load_moments(opt_holder[0], model, specs, src, k)

    owner_source = (CheckpointSource(resume["dir"]) if resume
                    else SafetensorsSource(cfg.model_dir, job.allowed_dirs)) if owner else None
    load_shard(model, group, owner_source, then=moments)
    opt = opt_holder[0]
    model.train()
    replicated = {name for name, s in specs.items() if s.dim is None}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s + k, cfg.warmup_steps))
    channel = BatchChannel(cfg, group, _ResumedBatches(source, k) if owner else None, bool(token_types))

    if k == 0:
        before = evaluate(model, cfg, channel, n_train, n_eval)
        if owner and before is not None:
            events.emit("eval", when="before", **_eval_fields(before))
    group.drain_timings()
    model.seed(cfg.seed + k)
    events.emit("status", status="running")

    rusage, per_epoch = Rusage(), n_train // cfg.batch_size
    batches = channel.train(n_train)
    for step in range(k, steps):
        if control.sync(group) == STOP:
            events.emit("cancelled", step=step)
            return
        rec = train_step(model, opt, sched, group, cfg, replicated, batches, step, rusage)
        # The epoch from the step, not the batch: after a resume only the owner's order knows it.
        events.emit("metrics", step=step + 1, epoch=step // per_epoch, loss=rec.loss, compute_s=rec.compute_s,
                    compute_attn_s=rec.compute_attn_s, compute_mlp_s=rec.compute_mlp_s,
                    compute_vocab_s=rec.compute_vocab_s, compute_rest_s=rec.compute_rest_s,
                    comm_s=rec.comm_s, idle_s=rec.idle_s, iteration_s=rec.iteration_s,
                    voluntary_ctx_switches=rec.voluntary_ctx_switches,
                    involuntary_ctx_switches=rec.involuntary_ctx_switches, peak_rss=rec.peak_rss)
        done = step + 1
        if done % job.spec["checkpoint_interval"] == 0 and done < steps:
            meta = {"job_id": job.job_id, "step": done, "epoch": done // per_epoch, "seed": cfg.seed,
                    "plan_version": job.plan_version, "layout": cfg.layout.model_dump(mode="json"), "saved_at": time.time()}
            save_checkpoint(job.checkpoint_dir or "", model, specs, layout, group, opt, config, cfg.task, meta)
            group.drain_timings()
            if owner:
                events.emit("checkpoint", step=done)

    after = evaluate(model, cfg, channel, n_train, n_eval)
    state = gather_full(model, specs, layout, group, dst=0)
    if owner:
        if after is not None:
            events.emit("eval", when="after", **_eval_fields(after))
        save_hf_dir(cfg.export_dir, config, cfg.task, state, cfg.model_dir)
    group.barrier()  # nobody reports completion before the export exists
    events.emit("completed", step=steps, epoch=max(steps - 1, 0) // per_epoch,
                export_dir=cfg.export_dir if owner else None)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the stdin EOF watch still ends this process


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.node.jobproc CONFIG.json", file=sys.stderr)
        return 2
    _die_with_parent()
    job = JobProcConfig.model_validate_json(Path(argv[1]).read_text())
    events = Events(job.events_fd)
    control = Control(events)
    torch.set_num_threads(job.run.threads)
    try:
        group = join(job.run)
        train(job, group, events, control)
    except Exception as exc:  # reported to the node service, which tells the gateway
        traceback.print_exc()
        events.emit("failed", detail=f"{type(exc).__name__}: {exc}"[:2000])
        return 1
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
