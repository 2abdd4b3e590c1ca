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

The per-worker figure is ``(PSS at max workers - PSS at 1 worker) / (max - 1)``; a
``--baseline`` folder (1,000 files) gives the floor it is compared with.
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
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench.scale_dl", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def pinfeed_images(
    srv: BenchServer, rel: str, workers: list[int], batch: int, epoch: bool
) -> dict[str, Any]:
    from pinfeed import Client, Loader

    admin = Client(srv.url, timeout=600)  # a 1.28M scan on a loaded machine: > 30 s
    t0 = time.perf_counter()
    admin.create_dataset("imgs", "images", {"path": rel, "size": 16})
    out: dict[str, Any] = {"register_s": time.perf_counter() - t0, "pss_idle": tree_pss(srv.pid)}
    out["describe_bytes"] = len(json.dumps(admin.dataset("imgs")))
    for nw in workers:
        t0 = time.perf_counter()
        admin.create_loader(
            f"l{nw}", dataset="imgs", batch_size=batch, shuffle=True, seed=1, num_workers=nw
        )
        with Loader(f"l{nw}", socket=srv.socket) as loader:
            it = iter(loader)
            next(it)
            row = {"first_batch_s": time.perf_counter() - t0, "pss": tree_pss(srv.pid)}
            if epoch:
                row["pss_epoch"] = epoch_pss(it, len(loader) - 1, srv.pid)
        admin.delete_loader(f"l{nw}")
        out[f"w{nw}"] = row
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
            ours = pinfeed_images(srv, "train", workers, args.batch_size, epoch)
            paths = pinfeed_paths(srv, files, 256) if files in args.epoch_sizes else None
        dl_workers = workers if files <= args.full_max else [min(workers), max(workers)]
        theirs = dataloader(
            {
                "folder": str(tmp / "train"),
                "workers": dl_workers,
                "batch_size": args.batch_size,
                "epoch": epoch,
                "paths": files if paths else 0,
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


def table(results: list[dict[str, Any]], workers: list[int]) -> str:
    lines = [
        "| files | workers | pinfeed register | pinfeed create->1st batch | DataLoader scan | "
        "DataLoader iter+next | pinfeed server tree PSS | DataLoader tree PSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ours, theirs = r["pinfeed"], r["dataloader"]
        for nw in workers:
            o, t = ours.get(f"w{nw}"), theirs.get(f"w{nw}")
            if o is None:
                continue
            tt = f"{t['first_batch_s']:.2f} s" if t else "-"
            tp = f"{t['pss'] / MiB:.0f} MiB" if t else "-"
            if t and "pss_epoch" in t:
                tp += f" ({t['pss_epoch'] / MiB:.0f} after an epoch)"
            op = f"{o['pss'] / MiB:.0f} MiB"
            if "pss_epoch" in o:
                op += f" ({o['pss_epoch'] / MiB:.0f} after an epoch)"
            lines.append(
                f"| {r['files']:,} | {nw} | {ours['register_s']:.2f} s | "
                f"{o['first_batch_s']:.2f} s | {theirs['scan_s']:.2f} s | {tt} | {op} | {tp} |"
            )
    lines.append("")
    lines.append(
        "| files | PSS per extra worker: pinfeed | DataLoader | second loader adds (its ring) | "
        "python list of paths, 4 workers, PSS growth over an epoch: pinfeed | DataLoader |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        pw, sl = r["per_worker_mib"], r["pinfeed"]["second_loader"]
        p = r["pinfeed_paths"]
        tp = r["dataloader"].get("paths")
        lines.append(
            f"| {r['files']:,} | {pw['pinfeed']:.1f} MiB | {pw['dataloader']:.1f} MiB | "
            f"{sl['pss_added'] / MiB:.1f} MiB ({sl['ring_bytes'] / MiB:.1f}), "
            f"created in {sl['create_s']:.2f} s | "
            + (
                f"{p['growth'] / MiB:.1f} MiB | {tp['growth'] / MiB:.1f} MiB |"
                if p and tp
                else "- | - |"
            )
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    ap.add_argument("--sizes", default="1000,100000,400000,1280000")
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
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    workers = [int(w) for w in args.workers.split(",") if w]
    args.epoch_sizes = {int(s) for s in args.epoch_sizes.split(",") if s}
    results = []
    for files in sizes:
        results.append(run_size(files, args, workers))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results, workers))
    return 0
