"""The job state machine's effects as the messages they put on the wire: pure, the gateway service
publishes what `messages` yields, one message at a time (a message that cannot be built stops the
effect there, as one that cannot be published does), each with the topic parameters it goes to.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Iterator
from typing import Any

from xronos.gateway.registry import Registry
from xronos.protocol import messages as m

from .types import Assign, Control, Effect, Inspect, Job, Profile, Reshard, Respond

_CONTROLS = {"start": m.JobStart, "pause": m.JobPause, "resume": m.JobResume, "cancel": m.JobCancel}
Outgoing = Iterator[tuple[m.Message, dict[str, str]]]


def messages(e: Effect, job: Job | None, reg: Registry, ports: tuple[int, int]) -> Outgoing:
    """The messages carrying out effect `e` of `job` (None for a `Respond`, which names no job);
    `reg` gives an assignment its owner's data-plane address, `ports` the rendezvous port range."""
    if isinstance(e, Respond):
        yield m.GatewayResponse(status="ok" if e.ok else "error", data=_jsonable(e.data), error=e.error,
                                transaction=e.transaction), {"name": e.name}
    elif isinstance(e, Inspect):
        assert job is not None, e
        yield m.InspectRequest(request_id=e.request_id, job_id=e.job_id, spec=job.spec), {"node_id": e.node_id}
    elif isinstance(e, Profile):
        assert job is not None and job.arch is not None, e
        for rid, node in e.requests:
            req = m.ProfileRequest(request_id=rid, job_id=e.job_id, arch=job.arch, key=job.spec.recipe.profile_key())
            yield req, {"node_id": node}
    elif isinstance(e, Assign):
        assert job is not None, e
        yield from _assign(e, job, reg, ports)
    elif isinstance(e, Reshard):
        yield m.JobReshard(job_id=e.job_id, plan_version=e.plan_version, at_step=e.at_step,
                           layout=e.layout, reason=e.reason,
                           shares=list(e.shares) if e.shares is not None else None), {"node_id": e.node}
    elif isinstance(e, Control):
        for node in e.nodes:
            yield _CONTROLS[e.action](job_id=e.job_id, plan_version=e.plan_version), {"node_id": node}


def _assign(e: Assign, job: Job, reg: Registry, ports: tuple[int, int]) -> Outgoing:
    owner = reg.get(job.owner)
    host = owner.capabilities.data_host if owner and owner.capabilities else None
    lo, hi = ports
    port = lo + (zlib.crc32(e.job_id.encode()) + e.plan.version) % (hi - lo + 1)
    entries = e.plan.entries
    layout = e.plan.layout()
    key = secrets.token_hex(32)  # the world's (node/tp/groupkey.py): every rank of this version gets it
    for x in entries:
        yield m.Assignment(
            job_id=e.job_id, plan_version=e.plan.version, node_id=x.node_id, rank=x.rank,
            world_size=len(entries), rendezvous_host=host or "127.0.0.1", rendezvous_port=port,
            layout=layout, spec=job.spec, shares=e.plan.shares, resume_step=e.resume_step,
            group_key=key, overlap=e.plan.overlap, trial=e.plan.trial), {"node_id": x.node_id}


def _jsonable(data: Any) -> Any:
    """A response's data with its models in JSON form."""
    if data is None:
        return None
    return {k: v.model_dump(mode="json") if isinstance(v, m.Message) else v for k, v in dict(data).items()}
