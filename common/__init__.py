"""Plumbing both planes use that is not the wire: logging, config files, error text, the systemd notify
protocol, caches, confinement of network paths, the log throttle, the embedded broker. Imports nothing
of ours, so protocol, gateway, node and cli may all import it."""
