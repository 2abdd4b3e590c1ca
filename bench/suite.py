"""The benchmark suite: pinfeed against ``torch.utils.data.DataLoader``, side by side.

For every workload (``bench.data``) and num_workers, pinfeed and DataLoader runs
alternate (ABBA order) in fresh trainer processes, ``--runs`` times each; the median
is reported. Then the single-process roofline, handoff latency of a ready batch,
and scaling with 1, 2 and 4 trainers on one server. Writes ``docs/bench.json`` and
``docs/bench.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import data
from bench.procs import BenchError, run_trainers
from bench.server import REPO, BenchServer

SYSTEMS = ("pinfeed", "dataloader")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="pinfeed vs torch.utils.data.DataLoader: throughput, roofline, handoff "
        "latency, time to first batch, peak memory, scaling. Writes docs/bench.json and "
        "docs/bench.png.",
    )
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every workload's sample count (default 1.0)",
    )
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument(
        "--workloads", default=",".join(data.MAKERS), help="comma-separated subset (default: all)"
    )
    ap.add_argument("--workers", default="0,1,2", help="num_workers values")
    ap.add_argument(
        "--trainers", default="1,2,4", help="trainer counts for the scaling section ('' skips it)"
    )
    ap.add_argument(
        "--scaling-workers",
        type=int,
        default=1,
        help="num_workers of each loader in the scaling section",
    )
    ap.add_argument("--handoff-batches", type=int, default=150)
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: --scale 0.1 --runs 1 --trainers 1,2"
    )
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=data.DATA_DIR,
        help="where generated workload files are cached",
    )
    ap.add_argument(
        "--out", type=Path, default=REPO / "docs", help="directory for bench.json and bench.png"
    )
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.runs, args.trainers = 0.1, 1, "1,2"
    args.workload_keys = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workload_keys) - set(data.MAKERS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(data.MAKERS)}")
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    args.trainer_counts = [int(x) for x in args.trainers.split(",") if x.strip()]
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    return args


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _git_commit() -> str | None:
    if os.environ.get("PINFEED_BENCH_COMMIT"):  # a tree exported without .git
        return os.environ["PINFEED_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "scale": args.scale,
        "runs": args.runs,
        "method": (
            "Each run is a fresh trainer process. pinfeed: the trainer creates a loader over "
            "HTTP on a server started for the section and iterates pinfeed.Loader (zero-copy "
            "views). DataLoader: the same Dataset class built by "
            "pinfeed_server.datasets.build_dataset from the same kind and params, "
            "persistent_workers when num_workers > 0, "
            "pin_memory only with CUDA, prefetch_factor 2 for both. Both use seed 0 (the "
            "same batches). Time to first batch: from creating the loader (pinfeed: POST "
            "/v1/loaders + attach; DataLoader: DataLoader() + iter) to the first batch. "
            "Throughput: after the first batch, the rest of the first epoch and the "
            "workload's further epochs, samples / wall seconds; runs of the two systems "
            "alternate (ABBA) and the median is reported. Memory: peak over the run of the "
            "summed RSS and PSS of the server tree (server, forkserver, workers) plus the "
            "trainer tree (pinfeed), or the trainer tree (DataLoader main + workers), "
            "RSS sampled every 0.1 s, PSS every 1 s and at the end (reading PSS stalls the "
            "process it reads, so it is read rarely). Roofline: the same gather "
            "(fetch_into) into one preallocated buffer, one process, torch threads 1. "
            "Handoff: latency of next() when the batch is already prepared, num_workers "
            "2: the trainer keeps its CPU busy for 20 ms (a stand-in for a training step, "
            "long enough for both systems to refill) before each next(); "
            "floor_after_step: what this machine charges after the same step for one "
            "socket send/recv and two tensor views in one process. Each section has a "
            "fresh server; "
            "its one-time costs (server start, the first loader with workers, which starts "
            "the forkserver) are paid and reported once (cold_start) before the runs. A "
            "pinfeed run registers the dataset for itself and deletes it afterwards, so the "
            "server holds no data pages during DataLoader runs. loadavg_1m_before records "
            "other load on the machine."
        ),
    }


class Progress:
    """A rich progress bar over the planned steps (plain lines when not a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.description:<44}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._bar.add_task("starting", total=total)

    def __enter__(self) -> Progress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)

    def step(self, description: str) -> None:
        self._bar.update(self._task, description=description)

    def done(self, note: str = "") -> None:
        self._bar.advance(self._task)
        if note:
            self._bar.console.print(note, highlight=False)


def _spec(
    workload: data.Workload, system: str, srv: BenchServer | None, root: Path, **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "system": system,
        "kind": workload.kind,
        "params": workload.params,
        "data_root": str(root),
        "batch_size": workload.batch_size,
        "shuffle": workload.shuffle,
        "epochs": workload.epochs,
        "collate_fn": workload.collate_fn,
        "reference": workload.reference,
        **extra,
    }
    if srv is not None:
        spec |= {"url": srv.url, "socket": str(srv.socket)}
    return spec


_loader_ids = itertools.count()


def _loader_name(tag: str) -> str:
    return f"bench-{tag}-{os.getpid()}-{next(_loader_ids)}"


def _order(run: int) -> tuple[str, ...]:
    """ABBA: alternate which system goes first, so drift hits both alike."""
    return SYSTEMS if run % 2 == 0 else SYSTEMS[::-1]


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    root = args.data_dir
    root.mkdir(parents=True, exist_ok=True)
    steps = 0
    for key in args.workload_keys:
        steps += 1 + len(args.worker_counts) * args.runs * 2 + args.runs
        if key == "W1":
            steps += 2
    steps += len(args.trainer_counts) * args.runs * 2
    result: dict[str, Any] = {
        "meta": _meta(args),
        "workloads": {},
        "runs": [],
        "roofline_runs": [],
        "handoff": {},
        "scaling_runs": [],
        "cold_start": {},
    }
    with Progress(steps) as progress:
        workloads = {}
        for key in args.workload_keys:
            progress.step(f"{key}: generating files")
            w = data.MAKERS[key](root, args.scale)
            workloads[key] = w
            result["workloads"][key] = w.describe()
            progress.done()
            with BenchServer(root) as srv:
                _section(args, w, srv, root, progress, result)
        if args.trainer_counts:
            w1 = workloads.get("W1") or data.make_w1(root, args.scale)
            result["workloads"].setdefault("W1", w1.describe())
            with BenchServer(root) as srv:
                _scaling(args, w1, srv, root, progress, result)
    result["summary"] = summarize(result)
    return result


_dataset_ids = itertools.count()


def _register(srv: BenchServer, w: data.Workload) -> str:
    from pinfeed import Client

    name = f"{w.key.lower()}-{next(_dataset_ids)}"
    with Client(srv.url, timeout=300) as c:
        c.create_dataset(name, w.kind, w.params)
    return name


def _unregister(srv: BenchServer, dataset: str, loaders: list[str]) -> None:
    from pinfeed import Client, NotFound

    with Client(srv.url, timeout=300) as c:
        for name in loaders:  # normally deleted by their trainer already
            with contextlib.suppress(NotFound):
                c.delete_loader(name)
        c.delete_dataset(dataset)


def _run(
    srv: BenchServer, w: data.Workload, system: str, specs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One measurement. A pinfeed run gets the dataset registered for it alone and deleted
    after it, so between pinfeed runs the server maps none of the data set's pages: pages
    it kept mapped would be shared with, and so lower the PSS of, the DataLoader runs."""
    load = os.getloadavg()[0]
    if system != "pinfeed":
        results, mem = run_trainers(specs, server_pid=None)
    else:
        dataset = _register(srv, w)
        for spec in specs:
            spec["dataset"] = dataset
        try:
            results, mem = run_trainers(specs, server_pid=srv.pid)
        finally:
            _unregister(srv, dataset, [spec["loader"] for spec in specs])
    mem["loadavg_1m_before"] = load
    return results, mem


def _cold_start(srv: BenchServer, w: data.Workload) -> dict[str, float]:
    """The one-time costs a fresh server pays: its own start, then the first loader with
    workers (which starts the forkserver). Paid once here, so runs see a warm server."""
    from pinfeed import Client

    dataset = _register(srv, w)
    name = _loader_name("coldstart")
    with Client(srv.url, timeout=300) as c:
        t0 = time.perf_counter()
        extra = {"collate_fn": w.collate_fn} if w.collate_fn else {}
        c.create_loader(name, dataset=dataset, batch_size=w.batch_size, num_workers=1, **extra)
        deadline = time.monotonic() + 300
        while c.loader(name)["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = time.perf_counter() - t0
    _unregister(srv, dataset, [name])
    return {"server_start_s": srv.start_s, "first_loader_with_workers_ready_s": ready}


def _section(
    args: argparse.Namespace,
    w: data.Workload,
    srv: BenchServer,
    root: Path,
    progress: Progress,
    result: dict[str, Any],
) -> None:
    data.warm_page_cache(root, w)
    result["cold_start"][w.key] = _cold_start(srv, w)
    for nw in args.worker_counts:
        for run in range(args.runs):
            for system in _order(run):
                progress.step(f"{w.key} nw={nw} {system} run {run + 1}/{args.runs}")
                spec = _spec(
                    w,
                    system,
                    srv,
                    root,
                    num_workers=nw,
                    loader=_loader_name(f"{w.key.lower()}-{nw}"),
                )
                (res,), mem = _run(srv, w, system, [spec])
                result["runs"].append(
                    {
                        "workload": w.key,
                        "num_workers": nw,
                        "system": system,
                        "run": run,
                        **res,
                        **mem,
                    }
                )
                progress.done(
                    f"  {w.key} nw={nw} {system:<10} {_fmt(res['samples_per_s']):>9}"
                    f" samples/s  ttfb {res['ttfb_s'] * 1e3:6.0f} ms  peak PSS "
                    f"{mem['peak_pss_bytes'] / 2**20:6.0f} MiB"
                )
    for run in range(args.runs):
        progress.step(f"{w.key} roofline run {run + 1}/{args.runs}")
        (res,), mem = _run(srv, w, "roofline", [_spec(w, "roofline", None, root, num_workers=0)])
        result["roofline_runs"].append({"workload": w.key, "run": run, **res, **mem})
        progress.done(f"  {w.key} roofline        {_fmt(res['samples_per_s']):>9} samples/s")
    if w.key == "W1":
        for system in SYSTEMS:
            progress.step(f"W1 handoff latency {system}")
            spec = _spec(
                w,
                system,
                srv,
                root,
                num_workers=2,
                mode="handoff",
                handoff_batches=min(args.handoff_batches, max(10, w.samples // w.batch_size - 2)),
                handoff_step_s=0.02,
                loader=_loader_name("handoff"),
            )
            (res,), mem = _run(srv, w, system, [spec])
            result["handoff"][system] = {**res, "workload": "W1", "num_workers": 2}
            progress.done(
                f"  handoff {system:<10} p50 {res['p50_us']:7.1f} us  p99 {res['p99_us']:7.1f} us"
            )


def _scaling(
    args: argparse.Namespace,
    w: data.Workload,
    srv: BenchServer,
    root: Path,
    progress: Progress,
    result: dict[str, Any],
) -> None:
    data.warm_page_cache(root, w)
    result["cold_start"].setdefault("scaling", _cold_start(srv, w))
    nw = args.scaling_workers
    for n in args.trainer_counts:
        for run in range(args.runs):
            for system in _order(run):
                progress.step(f"scaling {n} trainer(s) {system} run {run + 1}/{args.runs}")
                # One epoch each: n trainers share 2 cores, so each runs ~n times longer.
                specs = [
                    _spec(
                        w,
                        system,
                        srv,
                        root,
                        num_workers=nw,
                        loader=_loader_name(f"scale{n}"),
                        epochs=1,
                    )
                    for _ in range(n)
                ]
                results, mem = _run(srv, w, system, specs)
                agg = sum(r["samples_per_s"] for r in results)
                result["scaling_runs"].append(
                    {
                        "trainers": n,
                        "num_workers": nw,
                        "system": system,
                        "run": run,
                        "aggregate_samples_per_s": agg,
                        "per_trainer_samples_per_s": [r["samples_per_s"] for r in results],
                        "ttfb_s": [r["ttfb_s"] for r in results],
                        **mem,
                    }
                )
                progress.done(
                    f"  scaling n={n} {system:<10} {_fmt(agg):>9} samples/s "
                    f"aggregate  peak PSS {mem['peak_pss_bytes'] / 2**20:6.0f} MiB"
                )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per configuration, ratios, roofline shares and the issue's targets."""
    by: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in result["runs"]:
        by.setdefault((r["workload"], r["num_workers"], r["system"]), []).append(r)
    roof = {}
    for key in {r["workload"] for r in result["roofline_runs"]}:
        roof[key] = _median(
            [r["samples_per_s"] for r in result["roofline_runs"] if r["workload"] == key]
        )
    rows = []
    for wl, nw in sorted({(k[0], k[1]) for k in by}):
        p, d = by.get((wl, nw, "pinfeed"), []), by.get((wl, nw, "dataloader"), [])
        row: dict[str, Any] = {"workload": wl, "num_workers": nw}
        for name, rs in (("pinfeed", p), ("dataloader", d)):
            row[name] = {
                "samples_per_s": _median([r["samples_per_s"] for r in rs]),
                "samples_per_s_runs": [r["samples_per_s"] for r in rs],
                "ttfb_s": _median([r["ttfb_s"] for r in rs]),
                "peak_pss_bytes": _median([r["peak_pss_bytes"] for r in rs]),
                "peak_rss_bytes": _median([r["peak_rss_bytes"] for r in rs]),
                "peak_pss_by_process": {
                    label: _median([r["peak_pss_by_group"].get(label, 0) for r in rs])
                    for label in sorted({k for r in rs for k in r["peak_pss_by_group"]})
                },
            }
        row["ratio"] = row["pinfeed"]["samples_per_s"] / row["dataloader"]["samples_per_s"]
        row["ttfb_ratio"] = row["pinfeed"]["ttfb_s"] / row["dataloader"]["ttfb_s"]
        row["pss_ratio"] = row["pinfeed"]["peak_pss_bytes"] / row["dataloader"]["peak_pss_bytes"]
        row["rss_ratio"] = row["pinfeed"]["peak_rss_bytes"] / row["dataloader"]["peak_rss_bytes"]
        if wl in roof:
            row["roofline_samples_per_s"] = roof[wl]
            row["pinfeed_roofline_share"] = row["pinfeed"]["samples_per_s"] / roof[wl]
            row["dataloader_roofline_share"] = row["dataloader"]["samples_per_s"] / roof[wl]
        rows.append(row)
    scaling = []
    sc: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in result["scaling_runs"]:
        sc.setdefault((r["trainers"], r["system"]), []).append(r)
    for n in sorted({k[0] for k in sc}):
        entry: dict[str, Any] = {"trainers": n}
        for system in SYSTEMS:
            rs = sc.get((n, system), [])
            entry[system] = {
                "aggregate_samples_per_s": _median([r["aggregate_samples_per_s"] for r in rs]),
                "peak_pss_bytes": _median([r["peak_pss_bytes"] for r in rs]),
            }
        entry["ratio"] = (
            entry["pinfeed"]["aggregate_samples_per_s"]
            / entry["dataloader"]["aggregate_samples_per_s"]
        )
        scaling.append(entry)
    return {
        "throughput": rows,
        "roofline_samples_per_s": roof,
        "scaling": scaling,
        "handoff": {
            k: {
                **{m: v[m] for m in ("p50_us", "p90_us", "p99_us", "mean_us", "min_us", "n")},
                "floor_after_step_p50_us": v["floor_after_step"]["p50_us"],
            }
            for k, v in result["handoff"].items()
        },
        # pinfeed: attach + first batch of a loader created ahead (its ring full).
        "warm_attach_ttfb_s": result["handoff"].get("pinfeed", {}).get("ttfb_s"),
        "cold_start": result["cold_start"],
        "targets": targets(rows, result["handoff"]),
    }


def targets(rows: list[dict[str, Any]], handoff: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets that this machine can check (the GPU one is bench/gpu.py's)."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, ok: Callable[[float], bool]) -> None:
        out.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "met": None if value is None else bool(ok(value)),
            }
        )

    get = {(r["workload"], r["num_workers"]): r for r in rows}
    for wl in ("W1", "W2", "W4", "W6"):
        r = get.get((wl, 2))
        add(
            f"{wl} samples/s vs DataLoader, num_workers 2",
            r["ratio"] if r else None,
            ">= 3.0x",
            lambda v: v >= 3.0,
        )
    for (wl, nw), r in sorted(get.items()):
        if wl in ("W3", "W5", "W7", "W8"):
            add(
                f"{wl} samples/s vs DataLoader, num_workers {nw}",
                r["ratio"],
                ">= 1.0x",
                lambda v: v >= 1.0,
            )
    r = get.get(("W1", 1))
    add(
        "W1 num_workers 1, share of the single-process roofline",
        r.get("pinfeed_roofline_share") if r else None,
        ">= 0.70",
        lambda v: v >= 0.70,
    )
    h = handoff.get("pinfeed")
    add(
        "handoff p50 of a ready batch (us)",
        h["p50_us"] if h else None,
        "<= 30 us",
        lambda v: v <= 30,
    )
    for (wl, nw), r in sorted(get.items()):
        add(
            f"{wl} num_workers {nw}: peak PSS vs DataLoader",
            r["pss_ratio"],
            "<= 1.0x",
            lambda v: v <= 1.0,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        import matplotlib  # noqa: F401
        import psutil  # noqa: F401
    except ImportError as exc:
        print(
            f"the benchmarks need the 'bench' extra ({exc.name} is missing): "
            "pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    from bench import report

    args = parse_args(argv)
    t0 = time.monotonic()
    try:
        result = run_suite(args)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    result["meta"]["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = report.write_json(result, args.out / "bench.json")
    png_path = None if args.no_plot else report.plot(result, args.out / "bench.png")
    report.print_tables(result)
    print(
        f"wrote {json_path}"
        + (f" and {png_path}" if png_path else "")
        + f" in {result['meta']['wall_s']:.0f} s"
    )
    return 0
