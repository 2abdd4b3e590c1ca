"""One node, several trainers: the node arbiter against each loader's own autotune, an
equal static split and the best static split (issue 26).

Three trainers start together on one server, each in its own process, each reading its
own loader and sleeping a fixed step per batch (standing for the GPU's compute):

- ``fast``: a 4 ms step over a dataset whose decode is CPU (32 ms of CPU per batch of
  8): a sweep trial whose input can never keep up on this machine;
- ``medium``: a 40 ms step over a dataset fetched from slow storage (35 ms of latency
  and 0.5 ms of CPU per sample): the training job, priority 2, which needs about 7
  workers in flight and little CPU;
- ``slow``: a 100 ms step over a mixed dataset (3 ms CPU + 7 ms latency per sample):
  an evaluation job that one worker keeps fed.

The node has ``--max-workers`` (9) worker processes (PINFEED_MAX_WORKERS). Each system
runs ``--seconds`` and is measured over the same window (from ``--warmup`` to the
end: the arbiter's and autotune's search inside it counts):

- ``arbiter``: every loader autotuned (``max_workers`` 8, starting at 1 worker), the
  node arbiter on (PINFEED_ARBITER_INTERVAL_S ``--interval``);
- ``autotune``: the same loaders, PINFEED_ARBITER=false: each tunes itself alone;
- ``equal``: fixed 3 / 3 / 3;
- ``best-static``: the split with the highest weighted total among every split of the
  9 workers (each loader at least 1), found by a sweep on one server (the split
  patched live, ``--sweep-seconds`` each), then measured like the others.

Per trainer: samples/s and stall share (time blocked in ``next()`` over the window);
per system the **weighted total** ``sum(priority * (1 - stall share))`` (the arbiter's
objective, as progress: 1 is a trainer never waiting) and the unweighted one. The
arbiter's time to settle is its last kept change after the trainers started
(``GET /v1/node``).

Phase 2: a ``priority``-4 trainer (``urgent``: a 30 ms step over a 1 ms CPU + 7 ms
latency per sample dataset) first alone on a fresh arbiter server, then started while
the three others run settled; its samples/s with them over its alone figure, and the
floors (``min_workers`` never broken, no attached waiting loader at 0) checked on every
``GET /v1/node`` polled meanwhile.

``python -m bench node [--quick]`` writes ``docs/results/node.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import results
from bench.procs import end, read_points, spawn
from bench.server import BenchServer

BATCH = 8
# Decode draws no global RNG, and says so: any worker process makes any batch, so a live
# change of num_workers replays nothing (a dataset that may draw keeps DataLoader's
# per-worker RNG streams, and a loader running fewer processes than streams pays for it)
PYTHON = {"factory": "bench.node:decode", "draws_rng": False}


# -- the datasets ---------------------------------------------------------------------


class Decode(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Each sample costs ``cpu_ms`` of CPU (spun on this thread's CPU clock, so it takes
    longer under contention, as real decode does) then ``io_ms`` of latency (a fetch
    from storage: no CPU)."""

    def __init__(self, length: int, cpu_ms: float, io_ms: float) -> None:
        self.length, self.cpu_s, self.io_s = length, cpu_ms / 1e3, io_ms / 1e3

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        if self.io_s:
            time.sleep(self.io_s)
        return torch.full((16,), float(i)), i


def decode(length: int, cpu_ms: float, io_ms: float) -> Decode:
    """``{"factory": "bench.node:decode", "kwargs": {length, cpu_ms, io_ms}}``."""
    return Decode(length, cpu_ms, io_ms)


@dataclass(frozen=True)
class Job:
    name: str
    step_ms: float
    cpu_ms: float  # per sample
    io_ms: float  # per sample
    priority: int
    what: str

    def demand(self) -> dict[str, float]:
        """What it needs to never wait, by this model: batches/s, workers, CPU cores."""
        per_batch = BATCH * (self.cpu_ms + self.io_ms) / 1e3
        rate = 1e3 / self.step_ms
        return {
            "batches_per_s": rate,
            "workers": rate * per_batch,
            "cores": rate * BATCH * self.cpu_ms / 1e3,
        }


JOBS = (
    Job("fast", 4, 4.0, 0.0, 1, "sweep trial: CPU decode"),
    Job("medium", 40, 0.5, 35.0, 2, "training job: slow storage"),
    Job("slow", 100, 3.0, 7.0, 1, "evaluation job: mixed"),
)
URGENT = Job("urgent", 30, 1.0, 7.0, 4, "priority 4, started later")


# -- the trainer process ----------------------------------------------------------------


def trainer_main(spec: dict[str, Any]) -> int:
    """Wait for ``go`` on stdin, then read the loader, sleeping ``step_ms`` per batch,
    until stdin closes; a reporter thread prints ``[monotonic, samples, batches,
    wait_s]`` every 0.25 s, the wait in progress included (a trainer blocked for a whole
    window still reports it)."""
    from pinfeed import Loader

    step = spec["step_ms"] / 1e3
    stop = threading.Event()
    state = {"samples": 0, "batches": 0, "wait": 0.0, "since": None}
    lock = threading.Lock()

    def report() -> None:
        while not stop.wait(0.25):
            now = time.monotonic()
            with lock:
                since = state["since"]
                wait = state["wait"] + (now - since if since is not None else 0.0)
                row = [now, state["samples"], state["batches"], wait]
            print(json.dumps(row), flush=True)

    with Loader(spec["loader"], socket=spec["socket"], timeout=120) as loader:
        print(json.dumps({"event": "ready"}), flush=True)
        sys.stdin.readline()
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        threading.Thread(target=report, daemon=True).start()
        it = iter(loader)
        while not stop.is_set():
            t0 = time.monotonic()
            with lock:
                state["since"] = t0
            try:
                x, _ = next(it)
            except StopIteration:
                it = iter(loader)
                continue
            t1 = time.monotonic()
            with lock:
                state["since"] = None
                state["wait"] += t1 - t0
                state["samples"] += int(x.shape[0])
                state["batches"] += 1
            time.sleep(step)
    return 0


class Trainer:
    def __init__(self, srv: BenchServer, job: Job) -> None:
        self.job = job
        spec = {"loader": job.name, "socket": str(srv.socket), "step_ms": job.step_ms}
        self.proc = spawn(["bench.node", "trainer", json.dumps(spec)])
        # (time, samples, batches, seconds waited) points
        self.points, self.ready = read_points(self.proc)
        self.started = float("nan")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.started = time.monotonic()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        inside = [p for p in list(self.points) if t0 <= p[0] <= t1]
        if len(inside) < 2:
            return {"samples_per_s": None, "stall_share": None, "progress": None}
        (a, sa, _, wa), (b, sb, _, wb) = inside[0], inside[-1]
        stall = min(1.0, max(0.0, (wb - wa) / (b - a)))
        return {
            "samples_per_s": (sb - sa) / (b - a),
            "stall_share": stall,
            "progress": 1.0 - stall,
            "window_s": b - a,
        }

    def stop(self) -> None:
        end(self.proc, 30, (OSError,))


# -- one system -------------------------------------------------------------------------


def _server(args: argparse.Namespace, arbiter: bool) -> BenchServer:
    env = {
        "PINFEED_MAX_WORKERS": str(args.max_workers),
        "PINFEED_ARBITER": "true" if arbiter else "false",
        "PINFEED_ARBITER_INTERVAL_S": str(args.interval),
    }
    return BenchServer(args.data_dir, env=env)


def _loaders(
    c: Any, jobs: tuple[Job, ...], workers: dict[str, int] | None, interval: float
) -> None:
    """One dataset and loader per job; ``workers``: fixed counts, None: autotuned from 1."""
    have = {d["name"] for d in c.datasets()}
    for job in jobs:
        if job.name not in have:
            kwargs = {"length": 1 << 20, "cpu_ms": job.cpu_ms, "io_ms": job.io_ms}
            c.create_dataset(job.name, "python", PYTHON | {"kwargs": kwargs})
        extra: dict[str, Any] = {}
        if workers is None:
            extra["autotune"] = {"max_workers": 8, "interval_s": max(0.2, interval)}
        c.create_loader(
            job.name,
            dataset=job.name,
            batch_size=BATCH,
            num_workers=1 if workers is None else workers[job.name],
            priority=job.priority,
            min_workers=1,
            **extra,
        )


def _start(srv: BenchServer, jobs: tuple[Job, ...]) -> list[Trainer]:
    trainers = [Trainer(srv, job) for job in jobs]
    for t in trainers:
        if not t.ready.wait(120):
            raise RuntimeError(f"trainer {t.job.name} did not attach within 120 s")
    for t in trainers:
        t.go()
    return trainers


def _summary(rows: dict[str, dict[str, Any]], jobs: tuple[Job, ...]) -> dict[str, Any]:
    prog = {j.name: rows[j.name]["progress"] for j in jobs}
    if any(v is None for v in prog.values()):
        return {"weighted_total": None, "total": None}
    return {
        "weighted_total": sum(j.priority * prog[j.name] for j in jobs),
        "total": sum(prog[j.name] for j in jobs),
    }


def _settle(node: dict[str, Any], since_s: float) -> float | None:
    """The last kept change after ``since_s`` (server seconds), relative to it."""
    kept = [
        d["t"]
        for d in node["decisions"]
        if d["kind"] in ("keep", "prefetch", "room") and d["t"] >= since_s
    ]
    return (max(kept) - since_s) if kept else 0.0


def run_system(
    args: argparse.Namespace, system: str, split: dict[str, int] | None
) -> dict[str, Any]:
    from pinfeed import Client

    arbiter = system == "arbiter"
    foreign = results.ForeignCpu()
    with _server(args, arbiter) as srv, Client(srv.url, timeout=120) as c:
        _loaders(c, JOBS, split, args.interval)
        trainers = _start(srv, JOBS)
        t0 = time.monotonic()
        since = c.node()["uptime_s"]
        try:
            time.sleep(args.warmup)
            foreign.start()
            time.sleep(args.seconds - args.warmup)
            usage = foreign.stop()
            t1 = time.monotonic()
            node = c.node()
        finally:
            for t in trainers:
                t.stop()
    rows = {t.job.name: t.window(t0 + args.warmup, t1) for t in trainers}
    workers = {lo["name"]: lo["workers"] for lo in node["loaders"]}
    out = {
        "system": system,
        "split": split,
        "trainers": rows,
        "workers_at_end": workers,
        **_summary(rows, JOBS),
        "foreign": usage,
    }
    if arbiter:
        out["settle_s"] = _settle(node, since)
        out["decisions"] = node["decisions"]
    print(
        f"  {system:<12} split {workers}  weighted {_f(out['weighted_total'])}  "
        + "  ".join(
            f"{n}: {_f(r['samples_per_s'], '{:.0f}')}/s stall {_f(r['stall_share'], '{:.0%}')}"
            for n, r in rows.items()
        ),
        flush=True,
    )
    return out


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every split of the workers (each loader at least 1), patched live on one server."""
    from pinfeed import Client

    names = [j.name for j in JOBS]
    splits = [
        dict(zip(names, (a, b, args.max_workers - a - b), strict=True))
        for a, b in itertools.product(range(1, args.max_workers), repeat=2)
        if args.max_workers - a - b >= 1
    ]
    out = []
    with _server(args, False) as srv, Client(srv.url, timeout=120) as c:
        _loaders(c, JOBS, splits[0], args.interval)
        trainers = _start(srv, JOBS)
        try:
            for split in splits:
                for name in sorted(split, key=lambda n: split[n] - c.loader(n)["num_workers"]):
                    c.patch_loader(name, num_workers=split[name])  # shrink first: fits
                time.sleep(args.sweep_settle)
                t0 = time.monotonic()
                time.sleep(args.sweep_seconds)
                rows = {t.job.name: t.window(t0, time.monotonic()) for t in trainers}
                row = {"split": split, "trainers": rows, **_summary(rows, JOBS)}
                out.append(row)
                print(f"  sweep {split}: weighted {_f(row['weighted_total'])}", flush=True)
        finally:
            for t in trainers:
                t.stop()
    return out


def phase2(args: argparse.Namespace) -> dict[str, Any]:
    """The priority-4 trainer alone, then started beside the three others (arbiter)."""
    from pinfeed import Client

    def urgent_loader(c: Any) -> None:
        kwargs = {"length": 1 << 20, "cpu_ms": URGENT.cpu_ms, "io_ms": URGENT.io_ms}
        c.create_dataset(URGENT.name, "python", PYTHON | {"kwargs": kwargs})
        c.create_loader(
            URGENT.name,
            dataset=URGENT.name,
            batch_size=BATCH,
            num_workers=1,
            priority=URGENT.priority,
            min_workers=1,
            autotune={"max_workers": 8, "interval_s": max(0.2, args.interval)},
        )

    with _server(args, True) as srv, Client(srv.url, timeout=120) as c:
        urgent_loader(c)
        (alone_t,) = _start(srv, (URGENT,))
        time.sleep(args.seconds)
        alone = alone_t.window(alone_t.started + args.warmup, time.monotonic())
        alone_t.stop()
    print(f"  urgent alone: {_f(alone['samples_per_s'], '{:.0f}')}/s", flush=True)

    broken: list[str] = []
    polls = 0
    with _server(args, True) as srv, Client(srv.url, timeout=120) as c:
        _loaders(c, JOBS, None, args.interval)
        trainers = _start(srv, JOBS)
        try:
            time.sleep(args.seconds)  # the three settle
            before = {
                t.job.name: t.window(time.monotonic() - 10, time.monotonic()) for t in trainers
            }
            since = c.node()["uptime_s"]
            urgent_loader(c)
            (urgent,) = _start(srv, (URGENT,))
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                node = c.node()
                polls += 1
                broken += _floors_broken(node)
                time.sleep(0.5)
            t1 = time.monotonic()
            with_others = urgent.window(urgent.started + args.warmup, t1)
            others = {t.job.name: t.window(urgent.started + args.warmup, t1) for t in trainers}
            node = c.node()
            urgent.stop()
        finally:
            for t in trainers:
                t.stop()
    share = (
        with_others["samples_per_s"] / alone["samples_per_s"]
        if with_others["samples_per_s"] and alone["samples_per_s"]
        else None
    )
    rate = _f(with_others["samples_per_s"], "{:.0f}")
    print(f"  urgent with the others: {rate}/s = {_f(share, '{:.2f}x')}", flush=True)
    return {
        "alone": alone,
        "with_others": with_others,
        "share_of_alone": share,
        "others_before": before,
        "others_after": others,
        "settle_s": _settle(node, since),
        "workers_at_end": {lo["name"]: lo["workers"] for lo in node["loaders"]},
        "decisions": node["decisions"],
        "floor_checks": polls,
        "floors_broken": broken,
    }


def _floors_broken(node: dict[str, Any]) -> list[str]:
    out = []
    attached = [lo for lo in node["loaders"] if lo["trainers"]]
    lowest = min((lo["priority"] for lo in attached), default=0)
    top = max((lo["priority"] for lo in attached), default=0)
    for lo in node["loaders"]:
        if lo["workers"] < lo["min_workers"]:
            out.append(f"{lo['name']}: {lo['workers']} workers < min_workers {lo['min_workers']}")
        waiting = lo["trainers"] and (lo["wait_share"] or 0) >= 0.05
        exempt = lo["min_workers"] == 0 and lo["priority"] == lowest < top
        if waiting and lo["workers"] == 0 and not exempt:
            out.append(f"{lo['name']}: a waiting trainer and 0 workers")
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=75.0, help="each system's run")
    ap.add_argument("--warmup", type=float, default=10.0, help="the window starts here")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each system (ABBA order)")
    ap.add_argument("--max-workers", type=int, default=9, help="PINFEED_MAX_WORKERS")
    ap.add_argument("--interval", type=float, default=2.0, help="PINFEED_ARBITER_INTERVAL_S")
    ap.add_argument("--sweep-seconds", type=float, default=6.0)
    ap.add_argument("--sweep-settle", type=float, default=4.0)
    ap.add_argument("--quick", action="store_true", help="a smoke run (minutes; not published)")
    ap.add_argument("--data-dir", type=Path, default=Path("/tmp/pinfeed-bench-node"))
    ap.add_argument("--out", type=Path, default=results.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.rounds = 20.0, 5.0, 1
        args.sweep_seconds, args.sweep_settle = 2.0, 4.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    envelope = results.start("node", vars(args))
    print("== sweep: every split", flush=True)
    swept = sweep(args)
    best = max(swept, key=lambda r: r["weighted_total"] or -1)["split"]
    equal = {j.name: args.max_workers // len(JOBS) for j in JOBS}
    systems = [("arbiter", None), ("autotune", None), ("equal", equal), ("best-static", best)]
    runs: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = systems if k % 2 == 0 else systems[::-1]
        print(f"== round {k + 1}", flush=True)
        for system, split in order:
            runs.append(run_system(args, system, split) | {"round": k})
    print("== phase 2: a priority-4 trainer", flush=True)
    p2 = phase2(args)
    cells = {}
    for system, _ in systems:
        mine = [r for r in runs if r["system"] == system]
        cells[system] = {
            "weighted_total": results.spread([r["weighted_total"] for r in mine]),
            "total": results.spread([r["total"] for r in mine]),
            "trainers": {
                j.name: {
                    "samples_per_s": results.spread(
                        [r["trainers"][j.name]["samples_per_s"] for r in mine]
                    ),
                    "stall_share": results.spread(
                        [r["trainers"][j.name]["stall_share"] for r in mine]
                    ),
                }
                for j in JOBS
            },
            "split": mine[-1]["workers_at_end"],
            "under_load": results.under_load(mine),
        }
    cells["arbiter"]["settle_s"] = results.spread(
        [r.get("settle_s") for r in runs if r["system"] == "arbiter"]
    )
    result = envelope | {
        "kind": "node",
        "jobs": [j.__dict__ | {"demand": j.demand()} for j in (*JOBS, URGENT)],
        "sweep": swept,
        "best_split": best,
        "runs": runs,
        "cells": cells,
        "phase2": p2,
    }
    result["targets"] = targets(result)
    result = results.finish(result, runs)
    path = results.write(result, args.out)
    for t in result["targets"]:
        print(f"{'ok  ' if t['ok'] else 'MISS'} {t['target']}: {_f(t['value'])} ({t['goal']})")
    print(f"wrote {path} in {result['wall_s']:.0f} s")
    return 0


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26's must-show numbers, from the medians of the cells."""
    cells = result["cells"]

    def med(system: str) -> float | None:
        v: float | None = cells[system]["weighted_total"]["median"]
        return v

    out = []
    arb = med("arbiter")
    for other, goal in (("best-static", 0.95), ("autotune", 1.3), ("equal", 1.3)):
        o = med(other)
        ratio = arb / o if arb is not None and o else None
        out.append(
            {
                "target": f"arbiter's weighted total / {other}'s",
                "value": ratio,
                "goal": f">= {goal}x",
                "ok": ratio is not None and ratio >= goal,
            }
        )
    share = result["phase2"]["share_of_alone"]
    out.append(
        {
            "target": "priority-4 trainer's samples/s with the others / alone",
            "value": share,
            "goal": ">= 0.9x",
            "ok": share is not None and share >= 0.9,
        }
    )
    broken = result["phase2"]["floors_broken"]
    out.append(
        {
            "target": f"floors broken in {result['phase2']['floor_checks']} GET /v1/node polls",
            "value": float(len(broken)),
            "goal": "0",
            "ok": not broken,
        }
    )
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "trainer":
        raise SystemExit(trainer_main(json.loads(sys.argv[2])))
    raise SystemExit(main(sys.argv[1:]))
