"""What a trainer gets: a training loop with a fixed step per batch, for each system.

    python -m bench training [--workloads W1,W3] [--runs 3] [--quick]

The step stands for the GPU: ``sleep`` (default; the trainer's CPU is idle while the GPU
computes, as a trainer waiting on its CUDA stream) or ``spin`` (``--step-kind spin``:
the CPU busy). Per workload, system and ``num_workers``, fresh trainer processes
(ABC, CBA order) run ``--batches`` batches after the first and report:

- the stall share: time blocked in ``next()`` (epoch ends included) over the loop's
  wall time; 0 means input never held the step up;
- the trainer process's own CPU per batch (``getrusage(RUSAGE_SELF)``: its main thread
  and, under DataLoader, its pin-memory thread); what the training step would compete
  with in a real trainer (CUDA launches, the optimizer, logging);
- its children's CPU per batch (DataLoader's workers, forked from the trainer), and the
  server tree's (pinfeed's producer and workers), measured from outside; so the CPU
  each system spends in all is there too.

Steps: W1 5 ms (a batch of 256 small images), W3 20 ms (64 images at 224, about a
ResNet-50 step on one GPU); W9's is set where its workload is (issue 25). Writes
``docs/results/training.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench import data, results
from bench.procs import BenchError
from bench.server import BenchServer
from bench.suite import _spec, cell, loader_name, measure, order

METRICS = (
    "stall_share",
    "samples_per_s",
    "trainer_cpu_ms_per_batch",
    "trainer_children_cpu_ms_per_batch",
    "server_cpu_ms_per_batch",
    "total_cpu_ms_per_batch",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench training", description=__doc__)
    ap.add_argument("--workloads", default="W1,W3,W9", help="those not in bench.data are skipped")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=0, help="timed batches (default: per workload)")
    ap.add_argument("--step-kind", choices=("sleep", "spin"), default="sleep")
    ap.add_argument("--step-ms", type=float, default=0.0, help="override every workload's step")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 run, 30 batches, num_workers 0, 2"
    )
    ap.add_argument("--data-dir", type=Path, default=data.DATA_DIR)
    ap.add_argument("--out", type=Path, default=results.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.runs, args.batches, args.workers = min(args.scale, 0.05), 1, 30, "0,2"
    args.keys = [k.strip().upper() for k in args.workloads.split(",") if k.strip()]
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    return args


def _batches(w: data.Workload, args: argparse.Namespace) -> int:
    """Timed batches: at least two epochs, and at least about 2 s of steps."""
    if args.batches:
        return int(args.batches)
    per_epoch = -(-w.samples // w.batch_size)
    step_s = (args.step_ms or data.STEP_MS.get(w.key, 10.0)) / 1e3
    return max(2 * per_epoch, int(2.0 / step_s), 10)


def bench_workload(w: data.Workload, args: argparse.Namespace, srv: BenchServer) -> dict[str, Any]:
    root = args.data_dir
    step_ms = args.step_ms or data.STEP_MS.get(w.key, 10.0)
    batches = _batches(w, args)
    runs: list[dict[str, Any]] = []
    data.warm_page_cache(root, w)
    for nw in args.worker_counts:
        for run in range(args.runs):
            for system in order(w.systems, run):
                spec = _spec(
                    w,
                    system,
                    srv,
                    root,
                    num_workers=nw,
                    mode="training",
                    train_batches=batches,
                    step_ms=step_ms,
                    step_kind=args.step_kind,
                    loader=loader_name(f"train-{w.key.lower()}"),
                )
                (res,), mem = measure(srv, w, system, [spec])
                n = res["batches"]
                server_ms = mem["server_tree_cpu_s"] / n * 1e3
                rec = {
                    "system": system,
                    "num_workers": nw,
                    "run": run,
                    **res,
                    **mem,
                    "server_cpu_ms_per_batch": server_ms,
                    # the trainer tree (itself + children) and the server tree
                    "total_cpu_ms_per_batch": res["trainer_tree_cpu_s"] / n * 1e3 + server_ms,
                }
                runs.append(rec)
                print(
                    f"  {w.key} nw={nw} {system:<17} stall {res['stall_share']:5.1%}  trainer "
                    f"{res['trainer_cpu_ms_per_batch']:6.2f} ms/batch  children "
                    f"{res['trainer_children_cpu_ms_per_batch']:6.2f}  server {server_ms:6.2f}",
                    flush=True,
                )
    by: dict[str, dict[str, Any]] = {}
    for system in w.systems:
        for nw in args.worker_counts:
            rs = [r for r in runs if r["system"] == system and r["num_workers"] == nw]
            by.setdefault(system, {})[str(nw)] = cell(rs, METRICS)
    return {
        "workload": w.describe(),
        "step_ms": step_ms,
        "step_kind": args.step_kind,
        "batches": batches,
        "runs": runs,
        "cells": by,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench import tables

    args.data_dir.mkdir(parents=True, exist_ok=True)
    keys = [k for k in args.keys if k in data.MAKERS]
    skipped = [k for k in args.keys if k not in data.MAKERS]
    if skipped:
        print(f"skipping {skipped}: not in bench.data yet")
    result = results.start("training", vars(args) | {"workloads": ",".join(keys)})
    result |= {"kind": "training", "skipped": skipped, "workloads": {}}
    all_runs: list[dict[str, Any]] = []
    try:
        for key in keys:
            w = data.MAKERS[key](args.data_dir, args.scale)
            with BenchServer(args.data_dir) as srv:
                result["workloads"][key] = section = bench_workload(w, args, srv)
            all_runs += section["runs"]
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    path = results.write(results.finish(result, all_runs), args.out)
    print(f"wrote {path}")
    print(tables.training_table(results.load("training", args.out)))
    return 0
