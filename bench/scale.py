"""``python -m bench scale``: datasets at real size, pinfeed against DataLoader.

ImageFolders of ``--sizes`` files (hard links to 64 small JPEGs, 1,000 classes, under
``--tmp``, removed afterwards) x ``--workers``: registration time, loader create to
first batch, and the PSS of the server's process tree; against DataLoader over an
ImageFolder-like Dataset in a process of its own (``bench.scale_dl``: its scan, its
``iter()`` + ``next()``, its tree's PSS). Then, per size: the PSS added by a second
loader over the same dataset (``num_workers=0``: its ring and threads), and, at
``--epoch-sizes``, one full epoch with 4 workers over a ``python`` dataset holding a
Python list of that many paths (``tests.fixtures.datasets:PathList``): both trees'
PSS at the first batch and after the epoch.

Cold and warm: every measured pinfeed loader is cold, over a dataset registered for it
alone (so the loader starts the dataset's zygote, the process its workers fork from, as
the first loader of a dataset does); then a second loader with the same ``num_workers``
over that dataset is timed warm (its zygote already running), and the dataset deleted.
DataLoader has no such state: each ``iter()`` starts its workers anew. ``--runs`` times
each (median, min/max).

The per-worker figure is ``(PSS at max workers - PSS at 1 worker) / (max - 1)``.
Writes ``docs/results/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import results
from bench.procs import child_env
from bench.server import REPO, BenchServer

MiB = 1 << 20
SOURCES = 64  # ext4 allows 65,000 links to a file


def make_folder(root: Path, files: int, classes: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    src = root / "src"
    src.mkdir(parents=True)
    sources = []
    for k in range(SOURCES):
        path = src / f"{k}.jpg"
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
        sources.append(str(path))
    train = root / "train"
    per, done = -(-files // classes), 0
    for c in range(classes):
        d = train / f"n{c:08d}"
        d.mkdir(parents=True)
        for j in range(min(per, files - done)):
            os.link(sources[(c + j) % SOURCES], d / f"n{c:08d}_{j}.JPEG")
        done += min(per, files - done)
    return train


def tree_pss(pid: int) -> int:
    total = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) * 1024
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def epoch_pss(it: Any, left: int, pid: int) -> int:
    """The tree's PSS before the epoch's last batch (DataLoader's workers exit after
    it), then the rest of the epoch."""
    for _ in range(left - 1):
        next(it)
    pss = tree_pss(pid)
    for _ in it:
        pass
    return pss


def dataloader(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.scale_dl", json.dumps(spec)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _first_batch(
    srv: BenchServer, admin: Any, name: str, dataset: str, nw: int, batch: int, epoch: bool
) -> dict[str, Any]:
    """Create a loader, attach, take the first batch: its time, the tree's PSS then (and
    after the epoch with ``epoch``); the loader deleted."""
    from pinfeed import Loader

    t0 = time.perf_counter()
    admin.create_loader(
        name, dataset=dataset, batch_size=batch, shuffle=True, seed=1, num_workers=nw
    )
    with Loader(name, socket=srv.socket) as loader:
        it = iter(loader)
        next(it)
        row = {"first_batch_s": time.perf_counter() - t0, "pss": tree_pss(srv.pid)}
        if epoch:
            row["pss_epoch"] = epoch_pss(it, len(loader) - 1, srv.pid)
    admin.delete_loader(name)
    return row


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over runs, the runs' first-batch spread beside it."""
    keys = sorted({k for r in rows for k in r})
    out: dict[str, Any] = {k: results.spread([r.get(k) for r in rows])["median"] for k in keys}
    out["first_batch_spread"] = results.spread([r["first_batch_s"] for r in rows])
    out["runs"] = rows
    return out


def pinfeed_images(
    srv: BenchServer, rel: str, workers: list[int], batch: int, epoch: bool, runs: int
) -> dict[str, Any]:
    from pinfeed import Client, Loader

    admin = Client(srv.url, timeout=600)  # a 1.28M scan on a loaded machine: > 30 s
    t0 = time.perf_counter()
    admin.create_dataset("imgs", "images", {"path": rel, "size": 16})
    registers = [time.perf_counter() - t0]
    out: dict[str, Any] = {"pss_idle": tree_pss(srv.pid)}
    out["describe_bytes"] = len(json.dumps(admin.dataset("imgs")))
    admin.delete_dataset("imgs")
    for nw in workers:
        cold, warm = [], []
        for run in range(runs):
            # Cold: a dataset of its own, so this loader starts the dataset's zygote.
            ds = f"imgs-{nw}-{run}"
            t0 = time.perf_counter()
            admin.create_dataset(ds, "images", {"path": rel, "size": 16})
            registers.append(time.perf_counter() - t0)
            cold.append(_first_batch(srv, admin, f"c{nw}-{run}", ds, nw, batch, epoch))
            # Warm: the same dataset's next loader (its zygote running).
            warm.append(_first_batch(srv, admin, f"w{nw}-{run}", ds, nw, batch, False))
            admin.delete_dataset(ds)
        out[f"w{nw}"] = _median_row(cold)
        out[f"warm{nw}"] = _median_row(warm)
    out["register_s"] = results.spread(registers)["median"]
    out["register_spread"] = results.spread(registers)
    admin.create_dataset("imgs", "images", {"path": rel, "size": 16})
    # A second loader over the same dataset: no scan, its ring.
    admin.create_loader("a", dataset="imgs", batch_size=batch, num_workers=0)
    with Loader("a", socket=srv.socket) as a:
        next(iter(a))
        before = tree_pss(srv.pid)
        t0 = time.perf_counter()
        admin.create_loader("b", dataset="imgs", batch_size=batch, num_workers=0)
        with Loader("b", socket=srv.socket) as b:
            next(iter(b))
            out["second_loader"] = {
                "create_s": time.perf_counter() - t0,
                "pss_added": tree_pss(srv.pid) - before,
                "ring_bytes": b.nslots * b.slot_bytes,
            }
    admin.delete_loader("b")
    admin.delete_loader("a")
    admin.delete_dataset("imgs")
    return out


def pinfeed_paths(srv: BenchServer, n: int, batch: int) -> dict[str, Any]:
    from pinfeed import Client, Loader

    admin = Client(srv.url, timeout=600)  # a 1.28M scan on a loaded machine: > 30 s
    factory = {"factory": "tests.fixtures.datasets:PathList", "kwargs": {"length": n}}
    admin.create_dataset("paths", "python", factory)
    admin.create_loader("p", dataset="paths", batch_size=batch, num_workers=4)
    with Loader("p", socket=srv.socket) as loader:
        it = iter(loader)
        next(it)
        start = tree_pss(srv.pid)
        end = epoch_pss(it, len(loader) - 1, srv.pid)
    admin.delete_loader("p")
    admin.delete_dataset("paths")
    return {"pss_start": start, "pss_epoch": end, "growth": end - start}


def per_worker(rows: dict[str, Any], workers: list[int], key: str = "pss") -> float:
    lo, hi = min(workers), max(workers)
    return (rows[f"w{hi}"][key] - rows[f"w{lo}"][key]) / max(1, hi - lo) / MiB


def run_size(files: int, args: argparse.Namespace, workers: list[int]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"pinfeed-scale-{files}-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        classes = 1000 if files >= 100_000 else max(1, files // 100)
        make_folder(tmp, files, classes)
        made_s = time.perf_counter() - t0
        epoch = files <= args.epoch_max
        with BenchServer(tmp) as srv:
            ours = pinfeed_images(srv, "train", workers, args.batch_size, epoch, args.runs)
            paths = pinfeed_paths(srv, files, 256) if files in args.epoch_sizes else None
        dl_workers = workers if files <= args.full_max else [min(workers), max(workers)]
        theirs = dataloader(
            {
                "folder": str(tmp / "train"),
                "workers": dl_workers,
                "batch_size": args.batch_size,
                "epoch": epoch,
                "paths": files if paths else 0,
                "runs": args.runs,
            }
        )
        result = {
            "files": files,
            "made_s": made_s,
            "pinfeed": ours,
            "dataloader": theirs,
            "pinfeed_paths": paths,
        }
        result["per_worker_mib"] = {
            "pinfeed": per_worker(ours, workers),
            "dataloader": per_worker(theirs, dl_workers),
        }
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    ap.add_argument("--sizes", default="1000,400000,1280000")
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--epoch-sizes", default="400000", help="python list-of-paths epoch at these sizes"
    )
    ap.add_argument(
        "--epoch-max", type=int, default=1000, help="full images epochs up to this size"
    )
    ap.add_argument(
        "--full-max",
        type=int,
        default=400000,
        help="DataLoader at every worker count up to this size",
    )
    ap.add_argument("--runs", type=int, default=3, help="runs of each loader (median, spread)")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1,000 and 10,000 files")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.epoch_sizes, args.runs = "1000,10000", "10000", 1
    sizes = [int(s) for s in args.sizes.split(",") if s]
    workers = [int(w) for w in args.workers.split(",") if w]
    args.epoch_sizes = {int(s) for s in args.epoch_sizes.split(",") if s}
    from bench import tables

    result = results.start("scale", vars(args))
    result |= {"kind": "scale", "workers": workers, "sizes": []}
    for files in sizes:
        foreign = results.ForeignCpu().start()
        row = run_size(files, args, workers)
        row["foreign"] = foreign.stop()
        result["sizes"].append(row)
        print(f"  {files:,} files done in {row['foreign']['wall_s']:.0f} s", flush=True)
    path = results.write(results.finish(result, result["sizes"]), args.out)
    print(tables.scale_table(results.load("scale", args.out)))
    print(f"wrote {path}")
    return 0
