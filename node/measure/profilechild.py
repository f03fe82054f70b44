"""Profile in a child process: what the node service does on a profile request.

The service is long-lived and small; a profile allocates a full-width block, its gradients and
AdamW state. Running it in a child (a) measures under the allocator setting the training ranks use
(`xronos.node.measure.allocator`), which a running process cannot take on without keeping its peak heap
for life, (b) hands every byte back to the box when it ends, and (c) keeps a crash or the OOM
killer away from the service. The child is started as every child of the node is
(`xronos.node.rank.spawn.ChildProcess`): boxed under the box's memory and task limits, in its own
process group, dying with its parent, as its heap probes are; its report comes back on its events
pipe.

    python -m xronos.node.box.boxed xronos.node.measure.profilechild REQUEST.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from xronos.node.box.limits import ChildLimits
from xronos.protocol.messages import Capabilities, ProfileKey, ProfileReport

_TAIL_LINES = 15
REFUSED = 3  # the child's exit code when the profile refused to start (its reason on stderr)


class ProfileJob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any]
    key: ProfileKey  # the request's: the job recipe's task, batch, sequence, optimizer passes, LoRA
    threads: int
    iters: int = 10
    node_id: str
    request_id: str
    job_id: str
    capabilities: Capabilities
    cache_dir: str | None = None


def profile_in_child(job: ProfileJob, timeout_s: float = 3600.0, limits: ChildLimits | None = None) -> ProfileReport:
    """Run `job` in a fresh process with the ranks' environment, boxed by `limits` (node/box/limits.py);
    its report, or RuntimeError with the tail of what it printed (and the limit, if it ended it)."""
    from xronos.node.rank.spawn import ChildProcess, rank_env

    with tempfile.TemporaryDirectory(prefix="xronos-profile-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(job.model_dump_json())
        child = ChildProcess("xronos.node.measure.profilechild", str(req), env=rank_env(job.threads), name="profile",
                             limits=limits, events=True)
        try:
            code = child.wait(timeout_s)
        except TimeoutError:
            raise RuntimeError(f"profiling did not finish within {timeout_s:.0f} s") from None
        finally:
            child.close()
    if code == REFUSED:
        raise RuntimeError(child.tail(200)[-2000:])
    lines = child.drain_lines()
    if code != 0 or not lines:
        why = child.why()
        hint = "" if limits is None or "limit" in why else \
            f"; it ran limited to {limits.describe()}, and signal 9 is usually the OOM killer"
        raise RuntimeError(f"the profiling process failed ({why}{hint}):\n{child.tail(_TAIL_LINES)}")
    return ProfileReport.model_validate_json(lines[-1])


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.node.measure.profilechild REQUEST.json", file=sys.stderr)
        return 2
    from xronos.node.measure.profiler import profile
    from xronos.node.measure.profset import ProfileTooLarge
    from xronos.node.rank.spawn import send_result

    job = ProfileJob.model_validate_json(Path(argv[1]).read_text())
    try:
        key = job.key
        report = profile(job.config, key.task, key.batch_size, key.seq_len, threads=job.threads, iters=job.iters,
                         clip=key.clip, weight_decay=key.weight_decay, lora=key.lora, node_id=job.node_id,
                         request_id=job.request_id, job_id=job.job_id,
                         capabilities=job.capabilities, cache_dir=job.cache_dir)
    except ProfileTooLarge as exc:  # a refusal, not a crash: its sentence alone, no traceback
        print(exc, file=sys.stderr)
        return REFUSED
    send_result(report)
    return 0


if __name__ == "__main__":
    # the loopback Gloo pair of the collective probe outlives its groups by a little: end as a rank does
    from xronos.node.rank.spawn import main_process  # not at the top: the service imports this module

    main_process(main)
