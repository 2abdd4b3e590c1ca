"""W9: decode once per node. ``python -m bench W9 [--samples N] [--runs R] ...``.

ImageNet-like JPEGs (500x375, every fourth portrait, quality 90, generated with
Pillow) in class folders; the deterministic stage (decode, RGB, shorter side resized
to 256, aspect kept: the ``images`` kind with ``"crop": false``) is cached by the
server; RandomResizedCrop(224) + horizontal flip (``bench.transforms:w9``, torch: the
stand-in for torchvision) is each loader's ``transform``; batch 32, three epochs.
DataLoader runs ``Transformed(the same images dataset, the same transform)`` with
``persistent_workers`` and the same seed: the same batches.

Sections, each on a fresh server, runs in fresh trainer processes (``bench.w9_trainer``),
the two systems alternating ABBA, medians over ``--runs`` (spread = min..max):

- ``single``: one trainer, ``num_workers`` 0/1/2. Each pinfeed run registers the dataset
  afresh, so its first epoch fills an empty cache; the server deletes it afterwards.
- ``jobs``: four trainers at once, four loaders (seeds 0-3, one worker each) over one
  cached dataset, against four DataLoaders (one worker each): aggregate samples/s per
  epoch, CPU seconds of everything either system ran (trainers, DataLoader's workers;
  the server, its zygote and workers), and the cache's misses over all four loaders.
- ``restart``: a persisted cache filled by one epoch, then per run a new server process
  on the same state dir and one epoch (``num_workers`` 2), against DataLoader's first.
  The cache file's pages are still in the page cache (a server restart, not a reboot).
- ``subset``: a cache of half the dataset (``max_bytes``): its hit ratio in epochs 2-3
  against max_bytes / size.
- ``draft``: Pillow's full and draft JPEG decode of W9's JPEGs and of 4x larger ones
  (time per image, pixel difference), in this process; ``profile``: where a cold
  sample's time goes (cProfile over decode + resize + transform, one process).

Writes ``docs/bench-w9.json``; ``--report FILE`` prints the README's table from a
result file (every figure in the README comes from it).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.data import DATA_DIR, _jpeg, warm_page_cache
from bench.memory import PeakSampler
from bench.server import REPO, BenchServer
from tests.launcher import Server

TRANSFORM = "bench.transforms:w9"
RESIZE = 256
BATCH = 32
EPOCHS = 3
CLASSES = 10
SOURCE = (500, 375)
SYSTEMS = ("pinfeed", "dataloader")


# -- data ----------------------------------------------------------------------------------
def make_w9(root: Path, n: int) -> tuple[str, dict[str, Any]]:
    """``n`` JPEGs under ``root/w9-<n>`` (made once); (folder, the images params)."""
    folder = root / f"w9-{n}"
    spec = {"n": n, "classes": CLASSES, "source": list(SOURCE), "quality": 90, "seed": 9}
    stamp = folder / "spec.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == spec):
        rng = np.random.default_rng(9)
        w, h = SOURCE
        for i in range(n):
            cls = folder / f"class{i % CLASSES:02d}"
            cls.mkdir(parents=True, exist_ok=True)
            size = (w, h) if i % 4 else (h, w)
            _jpeg(rng, *size).save(cls / f"img{i:06d}.jpg", format="JPEG", quality=90)
        stamp.write_text(json.dumps(spec))
    return folder.name, {"path": folder.name, "size": RESIZE, "crop": False}


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
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.w9_trainer", json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )

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
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
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
        for t in trainers:
            t.send("go\n")
        results = [t.expect("result") for t in trainers]
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
    return {
        "jobs": [{"start": r["start"], "epochs": r["epochs"]} for r in results],
        "trainer_cpu_s": trainer_cpu,
        "server_cpu_s": server_cpu,
        "cpu_s": trainer_cpu + server_cpu,
        "peak_pss_bytes": memory["peak_pss_bytes"],
        "loadavg_1m_at_go": load,
    }


# -- measurements -----------------------------------------------------------------------------
_ids = iter(range(1 << 30))


def _spec(
    system: str, nw: int, args: argparse.Namespace, params: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    return {
        "system": system,
        "num_workers": nw,
        "batch_size": BATCH,
        "epochs": EPOCHS,
        "seed": 0,
        "transform": TRANSFORM,
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


def _order(run: int) -> tuple[str, ...]:
    return SYSTEMS if run % 2 == 0 else SYSTEMS[::-1]


def single(args: argparse.Namespace, params: dict[str, Any], progress: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with BenchServer(args.data_dir) as srv:
        _warm(srv, params, args)
        for nw in args.worker_counts:
            for r in range(args.runs):
                for system in _order(r):
                    ds = _register(srv, params, {}) if system == "pinfeed" else None
                    kw = _pinfeed_kw(srv, ds) if ds else {}
                    out = run_trainers(
                        [_spec(system, nw, args, params, **kw)], srv.pid if ds else None
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
            for system in _order(r):
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
    """Where a cold sample's time goes: decode, resize, copies, the transform."""
    import torch

    from bench.transforms import w9
    from pinfeed_server.datasets import DatasetContext, build_dataset

    torch.set_num_threads(1)
    ds = build_dataset("images", params, DatasetContext(args.data_dir))
    n = min(300, len(ds))
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        w9(ds[i])
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    top = [
        {
            "function": f"{Path(f).name}:{line}({fn})",
            "share": tt / total,
            "ms_per_sample": tt / n * 1e3,
        }
        for (f, line, fn), (_, _, tt, _, _) in rows[:8]
    ]
    return {"samples": n, "ms_per_sample": total / n * 1e3, "top_own_time": top}


# -- summary ------------------------------------------------------------------------------------
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


def _stat(xs: list[float]) -> dict[str, float]:
    return {"median": float(statistics.median(xs)), "min": min(xs), "max": max(xs)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"single": {}, "jobs": {}, "restart": {}}
    for nw in sorted({r["num_workers"] for r in result.get("single", [])}):
        row: dict[str, Any] = {}
        for system in SYSTEMS:
            runs = [r for r in result["single"] if r["num_workers"] == nw and r["system"] == system]
            epochs = [[_rate(e) for e in r["jobs"][0]["epochs"]] for r in runs]
            row[system] = {
                "epoch": [_stat([ep[e] for ep in epochs]) for e in range(EPOCHS)],
                "cpu_s": _stat([r["cpu_s"] for r in runs]),
                "peak_pss_mib": _stat([r["peak_pss_bytes"] / 2**20 for r in runs]),
            }
        row["ratio"] = [
            row["pinfeed"]["epoch"][e]["median"] / row["dataloader"]["epoch"][e]["median"]
            for e in range(EPOCHS)
        ]
        s["single"][str(nw)] = row
    if result.get("jobs"):
        for system in SYSTEMS:
            runs = [r for r in result["jobs"] if r["system"] == system]
            agg = [_aggregate(r["jobs"]) for r in runs]
            s["jobs"][system] = {
                "aggregate": [_stat([a[e] for a in agg]) for e in range(EPOCHS)],
                "cpu_s": _stat([r["cpu_s"] for r in runs]),
            }
        p, d = s["jobs"]["pinfeed"], s["jobs"]["dataloader"]
        s["jobs"]["ratio"] = [
            p["aggregate"][e]["median"] / d["aggregate"][e]["median"] for e in range(EPOCHS)
        ]
        s["jobs"]["cpu_ratio"] = p["cpu_s"]["median"] / d["cpu_s"]["median"]
        s["jobs"]["misses"] = [
            r["cache"]["misses"] for r in result["jobs"] if r["system"] == "pinfeed"
        ]
    if result.get("restart"):
        by = {
            system: [
                _rate(r["jobs"][0]["epochs"][0])
                for r in result["restart"]["runs"]
                if r["system"] == system
            ]
            for system in SYSTEMS
        }
        s["restart"] = {system: _stat(v) for system, v in by.items()}
        s["restart"]["ratio"] = (
            s["restart"]["pinfeed"]["median"] / s["restart"]["dataloader"]["median"]
        )
    return s


def table(result: dict[str, Any]) -> str:
    """The README's W9 table (markdown), from a result file."""
    s, meta = result["summary"], result["meta"]
    load = (
        f"load average {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after"
    )
    if meta["under_load"]:
        load += "; measured under load"
    lines = [
        f"W9, {meta['samples']} JPEGs {SOURCE[0]}x{SOURCE[1]}, batch {BATCH}, median of "
        f"{meta['runs']} runs (commit {meta['commit']}, {load}):",
        "",
        "| pinfeed / DataLoader | epoch 1 (fills the cache) | epoch 2 | epoch 3 | CPU s |",
        "|---|---|---|---|---|",
    ]

    def cells(ratios: list[float], ours: list[Any], theirs: list[Any]) -> str:
        return " | ".join(
            f"**{r:.2f}x** ({p['median']:,.0f} vs {d['median']:,.0f}/s)"
            for r, p, d in zip(ratios, ours, theirs, strict=True)
        )

    def cpu(p: dict[str, Any], d: dict[str, Any]) -> str:
        return f"{p['cpu_s']['median']:.0f} vs {d['cpu_s']['median']:.0f}"

    for nw, row in s["single"].items():
        p, d = row["pinfeed"], row["dataloader"]
        lines.append(
            f"| num_workers={nw} | {cells(row['ratio'], p['epoch'], d['epoch'])} | {cpu(p, d)} |"
        )
    if s.get("jobs"):
        j = s["jobs"]
        p, d = j["pinfeed"], j["dataloader"]
        lines.append(
            f"| {meta['jobs']} jobs at once (aggregate) "
            f"| {cells(j['ratio'], p['aggregate'], d['aggregate'])} | {cpu(p, d)} |"
        )
    if s.get("restart"):
        r = s["restart"]
        lines.append(
            f"| first epoch after a server restart (persisted), num_workers=2 "
            f"| **{r['ratio']:.2f}x** ({r['pinfeed']['median']:,.0f} vs "
            f"{r['dataloader']['median']:,.0f}/s) | | | |"
        )
    if result.get("subset"):
        sub = result["subset"]
        lines += [
            "",
            f"A cache of half the dataset (max_bytes {sub['max_bytes'] / 2**20:.0f} MiB of "
            f"{sub['whole_bytes'] / 2**20:.0f}): hit ratio {sub['hit_ratio_epochs_2_3']:.3f} "
            f"in epochs 2-3 (max_bytes / size = {sub['expected']:.3f}).",
        ]
    if s.get("jobs"):
        lines.append(
            f"Cache misses over the {meta['jobs']} loaders: {s['jobs']['misses']} "
            f"(the dataset has {meta['samples']} samples)."
        )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------
def _commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "bench"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (
        head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if head.returncode == 0
        else None
    )


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench W9", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--sections", default="single,jobs,restart,subset,draft,profile")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-w9.json")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 160 samples, 1 run")
    ap.add_argument("--report", type=Path, help="print the README table of a result file")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.runs = 160, 1
    args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    args.section_names = [x.strip() for x in args.sections.split(",") if x.strip()]
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return 0
    import torch

    args.data_dir.mkdir(parents=True, exist_ok=True)
    folder, params = make_w9(args.data_dir, args.samples)
    warm_page_cache(args.data_dir, type("W", (), {"files": [folder]})())  # type: ignore[arg-type]
    result: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench W9", *argv]),
            "commit": _commit(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "samples": args.samples,
            "runs": args.runs,
            "jobs": args.jobs,
            "method": __doc__,
        }
    }
    lock = threading.Lock()

    def progress(line: str) -> None:
        with lock:
            print(line, flush=True)

    sections = {
        "single": lambda: single(args, params, progress),
        "jobs": lambda: jobs(args, params, progress),
        "restart": lambda: restart(args, params, progress),
        "subset": lambda: subset(args, params, progress),
        "draft": lambda: draft(args, folder),
        "profile": lambda: profile(args, params),
    }
    for name in args.section_names:
        t0 = time.monotonic()
        result[name] = sections[name]()
        progress(f"{name} done in {time.monotonic() - t0:.0f} s")
    result["meta"]["loadavg_after"] = os.getloadavg()
    result["meta"]["under_load"] = (
        max(result["meta"]["loadavg_before"][0], result["meta"]["loadavg_after"][0]) > 1.5
    )
    result["summary"] = summarize(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"wrote {args.out}")
    return 0
