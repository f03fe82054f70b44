"""The embedded default broker: amqtt on loopback, in a background thread with its own event loop.

For `make demo`, `xronos broker` and test machines without Mosquitto. A real deployment runs
Mosquitto (see systemd/). amqtt is the optional `broker` extra, imported only when started.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import structlog

from xronos.common.ports import free_port

log = structlog.get_logger(__name__)


def _check_bindable(host: str, port: int) -> None:
    """Fail with a clear message before amqtt logs a traceback for a taken port or a bad address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"embedded broker cannot listen on {host}:{port}: {exc.strerror}") from None


class EmbeddedBroker:
    """`with EmbeddedBroker() as b: ...` or start()/stop(); anonymous access, no persistence."""

    kind = "amqtt"

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        try:
            from amqtt.broker import Broker
        except ImportError:
            raise ValueError("the embedded broker needs amqtt: pip install 'xronos[broker]'") from None
        _check_bindable(self.host, self.port)
        for name in ("amqtt", "transitions"):  # both log every packet/state at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}", "max_connections": 256}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop

            async def boot() -> None:
                self._broker = Broker(config)
                await self._broker.start()

            try:
                loop.run_until_complete(boot())
            except BaseException as exc:  # reported to the caller of start()
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"amqtt-{self.port}", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise RuntimeError(f"embedded amqtt broker on {self.host}:{self.port} did not start in {timeout}s")
        if failure:
            raise ValueError(f"embedded amqtt broker on {self.host}:{self.port} failed to start: {failure[0]}")
        log.info("broker.started", kind="amqtt", host=self.host, port=self.port)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._broker.shutdown(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            self._thread = None
        log.info("broker.stopped", kind="amqtt", host=self.host, port=self.port)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
