"""The launcher of local ranks: one process per rank on this machine, joined over Gloo on loopback
(or wherever a `Placement` puts each rank, e.g. the bench's emulated LAN): `spawn_ranks` for any
rank entry module (`xronos run`'s `xronos.node.rank.localrank`, the baselines', the bench's probes),
`launch_local` for `xronos run`. Each rank is a `spawn.ChildProcess`: boxed without limits (a run
the user started, confined by `wrap` if at all), dying with this launcher, even killed.

Any rank that dies takes the run down: the launcher kills the others at once and raises
`RankFailed` naming the rank and the last lines it wrote to stderr. (Without the launcher, the
ranks' own Gloo timeout does the same, only later.) For `xronos run`, rank 0's stderr — the
progress bar — is echoed live and every rank's stdout is inherited.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel

from xronos.common.ports import free_port
from xronos.node.rank.spawn import ChildProcess, rank_env
from xronos.node.runconfig import RunConfig
from xronos.node.tp.groupkey import new_key

Wrap = Callable[[int, subprocess.Popen], None]


class Placement(Protocol):
    """Where each rank process runs, when not plainly on this host's loopback.

    The launcher runs `argv_prefix(rank) + [python, -m, ...]` — the prefix must exec the rest
    (e.g. `ip netns exec NAME`), so the pid is the rank's own and `wrap` confines the rank itself —
    adds `env(rank)` (e.g. `GLOO_SOCKET_IFNAME`) to its environment and points every rank at
    `rendezvous_host` (rank 0's address there). The rendezvous port is the config's own: a port
    probed free here says nothing about another network namespace.
    """

    @property
    def rendezvous_host(self) -> str: ...

    def argv_prefix(self, rank: int) -> list[str]: ...

    def env(self, rank: int) -> dict[str, str]: ...


class RankFailed(RuntimeError):
    def __init__(self, rank: int, returncode: int, tail: str):
        self.rank, self.returncode, self.tail = rank, returncode, tail
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        super().__init__(f"rank {rank} {how}; its last stderr lines:\n{tail}")


def launch_local(config: RunConfig, n: int, wrap: Wrap | None = None, echo_rank0: bool = True,
                 placement: Placement | None = None, module: str = "xronos.node.rank.localrank") -> None:
    """Run `config` on n local ranks (`python -m module`: the rank entry, `xronos.cli.liverank`
    for a live re-balanced run); returns when all exit 0, raises RankFailed otherwise."""
    if n != config.world_size:
        raise ValueError(f"launch of {n} ranks for a layout of {config.world_size} ranks ({config.layout.describe()})")
    spawn_ranks(module, [config] * n, wrap, threads=config.threads, placement=placement,
                echo_rank0=echo_rank0, quiet=False, timeout_s=None)


def spawn_ranks(module: str, configs: Sequence[BaseModel], wrap: Wrap | None = None, *, threads: int = 1,
                placement: Placement | None = None, echo_rank0: bool = False, quiet: bool = True,
                timeout_s: float | None = 3600.0, extra_env: dict[str, str] | None = None) -> None:
    """Run `python -m module rankN.json` for every config (rank = list index; each config has
    `rank`, `rendezvous_host` and `rendezvous_port` fields, set here) and wait for all. `quiet`:
    the ranks' stdout goes nowhere (else it is inherited); `timeout_s` (None: no limit):
    TimeoutError after it."""
    update: dict[str, object] = {}
    if placement is None:
        port = free_port(configs[0].rendezvous_host)  # type: ignore[attr-defined]
    else:
        # A fresh namespace has every port free: the configs' own port is as good as any.
        port = configs[0].rendezvous_port  # type: ignore[attr-defined]
        update["rendezvous_host"] = placement.rendezvous_host
    if "group_key" in type(configs[0]).model_fields:  # a rank of ours proves it (node/tp/groupkey.py)
        update["group_key"] = new_key()
    env = {**rank_env(threads), **(extra_env or {})}
    ranks: list[ChildProcess] = []
    with tempfile.TemporaryDirectory(prefix="xronos-ranks-") as tmp:
        try:
            for rank, cfg in enumerate(configs):
                path = Path(tmp) / f"rank{rank}.json"
                mine = type(cfg).model_validate({**cfg.model_dump(), **update, "rank": rank, "rendezvous_port": port})
                path.write_text(mine.model_dump_json(indent=1))
                child = ChildProcess(module, str(path), env={**env, **placement.env(rank)} if placement else env,
                                     name=f"rank{rank}", quiet=quiet, echo=echo_rank0 and rank == 0,
                                     prefix=placement.argv_prefix(rank) if placement else ())
                ranks.append(child)
                if wrap is not None:
                    wrap(rank, child.proc)
            _supervise(ranks, None if timeout_s is None else time.monotonic() + timeout_s,
                       f"{module}: ranks still running after {timeout_s} s")
        finally:
            for child in ranks:
                child.close()


def _supervise(ranks: list[ChildProcess], deadline: float | None, late: str) -> None:
    while True:
        codes = [r.poll() for r in ranks]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank killed by a signal is the cause; the others merely noticed it.
            rank = min(failed, key=lambda r: (codes[r] >= 0, r))
            for r in ranks:
                r.kill()
            ranks[rank].wait(5.0)
            raise RankFailed(rank, codes[rank], ranks[rank].tail())
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.1)
