"""A training rank: the one lifecycle every rank lives (`lifecycle`), our TP engine (`tpengine`) and
what it uses (checkpoints, streaming, re-layout, metrics, the optimizer); the one way the node starts a
child process (`spawn`), the node service's handle on a job's rank (`process`) and the typed messages
between them (`messages`); the rank entries — a job's (`jobrank`) and `xronos run`'s (`localrank`) —
and the launcher of local ranks (`local`)."""
