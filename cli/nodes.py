"""`xronos nodes`: the gateway's node registry."""

from __future__ import annotations

import argparse

from xronos.cli.mqttclient import GatewayClient, add_broker_options, broker_from_args, dump


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("nodes", help="list the nodes the gateway knows",
                              description="List the nodes the gateway knows (through the broker).")
    add_broker_options(p)
    p.add_argument("--json", action="store_true", help="print the raw answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings, base = broker_from_args(args)
    with GatewayClient(settings, base) as client:
        try:
            nodes = client.request("nodes/list", args.timeout)["nodes"]
        except TimeoutError as exc:  # no broker or no gateway: one clean error line
            raise ValueError(str(exc)) from None
    if args.json:
        print(dump(nodes))
        return 0
    print(f"{'node':<16} {'online':<6} {'plan':<4} {'cores':>5} {'mem avail':>10} {'data host':<16} cpu")
    for n in nodes:
        mem = "-" if n["memory_available"] is None else f"{n['memory_available'] / 2**30:.1f} GiB"
        print(f"{n['node_id']:<16} {'yes' if n['online'] else 'no':<6} {'yes' if n['participate'] else 'no':<4} "
              f"{n['cores'] or '-':>5} {mem:>10} {n['data_host'] or '-':<16} {n['cpu_model'] or '-'}")
    return 0
