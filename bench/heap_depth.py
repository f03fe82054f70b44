"""The heap probe's holes at several depths, drawn several times: how the holes grow with depth and
how much one draw varies (bench/results/mem-peak-v9.md).

    python -m xronos.bench.heap_depth --model roberta-base --seq-len 64 --depths 1,4,6 --repeats 3

Each point is `node/heapprobe.measure` in its own fresh process (`measure_in_child`) at the
profile's smallest width (`profiler.widths`), batch 8, one thread; one JSON line per point (MiB).
The model is the bench checkpoint's config (`bench.workloads`: dropout 0, as the grid's ranks
ran), not the `--arch` shape's (the families' default dropout 0.1 shifts the holes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.heap_depth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a bench shape (bench/workloads.py)")
    ap.add_argument("--task", default="classify", choices=["classify", "causal-lm"])
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--depths", default="1,4,6", help="blocks per probe, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clip", action="store_true", help="with the chunked clipping pass (the grid's ranks: without)")
    args = ap.parse_args(argv)

    from xronos.bench.workloads import shape_config, write_checkpoint
    from xronos.node.measure.heapprobe import measure_in_child
    from xronos.node.measure.profiler import widths
    from xronos.node.models.registry import family_for
    from xronos.protocol.layout import KINDS

    with tempfile.TemporaryDirectory(prefix="xronos-heapdepth-") as tmp:
        ckpt = write_checkpoint(Path(tmp) / "model", shape_config(args.model, 1))
        config = json.loads((ckpt / "config.json").read_text())
    sizes = family_for(config).sizes(config)
    small = widths(sizes)[-1]
    job = dict(config=config, task=args.task, batch=args.batch_size, seq=args.seq_len, seed=0, clip=args.clip,
               weight_decay=0.0, lora=None, layout={k: (small[k], sizes.total(k) - small[k]) for k in KINDS})
    for rep in range(args.repeats):
        for blocks in (int(d) for d in args.depths.split(",")):
            t0 = time.perf_counter()
            r = measure_in_child(job | {"blocks": blocks}, 1)
            print(json.dumps(dict(model=args.model, counts=small, clip=args.clip, blocks=blocks, rep=rep,
                                  slack_mib=round(r.get("slack", 0) / MiB, 1), span_mib=round(r.get("span", 0) / MiB, 1),
                                  in_use_peak_mib=round(r.get("in_use_peak", 0) / MiB, 1),
                                  seconds=round(time.perf_counter() - t0, 1))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
