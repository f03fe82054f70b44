"""Requests and their answers: a node's `ErrorResponse` to a request it could not serve, and the
gateway's request/response API (Zigbee2MQTT style, JSON): one model per request name
(`REQUEST_MODELS`), one `GatewayResponse`. Re-exported by `xronos.protocol.messages`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from .msgjob import JobSpec
from .msgtypes import Code, Id, Message, Text4k, Text256, TopicText


class ErrorResponse(Message):
    code: Code
    message: Text4k
    topic: TopicText | None = None


# --- Gateway requests/responses (Zigbee2MQTT style, JSON) -------------------------------------

Transaction = Text256 | None


class GatewayRequest(Message):
    transaction: Transaction = None


class JobSubmitRequest(GatewayRequest):
    spec: JobSpec


class JobStatusRequest(GatewayRequest):
    job_id: Id | None = None  # None = every job


class JobPauseRequest(GatewayRequest):
    job_id: Id


class JobResumeRequest(GatewayRequest):
    job_id: Id


class JobCancelRequest(GatewayRequest):
    job_id: Id


class NodesListRequest(GatewayRequest):
    pass


class PlanPreviewRequest(GatewayRequest):
    spec: JobSpec


class GatewayResponse(Message):
    status: Literal["ok", "error"]
    data: dict[str, Any] | list[Any] | None = None
    error: Text4k | None = None
    transaction: Transaction = None

    @model_validator(mode="after")
    def _error_has_text(self) -> GatewayResponse:
        if self.status == "error" and not self.error:
            raise ValueError("error: an error response needs an error text")
        return self


REQUEST_MODELS: dict[str, type[GatewayRequest]] = {
    "job/submit": JobSubmitRequest,
    "job/status": JobStatusRequest,
    "job/pause": JobPauseRequest,
    "job/resume": JobResumeRequest,
    "job/cancel": JobCancelRequest,
    "nodes/list": NodesListRequest,
    "plan/preview": PlanPreviewRequest,
}
