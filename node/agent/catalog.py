"""What the node holds in its `allowed_dirs`, for Home Assistant's job form (protocol/msgcatalog.py).

`scan` walks the allowed directories (pure but for reading them): a directory with a config.json
and `*.safetensors` weights is a model directory; one of Hugging Face files without them (a PEFT
adapter, a tokenizer, a download under way) is not listed; neither's files are data, nor are their
subfolders entered. A file the data loader reads (`DATA_SUFFIXES`, as `xronos.node.data.batches`) is a
data file.
It is bounded and confined: hidden entries and the node's own job and profile directories are
skipped, nothing is listed whose real location (links followed) is outside the allowed
directories, no directory is entered twice (a link loop ends), at most `MAX_DEPTH` levels deep
and `MAX_VISITS` entries looked at, at most `MAX_CATALOG_ENTRIES` paths of each kind, each at most
`CATALOG_PATH_MAX` characters; what is found but not listed is counted (`left_out`).

`CatalogPublisher` is the node service's side: the retained `NodeCatalog` at connect, after a
rescan that found a change (every `CATALOG_EVERY_S`) and on a `CatalogRequest`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from xronos.protocol import messages as m

log = structlog.get_logger(__name__)

DATA_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet")  # xronos.node.data.batches's readers (a test keeps them equal)
MAX_DEPTH = 4  # levels below an allowed directory
MAX_VISITS = 20_000  # directory entries looked at per scan: a huge tree cannot stall the node
CATALOG_EVERY_S = 60.0
MIN_RESCAN_S = 2.0  # requests closer together are answered from the last scan


@dataclass(frozen=True)
class Found:
    models: tuple[str, ...]
    data: tuple[str, ...]
    left_out: int = 0


def _inside(real: Path, roots: Iterable[Path]) -> bool:
    return any(real == r or real.is_relative_to(r) for r in roots)


_MODEL_FILES = {"config.json", "adapter_config.json", "tokenizer_config.json"}


def _model_like(names: list[str]) -> bool:
    """A directory of Hugging Face files: its json files are configs and tokenizers, not data."""
    return any(n in _MODEL_FILES or n.endswith(".safetensors") for n in names)


def _weights_inside(d: Path, names: Iterable[str], roots: list[Path]) -> bool:
    for name in names:
        if name.endswith(".safetensors"):
            p = d / name
            if p.is_file() and _inside(p.resolve(), roots):
                return True
    return False


def _bounded(paths: list[str], cap: int) -> tuple[tuple[str, ...], int]:
    fit = sorted(p for p in paths if len(p) <= m.CATALOG_PATH_MAX)
    return tuple(fit[:cap]), len(paths) - min(len(fit), cap)


def scan(allowed_dirs: Iterable[str | os.PathLike[str]], skip: Iterable[str | os.PathLike[str]] = (), *,
         cap: int = m.MAX_CATALOG_ENTRIES, max_depth: int = MAX_DEPTH, max_visits: int = MAX_VISITS) -> Found:
    """Model directories and data files under `allowed_dirs` (absolute paths as reached from the
    configured directories), never under `skip`."""
    starts = [Path(os.path.abspath(os.fspath(d))) for d in allowed_dirs]
    roots = [p.resolve() for p in starts]
    skipped = [Path(os.fspath(s)).resolve() for s in skip]
    queue: deque[tuple[Path, int]] = deque((p, 0) for p in starts)
    entered: set[Path] = set()
    models: list[str] = []
    data: list[str] = []
    visits = left_out = 0
    while queue:
        d, depth = queue.popleft()
        real = d.resolve()
        if real in entered or not _inside(real, roots) or _inside(real, skipped):
            continue
        entered.add(real)
        budget = max_visits - visits
        if budget <= 0:
            left_out += 1 + len(queue)  # directories not looked into
            break
        try:
            with os.scandir(d) as it:
                entries = sorted(itertools.islice(it, budget + 1), key=lambda e: e.name)
        except OSError:
            continue
        if len(entries) > budget:
            entries, left_out = entries[:budget], left_out + 1
        visits += len(entries)
        names = [e.name for e in entries]
        if _model_like(names):  # a model, an adapter, a tokenizer, a half download: never data
            if "config.json" in names and _weights_inside(d, names, roots):
                models.append(str(d))
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            p = d / e.name
            try:
                if e.is_dir():
                    if depth < max_depth:
                        queue.append((p, depth + 1))
                elif e.is_file() and os.path.splitext(e.name)[1].lower() in DATA_SUFFIXES:
                    target = p.resolve()
                    if _inside(target, roots) and not _inside(target, skipped):
                        data.append(str(p))
            except OSError:
                continue
    listed_models, more_models = _bounded(models, cap)
    listed_data, more_data = _bounded(data, cap)
    return Found(listed_models, listed_data, left_out + more_models + more_data)


class CatalogPublisher:
    """The node's retained NodeCatalog: published at connect (`publish(force=True)`), after a
    rescan that found a change (`tick`, every `every_s`) and on a CatalogRequest."""

    def __init__(self, bus: Any, node_id: str, allowed_dirs: Iterable[Any], skip: Iterable[Any] = (),
                 every_s: float = CATALOG_EVERY_S) -> None:
        self.bus, self.node_id, self.every_s = bus, node_id, every_s
        self.allowed_dirs = [str(d) for d in allowed_dirs]
        self.skip = list(skip)
        self.last: m.NodeCatalog | None = None
        self._scanned_at = float("-inf")
        self._lock = threading.Lock()  # the connect hook (network thread) and the control loop

    def register(self, dispatcher: Any) -> None:
        dispatcher.on("node.catalog_request", self._on_request, node_id=self.node_id)

    def _on_request(self, _req: m.CatalogRequest, _params: dict[str, str]) -> None:
        self.publish(force=True, rescan=time.monotonic() - self._scanned_at >= MIN_RESCAN_S)

    def tick(self) -> None:
        """Every turn of the loop: rescan when due; never raises (logged)."""
        if time.monotonic() - self._scanned_at < self.every_s:
            return
        try:
            self.publish()
        except Exception as exc:
            self._scanned_at = time.monotonic()
            log.error("node.catalog_failed", error=f"{type(exc).__name__}: {exc}"[:300], exc_info=exc)

    def announce(self) -> None:
        """At every (re)connect: the retained catalog afresh; never raises (logged)."""
        try:
            self.publish(force=True)
        except Exception as exc:
            log.error("node.catalog_failed", error=f"{type(exc).__name__}: {exc}"[:300], exc_info=exc)

    def publish(self, force: bool = False, rescan: bool = True) -> None:
        with self._lock:
            self._publish(force, rescan)

    def _publish(self, force: bool, rescan: bool) -> None:
        before = self.last
        if rescan or before is None:
            self._scanned_at = time.monotonic()
            found = scan(self.allowed_dirs, self.skip)
            self.last = m.NodeCatalog(node_id=self.node_id, allowed_dirs=self.allowed_dirs[:m.MAX_ALLOWED_DIRS],
                                      models=list(found.models), data=list(found.data),
                                      left_out=found.left_out, scanned_at=time.time())
        if force or before is None or _listing(before) != _listing(self.last):
            self.bus.publish_message(self.last, node_id=self.node_id)


def _listing(c: m.NodeCatalog) -> tuple:
    return c.allowed_dirs, c.models, c.data, c.left_out
