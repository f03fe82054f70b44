"""Device agent. Rooms: `agent/` (the service), `box/` (this box and the bounds of what the node starts),
`measure/` (the profiler and its probes), `data/`, `models/`, `tp/` (the TP engine), `emulate/`, `rank/`
(a training rank: its processes, its messages, its lifecycle and our engine); at the top, `runconfig`
(a rank's settings)."""
