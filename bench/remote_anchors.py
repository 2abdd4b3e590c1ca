"""Once per node, against the anchors: ``python -m bench remote-anchors [--samples N]
[--links cloud,unthrottled] [--quick]``.

W3's JPEG folder (``bench.data``) converted once to each anchor's format and uploaded to
a real S3 server on loopback (SeaweedFS, ``tests/remote/s3server.py``) behind the fault
proxy (``tests/remote/proxy.py``), which shapes the link and counts the bytes and
requests the store served. The links are ``bench.remote``'s (``LINKS``): ``cloud``
(100 MB/s for the node, 20 ms added to every request) and ``unthrottled`` (loopback);
each system is run at each link of ``--links``, from empty caches. Per system and link,
four training jobs (four processes, each its own loader and seed, released together)
read ``--epochs`` epochs, batch 64, shuffled, each sample decoded to 224x224 as W3 does:

- ``pinfeed``: one server, the ``images`` kind over the folder's ``s3://`` prefix, a
  loader per job (``tests/remote/job.py``'s shape);
- ``mosaic``: Mosaic Streaming's ``StreamingDataset(remote="s3://...", local=...)`` over
  MDS shards written by its ``MDSWriter``, one ``local`` folder per job (its docs' set-up:
  a job names its own cache), under torch's DataLoader;
- ``litdata``: LitData's ``StreamingDataset("s3://...")`` over chunks written by
  ``litdata.optimize``, the cache at LitData's default (one folder per dataset URL, so
  shared by the node's jobs), under its ``StreamingDataLoader``, read with its boto3
  client (its obstore path refuses the loopback store's plain-HTTP endpoint);
- ``webdataset``: ``WebDataset`` over tar shards written by its ``ShardWriter``, each
  read through ``pipe:curl --aws-sigv4`` (the library has no S3 client of its own and
  the AWS CLI is not installed here; its docs' pattern is ``pipe:`` a command that writes
  the object to stdout), shard shuffle and a sample buffer, no cache (its default).

Result per system and link: bytes the store sent / the bytes of the format's objects,
requests, samples/s of each epoch (the median of the four jobs). Writes
``docs/results/remote-anchors.json`` (``bench.results``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import data, results
from bench.data import DATA_DIR
from bench.references import _pil_fit
from bench.remote import LINKS, read_epochs
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

BUCKET = "bench"
SYSTEMS = ("pinfeed", "mosaic", "litdata", "webdataset")
JOBS, SIZE, BATCH = 4, 224, 64
REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench remote-anchors", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--samples", type=int, default=1536)
    ap.add_argument("--workers", type=int, default=1, help="each job's loader workers")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--links", default=",".join(LINKS), help=f"of {', '.join(LINKS)}")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=None, help="result folder (docs/results/)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 128 samples")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples = 128
    args.system_names = [x.strip() for x in args.systems.split(",") if x.strip()]
    args.link_names = [x.strip() for x in args.links.split(",") if x.strip()]
    unknown = sorted(set(args.link_names) - set(LINKS))
    if unknown:
        ap.error(f"unknown link {', '.join(unknown)}; choose from {', '.join(LINKS)}")
    return args


# --- the formats, written once ----------------------------------------------------------


def _samples(folder: Path) -> list[tuple[Path, int]]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    return [
        (path, label)
        for label, cls in enumerate(classes)
        for path in sorted((folder / cls).glob("*.jpg"))
    ]


def _litdata_item(sample: tuple[str, int]) -> dict[str, Any]:
    # litdata.optimize's fn: at module level, its workers import it
    return {"image": Path(sample[0]).read_bytes(), "label": sample[1]}


def convert(system: str, folder: Path, out: Path) -> Path:
    """W3's ``folder`` in ``system``'s format under ``out``; the folder to upload."""
    samples = _samples(folder)
    if system == "pinfeed":
        return folder
    dest = out / system
    dest.mkdir(parents=True, exist_ok=True)
    if system == "mosaic":
        from streaming import MDSWriter

        with MDSWriter(out=str(dest), columns={"image": "bytes", "label": "int"}) as w:
            for path, label in samples:
                w.write({"image": path.read_bytes(), "label": label})
    elif system == "litdata":
        import litdata

        litdata.optimize(
            fn=_litdata_item,
            inputs=[(str(p), label) for p, label in samples],
            output_dir=str(dest),
            chunk_bytes="8MB",
            num_workers=1,
        )
    elif system == "webdataset":
        import webdataset as wds

        with wds.ShardWriter(str(dest / "shard-%06d.tar"), maxsize=8e6, verbose=0) as w:
            for i, (path, label) in enumerate(samples):
                w.write({"__key__": f"{i:08d}", "jpg": path.read_bytes(), "cls": label})
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    return dest


# --- one job (a process of its own) -----------------------------------------------------


def _decode(image: bytes) -> Any:
    return _pil_fit(io.BytesIO(image), SIZE, True)


def _loader(system: str, prefix: str, seed: int, workers: int, cache: Path) -> Iterable[Any]:
    """``system``'s loader over ``s3://BUCKET/prefix``, as its docs set one up."""
    import torch
    from torch.utils.data import DataLoader

    if system == "mosaic":
        from streaming import StreamingDataset

        class Mds(StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, i: int) -> Any:
                item = super().__getitem__(i)
                return _decode(item["image"]), item["label"]

        ds = Mds(
            remote=f"s3://{BUCKET}/{prefix}",
            local=str(cache / f"mosaic-job-{seed}"),
            shuffle=True,
            shuffle_seed=seed,
            batch_size=BATCH,
        )
        return DataLoader(ds, batch_size=BATCH, num_workers=workers)
    if system == "litdata":
        import litdata
        from litdata.streaming import downloader

        # LitData's obstore path builds its client without allow_http and refuses the
        # loopback store's plain-HTTP endpoint ("builder error"); off, LitData reads with
        # its boto3 client, the path it takes where obstore is not installed
        downloader._OBSTORE_AVAILABLE = False

        class Lit(litdata.StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, i: Any) -> Any:
                item = super().__getitem__(i)
                return _decode(item["image"]), item["label"]

        lit = Lit(f"s3://{BUCKET}/{prefix}", shuffle=True, seed=seed)
        return litdata.StreamingDataLoader(lit, batch_size=BATCH, num_workers=workers)
    if system == "webdataset":
        import webdataset as wds

        n = int(os.environ["BENCH_SHARDS"])
        endpoint, region = os.environ["AWS_ENDPOINT_URL"], os.environ["AWS_REGION"]
        urls = [
            "pipe:curl -sS --fail --aws-sigv4 aws:amz:"
            + f'{region}:s3 --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" '
            + f"{endpoint}/{BUCKET}/{prefix}/shard-{i:06d}.tar"
            for i in range(n)
        ]
        pipeline = (
            wds.WebDataset(urls, shardshuffle=n, seed=seed, empty_check=False)
            .shuffle(1000, seed=seed)
            .to_tuple("jpg", "cls")
            .map_tuple(_decode, int)
            .batched(
                BATCH, collation_fn=lambda s: (torch.stack([x for x, _ in s]), [y for _, y in s])
            )
        )
        return DataLoader(pipeline, batch_size=None, num_workers=workers)
    raise ValueError(f"unknown system {system!r}")


def job(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("system")
    p.add_argument("prefix")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--go", type=Path, required=True)
    p.add_argument("--url", default="")
    p.add_argument("--socket", default="")
    a = p.parse_args(argv)
    a.go.with_name(f"{a.go.name}.ready-{a.seed}").touch()
    deadline = time.monotonic() + 120
    while not a.go.exists():  # the driver makes it once every job is ready
        if time.monotonic() > deadline:
            raise SystemExit("never told to go")
        time.sleep(0.01)
    t0 = time.perf_counter()
    if a.system == "pinfeed":
        from pinfeed import Client, Loader

        name = f"job-{a.seed}"
        with Client(a.url) as admin:
            admin.create_loader(
                name,
                dataset=a.prefix,
                batch_size=BATCH,
                shuffle=True,
                seed=a.seed,
                num_workers=a.workers,
            )
            try:
                with Loader(name, socket=a.socket) as loader:
                    rates, first = read_epochs(loader, a.epochs, t0)
            finally:
                admin.delete_loader(name)
    else:
        rates, first = read_epochs(
            _loader(a.system, a.prefix, a.seed, a.workers, a.cache), a.epochs, t0
        )
    print(json.dumps({"epochs": rates, "first_batch_s": first}))
    return 0


# --- the driver -------------------------------------------------------------------------


def run_jobs(
    system: str,
    prefix: str,
    args: argparse.Namespace,
    env: dict[str, str],
    tmp: Path,
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Four jobs of ``system`` released together; what each printed."""
    go = tmp / f"go-{system}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.remote_anchors",
                "job",
                system,
                prefix,
                f"--seed={seed}",
                f"--workers={args.workers}",
                f"--epochs={args.epochs}",
                f"--cache={tmp / 'cache'}",
                f"--go={go}",
                *extra,
            ],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
        )
        for seed in range(JOBS)
    ]
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp.glob(f"go-{system}.ready-*"))) < JOBS:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{system}: the jobs did not get ready")
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{system}: a job failed: {[p.returncode for p in procs]}")
    return [json.loads(out.decode().strip().splitlines()[-1]) for out in outs]


def upload(system: str, folder: Path, s3: S3Server, tmp: Path) -> dict[str, Any]:
    """``system``'s format of ``folder``, in the store: its prefix, keys and bytes."""
    src = convert(system, folder, tmp / "formats")
    prefix = f"anchors-{system}"
    keys = s3.upload(BUCKET, prefix, src)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    return {"prefix": prefix, "keys": keys, "size": size}


def run_system(
    system: str,
    link: str,
    stored: dict[str, Any],
    args: argparse.Namespace,
    s3: S3Server,
    proxy: FaultProxy,
    tmp: Path,
) -> dict[str, Any]:
    """Four jobs of ``system`` at ``link``, each cache (pinfeed's object cache, Mosaic's
    per-job folders, LitData's under ``HOME``) empty at the start."""
    prefix, keys = stored["prefix"], stored["keys"]
    work = tmp / f"{system}-{link}"
    work.mkdir()
    env = s3.env(proxy.endpoint)
    env |= {"S3_ENDPOINT_URL": proxy.endpoint, "HOME": str(work / "home")}
    env["BENCH_SHARDS"] = str(sum(1 for k in keys if k.endswith(".tar")))
    proxy.bandwidth, proxy.latency_s = LINKS[link]
    proxy.reset_counts()
    try:
        if system == "pinfeed":
            from bench.server import BenchServer

            settings = {
                **env,
                "PINFEED_REMOTE_ALLOW": f'["s3://{BUCKET}/"]',
                "PINFEED_REMOTE_CACHE_DIR": str(work / "objects"),
            }
            with BenchServer(args.data_dir, env=settings) as srv, srv.client() as admin:
                admin.create_dataset(
                    prefix, "images", {"path": f"s3://{BUCKET}/{prefix}/", "size": SIZE}
                )
                jobs = run_jobs(
                    system, prefix, args, env, work, [f"--url={srv.url}", f"--socket={srv.socket}"]
                )
        else:
            jobs = run_jobs(system, prefix, args, env, work)
        seen = proxy.counts
    finally:
        proxy.bandwidth, proxy.latency_s = LINKS["unthrottled"]
    return {
        "system": system,
        "link": link,
        "dataset_bytes": stored["size"],
        "objects": len(keys),
        "store_bytes": seen.bytes,
        "store_requests": seen.requests,
        "by_method": seen.by_method,
        "jobs": jobs,
        "epochs": [statistics.median(j["epochs"][i] for j in jobs) for i in range(args.epochs)],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["job"]:
        return job(argv[1:])
    args = parse(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    w = data.make_w3(args.data_dir, args.samples / data.W3_SAMPLES)
    folder = args.data_dir / w.files[0]
    result = results.start(
        "remote-anchors",
        {
            "samples": w.samples,
            "jobs": JOBS,
            "workers": args.workers,
            "epochs": args.epochs,
            "links": args.link_names,
        },
    )
    links = {name: LINKS[name] for name in args.link_names}
    result |= {"kind": "remote-anchors", "method": __doc__, "links": links, "runs": []}
    with (
        tempfile.TemporaryDirectory(prefix="pinfeed-bench-anchors-") as tmp,
        S3Server(Path(tmp), buckets=(BUCKET,)) as s3,
        FaultProxy(s3.endpoint) as proxy,
    ):
        for system in args.system_names:
            stored = upload(system, folder, s3, Path(tmp))
            for link in args.link_names:
                foreign = results.ForeignCpu().start()
                run = run_system(system, link, stored, args, s3, proxy, Path(tmp))
                run |= foreign.stop()
                shown = ", ".join(f"{x:.0f}" for x in run["epochs"])
                print(
                    f"{system:<11} {link:<11} {run['store_bytes'] / run['dataset_bytes']:.3f}x "
                    f"the dataset's {run['dataset_bytes'] / 1e6:.1f} MB in "
                    f"{run['store_requests']} requests; samples/s by epoch (median job) {shown}",
                    flush=True,
                )
                result["runs"].append(run)
    results.finish(result, result["runs"])
    print(f"wrote {results.write(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
