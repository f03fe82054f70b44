"""`xronos job submit|status|pause|resume|cancel`: jobs through the gateway, over the broker."""

from __future__ import annotations

import argparse
import sys

from xronos.cli.mqttclient import (GatewayClient, add_broker_options, broker_from_args, dump, format_candidates,
                                   format_plan, format_state, load_spec, progress_bar)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("job", help="submit and control fine-tuning jobs",
                              description="Submit and control jobs through the gateway.")
    sub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    s = sub.add_parser("submit", help="submit a job spec (TOML or YAML)")
    s.add_argument("file", help="job spec file (.toml, .yaml or .yml); see examples/job.toml")
    s.add_argument("--follow", action="store_true", help="show a progress bar until the job ends")
    st = sub.add_parser("status", help="all jobs, or one job in detail")
    st.add_argument("job_id", nargs="?")
    st.add_argument("--follow", action="store_true", help="keep a progress bar until the job ends")
    st.add_argument("--json", action="store_true", help="print the raw answer")
    for action in ("pause", "resume", "cancel"):
        a = sub.add_parser(action, help=f"{action} a job")
        a.add_argument("job_id")
    for parser in (s, st, *(sub.choices[x] for x in ("pause", "resume", "cancel"))):
        add_broker_options(parser)
    s.set_defaults(timeout=900.0)  # the answer comes after inspection, profiling and planning
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except TimeoutError as exc:  # no broker or no gateway: one clean error line
        raise ValueError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    if args.job_command == "submit":
        spec = load_spec(args.file)  # refused locally, before anything is sent
    settings, base = broker_from_args(args)
    with GatewayClient(settings, base) as client:
        if args.job_command == "submit":
            print(f"submitting {spec.name!r}: the owner inspects the model and data, each node profiles it, then the "
                  f"gateway plans (minutes on slow boxes; waiting up to {args.timeout:g} s) ...", flush=True)
            try:
                data = client.request("job/submit", args.timeout, spec=spec)
            except KeyboardInterrupt:  # the job may exist already: Ctrl-C stops the waiting, not the gateway
                print(f"stopped waiting: the gateway may still plan and start {spec.name!r}; `xronos job status` "
                      "lists it, `xronos job cancel JOB` stops it", file=sys.stderr)
                raise
            print(f"job {data['job_id']} accepted: {data['total_steps']} steps")
            print(format_plan(data["plan"]))
            if data.get("candidates"):
                print(format_candidates(data["candidates"], data.get("chosen", "")))
            return _follow(client, data["job_id"], spec, data.get("total_steps")) if args.follow else 0
        if args.job_command == "status":
            return _status(client, args)
        data = client.request(f"job/{args.job_command}", args.timeout, job_id=args.job_id)
        print(f"job {data['job_id']}: {data['phase']}")
        return 0


def _status(client: GatewayClient, args: argparse.Namespace) -> int:
    if args.job_id is None:
        jobs = client.request("job/status", args.timeout)["jobs"]
        if args.json:
            print(dump(jobs))
            return 0
        print(f"{'job':<28} {'phase':<10} {'step':>11} {'loss':>8}  error")
        for j in jobs:
            loss = "-" if j["loss"] is None else f"{j['loss']:.4f}"
            print(f"{j['job_id']:<28} {j['phase']:<10} {j['step']:>5}/{j['total_steps']:<5} {loss:>8}  "
                  f"{j['error'] or ''}")
        return 0
    state = client.request("job/status", args.timeout, job_id=args.job_id)["job"]
    if args.json:
        print(dump(state))
        return 0
    print(format_state(state))
    if state["phase"] in ("running", "paused", "recovering", "assigning"):
        if args.follow:
            return _follow(client, args.job_id)
        on_state, bar = progress_bar()
        from xronos.protocol.messages import JobState

        on_state(JobState.model_validate(state))
        bar.close()
    return 0


def _follow(client: GatewayClient, job_id: str, spec=None, total: int | None = None) -> int:
    on_state, bar = progress_bar(total=total)
    try:
        final = client.follow(job_id, on_state)
    except KeyboardInterrupt:  # only the following stops: the job runs on the nodes
        bar.close()
        print(f"job {job_id} goes on: `xronos job status {job_id} --follow` follows it again, "
              f"`xronos job cancel {job_id}` stops it", file=sys.stderr)
        raise
    bar.close()
    print(format_state(final.model_dump(mode="json")))
    if spec is not None and final.phase == "completed":  # what to do with it, on the owner's disk
        from xronos.cli.usemodel import using_lines

        print(f"on the owner {spec.owner}:")
        r = spec.recipe
        for line in using_lines(r.export_dir, r.task, lora=r.lora is not None, gguf=r.export_gguf, merged=r.export_merged):
            print(f"  {line}")
    return 0 if final.phase == "completed" else 1
