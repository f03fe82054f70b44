"""The gateway's requests (`{base}/gateway/request/<name>`, answered on `.../response/<name>`): submit
a job, preview its plan, a job's status or the recent ones, pause / resume / cancel, the nodes.

A submit or a preview is answered later (`DEFER`), by the job state machine's `Respond` effect,
once the owner's inspection, the profiles and a plan have decided it.
"""

from __future__ import annotations

from typing import Any

from xronos.gateway import registry as R
from xronos.gateway.job import machine as J
from xronos.gateway.job.progress import state_view
from xronos.gateway.job.views import summary
from xronos.protocol import messages as m
from xronos.protocol.dispatch import DEFER, Dispatcher, RequestError

from .component import Component, Core

RECENT_JOBS = 50  # a status request without a job id lists this many, newest last


class Requests(Component):
    name = "requests"

    def __init__(self, core: Core) -> None:
        self.core = core

    def register(self, dispatcher: Dispatcher) -> None:
        for name, fn in (("job/submit", self._submit), ("job/status", self._status),
                         ("job/pause", self._command), ("job/resume", self._command),
                         ("job/cancel", self._command), ("nodes/list", self._nodes),
                         ("plan/preview", self._preview)):
            dispatcher.on(f"gateway.request.{name}", fn)

    def _submit(self, req: m.JobSubmitRequest, _p: dict[str, str]) -> Any:
        self.core.submit(req.spec, req.transaction)
        return DEFER

    def _preview(self, req: m.PlanPreviewRequest, _p: dict[str, str]) -> Any:
        self.core.submit(req.spec, req.transaction, respond_to="plan/preview")
        return DEFER

    def _status(self, req: m.JobStatusRequest, _p: dict[str, str]) -> Any:
        if req.job_id is None:
            recent = sorted(self.core.jobs.values(), key=lambda j: j.created_at)[-RECENT_JOBS:]
            return {"jobs": [summary(j) for j in recent]}
        job = self.core.jobs.get(req.job_id)
        if job is None:
            raise RequestError(f"unknown job {req.job_id!r}")
        return {"job": state_view(job).model_dump(mode="json")}

    def _command(self, req: m.JobPauseRequest | m.JobResumeRequest | m.JobCancelRequest, _p: dict[str, str]) -> Any:
        action = type(req).__name__.removeprefix("Job").removesuffix("Request").lower()
        if req.job_id not in self.core.jobs:
            raise RequestError(f"unknown job {req.job_id!r}")
        self.core.event(req.job_id, J.Command(action, req.transaction))
        return DEFER

    def _nodes(self, _req: m.NodesListRequest, _p: dict[str, str]) -> Any:
        return {"nodes": R.listing(self.core.reg)}
