"""``python -m bench ray``: W3 (decode-bound JPEG) with ``executor: "ray"`` against
local workers at the same ``num_workers``, and the ring's intake limit.

It starts the tests' multi-namespace cluster (``tests/ray/cluster.py``: a Ray head, two
worker nodes and the server's node, each in its own network namespace; needs root),
runs the same loader with each executor through a real trainer loop, and measures per
batch: wall time (the overhead of the Ray path), the server's CPU (its own process;
for Ray also the bridge, the process that copies batches from the object store into
the ring) and the decode CPU (local workers, or the actors on the worker nodes).

The intake limit is what one bridge can copy into a ring: (a) the bare copy, a numpy
copy of W3-sized batches into a memfd ring slot (what ``ray_bridge`` does per batch),
and (b) the bridge's measured CPU per batch. Divided by the bytes one decode core makes
per second (W3 samples/s per core x sample bytes), it says how many remote decode cores
one server can absorb. On a shared, loaded machine every figure is noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import data, results
from bench.data import Workload
from tests.reliability.procs import descendants, maps_ring


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def run_one(cluster: Any, srv: Any, w: Workload, executor: str, workers: int, epochs: int) -> dict:
    from pinfeed import Loader

    name = f"bench-ray-{executor}-{workers}-{int(time.time())}"
    with srv.client() as c:
        c.create_loader(
            name,
            dataset=w.key.lower(),
            batch_size=w.batch_size,
            shuffle=True,
            seed=0,
            num_workers=workers,
            executor=executor,
        )
        deadline = time.monotonic() + 300
        while c.loader(name)["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.5)
    try:
        with Loader(name, socket=srv.socket, timeout=600) as loader:
            it = iter(loader)
            next(it)  # the timed window starts after the first batch (start-up excluded)
            # The processes that map the ring: local workers, or the Ray bridge.
            mappers = [p.pid for p in descendants(srv.pid) if maps_ring(p.pid, name)]
            bridge, local = (mappers, []) if executor == "ray" else ([], mappers)
            actors = cluster.actor_pids()
            before = (_cpu([srv.pid]), _cpu(bridge), _cpu(local), _cpu(actors))
            t0 = time.perf_counter()
            batches = sum(1 for _ in it)
            for _ in range(epochs - 1):
                batches += sum(1 for _ in loader)
            wall = time.perf_counter() - t0
            after = (_cpu([srv.pid]), _cpu(bridge), _cpu(local), _cpu(actors))
    finally:
        with srv.client() as c:
            c.delete_loader(name)
    server_s, bridge_s, local_s, actors_s = (a - b for a, b in zip(after, before, strict=True))
    return {
        "executor": executor,
        "num_workers": workers,
        "batches": batches,
        "wall_ms_per_batch": 1e3 * wall / batches,
        "samples_per_s": batches * w.batch_size / wall,
        "server_cpu_ms_per_batch": 1e3 * server_s / batches,
        "bridge_cpu_ms_per_batch": 1e3 * bridge_s / batches,
        "decode_cpu_ms_per_batch": 1e3 * (local_s if executor == "local" else actors_s) / batches,
    }


def intake(slot_bytes: int, seconds: float = 2.0) -> dict[str, float]:
    """The bare copy a bridge makes per batch: numpy source into a memfd ring slot,
    found through the ring's slot space as the bridge finds it."""
    from pinfeed_server.engine.ring import Ring

    ring = Ring("bench-intake", 4, slot_bytes)
    try:
        space, step = ring.space, ring.slot_bytes
        src = np.random.default_rng(0).integers(0, 256, slot_bytes, dtype=np.uint8)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            start = (n % 4) * step
            space[start : start + slot_bytes].numpy()[:] = src
            n += 1
        elapsed = time.perf_counter() - t0
    finally:
        ring.close()
    return {"copy_bytes_per_s": n * slot_bytes / elapsed, "copies": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ray", description=__doc__)
    ap.add_argument("--scale", type=float, default=0.34, help="W3 sample count x this")
    ap.add_argument("--workers", type=int, default=2, help="num_workers (local and ray)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    envelope = results.start("ray", vars(args))
    foreign = results.ForeignCpu().start()

    from tests.ray.cluster import NetCluster

    root = Path(tempfile.mkdtemp(prefix="pinfeed-bench-ray-"))
    result: dict[str, Any] = envelope | {"kind": "ray"}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        cluster = stack.enter_context(NetCluster(root / "cluster"))
        srv = cluster.start_server(root / "server", env={"PINFEED_LOG_LEVEL": "warning"})
        w = data.make_w3(srv.data_root, args.scale)
        with srv.client() as c:
            c.create_dataset(w.key.lower(), w.kind, w.params)
        result["workload"] = w.describe()
        result["setup_s"] = time.perf_counter() - t0
        rows = [run_one(cluster, srv, w, ex, args.workers, args.epochs) for ex in ("local", "ray")]
        result["runs"] = rows
    slot_bytes = w.batch_size * w.sample_bytes
    result["intake"] = intake(slot_bytes)
    local, ray = rows
    sample_bytes = w.sample_bytes
    per_core = 1e3 / local["decode_cpu_ms_per_batch"] * w.batch_size * sample_bytes
    bridge_bps = (
        slot_bytes / (ray["bridge_cpu_ms_per_batch"] / 1e3)
        if ray["bridge_cpu_ms_per_batch"]
        else 0.0
    )
    result["summary"] = {
        "ray_overhead_ms_per_batch": ray["wall_ms_per_batch"] - local["wall_ms_per_batch"],
        "decode_bytes_per_core_s": per_core,
        "intake_copy_bytes_per_s": result["intake"]["copy_bytes_per_s"],
        "intake_bridge_bytes_per_cpu_s": bridge_bps,
        "decode_cores_per_copy_core": result["intake"]["copy_bytes_per_s"] / per_core,
        "decode_cores_per_bridge_core": bridge_bps / per_core if per_core else 0.0,
        "note": "the Ray nodes are network namespaces of this machine: they share its cores",
    }
    result["foreign"] = foreign.stop()
    path = results.write(results.finish(result, [result]), args.out)
    for row in rows:
        print(
            f"{row['executor']:>5}  workers {row['num_workers']}  "
            f"{row['wall_ms_per_batch']:8.1f} ms/batch  {row['samples_per_s']:7.1f} samples/s  "
            f"server {row['server_cpu_ms_per_batch']:6.2f} ms  bridge "
            f"{row['bridge_cpu_ms_per_batch']:6.2f} ms  "
            f"decode {row['decode_cpu_ms_per_batch']:7.1f} ms"
        )
    s = result["summary"]
    print(
        f"intake: copy {s['intake_copy_bytes_per_s'] / 1e9:.2f} GB/s, bridge "
        f"{s['intake_bridge_bytes_per_cpu_s'] / 1e9:.2f} GB per CPU-s; one decode core makes "
        f"{s['decode_bytes_per_core_s'] / 1e6:.0f} MB/s: {s['decode_cores_per_bridge_core']:.0f} "
        f"decode cores per bridge core ({s['decode_cores_per_copy_core']:.0f} by the bare copy)"
    )
    print(f"wrote {path}")
    return 0
