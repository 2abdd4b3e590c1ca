"""W9: decode once per node. ``python -m bench W9 [--samples N] [--runs R] ...``.

ImageNet-like JPEGs (500x375, every fourth portrait, quality 90, generated with
Pillow) in class folders; the deterministic stage (decode, RGB, shorter side resized
to 256, aspect kept: the ``images`` kind with ``"crop": false``) is cached by the
server; RandomResizedCrop(224) + horizontal flip (``bench.transforms:w9``, torch: the
stand-in for torchvision) is each loader's ``transform``; batch 32, three epochs.
DataLoader runs ``Transformed(ImageFolder, the same transform)`` with
``persistent_workers`` and the same seed: the same batches (``bench.references``'
ImageFolder uncropped: Pillow's decode and resize, the ``images`` kind's pixels).

Sections, each on a fresh server, runs in fresh trainer processes (``bench.w9_trainer``),
the systems alternating ABBA, medians over ``--runs`` (spread = min..max):

- ``single``: one trainer, ``num_workers`` 0/1/2. Each pinfeed run registers the dataset
  afresh, so its first epoch fills an empty cache; the server deletes it afterwards.
  Also the one-line switch: DataLoader's very call with ``pinfeed.DataLoader`` and
  ``cache=`` (a new cache name each run), on the same ImageFolder object; and
  ``dataloader-cached``, the tuned DataLoader here: that DataLoader call on the
  ImageFolder decoded once by the trainer's own processes (``bench.references.
  SharedDecoded``: each sample's decode and resize written in epoch 1, by whichever
  process reads it first, to a file in shared memory that every worker maps; later
  epochs run only the transform), the same batches as ``dataloader``'s.
- ``jobs``: four trainers at once, four loaders (seeds 0-3, one worker each) over one
  cached dataset, against four DataLoaders (one worker each), and four caching
  DataLoaders (a cache each: a job's own processes share it, other jobs do not):
  aggregate samples/s per epoch, CPU seconds of everything each system ran (trainers,
  DataLoader's workers; the server, its zygote and workers), and the cache's misses
  over all four loaders.
- ``restart``: a persisted cache filled by one epoch, then per run a new server process
  on the same state dir and one epoch (``num_workers`` 2), against DataLoader's first.
  The cache file's pages are still in the page cache (a server restart, not a reboot).
- ``subset``: a cache of half the dataset (``max_bytes``): its hit ratio in epochs 2-3
  against max_bytes / size.
- ``draft``: Pillow's full and draft JPEG decode of W9's JPEGs and of 4x larger ones
  (time per image, pixel difference), in this process; ``profile``: where a cold
  sample's time goes (cProfile over decode + resize + transform, one process).

Writes ``docs/results/W9.json`` (``bench.results``: commit, machine, load, other
processes' CPU share per run, every run's raw numbers); ``python -m bench report``
makes README's W9 table (``bench.tables.w9``) and W9's rows of the suite's tables
(``cells``: samples/s over the three epochs; ``roofline``: one process decoding and
transforming) from it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import data, results
from bench.data import DATA_DIR, W9_RESIZE, _jpeg, warm_page_cache
from bench.memory import PeakSampler
from bench.procs import end, spawn
from bench.server import BenchServer
from tests.launcher import Server

RESIZE = W9_RESIZE
SYSTEMS = ("pinfeed", "dataloader")
# A tuned DataLoader user's own cache of the decode and resize (issue 44): single and jobs.
CACHED = "dataloader-cached"
JOBS = (*SYSTEMS, CACHED)
# the single section also runs the one-line switch (pinfeed.DataLoader with cache=)
SINGLE = ("pinfeed", "pinfeed-dataloader", "dataloader", CACHED)


# -- processes -------------------------------------------------------------------------------
def _tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and every process below it, by pid."""
    out: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


class Trainer:
    """A ``bench.w9_trainer`` process, one JSON line per message."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finish()
        self.proc = spawn(["bench.w9_trainer", json.dumps(spec)], self._err)

    def expect(self, event: str, timeout: float = 1800) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self._err.seek(0)
                tail = self._err.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"trainer exited before {event!r}:\n{tail}")
            if not line.startswith("{"):
                continue
            msg: dict[str, Any] = json.loads(line)
            if msg["event"] == "error":
                raise RuntimeError(f"trainer failed: {msg['error']}\n{msg['where']}")
            if msg["event"] == event:
                return msg
        raise TimeoutError(f"no {event!r} within {timeout} s")

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def finish(self) -> None:
        end(self.proc, 120)
        self._err.close()


def run_trainers(specs: list[dict[str, Any]], server_pid: int | None) -> dict[str, Any]:
    """Start one trainer per spec, release them together; their epochs, the CPU seconds
    of the trainers' and the server's process trees over the run, the peak PSS."""
    before = _tree_cpu(server_pid) if server_pid else {}
    trainers: list[Trainer] = []

    def groups() -> dict[str, list[int]]:
        g = {"trainer": [t.proc.pid for t in trainers]}
        if server_pid:
            g["server"] = [server_pid]
        return g

    sampler = PeakSampler(groups).start()
    try:
        trainers.extend(Trainer(spec) for spec in specs)
        for t in trainers:
            t.expect("ready")
        load = os.getloadavg()[0]
        foreign = results.ForeignCpu().start()
        for t in trainers:
            t.send("go\n")
        done = [t.expect("result") for t in trainers]
        other = foreign.stop()
        trainer_cpu = sum(sum(_tree_cpu(t.proc.pid).values()) for t in trainers)
        after = _tree_cpu(server_pid) if server_pid else {}
        memory = sampler.stop()
        for t in trainers:
            t.finish()
    except BaseException:
        sampler.stop()
        for t in trainers:
            t.proc.kill()
        raise
    server_cpu = sum(v - before.get(pid, 0.0) for pid, v in after.items())
    jobs_ = [{"start": r["start"], "epochs": r["epochs"]} for r in done]
    samples = sum(e["samples"] for j in jobs_ for e in j["epochs"])
    wall = max(j["epochs"][-1]["end"] for j in jobs_) - min(j["start"] for j in jobs_)
    first = jobs_[0]["epochs"][0]["first"]
    cpu = trainer_cpu + server_cpu
    return {
        "jobs": jobs_,
        "samples_per_s": samples / wall,
        "ttfb_s": first - jobs_[0]["start"] if first else None,
        "trainer_cpu_s": trainer_cpu,
        "server_cpu_s": server_cpu,
        "cpu_s": cpu,
        "cpu_ms_per_ksample": cpu / samples * 1e6,
        "peak_pss_bytes": memory["peak_pss_bytes"],
        "peak_rss_bytes": memory["peak_rss_bytes"],
        "loadavg_1m_at_go": load,
        "foreign": other,
    }


# -- measurements -----------------------------------------------------------------------------
_ids = iter(range(1 << 30))


def _spec(
    system: str, nw: int, args: argparse.Namespace, params: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    return {
        "system": system,
        "num_workers": nw,
        "batch_size": args.workload.batch_size,
        "epochs": args.workload.epochs,
        "seed": 0,
        "transform": args.workload.transform,
        "params": params,
        "data_root": str(args.data_dir),
        **kw,
    }


def _pinfeed_kw(srv: Server, dataset: str, **kw: Any) -> dict[str, Any]:
    return {
        "url": srv.url,
        "socket": str(srv.socket),
        "dataset": dataset,
        "loader": f"w9-{next(_ids)}",
        **kw,
    }


def _register(srv: Server, params: dict[str, Any], cache: dict[str, Any] | None) -> str:
    from pinfeed import Client

    name = f"w9ds-{next(_ids)}"
    with Client(srv.url, timeout=600) as c:
        c.create_dataset(name, "images", params, cache=cache)
    return name


def _cleanup(srv: Server, dataset: str | None) -> dict[str, Any] | None:
    """Delete every loader (and ``dataset``); the dataset's cache stats, read before."""
    from pinfeed import Client

    with Client(srv.url, timeout=600) as c:
        for row in c.loaders():
            c.delete_loader(row["name"])
        if dataset is None:
            return None
        stats: dict[str, Any] | None = c.dataset(dataset)["cache"]
        c.delete_dataset(dataset)
        return stats


def _warm(srv: Server, params: dict[str, Any], args: argparse.Namespace) -> None:
    """The server's one-time costs (its forkserver: the first loader with workers), paid
    before the runs, as the suite's cold start is."""
    ds = _register(srv, params, None)
    spec = _spec("pinfeed", 1, args, params, **_pinfeed_kw(srv, ds)) | {"epochs": 1}
    run_trainers([spec], srv.pid)
    _cleanup(srv, ds)


def _order(run: int, systems: tuple[str, ...] = SYSTEMS) -> tuple[str, ...]:
    return systems if run % 2 == 0 else systems[::-1]


def single(args: argparse.Namespace, params: dict[str, Any], progress: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with BenchServer(args.data_dir) as srv:
        _warm(srv, params, args)
        for nw in args.worker_counts:
            for r in range(args.runs):
                for system in _order(r, SINGLE):
                    ds = _register(srv, params, {}) if system == "pinfeed" else None
                    kw = _pinfeed_kw(srv, ds) if ds else {}
                    if system == "pinfeed-dataloader":  # a cache of its own, filled afresh
                        kw = {"socket": str(srv.socket), "cache": f"w9-{next(_ids)}"}
                    out = run_trainers(
                        [_spec(system, nw, args, params, **kw)],
                        srv.pid if system.startswith("pinfeed") else None,
                    )
                    out["cache"] = _cleanup(srv, ds) if ds else None
                    runs.append({"num_workers": nw, "system": system, "run": r, **out})
                    progress(f"single nw={nw} {system} run {r}: " + _rates(out["jobs"][0]))
    return runs


def jobs(args: argparse.Namespace, params: dict[str, Any], progress: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with BenchServer(args.data_dir) as srv:
        _warm(srv, params, args)
        for r in range(args.runs):
            for system in _order(r, JOBS):
                ds = _register(srv, params, {}) if system == "pinfeed" else None
                specs = []
                for k in range(args.jobs):
                    kw = _pinfeed_kw(srv, ds) if ds else {}
                    specs.append(_spec(system, 1, args, params, **kw, seed=k))
                out = run_trainers(specs, srv.pid if ds else None)
                out["cache"] = _cleanup(srv, ds) if ds else None
                runs.append({"system": system, "run": r, **out})
                agg = _aggregate(out["jobs"])
                progress(
                    f"jobs x{args.jobs} {system} run {r}: "
                    + " ".join(f"{x:,.0f}" for x in agg)
                    + f" samples/s, {out['cpu_s']:.0f} CPU s"
                )
    return runs


def restart(args: argparse.Namespace, params: dict[str, Any], progress: Any) -> dict[str, Any]:
    from pinfeed import Client

    root = Path(tempfile.mkdtemp(prefix="pinfeed-w9-restart-"))
    env = {"PINFEED_LOG_LEVEL": "warning", "PINFEED_ALLOWED_PLUGINS": json.dumps(["bench"])}
    srv = Server(root, env=env, data=args.data_dir)
    out: dict[str, Any] = {"runs": []}
    try:
        srv.start()
        _warm(srv, params, args)
        ds = _register(srv, params, {"persist": True})
        spec = _spec("pinfeed", 2, args, params, **_pinfeed_kw(srv, ds)) | {"epochs": 1}
        fill = run_trainers([spec], srv.pid)
        _cleanup(srv, None)
        out["fill"] = fill
        srv.stop()
        for r in range(args.runs):
            for system in _order(r):
                if system == "pinfeed":
                    srv.start()
                    with Client(srv.url) as c:
                        reopened = c.dataset(ds)["cache"]
                    spec = _spec("pinfeed", 2, args, params, **_pinfeed_kw(srv, ds)) | {"epochs": 1}
                    res = run_trainers([spec], srv.pid)
                    with Client(srv.url) as c:
                        res["cache_reopened"] = reopened
                        res["cache"] = c.dataset(ds)["cache"]
                    res["server_start_s"] = srv.start_s
                    _cleanup(srv, None)
                    srv.stop()
                else:
                    res = run_trainers([_spec("dataloader", 2, args, params) | {"epochs": 1}], None)
                out["runs"].append({"system": system, "run": r, **res})
                progress(f"restart {system} run {r}: " + _rates(res["jobs"][0]))
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def subset(args: argparse.Namespace, params: dict[str, Any], progress: Any) -> dict[str, Any]:
    """A cache of half the dataset: ``size`` is what the whole dataset takes in a cache
    (measured: one epoch fills a cache without a bound), ``max_bytes`` half of it."""
    with BenchServer(args.data_dir) as srv:
        _warm(srv, params, args)
        whole = _register(srv, params, {})
        spec = _spec("pinfeed", 2, args, params, **_pinfeed_kw(srv, whole)) | {"epochs": 1}
        run_trainers([spec], srv.pid)
        size = _cleanup(srv, whole)["bytes"]  # type: ignore[index]
        max_bytes = size // 2
        ds = _register(srv, params, {"max_bytes": max_bytes})
        res = run_trainers(
            [_spec("pinfeed", 2, args, params, **_pinfeed_kw(srv, ds), stats=True)], srv.pid
        )
        _cleanup(srv, ds)
    after = [e["after"] for e in res["jobs"][0]["epochs"]]

    def reads(s: dict[str, Any]) -> int:
        return int(s["hits"] + s["misses"])

    ratio = (after[-1]["hits"] - after[0]["hits"]) / max(1, reads(after[-1]) - reads(after[0]))
    out = {
        "max_bytes": max_bytes,
        "whole_bytes": size,
        "expected": max_bytes / size,
        "hit_ratio_epochs_2_3": ratio,
        "stats_after_each_epoch": after,
        "epochs": res["jobs"][0]["epochs"],
    }
    progress(f"subset: hit ratio {ratio:.3f} (max_bytes/size {max_bytes / size:.3f})")
    return out


def draft(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """Full vs draft decode, per image, for W9's JPEGs and 4x larger ones."""
    from pinfeed_server.datasets.images import decode

    big = args.data_dir / "w9-draft-2000x1500"
    if not big.exists():
        big.mkdir(parents=True)
        rng = np.random.default_rng(1)
        for i in range(40):
            _jpeg(rng, 2000, 1500).save(big / f"img{i:03d}.jpg", format="JPEG", quality=90)
    out = {}
    for name, paths in (
        ("500x375", sorted((args.data_dir / folder).rglob("*.jpg"))[:200]),
        ("2000x1500", sorted(big.glob("*.jpg"))),
    ):
        times: dict[str, float] = {}
        imgs: dict[str, list[np.ndarray[Any, Any]]] = {}
        for mode in ("full", "draft", "full", "draft"):
            t0 = time.perf_counter()
            got = [np.asarray(decode(str(p), RESIZE, False, mode == "draft")) for p in paths]
            times[mode] = (time.perf_counter() - t0) / len(paths)  # the second pass counts
            imgs[mode] = got
        diffs = [
            np.abs(a.astype(np.int16) - b.astype(np.int16))
            for a, b in zip(imgs["full"], imgs["draft"], strict=True)
        ]
        out[name] = {
            "full_ms": times["full"] * 1e3,
            "draft_ms": times["draft"] * 1e3,
            "speedup": times["full"] / times["draft"],
            "bit_identical": all(int(d.max()) == 0 for d in diffs),
            "mean_abs_diff": float(np.mean([d.mean() for d in diffs])),
            "max_abs_diff": int(max(int(d.max()) for d in diffs)),
        }
    return out


def profile(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    """Where a cold sample's time goes, in one process with one torch thread: each stage
    timed apart (three passes, the median), cProfile's top functions, and the
    single-process rooflines: samples/s decoding and transforming (a cold epoch), and
    transforming samples already decoded (a cached epoch without any IPC)."""
    import numpy as np
    import torch
    from PIL import Image

    from bench.transforms import w9
    from pinfeed_server.datasets import DatasetContext, build_dataset
    from pinfeed_server.datasets.images import fit

    torch.set_num_threads(1)
    ds = build_dataset("images", params, DatasetContext(args.data_dir))
    n = min(300, len(ds))
    paths = [ds.sample(i)[0] for i in range(n)]
    passes: dict[str, list[float]] = {k: [] for k in ("decode", "resize", "to_tensor", "transform")}
    roof: list[dict[str, Any]] = []
    for _ in range(3):
        spent = dict.fromkeys(passes, 0.0)
        foreign = results.ForeignCpu().start()
        t_all = time.perf_counter()
        for path in paths:
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                img = Image.open(f)
                img.load()
            t1 = time.perf_counter()
            img = fit(img, RESIZE, crop=False)
            t2 = time.perf_counter()
            x = torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy())
            t3 = time.perf_counter()
            w9((x, 0))
            t4 = time.perf_counter()
            for k, dt in zip(passes, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                spent[k] += dt
        roof.append({"samples_per_s": n / (time.perf_counter() - t_all), "foreign": foreign.stop()})
        for k in passes:
            passes[k].append(spent[k] / n * 1e3)
    stages = {k: sorted(v)[1] for k, v in passes.items()}
    decoded = [ds[i] for i in range(min(100, n))]
    t0 = time.perf_counter()
    for _ in range(3):
        for sample in decoded:
            w9(sample)
    cached = 3 * len(decoded) / (time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(min(100, n)):
        w9(ds[i])
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    top = [
        {"function": f"{Path(f).name}:{line}({fn})", "share": tt / total}
        for (f, line, fn), (_, _, tt, _, _) in rows[:8]
    ]
    return {
        "samples": n,
        "stage_ms": stages,
        "transform_share": stages["transform"] / sum(stages.values()),
        "roofline_runs": roof,
        "cached_roofline_samples_per_s": cached,
        "top_own_time": top,
    }


# -- the result file ---------------------------------------------------------------------------
def _rate(e: dict[str, Any]) -> float:
    return float(e["samples"] / e["seconds"])


def _rates(job: dict[str, Any]) -> str:
    return " ".join(f"{_rate(e):,.0f}" for e in job["epochs"]) + " samples/s"


def _aggregate(jobs_: list[dict[str, Any]]) -> list[float]:
    """Samples/s of all jobs together, per epoch: their samples over the wall time from
    the earliest start of that epoch to the latest end."""
    out = []
    for e in range(len(jobs_[0]["epochs"])):
        start = min(j["start"] if e == 0 else j["epochs"][e - 1]["end"] for j in jobs_)
        end = max(j["epochs"][e]["end"] for j in jobs_)
        out.append(sum(j["epochs"][e]["samples"] for j in jobs_) / (end - start))
    return out


def _cell(runs: list[dict[str, Any]], epochs: list[list[float]]) -> dict[str, Any]:
    return {
        "epochs": [results.spread([ep[e] for ep in epochs]) for e in range(len(epochs[0]))],
        "cpu_s": results.spread([r["cpu_s"] for r in runs]),
        "peak_pss_bytes": results.spread([r["peak_pss_bytes"] for r in runs]),
        "under_load": results.under_load(runs),
    }


def summarize(result: dict[str, Any]) -> None:
    """Each section's cells (medians and spread over its runs), and the suite's view
    (``cells``, ``roofline``) that the headline, throughput, costs and plot read."""
    from bench import suite

    if result.get("single"):
        runs = result["single"]["runs"]
        by: dict[str, dict[str, Any]] = {}
        for nw in sorted({r["num_workers"] for r in runs}):
            for system in SINGLE:
                rs = [r for r in runs if r["num_workers"] == nw and r["system"] == system]
                if not rs:
                    continue
                epochs = [[_rate(e) for e in r["jobs"][0]["epochs"]] for r in rs]
                by.setdefault(str(nw), {})[system] = _cell(rs, epochs)
        result["single"]["cells"] = by
        result["cells"] = suite.cells(runs)
    if result.get("jobs"):
        runs = result["jobs"]["runs"]
        result["jobs"]["cells"] = {
            system: _cell(rs, [_aggregate(r["jobs"]) for r in rs])
            | {"misses": [r["cache"]["misses"] for r in rs if r.get("cache")]}
            for system in JOBS
            if (rs := [r for r in runs if r["system"] == system])
        }
    if result.get("restart"):
        runs = result["restart"]["runs"]
        result["restart"]["cells"] = {
            system: _cell(rs, [[_rate(r["jobs"][0]["epochs"][0])] for r in rs])
            for system in SYSTEMS
            if (rs := [r for r in runs if r["system"] == system])
        }
    if result.get("profile"):
        roof = result["profile"]["roofline_runs"]
        result["roofline"] = {"runs": roof, "cell": suite.cell(roof)}


# -- main ----------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench W9", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=None, help="result folder (docs/results/)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 160 samples, 1 run")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.runs = 160, 1
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    args.section_names = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(args.section_names) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


SECTIONS = ("single", "jobs", "restart", "subset", "draft", "profile")


def main(argv: list[str]) -> int:
    from bench import tables

    args = parse(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    w = data.make_w9(args.data_dir, args.samples / 3000)
    args.samples, folder, params = w.samples, w.files[0], w.params
    args.workload = w
    warm_page_cache(args.data_dir, w)
    result = results.start(
        "W9",
        {
            "samples": args.samples,
            "runs": args.runs,
            "workers": args.workers,
            "jobs": args.jobs,
            "sections": ",".join(args.section_names),
        },
    )
    result |= {"kind": "w9", "method": __doc__, "workload": w.describe()}
    lock = threading.Lock()

    def progress(line: str) -> None:
        with lock:
            print(line, flush=True)

    sections = {
        "single": lambda: {"runs": single(args, params, progress)},
        "jobs": lambda: {"runs": jobs(args, params, progress)},
        "restart": lambda: restart(args, params, progress),
        "subset": lambda: subset(args, params, progress),
        "draft": lambda: draft(args, folder),
        "profile": lambda: profile(args, params),
    }
    for name in args.section_names:
        t0 = time.monotonic()
        result[name] = sections[name]()
        progress(f"{name} done in {time.monotonic() - t0:.0f} s")
    summarize(result)
    every = [
        r
        for name in ("single", "jobs", "restart")
        for r in (result.get(name) or {}).get("runs", [])
    ]
    results.finish(result, every)
    path = results.write(result, args.out)
    print(tables.w9_table(result))
    print(f"wrote {path}")
    return 0
