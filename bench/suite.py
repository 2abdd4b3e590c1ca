"""The throughput suite: pinfeed against DataLoader as usually written and against a
tuned DataLoader, side by side, per workload and ``num_workers``.

    python -m bench suite [--workloads W1,W3] [--runs 3] [--quick]
    python -m bench W4 [--runs ...]            # one workload
    python -m bench scaling                    # 1, 2, 4 trainers on one server (W1)

For every workload (``bench.data``) and num_workers, the workload's systems
(``Workload.systems``: pinfeed, dataloader, dataloader-tuned where it has a batched
read) run in fresh trainer processes, ``--runs`` times each, the order rotated every run
(ABC, CBA, ...: drift weighs on every system alike); medians and spreads per cell. Then
the single-process roofline and, for W1, the handoff latency of a ready batch. Each
workload writes ``docs/results/<W>.json``; ``scaling`` writes ``docs/results/scaling.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import data, results
from bench.cells import best
from bench.procs import BenchError, run_trainers
from bench.server import BenchServer

METHOD = (
    "Each run is a fresh trainer process. pinfeed: the trainer creates a loader over HTTP "
    "on a server started for the workload and iterates pinfeed.Loader (zero-copy views). "
    "dataloader: torch.utils.data.DataLoader as usually written (per-sample __getitem__ "
    "and default_collate) over the workload's reference Dataset (bench.references) or, for "
    "a python dataset, the very object the server builds. dataloader-tuned: one batched "
    "read a batch (batch_size=None over a BatchSampler on the same generator, or a "
    "pipeline's own batching). Both DataLoaders: persistent_workers when num_workers > 0, "
    "pin_memory only with CUDA, prefetch_factor 2; every system seed 0 (the same batches). "
    "Time to first batch: from creating the loader (pinfeed: POST /v1/loaders + attach; "
    "DataLoader: DataLoader() + iter) to the first batch. Throughput: after the first "
    "batch, the rest of the first epoch and the workload's further epochs, samples / wall "
    "seconds. CPU: the trainer tree's and the server tree's CPU seconds in that window. "
    "Memory: peak summed PSS of the server tree plus the trainer tree (pinfeed) or of the "
    "trainer tree (DataLoader: main process and workers). Roofline: the same gather into "
    "one preallocated buffer, one process, torch threads 1. Handoff (W1): latency of "
    "next() on a batch already prepared, num_workers 2, after a 20 ms busy step. A pinfeed "
    "run registers the dataset for itself and deletes it afterwards, so the server holds "
    "no data pages during DataLoader runs; the server's one-time costs (its start, the "
    "first loader with workers) are paid once before the runs (cold_start)."
)


def parse_args(argv: list[str] | None, prog: str = "python -m bench suite") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sample count")
    ap.add_argument("--runs", type=int, default=3, help="runs per cell (median, spread)")
    ap.add_argument("--workloads", default=",".join(data.MAKERS), help="comma-separated subset")
    ap.add_argument("--workers", default="0,1,2", help="num_workers values")
    ap.add_argument("--systems", default="", help="only these systems (default: each workload's)")
    ap.add_argument("--handoff-batches", type=int, default=150)
    ap.add_argument("--trainers", default="1,2,4", help="scaling: trainer counts")
    ap.add_argument(
        "--scaling-workers",
        default="best",
        help="scaling: num_workers each, or 'best': each system at its best in W1's result file",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the smallest files, 1 run, num_workers 2 (W1 also 0), trainers 1, 2",
    )
    ap.add_argument("--data-dir", type=Path, default=data.DATA_DIR, help="generated files' cache")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.runs, args.trainers = min(args.scale, 0.05), 1, "1,2"
        args.workers, args.handoff_batches = "2", 20
    args.workload_keys = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workload_keys) - set(data.MAKERS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(data.MAKERS)}")
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    # A smoke run takes W1 at 0 workers too: the server's own producer, DataLoader in the
    # trainer's process.
    args.w1_worker_counts = [0, *args.worker_counts] if args.quick else args.worker_counts
    args.trainer_counts = [int(x) for x in args.trainers.split(",") if x.strip()]
    args.only_systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    return args


def _spec(
    w: data.Workload, system: str, srv: BenchServer | None, root: Path, **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "system": system,
        "kind": w.kind,
        "params": w.params,
        "data_root": str(root),
        "batch_size": w.batch_size,
        "shuffle": w.shuffle,
        "epochs": w.epochs,
        "collate_fn": w.collate_fn,
        "reference": w.reference,
        "tuned": w.tuned,
        "transform": w.transform,
        **extra,
    }
    if srv is not None:
        spec |= {"url": srv.url, "socket": str(srv.socket)}
    return spec


_ids = itertools.count()


def warmup_batches(num_workers: int, prefetch_factor: int = 2) -> int:
    """The batches a timed run takes before its window: more than any system queues
    ahead of a trainer (pinfeed's ring: ``num_workers * prefetch_factor`` and the
    trainer's three slots; DataLoader's ``num_workers * prefetch_factor``), so none
    enters the window with batches made before it."""
    return prefetch_factor * max(1, num_workers) + 4


def loader_name(tag: str) -> str:
    return f"bench-{tag}-{os.getpid()}-{next(_ids)}"


def order(systems: tuple[str, ...], run: int) -> tuple[str, ...]:
    """ABC, CBA, ...: which system goes first alternates, so drift hits all alike."""
    return systems if run % 2 == 0 else systems[::-1]


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def register(srv: BenchServer, w: data.Workload, system: str = "pinfeed") -> str:
    """The workload's dataset for a pinfeed run: of its kind, or for ``pinfeed-python``
    a ``python`` dataset whose factory builds the reference Dataset object itself."""
    from pinfeed import Client

    name = f"{w.key.lower()}-{next(_ids)}"
    kind, params = w.kind, w.params
    if system == "pinfeed-python":
        kind = "python"
        params = {
            "factory": "bench.references:named",
            "kwargs": {
                "reference": w.reference,
                "data_root": str(srv.data_root),
                "params": w.params,
            },
        }
    with Client(srv.url, timeout=300) as c:
        c.create_dataset(name, kind, params, cache=w.cache)
    return name


def unregister(srv: BenchServer, dataset: str, loaders: list[str]) -> None:
    from pinfeed import Client, NotFound

    with Client(srv.url, timeout=300) as c:
        for name in loaders:  # normally deleted by their trainer already
            with contextlib.suppress(NotFound):
                c.delete_loader(name)
        c.delete_dataset(dataset)


def measure(
    srv: BenchServer, w: data.Workload, system: str, specs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One measurement. A pinfeed run gets the dataset registered for it alone and deleted
    after it, so between pinfeed runs the server maps none of the data set's pages: pages
    it kept mapped would be shared with, and so lower the PSS of, the DataLoader runs."""
    load = os.getloadavg()[0]
    if not system.startswith("pinfeed"):
        res, mem = run_trainers(specs, server_pid=None)
    else:
        dataset = register(srv, w, system)
        for spec in specs:
            spec["dataset"] = dataset
        try:
            res, mem = run_trainers(specs, server_pid=srv.pid)
        finally:
            unregister(srv, dataset, [spec["loader"] for spec in specs])
    mem["loadavg_1m_before"] = load
    return res, mem


def cold_start(srv: BenchServer, w: data.Workload) -> dict[str, float]:
    """The one-time costs a fresh server pays: its own start, then the first loader with
    workers (which starts the dataset's zygote). Paid once here, so runs see a warm
    server."""
    from pinfeed import Client

    dataset = register(srv, w)
    name = loader_name("coldstart")
    with Client(srv.url, timeout=300) as c:
        t0 = time.perf_counter()
        extra = {"collate_fn": w.collate_fn} if w.collate_fn else {}
        c.create_loader(name, dataset=dataset, batch_size=w.batch_size, num_workers=1, **extra)
        deadline = time.monotonic() + 300
        while c.loader(name)["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = time.perf_counter() - t0
    unregister(srv, dataset, [name])
    return {"server_start_s": srv.start_s, "first_loader_with_workers_ready_s": ready}


def _run_record(res: dict[str, Any], mem: dict[str, Any], **key: Any) -> dict[str, Any]:
    cpu = res.get("trainer_tree_cpu_s", 0.0) + mem.get("server_tree_cpu_s", 0.0)
    samples = res.get("samples") or 0
    return {
        **key,
        **res,
        **mem,
        "cpu_s": cpu,
        "cpu_ms_per_ksample": cpu / samples * 1e6 if samples else None,
    }


CELL_METRICS = ("samples_per_s", "ttfb_s", "peak_pss_bytes", "peak_rss_bytes", "cpu_ms_per_ksample")


def cell(runs: list[dict[str, Any]], metrics: tuple[str, ...] = CELL_METRICS) -> dict[str, Any]:
    """Median and spread of each metric over a cell's runs, and whether any ran under load."""
    out: dict[str, Any] = {m: results.spread([r.get(m) for r in runs]) for m in metrics}
    out["under_load"] = results.under_load(runs)
    out["foreign_share_max"] = max(
        ((r.get("foreign") or {}).get("share", 0.0) for r in runs), default=None
    )
    return out


def cells(
    runs: list[dict[str, Any]], metrics: tuple[str, ...] = CELL_METRICS, key: str = "num_workers"
) -> dict[str, dict[str, Any]]:
    """``{system: {str(run[key]): cell}}`` over the systems and values that ran."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["system"], r[key]), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for (system, n), rs in sorted(by.items()):
        out.setdefault(system, {})[str(n)] = cell(rs, metrics)
    return out


def bench_workload(args: argparse.Namespace, w: data.Workload) -> dict[str, Any]:
    root = args.data_dir
    systems = tuple(s for s in w.systems if not args.only_systems or s in args.only_systems)
    result = results.start(
        w.key,
        {
            "scale": args.scale,
            "runs": args.runs,
            "workers": args.workers,
            "systems": ",".join(systems),
        },
    )
    result |= {"kind": "throughput", "method": METHOD, "workload": w.describe()}
    runs: list[dict[str, Any]] = []
    roof: list[dict[str, Any]] = []
    handoff: list[dict[str, Any]] = []
    data.warm_page_cache(root, w)
    with BenchServer(root) as srv:
        result["cold_start"] = cold_start(srv, w)
        for nw in args.w1_worker_counts if w.key == "W1" else args.worker_counts:
            for run in range(args.runs):
                for system in order(systems, run):
                    spec = _spec(
                        w, system, srv, root, num_workers=nw, loader=loader_name(w.key.lower())
                    )
                    (res,), mem = measure(srv, w, system, [spec])
                    runs.append(_run_record(res, mem, system=system, num_workers=nw, run=run))
                    print(
                        f"  {w.key} nw={nw} {system:<17} {fmt(res['samples_per_s']):>9} "
                        f"samples/s  ttfb {res['ttfb_s'] * 1e3:6.0f} ms  peak PSS "
                        f"{mem['peak_pss_bytes'] / 2**20:6.0f} MiB  other load "
                        f"{mem['foreign']['share']:.0%}",
                        flush=True,
                    )
        for run in range(args.runs):
            (res,), mem = measure(
                srv, w, "roofline", [_spec(w, "roofline", None, root, num_workers=0)]
            )
            roof.append(_run_record(res, mem, system="roofline", num_workers=0, run=run))
            print(f"  {w.key} roofline          {fmt(res['samples_per_s']):>9} samples/s")
        if w.key == "W1":
            batches = min(args.handoff_batches, max(10, w.samples // w.batch_size - 2))
            for run in range(args.runs):
                for system in order(systems, run):
                    spec = _spec(
                        w,
                        system,
                        srv,
                        root,
                        num_workers=2,
                        mode="handoff",
                        handoff_batches=batches,
                        handoff_step_s=0.02,
                        loader=loader_name("handoff"),
                    )
                    (res,), mem = measure(srv, w, system, [spec])
                    handoff.append(_run_record(res, mem, system=system, num_workers=2, run=run))
                    print(
                        f"  handoff {system:<17} p50 {res['p50_us']:7.1f} us  "
                        f"p99 {res['p99_us']:7.1f} us",
                        flush=True,
                    )
    result["runs"] = runs
    result["cells"] = cells(runs)
    result["roofline"] = {"runs": roof, "cell": cell(roof)}
    if handoff:
        hcells = {}
        for system in systems:
            rs = [r for r in handoff if r["system"] == system]
            floors = [r["floor_after_step"]["p50_us"] for r in rs]
            hcells[system] = cell(rs, ("p50_us", "p90_us", "p99_us", "mean_us")) | {
                "floor_after_step_p50_us": results.spread(floors)
            }
        result["handoff"] = {"runs": handoff, "cells": hcells, "num_workers": 2, "step_s": 0.02}
    return results.finish(result, runs + roof + handoff)


def _scaling_workers(choice: str, systems: tuple[str, ...], folder: Path) -> dict[str, int]:
    """Each system's num_workers for ``scaling``: ``choice`` for all, or (``best``) each
    at its best median samples/s in W1's result file (the run's folder's, else the
    committed one), the setting its user would pick."""
    if choice != "best":
        return dict.fromkeys(systems, int(choice))
    w1 = results.load("W1", folder) or results.load("W1")
    if w1 is None:
        raise BenchError("--scaling-workers best reads W1.json: run python -m bench suite W1")
    picks = {s: best(w1["cells"], s)[0] for s in systems}
    missing = [s for s, nw in picks.items() if nw == "-"]
    if missing:
        raise BenchError(f"W1.json has no cells of {', '.join(missing)}: run it again")
    return {s: int(nw) for s, nw in picks.items()}


def bench_scaling(args: argparse.Namespace) -> dict[str, Any]:
    """1, 2, 4 trainers on one server, one loader each (W1, ``--scaling-workers``: each
    system at its best by default), one epoch each, against as many DataLoaders (plain
    and tuned)."""
    root = args.data_dir
    w = data.make_w1(root, args.scale)
    systems = tuple(s for s in w.systems if not args.only_systems or s in args.only_systems)
    workers = _scaling_workers(args.scaling_workers, systems, args.out)
    result = results.start(
        "scaling",
        {
            "scale": args.scale,
            "runs": args.runs,
            "trainers": args.trainers,
            "num_workers": args.scaling_workers,
        },
    )
    result |= {"kind": "scaling", "workload": w.describe(), "num_workers": workers}
    runs: list[dict[str, Any]] = []
    data.warm_page_cache(root, w)
    with BenchServer(root) as srv:
        result["cold_start"] = cold_start(srv, w)
        for n in args.trainer_counts:
            for run in range(args.runs):
                for system in order(systems, run):
                    nw = workers[system]
                    # One epoch each: n trainers share the cores, so each runs ~n times longer.
                    specs = [
                        _spec(
                            w, system, srv, root, num_workers=nw, epochs=1, loader=loader_name("s")
                        )
                        for _ in range(n)
                    ]
                    res, mem = measure(srv, w, system, specs)
                    agg = sum(r["samples_per_s"] for r in res)
                    runs.append(
                        {
                            "trainers": n,
                            "num_workers": nw,
                            "system": system,
                            "run": run,
                            "aggregate_samples_per_s": agg,
                            "per_trainer_samples_per_s": [r["samples_per_s"] for r in res],
                            "ttfb_s": [r["ttfb_s"] for r in res],
                            **mem,
                        }
                    )
                    print(
                        f"  scaling n={n} {system:<17} {fmt(agg):>9} samples/s aggregate  "
                        f"peak PSS {mem['peak_pss_bytes'] / 2**20:6.0f} MiB",
                        flush=True,
                    )
    metrics = ("aggregate_samples_per_s", "peak_pss_bytes")
    result["runs"], result["cells"] = runs, cells(runs, metrics, key="trainers")
    return results.finish(result, runs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench import tables

    args.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        for key in args.workload_keys:
            print(f"{key}: generating files", flush=True)
            w = data.MAKERS[key](args.data_dir, args.scale)
            if w.driver is not None:  # its own driver writes its result file
                print(f"{key}: measured by python -m bench {key} ({w.driver})")
                continue
            path = results.write(bench_workload(args, w), args.out)
            print(f"wrote {path}")
            print(tables.throughput_table(results.load(key, args.out)))
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


def write_and_show(name: str, make: Any, args: argparse.Namespace, table: Any) -> int:
    """Run ``make(args)``, write its result file ``name`` and print its table (``table``
    of the file as loaded back); 1, with the reason, where the benchmark failed."""
    args.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        path = results.write(make(args), args.out)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    print(table(results.load(name, args.out)))
    return 0


def scaling_main(argv: list[str] | None = None) -> int:
    from bench import tables

    args = parse_args(argv, "python -m bench scaling")
    return write_and_show("scaling", bench_scaling, args, tables.scaling_table)
