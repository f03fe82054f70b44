"""`xronos node --config node.toml`: run the node agent until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("node", help="run the node agent (announce, profile, train on assignment)",
                              description="Run the node agent: connects to the broker with a last-will, "
                                          "announces this device, answers profile and inspection requests "
                                          "and trains its rank of assigned jobs in a child process.")
    p.add_argument("--config", required=True, metavar="TOML", help="node config (see systemd/node.toml.example)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xronos.cli.service import config_or_exit
    from xronos.common import cachedirs
    from xronos.common.logsetup import configure_logging
    from xronos.node.agent.config import load_config

    cfg = config_or_exit("node", load_config, args.config)  # a bad file: one line, exit 78
    configure_logging(cfg.log_level)
    cachedirs.apply(cfg.state_dir)  # before datasets/transformers are imported
    from xronos.node.agent.service import NodeService

    service = NodeService(cfg)
    signal.signal(signal.SIGTERM, lambda *_: service.stopping.set())
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    # An inspection still reading on the worker thread (a large dataset's scan) must not hold the
    # stop, as the interpreter would at exit: it only reads, so it is left unfinished.
    for t in threading.enumerate():
        if t.name.startswith("node-work"):
            t.join(timeout=0.5)
            if t.is_alive():
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
    return 0
