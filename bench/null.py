"""``python -m bench null``: the fixed cost per batch of each way into pinfeed, beside its
floor.

    python -m bench null [--runs 3] [--seconds 3] [--workers 0,1,2] [--quick]

The null workload (``bench.data.make_null``): batches of one sample of one uint8, so
making a batch costs next to nothing and a path's batches/s is its fixed cost per
batch: the messages between trainer and server, the wake-ups, the views. Per
``num_workers``, fresh trainer processes, the systems' order rotated every run:

- ``floor``: the same messages (a NEXT, a BATCH head and dims) over a socket pair and
  the same tensor views, in one process, no other process (``bench.trainer._floor``);
- ``floor-ipc``: the same with another process answering each NEXT, two NEXTs in
  flight (``bench.trainer._floor_ipc``): what any two processes pay on this machine;
- ``pinfeed``: a named loader (``pinfeed.Loader``) on the ``tensors`` kind;
- ``pinfeed-dataloader``: ``pinfeed.DataLoader`` over torch's ``TensorDataset``, a
  ``__getitem__`` a sample; ``pinfeed-dataloader-getitems``: over a Dataset with a
  batched ``__getitems__``; ``pinfeed-dataloader-tuned``: ``batch_size=None`` over a
  ``BatchSampler``, the Dataset indexed with the index list;
- ``dataloader``: torch's own DataLoader over the same ``TensorDataset``.

Each run times a window of ``--seconds`` after a warm-up that drains what was queued
before it (``bench.trainer.timed``). Writes ``docs/results/null.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import data, results, suite
from bench.server import BenchServer

SYSTEMS = (
    "floor",
    "floor-ipc",
    "pinfeed",
    "pinfeed-dataloader",
    "pinfeed-dataloader-getitems",
    "pinfeed-dataloader-tuned",
    "dataloader",
)
METRICS = ("batches_per_s", "samples_per_s", "cpu_ms_per_ksample")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench null", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per cell (median, spread)")
    ap.add_argument("--seconds", type=float, default=3.0, help="each run's timed window")
    ap.add_argument("--workers", default="0,1,2", help="num_workers values")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the sample count")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 run of 1 s a cell")
    ap.add_argument("--data-dir", type=Path, default=data.DATA_DIR, help="generated files' cache")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.seconds, args.scale = 1, 1.0, min(args.scale, 0.25)
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    return args


def bench_null(args: argparse.Namespace) -> dict[str, Any]:
    root = args.data_dir
    w = data.make_null(root, args.scale)
    systems = tuple(args.system_list)
    result = results.start(
        "null",
        {"runs": args.runs, "seconds": args.seconds, "workers": args.workers, "scale": args.scale},
    )
    result |= {"kind": "null", "workload": w.describe(), "method": __doc__}
    runs: list[dict[str, Any]] = []
    with BenchServer(root) as srv:
        result["cold_start"] = suite.cold_start(srv, w)
        for nw in args.worker_counts:
            for run in range(args.runs):
                for system in suite.order(systems, run):
                    spec = suite._spec(
                        w,
                        system,
                        srv,
                        root,
                        num_workers=nw,
                        loader=suite.loader_name("null"),
                        mode="timed",
                        seconds=args.seconds,
                        warmup=suite.warmup_batches(nw),
                        samples=w.samples,
                        sample_shape=w.sample_shape,
                        dtype=w.dtype,
                        getitems=w.getitems,
                    )
                    (res,), mem = suite.measure(srv, w, system, [spec])
                    runs.append(suite._run_record(res, mem, system=system, num_workers=nw, run=run))
                    print(
                        f"  null nw={nw} {system:<28} {res['batches_per_s']:9,.0f} batches/s "
                        f"({1e6 / res['batches_per_s']:6.1f} us a batch)  other load "
                        f"{mem['foreign']['share']:.0%}",
                        flush=True,
                    )
    result["runs"], result["cells"] = runs, suite.cells(runs, METRICS)
    return results.finish(result, runs)


def main(argv: list[str] | None = None) -> int:
    from bench import tables

    return suite.write_and_show("null", bench_null, parse_args(argv), tables.null_table)
