"""Spawn the baselines' rank processes (one JSON config each), confined by a wrap hook.

The same contract as `xronos.node.launch.launch_local`: any rank that dies takes the others down
and `RankFailed` names it with the tail of its stderr; an optional `Placement` (e.g. the network
emulator's `Network`) says where each rank runs and where the rendezvous is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from xronos.node.launch import Placement, RankFailed, free_port, rank_env

Wrap = Callable[[int, subprocess.Popen], None]


def spawn_ranks(module: str, configs: list[BaseModel], wrap: Wrap | None = None, *,
                threads: int = 1, timeout_s: float = 3600.0, extra_env: dict[str, str] | None = None,
                placement: Placement | None = None) -> None:
    """Run `python -m module rankN.json` for every config (rank = list index); wait for all.
    Each config needs `rank` and `rendezvous_port` fields (and `rendezvous_host` with a placement)."""
    update: dict[str, object] = {}
    if placement is None:
        port = free_port()
    else:
        # A fresh namespace has every port free: the configs' own port is as good as any.
        port = configs[0].rendezvous_port  # type: ignore[attr-defined]
        update["rendezvous_host"] = placement.rendezvous_host
    env = {**rank_env(threads), **(extra_env or {})}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="xronos-bench-") as tmp:
        errs = []
        try:
            for rank, cfg in enumerate(configs):
                path = Path(tmp) / f"rank{rank}.json"
                path.write_text(cfg.model_copy(update={**update, "rank": rank, "rendezvous_port": port})
                                .model_dump_json())
                err = open(Path(tmp) / f"rank{rank}.err", "w+b")
                errs.append(err)
                prefix = placement.argv_prefix(rank) if placement else []
                proc = subprocess.Popen([*prefix, sys.executable, "-m", module, str(path)],
                                        env={**env, **placement.env(rank)} if placement else env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
                procs.append(proc)
                if wrap is not None:
                    wrap(rank, proc)
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank = min(failed, key=lambda r: (codes[r] >= 0, r))  # signals first: the cause
                    raise RankFailed(rank, codes[rank], _tail(errs[rank]))
                if all(c == 0 for c in codes):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{module}: ranks still running after {timeout_s:.0f} s")
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            for e in errs:
                e.close()


def _tail(f, lines: int = 20) -> str:
    f.flush()
    f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
    text = f.read().decode(errors="replace").replace("\r", "\n")
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])
