"""Datasets in a store: ``python -m bench remote [--samples N] [--runs R] [--quick]``.

W3's JPEG folder (400x300, quality 90, in class folders; ``bench.data``) uploaded to a
real S3 server on loopback (SeaweedFS, ``tests/remote/s3server.py``) behind the fault
proxy (``tests/remote/proxy.py``), which shapes the link and counts what the store
sent. Each run is read for ``--epochs`` epochs, batch 64, shuffled, 224x224 crops.

- ``throughput``: two links, ``cloud`` (100 MB/s for the node, 20 ms added to every
  request, as a region's S3 from an instance) and ``unthrottled`` (loopback). Systems:
  ``pinfeed`` (a fresh server and an empty object cache a run: the ``images`` kind
  over ``s3://``, ``num_workers`` workers) and ``dataloader-s3``, torch's DataLoader
  over a Dataset that GETs each sample's object with the client in the worker that
  reads it (``bench.references.S3ImageFolder``: what a trainer writes without a
  streaming library; nothing cached, every epoch reads the store); ``pinfeed-local``,
  the same pinfeed loader over the folder on local disk (the link does not apply). Per
  run: samples/s
  of each epoch, seconds to the first batch (from registering the dataset, or from
  making the Dataset, which lists the bucket), bytes and requests the store served.
- ``cache``: a dataset (512 images at least, batch 16) twice the object cache's size
  (``PINFEED_REMOTE_CACHE_MAX_BYTES`` half its bytes), unthrottled, three epochs, 2
  workers, under each eviction rule
  (``next-use``: the loaders' known order, Belady's; ``lru``): the store's GETs each
  epoch, the hit ratio, 1 - GETs / samples (one object a sample), and the units fetched
  ahead and evicted before any read (the cache's ``wasted``, by the end of each epoch).

Mosaic Streaming, LitData and WebDataset are not run here: see docs/how-to/object-storage.md.
Writes ``docs/results/remote.json`` (``bench.results``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils.data import DataLoader

from bench import data, results
from bench.data import DATA_DIR
from bench.references import S3ImageFolder
from bench.server import BenchServer
from pinfeed import Loader
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

BUCKET, PREFIX = "bench", "w3"
LINKS = {"cloud": (100e6, 0.020), "unthrottled": (0.0, 0.0)}  # bytes/s, s a request
# pinfeed-local: the same loader over the folder on local disk (no store, no link): what
# the second epoch, served from the node's object cache, is measured against
SYSTEMS = ("pinfeed", "dataloader-s3", "pinfeed-local")
SIZE, BATCH = 224, 64
# the cache section: a dataset of at least this many images, batches of CACHE_BATCH (the
# batches in the making are pinned: a small share of the cache, as at real sizes)
CACHE_SAMPLES, CACHE_BATCH = 512, 16


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench remote", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1536)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sections", default="throughput,cache")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=None, help="result folder (docs/results/)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 128 samples, 1 run")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.runs = 128, 1
    args.section_names = [x.strip() for x in args.sections.split(",") if x.strip()]
    return args


def _server(s3: S3Server, proxy: FaultProxy, root: Path, **settings: str) -> BenchServer:
    env = {
        **s3.env(proxy.endpoint),
        "PINFEED_REMOTE_ALLOW": f'["s3://{BUCKET}/"]',
        "PINFEED_REMOTE_CACHE_DIR": tempfile.mkdtemp(prefix="pinfeed-bench-objects-"),
        **settings,
    }
    return BenchServer(root, env=env)


def read_epochs(batches: Any, epochs: int, t0: float) -> tuple[list[float], float]:
    """(samples/s of each epoch, seconds from ``t0`` to the first batch)."""
    rates, first = [], None
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for batch in batches:
            if first is None:
                first = time.perf_counter() - t0
            n += len(batch[1])
        rates.append(n / (time.perf_counter() - t))
    return rates, first or 0.0


def run_pinfeed(
    args: argparse.Namespace, s3: S3Server, proxy: FaultProxy, local: str | None = None
) -> dict[str, Any]:
    """The ``images`` kind over the store's prefix (``local``: over that folder under
    the data root instead)."""
    path = local or f"s3://{BUCKET}/{PREFIX}/"
    with _server(s3, proxy, args.data_dir) as srv, srv.client() as admin:
        proxy.reset_counts()
        t0 = time.perf_counter()
        admin.create_dataset("w3", "images", {"path": path, "size": SIZE})
        admin.create_loader(
            "w3", dataset="w3", batch_size=BATCH, shuffle=True, seed=0, num_workers=args.workers
        )
        with Loader("w3", socket=srv.socket) as loader:
            rates, first = read_epochs(loader, args.epochs, t0)
        seen = proxy.counts
        node = admin.node()["remote"]
    return {
        "epochs": rates,
        "first_batch_s": first,
        "store_bytes": seen.bytes,
        "store_requests": seen.requests,
        "wait_s": node["store"]["wait_s"],
    }


def run_dataloader(args: argparse.Namespace, s3: S3Server, proxy: FaultProxy) -> dict[str, Any]:
    with mock.patch.dict(os.environ, s3.env(proxy.endpoint)):  # the Dataset's AWS chain
        proxy.reset_counts()
        t0 = time.perf_counter()
        dataset = S3ImageFolder(BUCKET, PREFIX, SIZE)
        loader = DataLoader(
            dataset,
            batch_size=BATCH,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
            generator=torch.Generator().manual_seed(0),
            # obstore's runtime does not survive a fork: its workers start afresh
            multiprocessing_context="forkserver" if args.workers > 0 else None,
        )
        rates, first = read_epochs(loader, args.epochs, t0)
        del loader
    seen = proxy.counts
    return {
        "epochs": rates,
        "first_batch_s": first,
        "store_bytes": seen.bytes,
        "store_requests": seen.requests,
    }


def throughput(
    args: argparse.Namespace, s3: S3Server, proxy: FaultProxy, folder: str
) -> list[dict[str, Any]]:
    def run_local(a: argparse.Namespace, s: S3Server, p: FaultProxy) -> dict[str, Any]:
        return run_pinfeed(a, s, p, local=folder)

    run_system = {
        "pinfeed": run_pinfeed,
        "dataloader-s3": run_dataloader,
        "pinfeed-local": run_local,
    }
    runs = []
    for link, (bandwidth, latency) in LINKS.items():
        proxy.bandwidth, proxy.latency_s = bandwidth, latency
        for r in range(args.runs):
            for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:  # ABBA
                foreign = results.ForeignCpu().start()
                run = run_system[system](args, s3, proxy)
                run |= {"link": link, "system": system, "run": r, **foreign.stop()}
                shown = ", ".join(f"{x:.0f}" for x in run["epochs"])
                print(
                    f"{link:<11} {system:<14} samples/s by epoch {shown}; first batch "
                    f"{run['first_batch_s']:.2f} s; {run['store_bytes'] / 1e6:.1f} MB in "
                    f"{run['store_requests']} requests",
                    flush=True,
                )
                runs.append(run)
    proxy.bandwidth, proxy.latency_s = 0.0, 0.0
    return runs


def cache(args: argparse.Namespace, s3: S3Server, proxy: FaultProxy) -> dict[str, Any]:
    w = data.make_w3(args.data_dir, max(args.samples, CACHE_SAMPLES) / data.W3_SAMPLES)
    folder = args.data_dir / w.files[0]
    s3.upload(BUCKET, "w3-cache", folder)
    size = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    out: dict[str, Any] = {
        "samples": w.samples,
        "batch_size": CACHE_BATCH,
        "dataset_bytes": size,
        "cache_bytes": size // 2,
        "rules": {},
    }
    for rule in ("next-use", "lru"):
        settings = {
            "PINFEED_REMOTE_CACHE_MAX_BYTES": str(size // 2),
            "PINFEED_REMOTE_EVICTION": rule,
        }
        with _server(s3, proxy, args.data_dir, **settings) as srv, srv.client() as admin:
            url = f"s3://{BUCKET}/w3-cache/"
            admin.create_dataset("w3", "images", {"path": url, "size": SIZE})
            admin.create_loader(
                "w3", dataset="w3", batch_size=CACHE_BATCH, shuffle=True, seed=0, num_workers=2
            )
            gets, wasted, samples = [], [], 0
            with Loader("w3", socket=srv.socket) as loader:
                for _ in range(3):
                    proxy.reset_counts()
                    samples = sum(len(b[1]) for b in loader)
                    gets.append(proxy.counts.by_method.get("GET", 0))
                    wasted.append(admin.node()["remote"]["cache"]["wasted"])
        ratios = [1 - g / samples for g in gets]
        out["rules"][rule] = {
            "gets": gets,
            "samples": samples,
            "hit_ratio": ratios,
            "wasted": wasted,
        }
        print(
            f"cache {rule:<8}: GETs by epoch {gets} of {samples}; hit ratio {ratios}; "
            f"fetched ahead and evicted unread, by the end of each epoch, {wasted}"
        )
    return out


def summarize(result: dict[str, Any]) -> None:
    cells: dict[str, Any] = {}
    for run in (result.get("throughput") or {}).get("runs", []):
        cell = cells.setdefault(
            f"{run['link']}/{run['system']}",
            {"epochs": [], "first": [], "bytes": [], "requests": []},
        )
        cell["epochs"].append(run["epochs"])
        cell["first"].append(run["first_batch_s"])
        cell["bytes"].append(run["store_bytes"])
        cell["requests"].append(run["store_requests"])
    result["cells"] = {
        key: {
            "epochs": [
                results.spread([e[i] for e in c["epochs"]]) for i in range(len(c["epochs"][0]))
            ],
            "first_batch_s": results.spread(c["first"]),
            "store_bytes": results.spread(c["bytes"]),
            "store_requests": results.spread(c["requests"]),
        }
        for key, c in cells.items()
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    w = data.make_w3(args.data_dir, args.samples / data.W3_SAMPLES)
    folder = args.data_dir / w.files[0]
    size = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    result = results.start(
        "remote",
        {"samples": w.samples, "runs": args.runs, "workers": args.workers, "epochs": args.epochs},
    )
    result |= {"kind": "remote", "method": __doc__, "dataset_bytes": size, "links": LINKS}
    with (
        tempfile.TemporaryDirectory(prefix="pinfeed-bench-s3-") as tmp,
        S3Server(Path(tmp), buckets=(BUCKET,)) as s3,
        FaultProxy(s3.endpoint) as proxy,
    ):
        s3.upload(BUCKET, PREFIX, folder)
        if "throughput" in args.section_names:
            result["throughput"] = {"runs": throughput(args, s3, proxy, w.files[0])}
        if "cache" in args.section_names:
            result["cache"] = cache(args, s3, proxy)
    summarize(result)
    results.finish(result, (result.get("throughput") or {}).get("runs", []))
    path = results.write(result, args.out)
    for key, cell in result["cells"].items():
        shown = ", ".join(f"{e['median']:.0f}" for e in cell["epochs"])
        print(f"{key:<28} samples/s by epoch (median) {shown}")
    print(f"wrote {path}")
    return 0
