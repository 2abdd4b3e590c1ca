"""Soak: 8 loaders, a trainer process on each, random trainer and worker SIGKILLs.

    python -m bench.soak                  # 5 minutes
    python -m bench.soak --seconds 120    # shorter

Every batch a trainer gets is checked against ``torch.utils.data.DataLoader`` over the
same file with the same seed (sample indices *and* values), and against the position
``Loader.state_dict()`` reports. A killed trainer is replaced by a new one that attaches
where the server says the loader is; the gap across a kill (batches handed to the dead
trainer: the one it was reading and the ``protocol.NEXTS_IN_FLIGHT`` it had asked for
ahead, at most 3) is measured too.
Meanwhile the server's open fds, memfds, threads, processes and RSS are sampled.

Prints a summary and writes ``docs/results/soak.json``; exits 1 if a batch was wrong or a
resource grew past its bound. Not part of the test suite (it runs for minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

from bench import results
from pinfeed import Client, Loader
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.launcher import Server

LENGTH = 512
WIDTH = 16

# Bounds the run must stay within, from the first sample after warm-up to the end.
FD_GROWTH_MAX = 8  # a few HTTP keep-alive sockets come and go
RSS_GROWTH_MAX = 64 << 20
# Batches a killed trainer takes with it: the one it was checking (not yet counted) and
# the NEXTs it had in flight, which the server sent and moved its position past.
MAX_GAP = 1 + NEXTS_IN_FLIGHT

# Trainer report slots (one int64 array per trainer process, written by the trainer).
STATE, ATTACH_E, ATTACH_I, LAST_E, LAST_I, COUNT, MISMATCH, DISCONT, ERRORS, FIRST_E, FIRST_I = (
    range(11)
)
NSTATS = 11


def _loader_configs(n: int) -> list[dict[str, Any]]:
    sizes, workers = [4, 8, 16, 32], [0, 1, 2]
    return [
        {
            "name": f"soak-{i}",
            "batch_size": sizes[i % 4],
            "shuffle": i % 2 == 0,
            "drop_last": i % 3 == 0,
            "num_workers": workers[i % 3],
            "seed": 1000 + i,
        }
        for i in range(n)
    ]


def make_data(path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    torch.save((torch.randn(LENGTH, WIDTH, generator=g), torch.arange(LENGTH)), path)


class Reference:
    """DataLoader's index batches, epoch by epoch, from one seeded generator."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        gen = torch.Generator().manual_seed(cfg["seed"])
        self.loader = DataLoader(
            range(LENGTH),
            batch_size=cfg["batch_size"],
            shuffle=cfg["shuffle"],
            drop_last=cfg["drop_last"],
            generator=gen,
        )
        self.epoch = -1
        self.batches: list[torch.Tensor] = []

    def __call__(self, epoch: int) -> list[torch.Tensor]:
        while self.epoch < epoch:
            self.batches = list(self.loader)
            self.epoch += 1
        return self.batches


def trainer_main(sock: str, data: str, cfg: dict[str, Any], stats: Any) -> None:
    """Consume forever, checking every batch; report through ``stats``."""
    torch.set_num_threads(1)
    x, y = torch.load(data, weights_only=True)
    try:
        loader = Loader(cfg["name"], socket=sock, timeout=120)
        epoch, index = loader.meta.epoch, loader.meta.position
        stats[ATTACH_E], stats[ATTACH_I] = epoch, index
        stats[STATE] = 1
        ref = Reference(cfg)
        nb = len(loader)
        while True:
            for xb, yb in loader:
                want = ref(epoch)[index]
                if not (torch.equal(yb, y[want]) and torch.equal(xb, x[want])):
                    stats[MISMATCH] += 1
                state = loader.state_dict()
                nxt = (epoch, index + 1) if index + 1 < nb else (epoch + 1, 0)
                if (state["epoch"], state["index"]) != nxt:
                    stats[DISCONT] += 1
                if stats[COUNT] == 0:
                    stats[FIRST_E], stats[FIRST_I] = epoch, index
                stats[LAST_E], stats[LAST_I] = epoch, index
                stats[COUNT] += 1
                epoch, index = nxt
            if index != 0:  # the loop ended before the epoch did
                stats[DISCONT] += 1
                epoch, index = epoch + 1, 0
    except BaseException as exc:
        stats[ERRORS] += 1
        print(f"trainer of {cfg['name']}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)


@dataclass
class Trainer:
    proc: Any
    stats: Any
    generation: int


@dataclass
class LoaderRun:
    cfg: dict[str, Any]
    batches_per_epoch: int = 0
    generations: int = 0
    trainer_kills: int = 0
    worker_kills: int = 0
    worker_restarts: int = 0
    verified: int = 0
    mismatches: int = 0
    discontinuities: int = 0
    trainer_errors: int = 0
    gaps: list[int] = field(default_factory=list)  # batches lost across each kill
    detach_s: list[float] = field(default_factory=list)
    pending_gap: int | None = None  # global position of the last batch before a kill
    failure: dict[str, Any] | None = None  # the loader's, if it failed


def _fds(pid: int) -> tuple[int, int]:
    n = memfd = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += 1
        memfd += target.startswith("/memfd:pinfeed-")
    return n, memfd


def _workers_of(server: psutil.Process, loader: str) -> list[psutil.Process]:
    needle = f"/memfd:pinfeed-{loader} (deleted)"
    out = []
    for p in server.children(recursive=True):
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                if any(line.rstrip().endswith(needle) for line in f):
                    out.append(p)
        except OSError:
            continue
    return out


def _sample(server: psutil.Process, t0: float) -> dict[str, Any]:
    fds, memfds = _fds(server.pid)
    kids = server.children(recursive=True)
    rss_kids = 0
    for k in kids:
        try:
            rss_kids += k.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return {
        "t": round(time.monotonic() - t0, 1),
        "fds": fds,
        "memfds": memfds,
        "threads": server.num_threads(),
        "processes": len(kids),
        "rss_server": server.memory_info().rss,
        "rss_workers": rss_kids,
    }


def _poll(what: str, probe: Any, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while not probe():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: nothing after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="pinfeed-soak-"))
        (self.root / "data").mkdir()
        self.data = self.root / "data" / "soak.pt"
        make_data(self.data)
        self.server = Server(self.root, env={"PINFEED_LOG_LEVEL": args.log_level})
        self.sock = str(self.server.socket)
        self.runs = {c["name"]: LoaderRun(c) for c in _loader_configs(args.loaders)}
        self.trainers: dict[str, Trainer] = {}
        self.samples: list[dict[str, Any]] = []
        self.baseline: dict[str, Any] = {}
        self.quiesced: dict[str, Any] = {}
        from bench import soak as this  # the importable module, also when run as __main__

        # Trainers fork from a server that has imported torch and the client already.
        mp.set_forkserver_preload(["client"])
        self.ctx = mp.get_context("forkserver")
        self.target = this.trainer_main

    def spawn(self, name: str) -> None:
        run = self.runs[name]
        stats = RawArray("q", NSTATS)
        proc = self.ctx.Process(
            target=self.target,
            args=(self.sock, str(self.data), run.cfg, stats),
            name=f"soak-trainer-{name}",
            daemon=True,
        )
        proc.start()
        run.generations += 1
        self.trainers[name] = Trainer(proc, stats, run.generations)

    def harvest(self, name: str) -> None:
        """Fold a trainer's counters into its loader's totals."""
        run, t = self.runs[name], self.trainers[name]
        s = t.stats
        run.verified += s[COUNT]
        run.mismatches += s[MISMATCH]
        run.discontinuities += s[DISCONT]
        run.trainer_errors += s[ERRORS]

    def check_gap(self, name: str) -> None:
        run, s = self.runs[name], self.trainers[name].stats
        if run.pending_gap is None or s[COUNT] == 0:
            return
        first = s[FIRST_E] * run.batches_per_epoch + s[FIRST_I]
        run.gaps.append(first - run.pending_gap - 1)
        run.pending_gap = None

    def kill_trainer(self, admin: Client) -> None:
        busy = [n for n, t in self.trainers.items() if t.stats[COUNT] > 0]
        if not busy:
            return
        name = self.rng.choice(busy)
        run, t = self.runs[name], self.trainers[name]
        self.check_gap(name)
        t.proc.kill()
        t.proc.join(10)
        run.trainer_kills += 1
        run.pending_gap = t.stats[LAST_E] * run.batches_per_epoch + t.stats[LAST_I]
        self.harvest(name)

        def detached() -> bool:
            d = admin.loader(name)
            return not d["consumer_attached"] and d["slots"]["leased"] == 0

        run.detach_s.append(_poll(f"{name}: the killed trainer's slots", detached, 30))
        self.spawn(name)

    def trainer_died(self, admin: Client, name: str) -> None:
        """A trainer exited on its own (it got an error): count it, look at the loader."""
        run = self.runs[name]
        self.check_gap(name)
        self.harvest(name)
        del self.trainers[name]
        d = admin.loader(name)
        if d["state"] == "failed":
            run.failure = d["failure"]
            return  # a failed loader stays failed: no new trainer, no more kills
        run.pending_gap = None
        self.spawn(name)

    def kill_worker(self, server: psutil.Process) -> None:
        names = [n for n, r in self.runs.items() if r.cfg["num_workers"] > 0 and r.failure is None]
        name = self.rng.choice(names)
        workers = _workers_of(server, name)
        if not workers:
            return
        victim = self.rng.choice(workers)
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            return
        self.runs[name].worker_kills += 1

    def run(self) -> dict[str, Any]:
        args = self.args
        self.server.start()
        server = psutil.Process(self.server.pid)
        admin = Client(self.server.url, timeout=30)
        try:
            admin.create_dataset("soak", "tensors", {"path": "soak.pt"})
            for run in self.runs.values():
                cfg = {k: v for k, v in run.cfg.items() if k != "name"}
                admin.create_loader(run.cfg["name"], dataset="soak", **cfg)
            for name, run in self.runs.items():
                _poll(f"{name} ready", lambda n=name: admin.loader(n)["state"] == "ready", 120)
                run.batches_per_epoch = admin.loader(name)["batches_per_epoch"]
            t0 = time.monotonic()
            self.baseline = _sample(server, t0)  # loaders warm, no trainer yet
            for name in self.runs:
                self.spawn(name)
            end = t0 + args.seconds
            next_sample = t0
            next_tkill = t0 + self.rng.expovariate(1 / args.trainer_kill_every)
            next_wkill = t0 + self.rng.expovariate(1 / args.worker_kill_every)
            while (now := time.monotonic()) < end:
                if now >= next_sample:
                    self.samples.append(_sample(server, t0))
                    next_sample += args.sample_every
                    for name in self.trainers:
                        self.check_gap(name)
                if now >= next_tkill:
                    self.kill_trainer(admin)
                    next_tkill = time.monotonic() + self.rng.expovariate(
                        1 / args.trainer_kill_every
                    )
                if now >= next_wkill:
                    self.kill_worker(server)
                    next_wkill = time.monotonic() + self.rng.expovariate(1 / args.worker_kill_every)
                for name, t in list(self.trainers.items()):
                    if not t.proc.is_alive():
                        self.trainer_died(admin, name)
                time.sleep(0.05)  # the schedule's tick; nothing here to wait on
            self.samples.append(_sample(server, t0))
            for name, t in self.trainers.items():
                self.check_gap(name)
                t.proc.kill()
                t.proc.join(10)
                self.harvest(name)
            for name, run in self.runs.items():

                def settled(n: str = name, r: LoaderRun = run) -> bool:
                    d = admin.loader(n)
                    r.worker_restarts = d["worker_restarts"]
                    return r.worker_restarts >= r.worker_kills and not d["consumer_attached"]

                if run.failure is None:
                    _poll(f"{name}: trainer detached, killed workers replaced", settled, 60)
                else:
                    run.worker_restarts = admin.loader(name)["worker_restarts"]
            # Back to the start: no trainer, every worker running.
            self.quiesced = _sample(server, t0)
        finally:
            admin.close()
            code = self.server.stop(timeout=30)
        return self.report(code)

    def report(self, server_exit: int) -> dict[str, Any]:
        warm_at = min(20.0, self.args.seconds * 0.1)
        warm = next((s for s in self.samples if s["t"] >= warm_at), self.samples[0])
        last = self.samples[-1]
        growth = {
            "fds": last["fds"] - warm["fds"],
            "memfds": last["memfds"] - warm["memfds"],
            "threads": last["threads"] - warm["threads"],
            "processes": last["processes"] - warm["processes"],
            "rss_server": last["rss_server"] - warm["rss_server"],
            "rss_workers": last["rss_workers"] - warm["rss_workers"],
        }
        loaders = []
        for r in self.runs.values():
            loaders.append(
                {
                    **r.cfg,
                    "batches_per_epoch": r.batches_per_epoch,
                    "batches_verified": r.verified,
                    "trainer_generations": r.generations,
                    "trainer_kills": r.trainer_kills,
                    "worker_kills": r.worker_kills,
                    "worker_restarts": r.worker_restarts,
                    "mismatches": r.mismatches,
                    "discontinuities": r.discontinuities,
                    "trainer_errors": r.trainer_errors,
                    "max_gap_across_kill": max(r.gaps, default=0),
                    "gaps_across_kills": r.gaps,
                    "max_detach_s": round(max(r.detach_s, default=0.0), 3),
                    "failure": r.failure,
                }
            )
        problems = []
        for lo in loaders:
            if lo["failure"] is not None:
                problems.append(f"{lo['name']}: loader failed: {lo['failure']['detail']}")
            for key in ("mismatches", "discontinuities", "trainer_errors"):
                if lo[key]:
                    problems.append(f"{lo['name']}: {lo[key]} {key}")
            if lo["max_gap_across_kill"] > MAX_GAP or min(lo["gaps_across_kills"], default=0) < 0:
                problems.append(f"{lo['name']}: gaps across kills {lo['gaps_across_kills']}")
            if lo["worker_restarts"] != lo["worker_kills"] and lo["failure"] is None:
                problems.append(
                    f"{lo['name']}: {lo['worker_kills']} worker kills, "
                    f"{lo['worker_restarts']} restarts"
                )
        if growth["fds"] > FD_GROWTH_MAX:
            problems.append(f"fds grew by {growth['fds']} (bound {FD_GROWTH_MAX})")
        if growth["memfds"] != 0:
            problems.append(f"memfds changed by {growth['memfds']}")
        if growth["processes"] != 0:
            problems.append(f"server processes changed by {growth['processes']}")
        if growth["rss_server"] > RSS_GROWTH_MAX:
            problems.append(f"server RSS grew by {growth['rss_server'] >> 20} MiB")
        for key in ("fds", "memfds", "processes"):
            slack = FD_GROWTH_MAX if key == "fds" else 0
            if self.quiesced[key] > self.baseline[key] + slack:
                problems.append(
                    f"after the trainers left: {key} {self.quiesced[key]}, "
                    f"before they came: {self.baseline[key]}"
                )
        return {
            "config": {
                "seconds": self.args.seconds,
                "loaders": self.args.loaders,
                "trainer_kill_every_s": self.args.trainer_kill_every,
                "worker_kill_every_s": self.args.worker_kill_every,
                "seed": self.args.seed,
                "dataset": {"kind": "tensors", "length": LENGTH, "width": WIDTH},
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            "bounds": {
                "fd_growth_max": FD_GROWTH_MAX,
                "memfd_growth": 0,
                "process_growth": 0,
                "rss_growth_max_bytes": RSS_GROWTH_MAX,
                "max_gap_across_kill": 2,
                "measured_from_s": warm["t"],
            },
            "growth": growth,
            "loaders": loaders,
            "baseline": self.baseline,
            "quiesced": self.quiesced,
            "samples": self.samples,
            "server_exit_code": server_exit,
            "problems": problems,
            "ok": not problems,
        }


def print_summary(result: dict[str, Any]) -> None:
    cols = [
        "name",
        "batch_size",
        "shuffle",
        "drop_last",
        "num_workers",
        "batches_verified",
        "trainer_kills",
        "worker_kills",
        "worker_restarts",
        "mismatches",
        "discontinuities",
        "max_gap_across_kill",
        "max_detach_s",
    ]
    heads = [
        "loader",
        "bs",
        "shuf",
        "drop",
        "wrk",
        "verified",
        "t-kill",
        "w-kill",
        "restart",
        "wrong",
        "discont",
        "max gap",
        "detach s",
    ]
    rows = [[str(lo[c]) for c in cols] for lo in result["loaders"]]
    for r, lo in zip(rows, result["loaders"], strict=True):
        r[0] += " (failed)" if lo["failure"] else ""
    total = (
        ["total", "", "", "", ""]
        + [str(sum(lo[c] for lo in result["loaders"])) for c in cols[5:11]]
        + [
            str(max(lo["max_gap_across_kill"] for lo in result["loaders"])),
            str(max(lo["max_detach_s"] for lo in result["loaders"])),
        ]
    )
    widths = [max(len(h), *(len(r[i]) for r in [*rows, total])) for i, h in enumerate(heads)]
    line = "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in [*rows, total]:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    samples = result["samples"]
    warm_t = result["bounds"]["measured_from_s"]
    warm = next(s for s in samples if s["t"] == warm_t)
    print()
    base, quiet = result["baseline"], result["quiesced"]
    print(
        f"{'server':>12} {'no trainer':>10} {'warm':>10} {'end':>10} {'max':>10} "
        f"{'growth':>10} {'after':>10}"
    )
    for key, unit in (
        ("fds", 1),
        ("memfds", 1),
        ("threads", 1),
        ("processes", 1),
        ("rss_server", 1 << 20),
        ("rss_workers", 1 << 20),
    ):
        vals = [s[key] / unit for s in samples]
        fmt = (lambda v: f"{v:.0f}") if unit == 1 else (lambda v: f"{v:.1f}M")
        print(
            f"{key:>12} {fmt(base[key] / unit):>10} {fmt(warm[key] / unit):>10} "
            f"{fmt(vals[-1]):>10} {fmt(max(vals)):>10} "
            f"{fmt(result['growth'][key] / unit):>10} {fmt(quiet[key] / unit):>10}"
        )
    print(
        "(no trainer: loaders warm, before the trainers start; warm: first sample after "
        f"{warm_t:.0f} s; growth: end - warm; after: trainers gone, workers replaced)"
    )
    print()
    print("OK" if result["ok"] else "PROBLEMS:\n  " + "\n  ".join(result["problems"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="how long to run (300)")
    ap.add_argument("--loaders", type=int, default=8)
    ap.add_argument(
        "--trainer-kill-every",
        type=float,
        default=4.0,
        help="mean seconds between trainer SIGKILLs (any loader)",
    )
    ap.add_argument(
        "--worker-kill-every",
        type=float,
        default=3.0,
        help="mean seconds between worker SIGKILLs (any loader with workers)",
    )
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning", help="the server's (kept on failure)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 30 s")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds = 30.0
    soak = Soak(args)
    envelope = results.start("soak", vars(args))
    foreign = results.ForeignCpu().start()
    try:
        result = envelope | {"kind": "soak"} | soak.run()
    except BaseException:
        print(f"soak failed; the server's log and state are in {soak.root}", file=sys.stderr)
        raise
    if result["ok"]:
        shutil.rmtree(soak.root, ignore_errors=True)
    else:
        print(f"the server's log and state are kept in {soak.root}")
    print_summary(result)
    result["foreign"] = foreign.stop()
    print(f"wrote {results.write(results.finish(result, [result]), args.out)}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
