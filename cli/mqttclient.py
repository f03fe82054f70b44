"""What the job and nodes commands share: broker options, a request/response client for the
gateway's topics, job spec files, and the plan and progress displays."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xronos.common.configfile import TopicPrefix
from xronos.common.errtext import problems
from xronos.protocol import messages as m
from xronos.protocol.codec import DecodeError, decode
from xronos.protocol.specfile import load_spec  # noqa: F401  (re-exported: the CLI's spec files)
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BrokerSettings, MqttBus

TERMINAL = ("completed", "failed", "cancelled")
MAX_WAIT_S = 7 * 86400.0  # --timeout's bound: a week (a larger deadline overflows the clock's arithmetic)


def add_broker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker")
    g.add_argument("--config", metavar="TOML", help="take [broker] and base_topic from this gateway/node config")
    g.add_argument("--host", help="broker host (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="broker port (default 1883)")
    g.add_argument("--username", help="MQTT user name")
    g.add_argument("--password-file", help="file holding the MQTT password")
    g.add_argument("--base-topic", help="Xronos base topic (default xronos)")
    # %(default)g, not a fixed number: job submit sets its own (its answer waits for the profiles).
    g.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds to wait for the gateway (default %(default)g)")


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse's type: its error names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_S):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds above 0 and at most {MAX_WAIT_S:g}")
    return value


class _BrokerPart(BaseModel):
    """What a client command takes from a gateway or node config; the rest is the service's."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    base_topic: TopicPrefix = "xronos"


def broker_from_args(args: argparse.Namespace) -> tuple[BrokerSettings, str]:
    """Broker settings from --config's [broker] and the command line (which wins).

    A service's config names a username but no password file: its service gets the password as a
    systemd credential from /etc/xronos/mqtt_password. Outside systemd the CLI uses that same
    file (the config's directory, `mqtt_password`) when it can read it, and says so when not,
    instead of connecting without a password and being refused.
    """
    from xronos.common.configfile import check_broker_files, credential_password_file, read_toml, validate_config

    fields: dict[str, Any] = {}
    base = "xronos"
    if args.config:  # refused as the services refuse it: file, key and reason
        part = validate_config(_BrokerPart, read_toml(args.config), args.config)
        # The TLS files too, before any connection is tried (the password file is checked below).
        check_broker_files(part.broker, args.config, names=("tls_ca", "tls_cert", "tls_key"))
        fields = part.broker.model_dump(exclude_unset=True)
        base = part.base_topic
    for opt, key in (("host", "host"), ("port", "port"), ("username", "username"), ("password_file", "password_file")):
        if getattr(args, opt) is not None:
            fields[key] = getattr(args, opt)
    if fields.get("username") and not fields.get("password_file"):
        beside = Path(args.config).parent / "mqtt_password" if args.config else None
        found = credential_password_file() or beside
        if found is not None and found.exists():
            if not os.access(found, os.R_OK):
                raise ValueError(f"broker user {fields['username']!r} needs its password: {found} is not readable "
                                 f"by you (run with sudo, or pass --password-file FILE)")
            fields["password_file"] = found
        elif args.config:
            raise ValueError(f"{args.config}: broker.username {fields['username']!r} is set but no password file: "
                             "pass --password-file FILE")
    if fields.get("password_file"):
        pf = Path(fields["password_file"])
        try:
            pf.read_bytes()
        except OSError as exc:
            raise ValueError(f"--password-file {pf}: cannot read: {exc.strerror}") from None
    try:
        return BrokerSettings(**fields), args.base_topic or base
    except ValidationError as exc:
        raise ValueError(f"broker settings: {problems(exc.errors())}") from None


class NotAuthorised(ValueError):
    """The broker refused the connection: wrong user name or password, or not allowed."""


def _refusal_text(reason: Any) -> str | None:
    """The broker's CONNACK refusal in words a person can act on, or None if it is not one."""
    text = str(reason)
    value = getattr(reason, "value", None)
    if value in (4, 5, 134, 135) or "user name or password" in text.lower() or "not authori" in text.lower():
        return ("not authorised: the broker refused this user name and password (check --username and "
                f"--password-file, and that the broker has this user) [{text}]")
    if value in (2, 133) or "identifier" in text.lower():
        return f"the broker refused the client id [{text}]"
    return None


class BrokerUnreachable(TimeoutError):
    """Nothing answers at the broker's address (refused, unknown host): said at once, not after the
    wait. A TimeoutError, so a caller that retries until the broker is up still does."""


def unreachable(host: str, port: int, timeout: float = 2.0) -> str | None:
    """Why a TCP connection to the broker's address fails for certain, or None (it connects, or only
    times out: a slow network or a broker still starting is waited for as before)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return f"connection refused: nothing listens on port {port} there (is the broker running, on this port?)"
    except socket.gaierror as exc:
        return f"unknown host {host!r} ({exc.strerror})"
    except OSError as exc:
        if isinstance(exc, TimeoutError) or exc.errno is None:
            return None
        return exc.strerror or str(exc)


class GatewayClient:
    """Requests on {base}/gateway/request/<name>, answers matched by transaction."""

    def __init__(self, settings: BrokerSettings, base: str = "xronos") -> None:
        self.table = TopicTable(base)
        self.bus = MqttBus(settings, f"cli-{uuid.uuid4().hex[:8]}", table=self.table)
        self.refused: str | None = None
        inner = self.bus.client.on_connect

        def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            if getattr(reason, "is_failure", False):
                self.refused = _refusal_text(reason) or f"the broker refused the connection: {reason}"
                client.disconnect()  # a person waits: say so instead of retrying in the background
            inner(client, userdata, flags, reason, props)

        self.bus.client.on_connect = on_connect
        # paho retries a failed socket connect in the background and says no more than that it failed
        self._connect_failed = False
        self._ever_connected = False

        def on_connect_fail(_client: Any, _userdata: Any) -> None:
            self._connect_failed = True

        self.bus.client.on_connect_fail = on_connect_fail
        self.bus.subscribe(self.table.filter("gateway.response"))
        self.bus.start()

    def close(self) -> None:
        self.bus.stop()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_connected(self, timeout: float) -> None:
        where = f"{self.bus.settings.host}:{self.bus.settings.port}"
        user = self.bus.settings.username
        deadline = time.monotonic() + timeout
        while not self.bus.wait_connected(0.1):
            if self.refused:
                who = f" as user {user!r}" if user else " without a user name"
                raise NotAuthorised(f"MQTT broker at {where}{who}: {self.refused}")
            # Before the first connection only: a client that was connected waits out a broker restart.
            if self._connect_failed and not self._ever_connected:
                self._connect_failed = False
                why = unreachable(self.bus.settings.host, self.bus.settings.port,
                                  timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if why is not None:
                    raise BrokerUnreachable(f"cannot reach the MQTT broker at {where}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cannot reach the MQTT broker at {where} (no answer within {timeout:.0f} s)")
        self._ever_connected = True

    def request(self, name: str, timeout: float, **fields: Any) -> dict[str, Any] | list[Any]:
        """The response's data; ValueError with the gateway's error text, TimeoutError if silent."""
        txn = uuid.uuid4().hex
        try:  # what the user typed (a job id) is refused here, in one line, before the broker is waited for
            req = m.REQUEST_MODELS[name](transaction=txn, **fields)
        except ValidationError as exc:
            raise ValueError(problems(exc.errors(), empty="request")) from None
        self._wait_connected(min(timeout, 10.0))
        self.bus.publish(self.table.build(f"gateway.request.{name}"), req.model_dump_json())
        want = self.table.build("gateway.response", name=name)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            item = self.bus.get(left)
            if item is None or item[0] != want:
                continue
            try:
                resp = decode(*item, table=self.table)
            except DecodeError:  # not the gateway's answer (e.g. a retained or stray bad payload): not ours
                continue
            if resp.transaction != txn:
                continue
            if resp.status == "error":
                raise ValueError(f"gateway: {resp.error}")
            return resp.data if resp.data is not None else {}
        if name == "job/submit":  # its answer comes after the owner's inspection and every node's profile
            raise TimeoutError(f"no answer to job/submit within {timeout:g} s: if the gateway is running, the job "
                               "may still be in its inspection or profiling and go on; `xronos job status` lists "
                               "it (cancel it there before submitting again), and --timeout waits longer")
        raise TimeoutError(f"no answer to {name} within {timeout:g} s (is the gateway running?)")

    def follow(self, job_id: str, on_state, timeout: float | None = None) -> m.JobState:
        """Call on_state(JobState) for each retained job state until the job ends."""
        self.bus.subscribe(self.table.build("job.state", job_id=job_id))
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            item = self.bus.get(1.0)
            if item is None or not item[0].endswith(f"/job/{job_id}/state") or not item[1]:
                continue  # an empty payload: the gateway cleared the state (pruned from its history)
            try:
                state = decode(*item, table=self.table)
            except DecodeError as exc:  # e.g. a state retained by another schema version: wait for the gateway's
                print(f"ignoring an unreadable state of job {job_id}: {exc}"[:300], file=sys.stderr)
                continue
            on_state(state)
            if state.phase in TERMINAL:
                return state
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s")


def format_plan(plan: dict[str, Any]) -> str:
    sz = plan["sizes"]
    lines = [f"plan v{plan['version']} ({plan['strategy']}; {sz['attn']} attention units, {sz['mlp']} MLP "
             f"columns, {sz['vocab']} vocabulary rows): predicted iteration "
             f"{plan['predicted_iteration_s']:.3f} s (ideal {plan['ideal_iteration_s']:.3f} s, "
             f"communication {plan['comm_s']:.3f} s)",
             f"  {'node':<16} {'rank':>4} {'attn':>4} {'mlp':>6} {'vocab':>6} {'compute s':>9} {'memory MiB':>11} "
             f"{'cap MiB':>9}"]
    shares = plan.get("shares")
    tp = len(plan["entries"]) // len(shares) if shares else 0
    if shares:  # data parallelism: rows of each global batch per group (rank r in group r // tp)
        lines[0] += f"; {len(shares)} data-parallel groups of TP {tp}, rows per group {shares}"
    label = lambda o: m.overlap_label(m.Overlap(**o) if o else None)  # noqa: E731
    if plan.get("overlap"):
        lines[0] += f"; overlap {label(plan['overlap'])}"
    if plan.get("trial"):
        t = plan["trial"]
        steps = m.OverlapTrial.model_validate(t).steps
        lines[0] += f"; overlap trial of {', '.join(label(x) for x in t['modes'])} over its first {steps} steps"
    for e in plan["entries"]:
        lines.append(f"  {e['node_id']:<16} {e['rank']:>4} {e['attn']:>4} {e['mlp']:>6} {e['vocab']:>6} "
                     f"{e['predicted_compute_s']:>9.4f} {e['predicted_memory'] / 2**20:>11.1f} "
                     f"{e['memory_cap'] / 2**20:>9.0f}" + (f"  group {e['rank'] // tp}" if shares else ""))
    return "\n".join(lines)


def format_candidates(candidates: list[dict[str, Any]], chosen: str = "") -> str:
    """The planner's candidates side by side (a submit's or a preview's answer), the chosen one marked."""
    if not candidates:
        return ""
    lines = ["  candidates:"]
    for c in candidates:
        t = "-" if c.get("iteration_s") is None else f"{c['iteration_s']:.4f} s"
        fits = "fits" if c.get("feasible") else f"does not fit: {str(c.get('why_not') or '').splitlines()[0][:200]}"
        lines.append(f"  {'*' if c.get('chosen') else ' '} {c.get('label', c.get('strategy'))}: {t}, {fits}")
    if chosen:
        lines.append(f"  chosen: {chosen}")
    return "\n".join(lines)


def format_state(s: dict[str, Any]) -> str:
    lines = [f"job {s['job_id']} ({s['name']}): {s['phase']}, step {s['step']}/{s.get('total_steps') or '?'}"
             f", epoch {s['epoch']}" + (f", loss {s['loss']:.4f}" if s.get("loss") is not None else "")]
    if s.get("eval_metric") is not None:
        lines.append(f"  {s['eval_metric_name']}: {s['eval_metric']:.4f}")
    if s.get("iteration_s") is not None:
        eta = f", ETA {s['eta_s']:.0f} s" if s.get("eta_s") is not None else ""
        clock = f" ({s['clock']} clock)" if s.get("clock") else ""
        lines.append(f"  iteration {s['iteration_s']:.3f} s{eta}{clock}")
    if s.get("overlap_kept"):
        lines.append(f"  overlap: {s['overlap_kept']} (the overlap trial's fastest)")
    nodes = sorted(set(s.get("predicted_s", {})) | set(s.get("measured_s", {})))
    if nodes:
        pc, mc = s.get("predicted_comm_s", {}), s.get("measured_comm_s", {})
        lines.append(f"  {'node':<16} {'compute pred s':>14} {'measured s':>10} {'comm pred s':>11} "
                     f"{'measured s':>10} {'idle %':>6}")
        for n in nodes:
            pred, meas, idle = s["predicted_s"].get(n), s["measured_s"].get(n), s["idle_ratio"].get(n)
            lines.append(f"  {n:<16} {_num(pred, '.4f'):>14} {_num(meas, '.4f'):>10} {_num(pc.get(n), '.4f'):>11} "
                         f"{_num(mc.get(n), '.4f'):>10} {_num(None if idle is None else 100 * idle, '.1f'):>6}")
        errs = [f"{name} {s[key]:.1f}%" for name, key in (("compute", "compute_mape_pct"), ("comm", "comm_mape_pct"))
                if s.get(key) is not None]
        if errs:
            lines.append("  prediction MAPE: " + ", ".join(errs))
    lines += format_peak_memory(s)
    if s.get("replans") or s.get("last_replan_reason"):
        plan = s.get("plan") or {}
        layout = ";".join(f"{k}=" + ",".join(str(e[k]) for e in plan.get("entries", [])) for k in ("attn", "mlp", "vocab"))
        lines.append(f"  live re-plans: {s.get('replans', 0)}" + (f" (now {layout})" if plan else ""))
        if s.get("last_replan_reason"):
            lines.append(f"  last re-plan decision: {s['last_replan_reason']}")
    if s.get("error"):
        lines.append(f"  error: {s['error']}")
    lines += [f"  | {e}" for e in s.get("events", [])[-8:]]
    return "\n".join(lines)


def format_peak_memory(s: dict[str, Any]) -> list[str]:
    """Per node: the plan's predicted peak resident set vs the highest measured (MiB)."""
    pred, meas = s.get("predicted_peak_bytes") or {}, s.get("peak_rss_bytes") or {}
    nodes = sorted(set(pred) | set(meas))
    if not nodes:
        return []
    out = [f"  {'node':<16} {'predicted peak MiB':>18} {'measured peak MiB':>17}"]
    for n in nodes:
        p, q = pred.get(n), meas.get(n)
        out.append(f"  {n:<16} {_num(None if p is None else p / 2**20, '.0f'):>18} "
                   f"{_num(None if q is None else q / 2**20, '.0f'):>17}")
    return out


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def progress_bar(desc: str = "training", total: int | None = None):
    """A tqdm bar driven by JobState updates (returns the on_state callback and the bar); `total`:
    the job's steps when known already (the submit's answer), so the bar does not start at 0/1."""
    from tqdm import tqdm

    bar = tqdm(total=total or None, desc=desc, unit="step", dynamic_ncols=True)

    def on_state(state: m.JobState) -> None:
        bar.total = max(state.total_steps or bar.total or 1, 1)
        bar.n = min(state.step, bar.total)
        post = {"phase": state.phase}
        if state.loss is not None:
            post["loss"] = f"{state.loss:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.refresh()

    return on_state, bar


def dump(data: Any) -> str:
    return json.dumps(data, indent=1, allow_nan=True)
