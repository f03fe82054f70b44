"""`xronos gateway --config gateway.toml`: run the gateway until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys

# sysexits.h EX_DATAERR: the job table on disk does not read back. Like a config error (78) it
# needs a person (`--restore-previous`), so xronos-gateway.service lists it in
# RestartPreventExitStatus= and systemd reports the start as failed once instead of restarting.
EXIT_DATAERR = 65


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="run the gateway (node registry, planner, jobs)",
                              description="Run the gateway: keeps the node registry, plans and drives jobs, "
                                          "answers requests on {base}/gateway/request/<name>, persists its "
                                          "job table under state_dir and publishes Home Assistant discovery.")
    p.add_argument("--config", required=True, metavar="TOML", help="gateway config (see systemd/gateway.toml.example)")
    p.add_argument("--restore-previous", action="store_true",
                   help="do not run: put the previous good job table (state_dir/jobs.json.prev) back in place "
                        "of a damaged jobs.json (kept as jobs.json.damaged-<time>), then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xronos.cli.service import config_or_exit
    from xronos.common import cachedirs
    from xronos.common.logsetup import configure_logging
    from xronos.gateway.config import load_config
    from xronos.gateway.job.store import JobStore
    from xronos.gateway.service import GatewayService

    cfg = config_or_exit("gateway", load_config, args.config)  # a bad file: one line, exit 78
    if args.restore_previous:
        return restore_previous(cfg)
    configure_logging(cfg.log_level)
    cachedirs.apply(cfg.state_dir)
    try:
        JobStore(cfg.state_dir).load()  # the service loads it again; a bad one is refused here, once
    except ValueError as exc:
        print(f"xronos gateway: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_DATAERR
    service = GatewayService(cfg)

    def stop(*_: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    return 0


def restore_previous(cfg) -> int:
    """`--restore-previous`: the one command that recovers from a damaged job table."""
    from xronos.gateway.job.store import JobStore

    store = JobStore(cfg.state_dir)
    n, kept = store.restore_previous()  # ValueError (one line, exit 2) if there is nothing good to restore
    print(f"restored {store.path} from {store.prev} ({n} jobs)"
          + (f"; the damaged table is kept as {kept}" if kept else ""))
    return 0
