"""`xronos broker`: run the embedded amqtt MQTT broker until Ctrl-C or SIGTERM.

For demos and trying Xronos on one machine; a real deployment runs Mosquitto.
"""

from __future__ import annotations

import argparse
import signal
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "broker", help="run the embedded MQTT broker (amqtt, anonymous) until Ctrl-C",
        description="Run the embedded amqtt MQTT broker (anonymous access, no persistence) until "
                    "Ctrl-C or SIGTERM. Use Mosquitto for a real deployment.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=1883, help="TCP port; 0 picks a free one (default: 1883)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xronos.common.broker import EmbeddedBroker

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: must be 0..65535")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    broker = EmbeddedBroker(args.host, args.port or None).start()
    print(f"xronos broker: listening on {broker.host}:{broker.port} (amqtt, anonymous); Ctrl-C to stop",
          flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
    return 0
