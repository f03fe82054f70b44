"""Hostile payloads for the fuzzer (test_fuzz.py): a seeded generator, no network of its own.

`Fuzzer(rng, base, ...)` yields `(topic, payload, retain)` triples for every topic a gateway and a
node subscribe to: random bytes, wrong types, boundary and non-finite numbers, huge and deeply
nested values, invalid Unicode (lone surrogates in JSON, invalid UTF-8 in msgpack strings),
unknown and missing fields, wrong schema versions, retained copies, replays of a real node's own
messages (duplicated and out of order), and claims in other nodes' or other ranks' names. It also
plays three fake nodes that answer the gateway's requests — correctly, late, twice, or wrongly —
so that jobs owned by them travel the whole state machine under fire.

It also speaks on the services' own retained topics, which each service now listens to
(protocol/ownavail.py, node/agent/owncaps.py): anything on the gateway's availability (an `offline` it
must answer with `online`), and, on the real node's capabilities, schema-valid announcements of an
impostor (another box under its id) with the longest and oddest host names the schema admits, and
replays of the node's own.

What it never sends are messages that the example ACL reserves to the gateway or to the real node
and that are *valid* orders for the real job (its assignment, a start/cancel of its plan, a
pause/cancel request for it): those are authority, not hostility; the ACL test covers who may
send them. Anything schema-valid it builds for those topics is re-mutated until it is not
(`_dangerous`), except a few valid profile requests under made-up job ids.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
from protocol_samples import ARCH, CAPS, LAYERS, SAMPLES, SPEC  # noqa: E402
from xronos.protocol import messages as m  # noqa: E402
from xronos.protocol.codec import DecodeError, decode  # noqa: E402
from xronos.protocol.topics import ENTRIES, TopicTable  # noqa: E402
from xronos.protocol.layout import Layout  # noqa: E402

FAKES = ("n1", "n2", "n3")
INTS = [-1, -(2**63), 0, 1, 2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 10**30]
JSON_INTS = [10**400, -(10**400), 2**64, 10**100]
FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e-300, 1e30]
STRS = ["", "x" * 100_000, "../../../etc/passwd", "a/b", "+", "#", "\0", "é" * 3000, "\U0001F600", " ", "..",
        "n0", "n1", "a" * 129, "online", "{}", "\u202e"]
JSON_STRS = ["\ud800", "a\udfffb", "\udbff\udc00x\ud800"]  # lone surrogates: JSON can carry them
# Host names the schema admits (Host: up to 255 characters of valid Unicode), the longest in print first.
HOSTS = ["\U000e0001" * 255, "\u202e" * 255, "\0" * 255, "é" * 255, "x" * 255, "", " ", "n0", "127.0.0.1", "::1"]
OTHER: list[Any] = [None, True, False, [], {}, [1, 2], {"a": 1}, [[[[[]]]]], {"schema_version": 1}]


def deep_json(n: int) -> bytes:
    return b"[" * n + b"]" * n


def deep_msgpack(n: int) -> bytes:
    return b"\x91" * n + b"\xc0"  # n nested one-element arrays around nil


def msgpack_bad_utf8() -> bytes:
    """A msgpack map {"job_id": <str with UTF-8 of a surrogate>} (no encoder makes one)."""
    return b"\x81" + msgpack.packb("job_id") + b"\xa3\xed\xa0\x80"


def _json(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


class Fuzzer:
    def __init__(self, rng: random.Random, base: str, real_node: str, real_job: str | None = None) -> None:
        self.rng, self.base, self.real_node, self.real_job = rng, base, real_node, real_job
        self.table = TopicTable(base)
        self.counts: Counter[str] = Counter()  # payloads per topic key
        self.valid_profiles_left = 1  # a real profile run on the real node, under a made-up job id
        self.seen: list[tuple[str, bytes]] = []  # the real node's own messages, for replays
        self.todo: list[tuple[str, bytes, bool]] = []  # fake nodes' answers, sent with the next batch
        self.fake_jobs: dict[str, dict[str, Any]] = {}  # job id -> what the fake nodes know of it
        self.answers: Counter[str] = Counter()  # the gateway's answers to the fuzzer's submits and previews
        self.own_caps: m.Capabilities | None = None  # the real node's latest announcement, as heard
        self.forged: set[bytes] = set()  # our impostor announcements on its topic (not the node's own)
        self.impostor_reports = 0  # the real node's duplicate_node_id reports (node/agent/owncaps.py)
        self.templates = self._templates()

    # --- templates: one valid message per topic (or a tuple of shapes), in this deployment's names ---
    def _templates(self) -> dict[str, Any]:
        t = dict(SAMPLES)
        t["node.inspect_request"] = m.InspectRequest(request_id="fz.1", job_id="ghost-1",
                                                     spec=SPEC.model_copy(update={"owner": self.real_node}))
        t["node.profile_request"] = m.ProfileRequest(request_id="fz.2", job_id="ghost-2", arch=ARCH, threads=1,
                                                     key=m.ProfileKey(task="causal-lm", batch_size=2, seq_len=16))
        t["node.assignment"] = SAMPLES["node.assignment"].model_copy(update={"node_id": self.real_node,
                                                                             "job_id": "ghost-3"})
        # Two shapes on the control topic: each mutation starts from one of them.
        t["node.control"] = (m.JobStart(job_id="ghost-4", plan_version=3),
                             m.JobReshard(job_id="ghost-4", plan_version=3, at_step=5, reason="fuzz",
                                          layout=Layout(attn=(2, 2), mlp=(40, 24), vocab=(30, 20))))
        owner = self.rng.choice(FAKES)
        fake_spec = SPEC.model_copy(update={"owner": owner, "nodes": [owner] + [n for n in FAKES if n != owner][:1]})
        t["gateway.request.job/submit"] = m.JobSubmitRequest(transaction="fz", spec=fake_spec)
        t["gateway.request.plan/preview"] = m.PlanPreviewRequest(transaction="fz", spec=fake_spec)
        return t

    def _dangerous(self, key: str, topic: str, payload: bytes) -> bool:
        """A schema-valid message that is an order only the gateway (or the real node) may give."""
        try:
            msg = decode(topic, payload, table=self.table)
        except DecodeError:
            return False
        node_topic = topic.startswith(f"{self.base}/node/{self.real_node}/")
        if key == "node.profile_request" and node_topic:
            if self.valid_profiles_left > 0 and msg.job_id.startswith("ghost"):
                self.valid_profiles_left -= 1
                return False
            return True
        if key in ("node.assignment", "node.control") and node_topic:
            return getattr(msg, "node_id", self.real_node) == self.real_node and \
                (key == "node.assignment" or msg.job_id == self.real_job)
        if key in ("gateway.request.job/pause", "gateway.request.job/resume", "gateway.request.job/cancel"):
            return msg.job_id == self.real_job
        if key in ("gateway.request.job/submit", "gateway.request.plan/preview"):
            # A job that would use the real node: its profile and training runs would be real work.
            return msg.spec.nodes is None or self.real_node in msg.spec.nodes
        if key == "node.set" and node_topic:
            return msg.participate is False  # switching the real node off is Home Assistant's order to give
        if key == "gateway.set":
            return True  # pause, resume, cancel, start, select, remove_node: all orders of the house's owner
        if node_topic and key in ("node.availability", "node.capabilities", "node.job", "node.metrics", "node.ack",
                                  "node.profile_report", "node.inspect_report", "node.error"):
            return True  # the real node's own voice: only invalid payloads, or replays of what it said
        return False

    # --- mutations -----------------------------------------------------------------------------
    def _hostile(self, encoding: str) -> Any:
        r = self.rng.random()
        if r < 0.3:
            return self.rng.choice(INTS + (JSON_INTS if encoding == "json" else []))
        if r < 0.5:
            return self.rng.choice(FLOATS)
        if r < 0.8:
            return self.rng.choice(STRS + (JSON_STRS if encoding == "json" else []))
        if r < 0.9:
            return self.rng.choice(OTHER)
        depth = self.rng.choice([50, 200, 600])
        value: Any = 1
        for _ in range(depth):
            value = [value] if self.rng.random() < 0.5 else {"k": value}
        return value

    def _paths(self, obj: Any, prefix: tuple = ()) -> list[tuple]:
        out = [prefix] if prefix else []
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k != "schema_version":  # mutated on its own (below), not as one field among others
                    out += self._paths(v, prefix + (k,))
        elif isinstance(obj, list):
            for i, v in enumerate(obj[:4]):
                out += self._paths(v, prefix + (i,))
        return out

    def _mutate(self, obj: dict[str, Any], encoding: str) -> Any:
        obj = json.loads(json.dumps(obj))
        how = self.rng.random()
        paths = self._paths(obj)
        if how < 0.08 or not paths:
            return self._hostile(encoding)  # the whole payload of the wrong type
        if how < 0.14:
            obj[self.rng.choice(["bogus", "units_x", "__class__", "x" * 300])] = 1
            return obj
        if how < 0.2:
            obj["schema_version"] = self.rng.choice([0, 2, 99, "1", None, 1.0, 2**70])
            return obj
        path = self.rng.choice(paths)
        parent = obj
        for p in path[:-1]:
            parent = parent[p]
        if how < 0.3 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = self._hostile(encoding)
        return obj

    def _encode(self, obj: Any, encoding: str) -> bytes:
        if encoding == "json":
            try:
                return _json(obj)
            except (ValueError, RecursionError):
                return deep_json(5000)
        try:
            return msgpack.packb(obj, use_bin_type=True)
        except (OverflowError, ValueError, TypeError, UnicodeEncodeError):
            return self.rng.choice([msgpack_bad_utf8(), deep_msgpack(5000), b"\xc1"])

    # --- payloads ------------------------------------------------------------------------------
    def _node_id(self, entry_key: str) -> str:
        r = self.rng.random()
        if entry_key in ("node.profile_request", "node.inspect_request", "node.assignment", "node.control"):
            return self.real_node if r < 0.8 else self.rng.choice(FAKES)
        return self.real_node if r < 0.3 else self.rng.choice(FAKES) if r < 0.9 else \
            self.rng.choice(["x" * 200, "bad id", "é", "n0.evil", "-lead", "."])

    def one(self) -> tuple[str, bytes, bool]:
        """One hostile (topic, payload, retain)."""
        subscribed = [e for e in ENTRIES if e.key not in ("gateway.response", "job.state")]
        if self.own_caps is not None and self.rng.random() < 0.02:
            return self.impostor()
        if self.rng.random() < 0.06:
            ha = self.rng.choice([f"{self.base}/gateway/set", "homeassistant/status", f"{self.base}/node/{self.real_node}/set"])
            payload = self.rng.choice([b"online", b"offline", b'{"action": "explode"}', b'{"participate": "yes"}',
                                       b'{"action": null}', _json({"action": "\ud800"}), self.rng.randbytes(40),
                                       deep_json(3000), b"", b'{"participate": true, "x": 1}'])
            self.counts[ha.replace(self.base, "{base}")] += 1
            return ha, payload, self.rng.random() < 0.1
        entry = self.rng.choice(subscribed)
        params = {}
        if "node_id" in entry.params:
            params["node_id"] = self._node_id(entry.key)
        try:
            topic = self.table.build(entry, **params)
        except ValueError:  # a node id no topic may carry: sent raw, the table must not match it
            topic = f"{self.base}/{entry.pattern.format(**params)}"
        kind = self.rng.random()
        if kind < 0.12:
            payload = self.rng.randbytes(self.rng.choice([0, 1, 7, 64, 512, 4096]))
        elif kind < 0.14:
            payload = b"{" * 10 + self.rng.randbytes(300_000)  # over the payload cap
        elif kind < 0.17:
            payload = deep_json(20_000) if entry.encoding == "json" else deep_msgpack(20_000)
        elif kind < 0.20 and self.seen:
            topic, payload = self.rng.choice(self.seen)  # the real node's own words, again, out of order
        else:
            template = self.templates[entry.key]
            if isinstance(template, tuple):
                template = self.rng.choice(template)
            if entry.encoding == "text":
                texts = [b"ONLINE", b"onl\xffine", b"1", b"online\0", b"x" * 1000, b"\xed\xa0\x80"]
                if params.get("node_id") != self.real_node:  # another node may say anything of itself
                    texts += [b"online", b"offline"]
                payload = self.rng.choice(texts)
            else:
                obj = self._mutate(template.model_dump(mode="json"), entry.encoding)
                payload = self._encode(obj, entry.encoding)
                for _ in range(5):
                    if not self._dangerous(entry.key, topic, payload):
                        break
                    payload = self._encode(self._mutate(template.model_dump(mode="json"), entry.encoding),
                                           entry.encoding)
                else:
                    payload = self.rng.randbytes(16)
        self.counts[entry.key] += 1
        return topic, payload, self.rng.random() < 0.05

    def impostor(self) -> tuple[str, bytes, bool]:
        """A schema-valid announcement on the real node's capabilities topic that the node did not
        make: another box under its id (odd, maximal host names; timestamps at the schema's ends) or
        a replay of its own. Its capacity and participation are left as the node said them: this is
        a duplicate box, not an order to plan differently. The first one is the worst case, since
        the node reports an impostor at most once per 10 minutes."""
        assert self.own_caps is not None
        topic = self.table.build("node.capabilities", node_id=self.real_node)
        if self.forged and self.rng.random() < 0.2:
            msg = self.own_caps  # its own words again
        else:
            hosts = HOSTS if self.forged else [HOSTS[0]]
            msg = self.own_caps.model_copy(update={
                "hostname": self.rng.choice(hosts), "data_host": self.rng.choice(hosts),
                "cpu_model": self.rng.choice(hosts), "torch_version": self.rng.choice([None, "\u202e" * 256]),
                "cpu_temp_c": self.rng.choice([None, -273.15, 1000.0, -0.0]),
                "sent_at": self.rng.choice([0.0, 5e-324, 1e11, self.own_caps.sent_at + 1e-6])})
            m.Capabilities.model_validate(msg.model_dump())  # schema-valid: it reaches the handlers
        payload = msg.model_dump_json().encode()
        self.forged.add(payload)
        self.counts["node.capabilities (own, valid)"] += 1
        return topic, payload, self.rng.random() < 0.1

    # --- claims about the real job, in other nodes' names -----------------------------------
    def claims(self, job_id: str, version: int) -> list[tuple[str, bytes, bool]]:
        out = []
        for node in FAKES:
            for status in ("completed", "failed", "running"):
                s = m.NodeJobStatus(node_id=node, job_id=job_id, plan_version=version, rank=self.rng.choice([0, 1]),
                                    status=status, step=10**6, checkpoint_step=10**6, export_dir="/evil",
                                    eval_metric=1.0, eval_metric_name="accuracy", sent_at=1.0)
                out.append((self.table.build("node.job", node_id=node), s.model_dump_json().encode(), False))
            metric = SAMPLES["node.metrics"].model_copy(update={"job_id": job_id, "plan_version": version,
                                                                "node_id": node, "rank": 0, "step": 10**6})
            out.append((self.table.build("node.metrics", node_id=node), _msgpack(metric), False))
            ack = m.AssignmentAck(job_id=job_id, plan_version=version, node_id=node, accepted=False, reason="evil")
            out.append((self.table.build("node.ack", node_id=node), _msgpack(ack), False))
            # A node's message carrying the real node's id, on its own topic.
            s = m.NodeJobStatus(node_id=self.real_node, job_id=job_id, plan_version=version, rank=0,
                                status="completed", step=1, sent_at=1.0)
            out.append((self.table.build("node.job", node_id=node), s.model_dump_json().encode(), False))
        for topic, payload, retain in out:
            self.counts[self.table.match(topic)[0].key] += 1
        return out

    # --- the fake nodes: answer what the gateway asks them -----------------------------------
    def observe(self, topic: str, payload: bytes) -> None:
        found = self.table.match(topic)
        if found is None or not payload:
            return
        entry, params = found
        if entry.key == "gateway.response" and params.get("name") in ("job/submit", "plan/preview"):
            try:
                resp = m.GatewayResponse.model_validate_json(payload)
            except ValueError:
                return
            if resp.transaction != "fz":
                return
            why = "ok" if resp.status == "ok" else (resp.error or "").split(":")[0][:40]
            self.answers[f"{params['name']}: {why}"] += 1
            return
        node = params.get("node_id")
        if node == self.real_node and entry.key == "node.capabilities" and payload not in self.forged:
            try:
                self.own_caps = decode(topic, payload, table=self.table)
            except DecodeError:  # one of the fuzz's own invalid payloads
                pass
            return
        if node == self.real_node and entry.key == "node.error":
            try:
                self.impostor_reports += decode(topic, payload, table=self.table).code == "duplicate_node_id"
            except DecodeError:
                pass
            return
        if node == self.real_node and entry.key in ("node.ack", "node.metrics", "node.job", "node.profile_report",
                                                    "node.inspect_report") and len(self.seen) < 500:
            self.seen.append((topic, payload))
        if node not in FAKES:
            return
        try:
            msg = decode(topic, payload, table=self.table)
        except DecodeError:
            return
        answers: list[Any] = []
        if entry.key == "node.inspect_request":
            if self.rng.random() < 0.7:
                answers.append(m.InspectReport(node_id=node, request_id=msg.request_id, job_id=msg.job_id, ok=True,
                                               arch=ARCH, train_rows=40, eval_rows=4, total_steps=6))
        elif entry.key == "node.profile_request":
            r = self.rng.random()
            if r < 0.7:
                caps = CAPS.model_copy(update={"node_id": node, "memory_available": 8 << 30})
                answers.append(m.ProfileReport(node_id=node, request_id=msg.request_id, job_id=msg.job_id,
                                               capabilities=caps, arch=msg.arch, task=msg.key.task,
                                               batch_size=msg.key.batch_size, seq_len=msg.key.seq_len, threads=1,
                                               sizes=msg.arch.sizes(),
                                               num_blocks=2, layers=LAYERS, profile_seconds=1.0, created_at=1.0))
            elif r < 0.85:
                answers.append(m.ErrorResponse(code="profile_failed", message=f"{msg.request_id}: fake failure"))
        elif entry.key == "node.assignment":
            self.fake_jobs[msg.job_id] = {"version": msg.plan_version, "nodes": {msg.node_id: msg.rank}}
            answers.append(m.AssignmentAck(job_id=msg.job_id, plan_version=msg.plan_version, node_id=node,
                                           accepted=self.rng.random() < 0.9, reason="fake"))
        elif entry.key == "node.control" and msg.action == "start":
            job = self.fake_jobs.get(msg.job_id, {"nodes": {}})
            rank = job["nodes"].get(node, 0)
            for step in range(1, 4):
                answers.append(SAMPLES["node.metrics"].model_copy(update={
                    "job_id": msg.job_id, "plan_version": msg.plan_version, "node_id": node, "rank": rank,
                    "step": step}))
            # The fake owner ends its job (completed or failed); the others say anything.
            status = self.rng.choice(["completed", "failed", "completed"] if rank == 0 else
                                     ["running", "completed", "failed", "paused"])
            answers.append(m.NodeJobStatus(node_id=node, job_id=msg.job_id, plan_version=msg.plan_version, rank=rank,
                                           status=status, step=6, checkpoint_step=3, export_dir="/out", sent_at=2.0))
        for a in answers:
            t, _ = self.table.topic_for(a, node_id=node)
            data = a.model_dump_json().encode() if self.table.match(t)[0].encoding == "json" else _msgpack(a)
            copies = 2 if self.rng.random() < 0.2 else 1  # sometimes twice
            for _ in range(copies):
                self.todo.append((t, data, False))
                self.counts[self.table.match(t)[0].key] += 1
        if self.rng.random() < 0.3:
            self.rng.shuffle(self.todo)  # out of order

    def batch(self, n: int) -> Iterator[tuple[str, bytes, bool]]:
        todo, self.todo = self.todo, []
        # Fake nodes flap: the fuzz says they went offline, they come back (mostly).
        for topic, payload, retain in announce_fakes(self.table):
            if self.rng.random() < 0.7:
                self.counts[self.table.match(topic)[0].key] += 1
                todo.insert(self.rng.randrange(len(todo) + 1), (topic, payload, retain))
        yield from todo
        for _ in range(max(n - len(todo), 0)):
            yield self.one()

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _msgpack(msg: m.Message) -> bytes:
    return msgpack.packb(msg.model_dump(mode="json"), use_bin_type=True)


def announce_fakes(table: TopicTable) -> list[tuple[str, bytes, bool]]:
    out = []
    for node in FAKES:
        out.append((table.build("node.availability", node_id=node), b"online", True))
        caps = CAPS.model_copy(update={"node_id": node, "memory_available": 8 << 30})
        out.append((table.build("node.capabilities", node_id=node), caps.model_dump_json().encode(), True))
    return out


