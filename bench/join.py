"""A node that joins a running job: does it pay? (issue 14)

    python -m xronos.bench.join [--quick] [--blocks 4] [--steps 200] [--switch-at 6]
        [--checkpoint-interval 10] [--shares 0.5,0.5,0.5] [--out bench/results/join]

The whole product on this machine, as `xronos demo` runs it: an embedded MQTT broker, a gateway
and three node services, each node in a cgroup of `--shares` cores at the top CFS weight (the
emulated boxes; a bench refuses to run without them). Node n2 starts with its Participate switch
off (`participate.json` in its state directory, as Home Assistant leaves it). One job: a
GPT-2-Medium-shaped classifier (hidden 1024, 16 heads, 4096 MLP columns, 50257 vocabulary rows;
`--blocks` of its 24 blocks), owner n0, live re-balancing on, a checkpoint every
`--checkpoint-interval` steps, the gateway's `join_restart_s` unset (the job's measured restart).

Two runs, side by side, each on a fresh deployment:
  join    n2 is switched on (the switch's own `NodeCommand`) once rank 0 reports step `--switch-at`;
          the gateway profiles it, plans with it, and if that pays moves the job to three ranks at
          the owner's next checkpoint;
  static  n2 is never switched on: the job runs on n0 and n1 to the end.

Reported from the ranks' `IterationMetrics` (over MQTT, stamped on arrival here) and the job's
`JobState` events: the iteration time (the slowest rank's per step) before the join (median of the
first plan's steps from the third) and after it (median of the new plan's steps from the third
after the restart); the gateway's predictions (the join event's "predicted a -> b"); the restart's
wall time from the cancel (the first job state naming the new plan) to the new plan's first step,
and the steps redone (the old plan's steps past the checkpoint it resumed from); the break-even
(the restart's cost over the seconds saved per iteration); the static run's median over the same
steps, and each run's wall time from its first step to its last.
Why so many steps: the job trains on while the newcomer profiles (about a minute at half a core
for 2 blocks), the join waits for the next checkpoint after the decision, and the gateway takes it
only if the time saved over the steps left repays its measured restart (~18 s here: processes
importing torch, loading, the first step) — ~75 steps after the checkpoint at a 23 % gain. At
130 steps (`--quick` first had that) one run was refused by 1 s (17.7 s saved < 18.9 s restart).
Timings on a shared machine are provisional: the load (`os.getloadavg`) is recorded. The figures
and the report are `joinsummary.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from xronos.bench.joinsummary import NEWCOMER, OWNER, PEER, SKIP, report, results

SUBMIT_TIMEOUT_S = 600.0  # inspection and two profiles at half a core: ~80 s on a quiet 2-core machine



class Collector:
    """Every rank's IterationMetrics and every JobState, stamped on arrival (its own MQTT client:
    the gateway client's queue is for request answers)."""

    def __init__(self, host: str, port: int, base: str) -> None:
        from xronos.protocol.topics import TopicTable
        from xronos.protocol.transport import BrokerSettings, MqttBus

        self.table = TopicTable(base)
        self.bus = MqttBus(BrokerSettings(host=host, port=port), f"joinbench-{os.getpid()}", table=self.table)
        self.bus.subscribe(self.table.filter("node.metrics"))
        self.bus.subscribe(self.table.filter("job.state"))
        self.metrics: list[dict] = []
        self.states: list[dict] = []
        self.events: list[str] = []
        self.event_t: dict[str, float] = {}  # each event's first arrival here
        self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.bus.start()
        self._thread.start()

    def _run(self) -> None:
        from xronos.protocol import messages as m
        from xronos.protocol.codec import decode

        while not self._stop.is_set():
            item = self.bus.get(0.2)
            if item is None or not item[1]:
                continue
            t = time.time()
            msg = decode(*item, table=self.table)
            if isinstance(msg, m.IterationMetrics):
                self.metrics.append({"t": t, "plan_version": msg.plan_version, "rank": msg.rank,
                                     "node_id": msg.node_id, "step": msg.step, "iteration_s": msg.iteration_s})
            elif isinstance(msg, m.JobState):
                self.last = msg
                self.states.append({"t": t, "plan_version": msg.plan.version if msg.plan else None,
                                    "phase": msg.phase, "step": msg.step})
                for e in msg.events:
                    if e not in self.event_t:
                        self.event_t[e] = t
                        self.events.append(e)

    def step(self) -> int:
        return max((x["step"] for x in self.metrics if x["rank"] == 0), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.bus.stop()


def _progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_one(args, model: Path, data: Path, root: Path, *, join: bool) -> dict:
    """One deployment, one job; returns the collector's records and the job's final state."""
    from xronos.cli.localstack import LocalStack
    from xronos.common.broker import EmbeddedBroker
    from xronos.node.emulate.confinement import Confinement, RankLimits
    from xronos.protocol import hastate
    from xronos.protocol.messages import JobSpec

    name = "join" if join else "static"
    run_dir = root / name
    with ExitStack() as guard:
        conf = guard.enter_context(Confinement([RankLimits(s) for s in args.shares], top_weight=True))
        broker = EmbeddedBroker().start()
        guard.callback(broker.stop)
        stack = LocalStack(run_dir, broker.host, broker.port, allowed=root, base=f"xrjoin{name}")
        guard.callback(stack.close)
        col = Collector(broker.host, broker.port, stack.base)
        guard.callback(col.close)
        stack.gateway()
        (run_dir / NEWCOMER).mkdir(parents=True)
        (run_dir / NEWCOMER / "participate.json").write_text(json.dumps({"participate": False}))
        for rank, node in enumerate((OWNER, PEER, NEWCOMER)):
            stack.node(node, threads=1, wrap=lambda pid, r=rank: conf.add(r, pid))
        nodes = stack.wait_nodes(3)
        off = [x["node_id"] for x in nodes if not x["participate"]]
        if off != [NEWCOMER]:
            raise RuntimeError(f"{name}: expected only {NEWCOMER} switched off, got {off}")
        _progress(f"{name}: broker, gateway and 3 nodes online ({NEWCOMER} switched off); submitting")
        spec = JobSpec(name=f"join-bench-{name}", owner=OWNER, model_dir=str(model), data_path=str(data),
                       task="classify", batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-4,
                       max_steps=args.steps, eval_fraction=args.eval_fraction, strategy="segment",
                       checkpoint_interval=args.checkpoint_interval, export_dir=str(root / f"export-{name}"),
                       reserve_mb=0, seed=0, dropout=0.0, rebalance=True)
        t_submit = time.time()
        accepted = stack.client.request("job/submit", min(args.timeout, SUBMIT_TIMEOUT_S), spec=spec)
        job_id = accepted["job_id"]
        _progress(f"{name}: job {job_id} planned on {[e['node_id'] for e in accepted['plan']['entries']]}, "
                  f"predicted {accepted['plan']['predicted_iteration_s']:.3f} s/iteration")
        deadline = time.monotonic() + args.timeout
        switched, seen = None, 0
        phase = None
        while time.monotonic() < deadline:
            time.sleep(0.2)
            dead = [n for n, proc in stack.procs.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{name}: {', '.join(dead)} exited during the job\n{stack.logs(1500)}")
            last = col.last
            phase = last.phase if last is not None and last.job_id == job_id else phase
            if phase in ("completed", "failed", "cancelled"):
                break
            if join and switched is None and col.step() >= args.switch_at:
                stack.client.bus.publish_message(hastate.NodeCommand(participate=True), node_id=NEWCOMER)
                switched = {"t": time.time(), "step": col.step()}
                _progress(f"{name}: {NEWCOMER} switched on at step {switched['step']}")
            for e in col.events[seen:]:
                if any(k in e for k in ("profiling it", "taken", "joins", "dropped", "recover", "re-shard")):
                    _progress(f"{name}: {e}")
            seen = len(col.events)
        else:
            raise TimeoutError(f"{name}: the job did not end within {args.timeout:.0f} s\n{stack.logs(1500)}")
        final = col.last
        if phase != "completed":
            raise RuntimeError(f"{name}: job ended {phase}: {final.error if final else '?'}\n{stack.logs(1500)}")
        _progress(f"{name}: completed at step {final.step} ({time.time() - t_submit:.0f} s after submit)")
        decided = next((col.event_t[e] for e in col.events if " taken" in e and NEWCOMER in e), None)
        return {"metrics": list(col.metrics), "states": list(col.states), "events": list(col.events),
                "profiling": [switched["t"], decided] if switched and decided else None,
                "switched": switched, "plan_v1": accepted["plan"],
                "final_plan": final.plan.model_dump(mode="json") if final.plan else None,
                "replans": final.replans, "submit_t": t_submit}


def _shares(text: str) -> list[float]:
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shares: comma-separated core counts, got {text!r}") from None
    if len(shares) != 3 or any(not 0 < s <= 4 for s in shares):
        raise argparse.ArgumentTypeError(f"--shares: three core counts in (0, 4], got {text!r}")
    return shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xronos.bench.join", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 blocks, 160 steps")
    p.add_argument("--blocks", type=int, default=None, help="GPT-2-Medium blocks (default 4; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; --quick 160)")
    p.add_argument("--switch-at", type=int, default=6, help="rank 0's step at which n2 is switched on")
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--shares", type=_shares, default=[0.5, 0.5, 0.5], help="cores of n0,n1,n2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--runs", choices=["both", "join", "static"], default="both")
    p.add_argument("--out", default="bench/results/join")
    p.add_argument("--from-json", metavar="PATH", help="recompute the figures and report of a run's JSON "
                   "(its raw records) into --out; runs nothing")
    args = p.parse_args(argv)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        return _write(Path(args.out), doc["meta"], results(doc["runs"]), doc["runs"])
    args.blocks = args.blocks or (2 if args.quick else 4)
    args.steps = args.steps or (160 if args.quick else 200)
    if not 1 <= args.switch_at < args.steps - args.checkpoint_interval - SKIP - 3:
        raise SystemExit(f"--switch-at {args.switch_at} must be >= 1 and leave a checkpoint and "
                         f"{SKIP + 3} measured steps after it (steps {args.steps}, "
                         f"checkpoint_interval {args.checkpoint_interval})")
    _require_cgroups(args.shares)
    # Every exit path cleans up (processes, cgroups, the poller): SIGTERM, and SIGINT even when a
    # non-interactive shell started this in the background (which ignores SIGINT), unwind the stack.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    from xronos.bench.workloads import shape_config, write_checkpoint, write_dataset

    config = shape_config("gpt2-medium", args.blocks)
    load = {"loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="xronos-joinbench-") as tmp:
        root = Path(tmp)
        model = write_checkpoint(root / "model", config)
        rows = int(args.batch_size * args.steps / (1 - args.eval_fraction)) + 16
        data = write_dataset(root / "data.jsonl", rows, args.seq_len, config["vocab_size"])
        _progress(f"model ({args.blocks} blocks) and {rows} rows written in {root}")
        runs = {"join": True, "static": False} if args.runs == "both" else {args.runs: args.runs == "join"}
        raw = {}
        for name, join in runs.items():
            raw[name] = run_one(args, model, data, root, join=join)
            shutil.rmtree(root / f"export-{name}", ignore_errors=True)
    load["loadavg_after"] = os.getloadavg()
    res = results(raw)
    meta = {"model": "gpt2-medium", "blocks": args.blocks, "shares": args.shares, "steps": args.steps,
            "switch_at": args.switch_at, "checkpoint_interval": args.checkpoint_interval,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "eval_fraction": args.eval_fraction,
            "command": "python -m xronos.bench.join " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or _cpu_model()}",
            "clock": _clock_note(), **load}
    return _write(Path(args.out), meta, res, raw)


def _clock_note() -> str:
    """What the ranks' seconds are on (the emulator's mode, XRONOS_EMULATOR_CPU)."""
    from xronos.node.emulate.cpumode import default_cpu_mode

    mode = default_cpu_mode()
    return ("virtual (iteration times, profiles and the gateway's predictions; the restart and the runs' "
            "durations are wall seconds)" if mode == "virtual" else f"wall ({mode})")


def _write(out: Path, meta: dict, res: dict, raw: dict) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    # The raw records too (metrics stamped on arrival, job states): the summary can be recomputed.
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": res, "runs": raw}, default=sorted))
    if "join" in res and "static" in res:
        text = report(meta, res)
        out.with_suffix(".md").write_text(text)
        print(text)
    return 0


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _require_cgroups(shares: list[float]) -> None:
    """A bench of emulated boxes without the emulation measures nothing: refuse, saying why."""
    from xronos.node.emulate.confinement import Confinement, EmulatorError, RankLimits

    try:
        with Confinement([RankLimits(s) for s in shares], top_weight=True):
            pass
    except (EmulatorError, OSError) as exc:
        raise SystemExit(f"this bench needs cgroup CPU quotas for its emulated boxes and cannot have them: {exc}")


if __name__ == "__main__":
    raise SystemExit(main())
