"""The gateway service: a small core (core.py: the bus, the control loop, the job state machine's
driver, the job table on disk) composed of components that each handle their own topics and tick
(component.py says what a component is): the nodes, the requests, Home Assistant and the gateway's
own availability."""

from .core import STATE_EVERY_S, GatewayService

__all__ = ["STATE_EVERY_S", "GatewayService"]
