"""What a component of the gateway service is, and what it may ask of the service's core.

A component (zigbee2mqtt's "extension") owns one concern of the service: it registers the
handlers of its topics, entries of the protocol's one topic table, with the dispatcher, and acts
on the moments of the service named by the hooks of `Component` (each a no-op unless it
overrides it). It reaches the job table, the node registry and the bus only through `Core`,
never through another component.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from xronos.gateway import registry as R
from xronos.gateway.config import GatewayConfig
from xronos.gateway.job import machine as J
from xronos.gateway.job.types import RespondTo
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.transport import BusBase


class Core(Protocol):
    """The service's core (gateway/service/core.py) as its components see it."""

    @property
    def cfg(self) -> GatewayConfig: ...

    @property
    def bus(self) -> BusBase: ...

    @property
    def dispatcher(self) -> Dispatcher: ...

    @property
    def jobs(self) -> Mapping[str, J.Job]:
        """The job table: accepted jobs, unfinished and the history (read only: events change it)."""

    @property
    def previews(self) -> Mapping[str, J.Job]:
        """Plan previews being worked out (answered and dropped when done)."""

    @property
    def reg(self) -> R.Registry:
        """The node registry (read only: `set_registry` replaces it)."""

    def set_registry(self, reg: R.Registry) -> None:
        """Replace the node registry; every component hears of it (`Component.nodes_changed`)."""

    def event(self, job_id: str, event: J.Event) -> None:
        """Hand an event to one job's state machine and carry out what it returns."""

    def to_jobs(self, event: J.Event) -> None:
        """Hand an event to every unfinished job and preview."""

    def submit(self, spec: m.JobSpec, transaction: str | None, respond_to: RespondTo = "job/submit") -> J.Job:
        """A new job (or a plan preview) from a spec, after its first transition (`J.refused` tells
        whether it was refused at once: then it is not kept). RequestError when too many are unfinished."""

    def internal(self, where: str, job_id: str | None, exc: BaseException) -> None:
        """Count and log an unexpected exception a guard caught (with its traceback)."""


class Component:
    """One concern of the gateway service. The core calls each hook of each component in the order
    they were composed. `tick`, `reconnected`, `published` and `stop` are guarded one component at
    a time (a failing one is logged and counted; the others and the loop go on); the others run
    inside the guard of what calls them (a topic's handler, an effect, the bus's connect hook),
    but `register`, which is wiring: a failing one stops the start."""

    name = "component"  # for the log lines of the guards

    def register(self, dispatcher: Dispatcher) -> None:
        """Register the handlers of this component's topics (at start, before connecting)."""

    def connected(self) -> None:
        """On every (re)connect, in the bus's network thread: retained state published again."""

    def reconnected(self, now: float) -> None:
        """In the control loop after a (re)connect (`now`: time.monotonic())."""

    def tick(self, now: float) -> None:
        """Periodic work, every turn of the control loop (`now`: time.monotonic())."""

    def published(self) -> None:
        """The jobs' retained states went out (at most every STATE_EVERY_S, or forced)."""

    def responding(self, answer: J.Respond) -> None:
        """A request's answer, just before it is published."""

    def nodes_changed(self, before: R.Registry, after: R.Registry) -> None:
        """The node registry was replaced (called before whoever replaced it goes on)."""

    def stop(self) -> None:
        """A clean stop, before the bus is stopped."""
