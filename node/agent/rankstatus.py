"""A job rank's typed events (`node/rank/messages.py`) as this node's job status: which status
and which of `NodeJobStatus`'s fields each event sets. Metrics are not a status: the service
publishes them as `IterationMetrics`."""

from __future__ import annotations

from typing import Any

import structlog

from xronos.node.rank import messages as msg

log = structlog.get_logger(__name__)


def status_update(job_id: str, ev: msg.RankEvent, now: str) -> tuple[str, dict[str, Any]] | None:
    """(status, fields) an event sets, `now` being the current status; None for a metrics event."""
    if isinstance(ev, msg.Status):
        return ev.status, {}
    if isinstance(ev, msg.Evaluated):
        key = "eval_initial" if ev.when == "before" else "eval_metric"
        return now, {key: ev.metric, "eval_metric_name": ev.name}
    if isinstance(ev, msg.Checkpointed):
        return "running", {"checkpoint_step": ev.step, "step": ev.step}
    if isinstance(ev, msg.Completed):
        return "completed", {"step": ev.step, "epoch": ev.epoch, "export_dir": ev.export_dir}
    if isinstance(ev, msg.Failed):
        return "failed", {"detail": ev.detail or None, "job_fault": ev.job_fault}
    if isinstance(ev, msg.Cancelled):
        return "cancelled", {"detail": None, "job_fault": False}
    if isinstance(ev, msg.Resharded):  # the owner's: the gateway hears the step the ranks moved at
        log.info("resharded", job_id=job_id, step=ev.step, layout=ev.layout.to_text(), shares=ev.shares,
                 reason=ev.reason)
        return now, {"reshard_step": ev.step, "reshard_layout": ev.layout, "reshard_s": ev.seconds,
                     "reshard_bytes": ev.moved_bytes, "reshard_shares": ev.shares}
    if isinstance(ev, msg.OverlapTried):  # the owner's: the gateway hears which mode the trial kept
        log.info("overlap_tried", job_id=job_id, step=ev.step, kept=ev.kept, seconds=ev.seconds)
        return now, {"trial_step": ev.step, "trial_kept": ev.kept, "trial_seconds": dict(ev.seconds)}
    if isinstance(ev, msg.ReshardRefused):  # the owner's: the gateway drops the order it had pending
        log.warning("reshard_refused", job_id=job_id, detail=ev.detail)
        return now, {"reshard_refused": ev.detail[:256] or "refused"}
    return None
