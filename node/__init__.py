"""Device agent. Rooms: `agent/` (the service), `box/` (this box and the bounds of what the node starts),
`measure/` (the profiler and its probes), `data/`, `models/`, `tp/` (the TP engine), `emulate/`; at the
top, a training rank's process (runtime, trainer, child, jobproc, worker, launch) and what it uses."""
