"""`xronos run --strategy`: each rank's predicted peak memory against the peak it reached.

The prediction is the planner's (`memorymodel.predict_memory` at the rank's shares; rank 0 as the
owner, export included); the measurement is the rank's resident high-water mark over its whole
life (`xronos.node.measure.memwatch`: VmHWM, the export included), which the metrics document carries
under `memory.peak_rss_bytes`. The training iterations' own peak (`peak_rss` of the summaries)
is shown beside it.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20


def judge_memory(rows: list[Any], doc: dict[str, Any]) -> dict[str, Any] | None:
    """Per rank: predicted_peak_bytes, peak_rss_bytes, train_peak_rss_bytes, memory_cap_bytes and
    the error (%); the mean absolute percentage error. None when the document has no peaks."""
    peaks = (doc.get("memory") or {}).get("peak_rss_bytes")
    if not peaks:
        return None
    out = []
    for row, peak, rank in zip(rows, peaks, doc["ranks"]):
        out.append(dict(rank=row.rank, predicted_peak_bytes=row.predicted_memory, peak_rss_bytes=peak,
                        train_peak_rss_bytes=rank["summary"]["peak_rss"], memory_cap_bytes=row.memory_cap,
                        error_pct=100.0 * (row.predicted_memory - peak) / peak))
    return dict(ranks=out, mape_pct=sum(abs(r["error_pct"]) for r in out) / len(out))


def format_memory(j: dict[str, Any]) -> str:
    lines = [f"{'rank':>4} {'predicted MiB':>13} {'peak MiB':>9} {'training MiB':>12} {'cap MiB':>9} {'error':>7}"]
    for r in j["ranks"]:
        cap = r["memory_cap_bytes"]
        cap_text = f"{cap / MiB:>9.0f}" if cap < 1 << 49 else f"{'-':>9}"
        lines.append(f"{r['rank']:>4} {r['predicted_peak_bytes'] / MiB:>13.0f} {r['peak_rss_bytes'] / MiB:>9.0f} "
                     f"{r['train_peak_rss_bytes'] / MiB:>12.0f} {cap_text} {r['error_pct']:>+6.1f}%")
    lines.append(f"peak-memory prediction MAPE {j['mape_pct']:.2f}% (resident high-water mark, export included)")
    return "\n".join(lines)
