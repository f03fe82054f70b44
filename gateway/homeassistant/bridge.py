"""The gateway's Home Assistant side, as one object the service drives (`HABridge`): discovery
(published at connect, when Home Assistant says `online`, and when what it offers changes: the job
specs in job_dir, the owners' catalogs, the form's owner), the commands on `gateway/set`, the
owners' catalogs (`node/+/catalog`) and the `gateway/state` it publishes — only when something
other than its timestamp changed.

Starting a job: a spec file from job_dir (`start`), or the job form (`set`, `start_form`;
`haform`). Either way Last command says "submitted NAME as ID", then "accepted NAME as ID" or
"refused NAME (ID): reason" when the submit is answered; a start refused at once says "refused
NAME: reason" and no job exists.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from xronos.gateway.homeassistant import form as haform
from xronos.gateway.homeassistant.discovery import (
    BUTTONS, HAContext, discovery_messages, gateway_discovery, gateway_state, state_text,
)
from xronos.protocol import hastate
from xronos.protocol.messages import Capabilities, CatalogRequest, JobSpec, JobState, NodeCatalog

log = structlog.get_logger(__name__)

SPEC_SUFFIXES = (".toml", ".yaml", ".yml")
_SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_SPECS = 50  # a select with more options is no longer a menu
RESCAN_S = 30.0
MAX_STARTED = 16  # starts from Home Assistant awaiting their answer


def _spec_file(job_dir: Path, path: Path) -> bool:
    """A regular file that is in job_dir once links are resolved: a button in Home Assistant must
    not make the gateway read (and quote the parse errors of) a file elsewhere through a link."""
    try:
        return path.is_file() and path.resolve().is_relative_to(job_dir.resolve())
    except OSError:
        return False


def list_specs(job_dir: Path | None) -> tuple[str, ...]:
    """Job spec names in job_dir: file names without suffix, usable as select options."""
    if job_dir is None:
        return ()
    try:
        entries = sorted(os.scandir(job_dir), key=lambda e: e.name)
    except OSError:
        return ()
    names: list[str] = []
    for e in entries:
        stem, suffix = os.path.splitext(e.name)
        if suffix in SPEC_SUFFIXES and _spec_file(job_dir, Path(e.path)) and _SPEC_NAME.fullmatch(stem) \
                and stem not in names:
            names.append(stem)
    return tuple(names[:MAX_SPECS])



def load_form(path: Path | None) -> hastate.JobForm:
    """The form as last saved; the defaults without a file, or with one that is not a JobForm (a
    form from another version: logged, not fatal)."""
    if path is None or not path.exists():
        return hastate.JobForm()
    try:
        return hastate.JobForm.model_validate_json(path.read_bytes()[:65536], strict=True)
    except (OSError, ValueError) as exc:
        log.warning("homeassistant.form_unreadable", path=str(path), error=str(exc)[:300])
        return hastate.JobForm()


def save_form(path: Path | None, form: hastate.JobForm) -> None:
    """Atomically (a crash leaves the old file or the new one); a full disk is logged, not fatal."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(form.model_dump_json())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("homeassistant.form_not_saved", path=str(path), error=str(exc)[:300])


class Refused(ValueError):
    """A start the gateway refused at once (the job was never kept): the reason, for Last command."""


@dataclass
class Actions:
    """What the bridge asks of the gateway service (each raises ValueError with a reason)."""

    job_command: Callable[[str], str]  # pause|resume|cancel the current job -> result text
    start: Callable[[Any, str], str]  # (JobSpec, spec name) -> job id; Refused(reason) if refused at once
    remove_node: Callable[[str], None]
    nodes: Callable[[], list[Capabilities]]  # for discovery
    publish: Callable[[], None] = lambda: None  # publish gateway/state now (after a command)


class HABridge:
    """Home Assistant for the gateway: discovery, commands from `gateway/set` and HA's birth
    message (both through the dispatcher), and the `gateway/state` it publishes — only when
    something other than its timestamp changed."""

    def __init__(self, ctx: HAContext, bus: Any, job_dir: Path | None, actions: Actions,
                 form_file: Path | None = None) -> None:
        self.ctx, self.bus, self.job_dir, self.actions = ctx, bus, job_dir, actions
        self.catalogs: dict[str, NodeCatalog] = {}  # node id -> its model directories and data files
        self.form_file = form_file  # the form's values, kept across restarts of the gateway
        self.form = load_form(form_file)
        self._gateway_config: bytes | None = None  # the gateway device's discovery as last published
        self.specs: tuple[str, ...] = list_specs(job_dir)
        self.selected: str | None = self.specs[0] if self.specs else None
        self.last_command: str | None = None
        self.refusal: tuple[float, str] | None = None  # (when, why) of the newest refused submit
        # Jobs started from Home Assistant and not yet answered (job id -> the command's action and
        # the name Last command gave): their acceptance or refusal replaces "submitted" there.
        self.started: dict[str, tuple[str, str]] = {}
        self._published: hastate.GatewayHAState | None = None
        self._scanned_at = time.monotonic()

    # --- wiring ---------------------------------------------------------------------------
    def register(self, dispatcher: Any) -> None:
        dispatcher.on("gateway.set", self._on_command, on_error=self._on_bad)
        dispatcher.on("ha.status", self._on_status)
        dispatcher.on("node.catalog", self._on_catalog, on_cleared=self._catalog_cleared)

    def discovery(self) -> list[tuple[str, bytes]]:
        return discovery_messages(self.ctx, self.actions.nodes(), self.specs, self.form, self.catalogs)

    def publish_discovery(self) -> None:
        for topic, payload in self.discovery():
            self.bus.publish(topic, payload, retain=True)
        self._gateway_config = self._gateway_payload()

    def _gateway_payload(self) -> bytes:
        return json.dumps(gateway_discovery(self.ctx, self.specs, self.form, self.catalogs)[1]).encode()

    def _rediscover(self) -> None:
        """Publish the gateway device's discovery again if what it offers changed."""
        payload = self._gateway_payload()
        if payload != self._gateway_config:
            self.bus.publish(self.ctx.discovery_topic(self.ctx.gateway_device_id), payload, retain=True)
            self._gateway_config = payload

    # --- the owners' catalogs -------------------------------------------------------------
    def _on_catalog(self, msg: NodeCatalog, params: dict[str, str]) -> None:
        if msg.node_id != params["node_id"]:  # a node speaks for itself only
            raise ValueError(f"catalog names node {msg.node_id!r} but arrived on {params['node_id']!r}'s topic")
        self.catalogs[msg.node_id] = msg
        self._catalogs_changed()

    def _catalog_cleared(self, params: dict[str, str]) -> None:
        self.forget_node(params.get("node_id", ""))

    def forget_node(self, node_id: str) -> None:
        if self.catalogs.pop(node_id, None) is not None:
            self._catalogs_changed()

    def _catalogs_changed(self) -> None:
        form = haform.default_owner(self.form, self.catalogs)
        # A chosen file the owner no longer lists is unchosen (Start would refuse it anyway).
        cat = self.catalogs.get(form.owner) if form.owner else None
        if cat is not None:
            form = form.model_copy(update={"model": form.model if form.model in cat.models else None,
                                           "data": form.data if form.data in cat.data else None})
        self.form = form
        self._rediscover()
        self.actions.publish()

    def tick(self) -> None:
        """Every turn of the loop: re-read job_dir now and then; new specs = new discovery."""
        if time.monotonic() - self._scanned_at < RESCAN_S:
            return
        self.rescan()

    def rescan(self) -> None:
        self._scanned_at = time.monotonic()
        specs = list_specs(self.job_dir)
        if specs != self.specs:
            self.specs = specs
            if self.selected not in specs:
                self.selected = specs[0] if specs else None
            self._rediscover()

    # --- state ----------------------------------------------------------------------------
    def refused(self, reason: str | None) -> None:
        self.refusal = (time.time(), reason or "refused")

    def answered(self, job_id: str | None, ok: bool, reason: str | None) -> None:
        """The answer to a submit: for a job started here, Last command turns from "submitted" to
        "accepted" or "refused" with the reason (the owner's inspection, the plan that cannot fit)."""
        started = self.started.pop(job_id, None) if job_id else None
        if started is None:
            return
        action, name = started
        if ok:
            self.last_command = f"{action}: accepted {name} as {job_id}"
        else:
            self.last_command = state_text(f"{action}: refused {name} ({job_id}): {reason or 'refused'}")
            log.warning("Home Assistant start refused", job=job_id, spec=name, reason=reason)
        self.actions.publish()

    def forget_published(self) -> None:
        """The next `publish_state` publishes even an unchanged state (the broker lost it)."""
        self._published = None

    def publish_state(self, job: JobState | None, job_created_at: float | None, nodes_online: int,
                      force: bool = False, spec: JobSpec | None = None) -> bool:
        """Publish gateway/state if it changed (or force); True if published. `spec`: the job's."""
        error = None
        if self.refusal and (job_created_at is None or self.refusal[0] >= job_created_at):
            error = self.refusal[1]
        st = gateway_state(job, nodes_online=nodes_online, now=time.time(), last_command=self.last_command,
                           error=error, selected_spec=self.selected, spec=spec, form=self.form)
        if not force and hastate.same_state(st, self._published):
            return False
        self.bus.publish_message(st)
        self._published = st
        return True

    # --- commands -------------------------------------------------------------------------
    def _on_bad(self, text: str) -> None:
        self.last_command = f"error: {text}"
        self.actions.publish()

    def _on_status(self, msg: hastate.HAStatus, _params: dict[str, str]) -> None:
        if msg == hastate.HAStatus.ONLINE:  # Home Assistant (re)started: it forgot the devices
            self.rescan()
            self.publish_discovery()
            self.forget_published()  # and show it the current state again
            self.actions.publish()

    def _on_command(self, cmd: hastate.GatewayCommand, _params: dict[str, str]) -> None:
        try:
            self.last_command = f"{cmd.action}: {self._do(cmd)}"
        except Refused as exc:
            self.last_command = state_text(f"{cmd.action}: refused {exc}")
            log.warning("Home Assistant start refused", reason=str(exc))
        except ValueError as exc:
            self.last_command = f"{cmd.action}: error: {exc}"
            log.warning("Home Assistant command refused", action=cmd.action, reason=str(exc))
        self.actions.publish()

    def _do(self, cmd: hastate.GatewayCommand) -> str:
        if cmd.action in BUTTONS:
            return self.actions.job_command(cmd.action)
        if cmd.action == "set":
            assert cmd.field is not None
            self.form = haform.set_field(self.form, cmd.field, cmd.value, self.catalogs)
            save_form(self.form_file, self.form)
            self._rediscover()  # another owner: its files are the Model and Data options
            return f"{cmd.field} = {getattr(self.form, cmd.field)}"
        if cmd.action == "start_form":
            try:
                form = haform.with_values(self.form, cmd.form or {}, self.catalogs)
                spec = haform.form_spec(form, self.catalogs, time.time())
            except ValueError as exc:
                raise Refused(f"the job form: {exc}") from None
            return self._submit(spec, spec.name, cmd.action)
        if cmd.action == "refresh":
            return self._refresh()
        if cmd.action == "select":
            self.rescan()
            if cmd.spec not in self.specs:
                raise ValueError(f"no job spec {cmd.spec!r} in {self.job_dir}")
            self.selected = cmd.spec
            return f"selected {cmd.spec}"
        if cmd.action == "start":
            name = cmd.spec or self.selected
            if name is None:
                raise ValueError(f"no job spec to start: put one in {self.job_dir}")
            from xronos.protocol.specfile import load_spec  # noqa: PLC0415 (yaml/toml only when a spec is started)

            self.rescan()
            path = next((self.job_dir / f"{name}{sfx}" for sfx in SPEC_SUFFIXES
                         if self.job_dir and _spec_file(self.job_dir, self.job_dir / f"{name}{sfx}")), None)
            if path is None:
                raise ValueError(f"no job spec {name!r} in {self.job_dir}")
            try:
                spec = load_spec(path)
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None
            return self._submit(spec, name)
        assert cmd.action == "remove_node" and cmd.node_id is not None
        self.actions.remove_node(cmd.node_id)
        return f"removed node {cmd.node_id}"

    def _refresh(self) -> str:
        """Every known node scans its allowed directories now (their catalogs come back retained)."""
        nodes = sorted({c.node_id for c in self.actions.nodes()} | set(self.catalogs))
        for node_id in nodes:
            self.bus.publish_message(CatalogRequest(request_id=f"ha-{uuid.uuid4().hex[:8]}"), node_id=node_id)
        return f"asked {len(nodes)} node(s) for their files"

    def _submit(self, spec: JobSpec, name: str, action: str = "start") -> str:
        try:
            job_id = self.actions.start(spec, name)
        except Refused as exc:
            raise Refused(f"{name}: {exc}") from None
        self.started[job_id] = (action, name)
        while len(self.started) > MAX_STARTED:  # answers that never came (a gateway restart between)
            self.started.pop(next(iter(self.started)))
        return f"submitted {name} as {job_id}"
