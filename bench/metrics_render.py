"""How long one fresh ``/metrics`` render takes with N loaders (no HTTP, no cache).

A Service in this process with ``--loaders`` idle loaders (``num_workers`` 0) over a
small synthetic dataset, each with a few produced, consumed and waited batches so
that its histogram has several buckets, and one loader that could not start. Times
``render()`` ``--renders`` times and prints the median, tenth percentile and minimum
of its CPU time (``time.thread_time``: what a render takes from the cores) and its
wall time. On a shared machine compare two trees by running them in turns, and read
the minimum and the median.

``python -m bench metrics-render [--loaders 50] [--renders 400]`` writes
``docs/results/metrics-render.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pinfeed_server.api.prometheus import render
from pinfeed_server.schemas import DatasetCreate, LoaderCreate
from pinfeed_server.service import Service
from pinfeed_server.service.table import LoaderRecord, Unstarted
from pinfeed_server.settings import Settings

WAITS_S = (0.00001, 0.0004, 0.002, 0.003, 0.03)


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p50, p10 = statistics.median(values), values[len(values) // 10]
    return f"p50 {p50 * 1e3:.3f} ms  p10 {p10 * 1e3:.3f}  min {values[0] * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench metrics-render")
    parser.add_argument("--loaders", type=int, default=50)
    parser.add_argument("--renders", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None, help="folder of result files")
    args = parser.parse_args(argv)
    from bench import results

    envelope = results.start("metrics-render", vars(args))
    foreign = results.ForeignCpu().start()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = Settings(run_dir=root / "run", state_dir=root / "state", data_root=root)
        service = Service(settings)
        service.start()
        try:
            fields = [{"shape": [4], "dtype": "int64", "low": 0, "high": 9}]
            params = {"length": 64, "seed": 0, "fields": fields}
            service.create_dataset(
                DatasetCreate.model_validate({"name": "d", "kind": "synthetic", "params": params})
            )
            for i in range(args.loaders):
                service.create_loader(LoaderCreate(name=f"l{i:03d}", dataset="d", batch_size=4))
            for engine in service.loaders.values():
                for wait_s in WAITS_S:
                    engine.stats.produced(4, 128)
                    engine.stats.consumed(4)
                    engine.stats.consumer_wait(wait_s)
            # As after a restart whose budget no longer fits it: listed, failed, zeros.
            config = {"name": "unstarted", "batch_size": 4, "num_workers": 0}
            failed = Unstarted(config, "benchmark")
            service.table.add(LoaderRecord("unstarted", "d", 0.0, None, unstarted=failed))
            for _ in range(20):  # warm up
                render(service)
            cpu, wall = [], []
            for _ in range(args.renders):
                c0, w0 = time.thread_time(), time.perf_counter()
                render(service)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - w0)
        finally:
            service.close()
    run = {"foreign": foreign.stop()}
    result = envelope | {
        "kind": "metrics-render",
        "cpu_ms": results.spread([c * 1e3 for c in cpu]),
        "wall_ms": results.spread([w * 1e3 for w in wall]),
        "runs": [run],
    }
    result = results.finish(result, [run])
    path = results.write(result, args.out)
    print(f"render, {args.loaders} loaders + 1 unstarted, {args.renders} renders")
    print(f"  cpu   {_ms(cpu)}")
    print(f"  wall  {_ms(wall)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
