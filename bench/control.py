"""Does watching slow training? The control plane against the data plane (issue 19).

One trainer reads a W1-like loader (``tensors`` kind, uint8 3x64x64, batch 256,
``num_workers`` 2) flat out, in its own process, for the whole run, and reports its
sample count every 0.1 s. Meanwhile a load process (its own process too, as a scraper
or a prober would be) talks HTTP to the same server, phase by phase:

- nothing (the trainer alone: a window before and after every phase; a phase's share
  is against the mean of the two windows either side of it),
- ``GET /metrics`` paced at 1, 10 and 50 scrapes per second,
- 16 connections flooding ``/healthz``, ``/v1/loaders/{name}/stats`` or ``/metrics``
  (closed loop: each sends its next request when the last one is answered),
- probes: ``/healthz``, ``/readyz`` and one ``/metrics`` scrape, paced, for latency
  under full data-plane load,

with 1 and then 50 loaders registered (49 idle ones over a small synthetic dataset).
The trainer's samples/s in each phase's window is its share of running alone. Every
reply is counted by status; 503 (a clean refusal) is told apart from other 5xx, and a
request unanswered within ``--request-timeout`` counts as a hang.

``python -m bench control`` prints the table and writes ``docs/results/control.json``.
Loopback only; every phase is bounded in time and every request in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import data, results
from bench.procs import child_env, end, read_points, spawn

if TYPE_CHECKING:
    from bench.server import BenchServer

# bench.server's REPO, without importing it: it imports pinfeed, so torch, which the
# load processes (one per phase) do not need (2 s of CPU each on these cores)
REPO = Path(__file__).resolve().parent.parent

TRAIN = "train"
OTHER_ALONE = "a client's requests and probes, alone"
OTHER_FLOODED = "the same beside a client flooding 16 connections"
FRESH_METRICS = "/metrics scrapes that miss the cache"
FLOOD_CONNECTIONS = 16
SCRAPE_RATES = (1, 10, 50)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench control",
        description="A trainer's samples/s under HTTP load on the same server, and the "
        "control plane's latency under full data-plane load. Writes "
        "docs/results/control.json.",
    )
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each phase")
    ap.add_argument("--loaders", default="1,50", help="loader counts (the trainer's + idle)")
    ap.add_argument("--scale", type=float, default=0.2, help="W1 sample-count scale")
    ap.add_argument("--request-timeout", type=float, default=10.0, help="a hang after this")
    ap.add_argument(
        "--metrics-max-age", type=float, default=1.0, help="the server's PINFEED_METRICS_MAX_AGE_S"
    )
    ap.add_argument("--only", default="", help="run only the phases whose label has this text")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 s phases, 1 and 3 loaders")
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=data.DATA_DIR,
    )
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.loaders, args.scale = 1.0, "1,3", 0.05
    args.loader_counts = [int(x) for x in args.loaders.split(",") if x.strip()]
    return args


# -- the load process: a minimal HTTP/1.1 client over asyncio streams ------------------
# Raw keep-alive requests rather than httpx: the load generator should spend its core
# sending requests, not in client machinery, so the server sees the most it can.


class Conn:
    def __init__(self, port: int, timeout: float, source: str = "127.0.0.1") -> None:
        """``source``: the loopback address this client connects from (the server
        paces each client apart; 127.0.0.0/8 is all this machine's)."""
        self.port, self.timeout, self.source = port, timeout, source
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        """The reply's status; raises TimeoutError (a hang) or OSError."""
        return await asyncio.wait_for(self._get(path), self.timeout)

    async def _get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                "127.0.0.1", self.port, local_addr=(self.source, 0)
            )
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
        await self.writer.drain()
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        length = 0
        for line in head.split("\r\n"):
            if line.startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        await self.reader.readexactly(length)
        if "connection: close" in head:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Tally:
    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.latencies: list[float] = []
        self.hangs = 0
        self.conn_errors = 0

    async def one(self, conn: Conn, path: str) -> None:
        t = time.perf_counter()
        try:
            status = await conn.get(path)
        except TimeoutError:
            self.hangs += 1
            conn.close()
            return
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.conn_errors += 1
            conn.close()
            return
        self.latencies.append(time.perf_counter() - t)
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1

    def report(self, seconds: float) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else None

        fivexx = sum(n for s, n in self.statuses.items() if s.startswith("5") and s != "503")
        return {
            "requests": len(lat),
            "per_s": len(lat) / seconds,
            "statuses": self.statuses,
            "refused_503": self.statuses.get("503", 0),
            "errors_5xx": fivexx,
            "hangs": self.hangs,
            "conn_errors": self.conn_errors,
            "p50_ms": pct(0.5),
            "p99_ms": pct(0.99),
        }


async def _paced(
    port: int, paths: list[str], rate: float, seconds: float, timeout: float, source: str
) -> Any:
    """``rate`` requests per second in total, round-robin over ``paths``, one connection
    per path; a late reply delays the next request of that path, never piles them up."""
    tallies = {p: Tally() for p in paths}
    conns = {p: Conn(port, timeout, source) for p in paths}
    start = time.perf_counter()
    k = 0
    while (now := time.perf_counter()) - start < seconds:
        due = start + k / rate
        if due > now:
            await asyncio.sleep(due - now)
        path = paths[k % len(paths)]
        await tallies[path].one(conns[path], path)
        k += 1
    for c in conns.values():
        c.close()
    return tallies


async def _flood(
    port: int, path: str, connections: int, seconds: float, timeout: float, source: str
) -> Any:
    tally = Tally()
    end = time.perf_counter() + seconds

    async def loop() -> None:
        conn = Conn(port, timeout, source)
        while time.perf_counter() < end:
            await tally.one(conn, path)
        conn.close()

    await asyncio.gather(*(loop() for _ in range(connections)))
    return {path: tally}


def load_main(spec: dict[str, Any]) -> int:
    port, seconds, timeout = spec["port"], spec["seconds"], spec["timeout"]
    source = spec.get("source", "127.0.0.1")
    t0 = time.monotonic()
    if spec["mode"] == "flood":
        coro = _flood(port, spec["paths"][0], spec["connections"], seconds, timeout, source)
    else:
        coro = _paced(port, spec["paths"], spec["rate"], seconds, timeout, source)
    tallies = asyncio.run(coro)
    t1 = time.monotonic()
    out = {
        "window": [t0, t1],
        "paths": {p: t.report(t1 - t0) for p, t in tallies.items()},
        "flood_role": spec.get("flood_role", "main"),
    }
    print(json.dumps(out), flush=True)
    return 0


# -- the trainer process ---------------------------------------------------------------


def trainer_main(spec: dict[str, Any]) -> int:
    """Read the loader flat out until stdin closes; print ``[monotonic, samples]`` every
    0.1 s (CLOCK_MONOTONIC is one clock for every process on the machine)."""
    from pinfeed import Loader

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    samples = 0
    with Loader(spec["loader"], socket=spec["socket"], timeout=120) as loader:
        print(json.dumps({"event": "ready"}), flush=True)
        last = 0.0
        while not stop.is_set():
            for x, _ in loader:
                samples += int(x.shape[0])
                now = time.monotonic()
                if now - last >= 0.1:
                    print(json.dumps([now, samples]), flush=True)
                    last = now
                if stop.is_set():
                    break
    return 0


class Trainer:
    def __init__(self, srv: BenchServer) -> None:
        spec = {"loader": TRAIN, "socket": str(srv.socket)}
        self.proc = spawn(["bench.control", "trainer", json.dumps(spec)])
        self.points, self.ready = read_points(self.proc)  # (time, samples) points
        if not self.ready.wait(120):
            self.stop()
            raise RuntimeError("the trainer did not get its first batch within 120 s")

    def rate(self, window: tuple[float, float]) -> float:
        inside = [p for p in list(self.points) if window[0] <= p[0] <= window[1]]
        if len(inside) < 2:
            return float("nan")
        (t0, n0), (t1, n1) = inside[0], inside[-1]
        return float((n1 - n0) / (t1 - t0))

    def stop(self) -> None:
        end(self.proc, 30, ())


# -- the parent ------------------------------------------------------------------------


def _load(srv: BenchServer, args: argparse.Namespace, **spec: Any) -> dict[str, Any]:
    spec = {"seconds": args.seconds} | spec | {"port": srv.port, "timeout": args.request_timeout}
    out = subprocess.run(
        [sys.executable, "-m", "bench.control", "load", json.dumps(spec)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=spec["seconds"] + args.request_timeout + 60,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _loads(srv: BenchServer, args: argparse.Namespace, specs: list[dict[str, Any]]) -> Any:
    """Several load processes at once (a flooding client beside another one); the
    window is the first one's, the paths' tallies merged (each path is one client's)."""
    results_: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=lambda s=spec: results_.append(_load(srv, args, **s)))
        for spec in specs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next(r for r in results_ if r["flood_role"] == "main") if results_ else None
    out = {"window": first["window"] if first else [0, 0], "paths": {}}
    for r in results_:
        for path, tally in r["paths"].items():
            out["paths"][f"{r['flood_role']}: {path}" if r["flood_role"] != "main" else path] = (
                tally
            )
    return out


def _phases(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    stats = f"/v1/loaders/{TRAIN}/stats"
    out: list[tuple[str, dict[str, Any]]] = [
        (f"/metrics {r}/s", {"mode": "paced", "paths": ["/metrics"], "rate": r})
        for r in SCRAPE_RATES
    ]
    for path in ("/healthz", stats, "/metrics"):
        spec = {"mode": "flood", "paths": [path], "connections": FLOOD_CONNECTIONS}
        out.append((f"flood {FLOOD_CONNECTIONS} {path}", spec))
    # 10 probes a second on each path, for twice as long: ~120 latencies per path, so
    # the p99 is not just the one slowest reply.
    probes = {"mode": "paced", "paths": ["/healthz", "/readyz", "/metrics"], "rate": 30}
    out.append(("probes /healthz /readyz /metrics", probes | {"seconds": 2 * args.seconds}))
    # Another client (its requests and the probes, 30 a second, from 127.0.0.1) alone,
    # then beside a client flooding from 127.0.0.2 with 16 connections: what the flood
    # adds to its latency (issue 26: <= 50 ms at p99).
    other = {"mode": "paced", "paths": ["/v1/loaders", "/healthz", "/readyz"], "rate": 30}
    out.append((OTHER_ALONE, other | {"seconds": 2 * args.seconds}))
    flood = {
        "mode": "flood",
        "paths": [stats],
        "connections": FLOOD_CONNECTIONS,
        "source": "127.0.0.2",
        "flood_role": "flooder",
    }
    both = other | {"seconds": 2 * args.seconds, "flood_role": "main", "also": flood}
    out.append((OTHER_FLOODED, both))
    # Scrapes that miss the cache (every 2.5 PINFEED_METRICS_MAX_AGE_S, as Prometheus'
    # 15 s against 1 s): their latency is a fresh render's, or a body rendered ahead.
    fresh = {"mode": "paced", "paths": ["/metrics"], "rate": 1 / (2.5 * args.metrics_max_age)}
    out.append((FRESH_METRICS, fresh | {"seconds": max(30.0, 5 * args.seconds)}))
    return out


def _setup(srv: BenchServer, w: data.Workload) -> None:
    from pinfeed import Client

    with Client(srv.url, timeout=300) as c:
        c.create_dataset("w1", w.kind, w.params)
        c.create_loader(TRAIN, dataset="w1", batch_size=256, shuffle=True, num_workers=2, seed=0)
        small = {"length": 64, "seed": 0, "fields": [{"shape": [8], "dtype": "float32"}]}
        c.create_dataset("idle", "synthetic", small)


def _idle_loaders(srv: BenchServer, total: int) -> None:
    """Idle loaders up to ``total`` in all (their rings fill once, then they wait)."""
    from pinfeed import Client

    with Client(srv.url, timeout=300) as c:
        have = {lo["name"] for lo in c.loaders()}
        for i in range(total - 1):
            name = f"idle-{i:02d}"
            if name not in have:
                c.create_loader(name, dataset="idle", batch_size=4, num_workers=0)


def _alone(trainer: Trainer, seconds: float) -> float:
    t = time.monotonic()
    time.sleep(seconds)
    return trainer.rate((t, time.monotonic()))


def _measure(
    srv: BenchServer, args: argparse.Namespace, trainer: Trainer, count: int
) -> list[dict[str, Any]]:
    """Every phase between two windows of the trainer alone (A B A B ... A): its share
    is against the mean of the windows either side, so a machine that others load
    and unload while this runs moves the baseline along with the phase."""
    alone = [_alone(trainer, args.seconds)]
    rows = []
    for label, spec in _phases(args):
        if args.only not in label:
            continue
        also = spec.pop("also", None)
        if also is not None:
            res = _loads(srv, args, [spec, also | {"seconds": spec["seconds"]}])
        else:
            spec.pop("flood_role", None)
            res = _load(srv, args, **spec)
        rate = trainer.rate(tuple(res["window"]))
        alone.append(_alone(trainer, args.seconds))
        base = statistics.fmean(alone[-2:])
        rows.append(
            {
                "loaders": count,
                "traffic": label,
                "samples_per_s": rate,
                "share": rate / base,
                "alone_either_side": alone[-2:],
                "http": res["paths"],
            }
        )
    head = {"loaders": count, "traffic": "none (alone)", "samples_per_s": statistics.fmean(alone)}
    return [head | {"alone_windows": alone}, *rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.data_dir.mkdir(parents=True, exist_ok=True)
    w = data.make_w1(args.data_dir, args.scale)
    from bench.server import BenchServer

    rows: list[dict[str, Any]] = []
    load = os.getloadavg()
    env = {"PINFEED_METRICS_MAX_AGE_S": str(args.metrics_max_age)}
    with BenchServer(args.data_dir, env=env) as srv:
        _setup(srv, w)
        trainer = Trainer(srv)
        try:
            time.sleep(min(2.0, args.seconds))  # past the first epoch's start-up
            for count in args.loader_counts:
                _idle_loaders(srv, count)
                rows.extend(_measure(srv, args, trainer, count))
        finally:
            trainer.stop()
    return {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "loadavg_start": load,
            "loadavg_end": os.getloadavg(),
            "seconds_per_phase": args.seconds,
            "workload": w.describe() | {"num_workers": 2},
        },
        "rows": rows,
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 19's must-show numbers, from the rows (the most loaders measured)."""
    rows = result["rows"]
    most = max(r["loaders"] for r in rows)
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, ok: bool) -> None:
        out.append({"target": name, "value": value, "goal": goal, "ok": ok})

    def row(count: int, traffic: str) -> dict[str, Any]:
        return next(r for r in rows if r["loaders"] == count and r["traffic"] == traffic)

    for rate, goal in ((10, 0.95), (50, 0.9)):
        share = row(most, f"/metrics {rate}/s")["share"]
        add(
            f"/metrics {rate}/s, {most} loaders: trainer share", share, f">= {goal}x", share >= goal
        )
    for r in rows:
        if r["traffic"].startswith("flood"):
            h = next(iter(r["http"].values()))
            add(
                f"{r['traffic']}, {r['loaders']} loaders: share",
                r["share"],
                ">= 0.6x",
                r["share"] >= 0.6,
            )
            bad = h["errors_5xx"] + h["hangs"] + h["conn_errors"]
            add(f"{r['traffic']}, {r['loaders']} loaders: 5xx + hangs", bad, "0", bad == 0)
    probes = row(most, "probes /healthz /readyz /metrics")["http"]
    for path in ("/healthz", "/readyz"):
        p99 = probes[path]["p99_ms"]
        add(
            f"{path} p99 under full load, {most} loaders (ms)",
            p99,
            "< 50",
            p99 is not None and p99 < 50,
        )
    p50 = probes["/metrics"]["p50_ms"]
    add(
        f"/metrics scrape p50 under full load, {most} loaders (ms)",
        p50,
        "<= 5",
        p50 is not None and p50 <= 5,
    )
    # issue 26: a flooding client delays another client's requests and the probes by
    # <= 50 ms at p99; a scrape that misses the cache (a fresh render) p50 <= 5 ms
    alone = {p: h for p, h in row(most, OTHER_ALONE)["http"].items()}
    flooded = row(most, OTHER_FLOODED)["http"]
    for path in ("/v1/loaders", "/healthz", "/readyz"):
        a, f = alone[path]["p99_ms"], flooded[path]["p99_ms"]
        delay = None if a is None or f is None else f - a
        add(
            f"{path} p99 delay from a 16-connection flood by another client, {most} loaders (ms)",
            delay,
            "<= 50",
            delay is not None and delay <= 50,
        )
    fresh = row(most, FRESH_METRICS)["http"]["/metrics"]["p50_ms"]
    add(
        f"/metrics scrape missing the cache p50 under full load, {most} loaders (ms)",
        fresh,
        "<= 5",
        fresh is not None and fresh <= 5,
    )
    return out


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'loaders':>7}  {'HTTP traffic':<40} {'samples/s':>9} {'share':>6}  "
        f"{'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'503':>5} {'5xx':>4} {'hang':>4}"
    )
    for r in result["rows"]:
        paths = r.get("http", {"": None})
        first = True
        for path, h in paths.items():
            head = (
                f"{r['loaders']:>7}  {r['traffic']:<40} {_f(r['samples_per_s'], '{:.0f}'):>9} "
                f"{_f(r.get('share'), '{:.2f}x'):>6}"
                if first
                else " " * 7 + "  " + f"  {path:<38}" + " " * 17
            )
            first = False
            if h is None:
                print(head)
                continue
            print(
                f"{head}  {_f(h['per_s'], '{:.0f}'):>7} {_f(h['p50_ms'], '{:.2f}'):>7} "
                f"{_f(h['p99_ms'], '{:.2f}'):>7} {h['refused_503']:>5} {h['errors_5xx']:>4} "
                f"{h['hangs'] + h['conn_errors']:>4}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    envelope = results.start("control", vars(args))
    foreign = results.ForeignCpu().start()
    result = envelope | {"kind": "control"} | run(args)
    result["foreign"] = foreign.stop()
    result["targets"] = [] if args.only else targets(result)
    result = results.finish(result, [result])
    result["meta"]["wall_s"] = result["wall_s"]
    path = results.write(result, args.out)
    print_table(result)
    for t in result["targets"]:
        mark = "ok  " if t["ok"] else "MISS"
        print(f"{mark} {t['target']}: {_f(t['value'], '{:.2f}')} ({t['goal']})")
    share = result["foreign"]["share"]
    print(f"wrote {path} in {result['wall_s']:.0f} s (other processes' CPU share: {share:.0%})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("trainer", "load"):
        entry = trainer_main if sys.argv[1] == "trainer" else load_main
        raise SystemExit(entry(json.loads(sys.argv[2])))
    raise SystemExit(main(sys.argv[1:]))
