"""Autotune against fixed settings (issue 15): a trainer with a fixed compute step on
the decode-bound workloads (W3; W5, W3's JPEGs with random crop and flip, when
``bench.data`` has it), from ``num_workers=1``.

For each workload, one server; runs one after another, each a fresh loader and a
trainer (in this process: its step is a ``sleep``, standing for GPU time, so it takes
no core from the workers) reading for ``--seconds``:

- fixed ``num_workers`` = each of ``--fixed`` (prefetch_factor 2),
- ``num_workers=1`` with ``autotune: {max_workers: --max-workers, interval_s}``.

One window rule for every setting, autotune included: the steady rate is the mean
samples/s from ``--warmup`` s to the end of the run (the same seconds for all), so time
autotune spends finding its setting inside the window counts against it; the mean over
the whole run (from 0 s) is reported too. ``--rounds`` rounds of all settings, the order
reversed every other round; per setting the median and min/max over rounds. Also: the
samples/s curve per second, when autotune settled (its last decision, from the loader's
stats) and its decisions. ``python -m bench autotune`` prints the table and writes
``docs/results/autotune.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench import data, results
from bench.server import BenchServer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench autotune", description=__doc__)
    ap.add_argument("--workloads", default="W3,W5", help="those not in bench.data are skipped")
    ap.add_argument("--fixed", default="1,2,3", help="fixed num_workers to compare with")
    ap.add_argument("--max-workers", type=int, default=3, help="autotune's max_workers")
    ap.add_argument("--interval", type=float, default=2.0, help="autotune's interval_s")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    ap.add_argument(
        "--warmup", type=float, default=8.0, help="every setting: the rate is measured after"
    )
    ap.add_argument("--step-ms", type=float, default=20.0, help="the trainer's compute per batch")
    ap.add_argument(
        "--batch-size", type=int, default=16, help="batch size (small: many measurements a second)"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="workload sample-count scale")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of all settings, order reversed every other round (median, min, max)",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 s, fixed 1,2, 1 round")
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=data.DATA_DIR,
    )
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.fixed, args.warmup, args.interval = 8.0, "1,2", 3.0, 1.0
        args.rounds, args.scale = 1, min(args.scale, 0.34)
    args.fixed_counts = [int(x) for x in args.fixed.split(",") if x.strip()]
    return args


def _run(
    srv: BenchServer, dataset: str, w: data.Workload, args: argparse.Namespace, **loader: Any
) -> dict[str, Any]:
    from pinfeed import Client, Loader

    name = f"run{time.monotonic_ns()}"
    step = args.step_ms / 1e3
    foreign = results.ForeignCpu().start()
    with Client(srv.url, timeout=300) as admin:  # workers start slowly on a loaded box
        admin.create_loader(
            name, dataset=dataset, batch_size=args.batch_size, shuffle=True, seed=0, **loader
        )
        per_second: list[int] = []
        t0 = time.monotonic()
        with Loader(name, socket=srv.socket, timeout=120) as trainer:
            while time.monotonic() - t0 < args.seconds:
                for batch in trainer:
                    second = int(time.monotonic() - t0)
                    per_second.extend([0] * (second + 1 - len(per_second)))
                    per_second[second] += int(batch[0].shape[0])
                    time.sleep(step)  # the trainer's step: GPU time, no CPU
                    if time.monotonic() - t0 >= args.seconds:
                        break
        stats = admin.loader_stats(name)
        final = admin.loader(name)
        admin.delete_loader(name)
    window_cpu = foreign.stop()
    per_second = per_second[: int(args.seconds)]
    per_second.extend([0] * (int(args.seconds) - len(per_second)))
    tune = stats.get("autotune")
    settled = None
    if tune:
        # Settled: the last change (or the first 'settled' record), seconds from start.
        settled = tune["settled_after_s"]
        changes = [d["t"] for d in tune["decisions"]]
        if settled is None and changes:
            settled = changes[-1]
    since = int(args.warmup)  # the same window for every setting
    window = per_second[since:] or per_second
    return {
        "loader": loader,
        "samples_per_s_curve": per_second,
        "steady_samples_per_s": sum(window) / max(1, len(window)),
        "whole_run_samples_per_s": sum(per_second) / max(1, len(per_second)),
        "steady_from_s": since,
        "foreign": window_cpu,
        "final_num_workers": final["num_workers"],
        "final_prefetch_factor": final["prefetch_factor"],
        "settled_after_s": settled,
        "decisions": tune["decisions"] if tune else None,
    }


def bench_workload(key: str, args: argparse.Namespace) -> dict[str, Any]:
    args.data_dir.mkdir(parents=True, exist_ok=True)
    w = data.MAKERS[key](args.data_dir, args.scale)
    data.warm_page_cache(args.data_dir, w)
    out: dict[str, Any] = {"workload": w.describe(), "fixed": {}, "autotune": None}
    with BenchServer(args.data_dir) as srv:
        from pinfeed import Client

        with Client(srv.url) as admin:
            admin.create_dataset(key.lower(), w.kind, w.params)
        spec = {"max_workers": args.max_workers, "interval_s": args.interval}
        settings: list[tuple[str, dict[str, Any]]] = [
            (str(n), {"num_workers": n}) for n in args.fixed_counts
        ] + [("autotune", {"num_workers": 1, "autotune": spec})]
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in settings}
        for rnd in range(args.rounds):
            # Reversed every other round, so a machine's drift weighs on every setting.
            for label, loader in settings if rnd % 2 == 0 else settings[::-1]:
                r = _run(srv, key.lower(), w, args, **loader)
                runs[label].append(r)
                print(f"{key} {label} (round {rnd}): {r['steady_samples_per_s']:.0f} samples/s")
    for label, rounds in runs.items():
        summary = {
            "rounds": rounds,
            "steady": results.spread([r["steady_samples_per_s"] for r in rounds]),
            "whole_run": results.spread([r["whole_run_samples_per_s"] for r in rounds]),
            "under_load": results.under_load(rounds),
        }
        if label == "autotune":
            summary["settled_after_s"] = results.spread([r["settled_after_s"] for r in rounds])
            summary["final"] = sorted(
                {f"{r['final_num_workers']}x{r['final_prefetch_factor']}" for r in rounds}
            )
            summary["max_workers"] = args.max_workers
            out["autotune"] = summary
        else:
            out["fixed"][label] = summary
    best_n, best = max(
        ((n, f["steady"]["median"]) for n, f in out["fixed"].items()), key=lambda x: x[1]
    )
    out["best_fixed"] = {"num_workers": int(best_n), "samples_per_s": best}
    a = out["autotune"]
    out["autotune_vs_best"] = a["steady"]["median"] / best if best else None
    print(
        f"{key} autotune: {a['steady']['median']:.0f} samples/s from {args.warmup:.0f} s "
        f"(settled at {a['settled_after_s']['median']} s on {a['final']}; "
        f"{out['autotune_vs_best']:.0%} of the best fixed, num_workers={best_n})"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench import tables

    keys = [k.strip().upper() for k in args.workloads.split(",") if k.strip()]
    missing = [k for k in keys if k not in data.MAKERS]
    if missing:
        print(f"skipping {missing}: not in bench.data")
    os.environ.setdefault("PINFEED_MAX_WORKERS", "64")  # fixed runs past the cores too
    result = results.start("autotune", vars(args))
    result |= {"kind": "autotune", "skipped": missing}
    result["workloads"] = [bench_workload(k, args) for k in keys if k in data.MAKERS]
    rounds = [
        r
        for res in result["workloads"]
        for s in [*res["fixed"].values(), res["autotune"]]
        for r in s["rounds"]
    ]
    path = results.write(results.finish(result, rounds), args.out)
    print(tables.autotune_table(results.load("autotune", args.out)))
    print(f"wrote {path}")
    return 0
