"""Where W4's time goes: ``python -m bench w4-profile [--batches N] [--scale S]``.

W4 is a Python-bound workload: 64 ``__getitem__`` calls and a padding ``collate_fn``
per batch, which pinfeed's workers and DataLoader's make alike. What differs is what
each adds per batch to move the batch to the trainer. This measures, in one process
and one thread, the CPU time per batch of:

- ``make``: fetch 64 samples + ``pad_collate`` (both systems, in their workers);
- pinfeed's worker: ``write_output`` (copy into the slot, the per-batch layout);
- pinfeed's trainer: the views of a BATCH with its own layout (``BatchViews``);
- DataLoader's worker: pickling the batch for its result queue (``ForkingPickler``:
  each tensor's storage moved into a new shared-memory segment);
- DataLoader's main process: unpickling it (each storage rebuilt from its fd).

On a machine where the workers are CPU-bound, throughput is about cores / (CPU per
batch), so pinfeed's best ratio over DataLoader is (make + DataLoader's extra) /
(make + pinfeed's extra): printed as ``bound``. Figures on a loaded machine are noisy.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import results
from bench.data import DATA_DIR


def _cpu_us(fn: Callable[[], Any], n: int) -> float:
    """Median process CPU time of ``fn`` in microseconds (CPU, so other load on the
    machine slows it less than wall time would)."""
    out = []
    for _ in range(n):
        t0 = time.process_time_ns()
        fn()
        out.append((time.process_time_ns() - t0) / 1000)
    return float(statistics.median(out))


def profile(root: Path, scale: float, batches: int) -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    from bench import data, tokens
    from pinfeed import protocol as p
    from pinfeed._ring import RingMapping, RingSegments
    from pinfeed._views import BatchViews
    from pinfeed_server.engine.batchlayout import write_output

    torch.set_num_threads(1)
    w = data.make_w4(root, scale)
    ds = tokens.TokenSequences(**w.params["kwargs"])
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    groups = [perm[i : i + 64] for i in range(0, 64 * batches, 64)]
    it = iter(groups * 4)

    def make() -> Any:
        return tokens.pad_collate([ds[i] for i in next(it)])

    make_us = _cpu_us(make, batches)
    outs = [make() for _ in range(8)]
    slot_bytes = 4 << 20
    fd = os.memfd_create("w4-profile")
    os.ftruncate(fd, slot_bytes)
    ring = RingMapping(os.dup(fd), slot_bytes)
    layout = p.Layout(["list", []], (), 64, slot_bytes, per_batch=True)
    views = BatchViews(RingSegments(ring, 1, slot_bytes), layout, 1, slot_bytes)
    k = iter(range(10**9))
    bodies = []

    def write() -> None:
        bodies.append(write_output(outs[next(k) % 8], ring.base))

    write_us = _cpu_us(write, batches)
    buf = bytearray(p.MAX_MESSAGE)
    body = bodies[-1]
    head = p.BATCH_HEAD.pack(p.BATCH | p.FLAG_LAYOUT << 8, 0, 0, 0, 0, len(body))
    buf[: len(head) + len(body)] = head + body
    view_us = _cpu_us(lambda: views.batch(buf, 0, len(body)), batches)
    pickled: list[bytes] = []
    # Fresh tensors each time: DataLoader's worker pickles a new batch every time.
    outs = [make() for _ in range(batches)]
    k = iter(range(10**9))

    def dump_fresh() -> None:
        f = io.BytesIO()
        ForkingPickler(f, pickle.HIGHEST_PROTOCOL).dump(outs[next(k)])
        pickled.append(f.getvalue())

    dump_us = _cpu_us(dump_fresh, batches)
    loads = iter(pickled)
    load_us = _cpu_us(lambda: pickle.loads(next(loads)), min(batches, len(pickled)))
    views.clear()
    bodies.clear()
    ring.close()
    os.close(fd)
    pinfeed = make_us + write_us + view_us
    dataloader = make_us + dump_us + load_us
    return {
        "workload": w.describe(),
        "batches": batches,
        "cpu_us_per_batch": {
            "make (fetch 64 + pad_collate), both": make_us,
            "pinfeed worker: write_output into the slot": write_us,
            "pinfeed trainer: views of the batch": view_us,
            "DataLoader worker: pickle to shared memory": dump_us,
            "DataLoader main: unpickle (storages from fds)": load_us,
        },
        "pinfeed_cpu_us": pinfeed,
        "dataloader_cpu_us": dataloader,
        "bound": dataloader / pinfeed,
        "note": "pinfeed also pays a pipe message per batch to and from its worker and "
        "a socket send/recv to the trainer (the handoff table); DataLoader pays a "
        "queue put/get and its pin/result threads. Neither is counted here.",
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench w4-profile", description=__doc__)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=DATA_DIR,
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 10 batches")
    ap.add_argument("--out", type=Path, default=results.RESULTS, help="folder of result files")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches = 10
    args.data_dir.mkdir(parents=True, exist_ok=True)
    envelope = results.start("w4-profile", vars(args))
    foreign = results.ForeignCpu().start()
    result = envelope | {"kind": "w4-profile"} | profile(args.data_dir, args.scale, args.batches)
    result["foreign"] = foreign.stop()
    result = results.finish(result, [result])
    for name, us in result["cpu_us_per_batch"].items():
        print(f"{name:<50} {us:9.0f} us")
    print(f"{'pinfeed, CPU per batch':<50} {result['pinfeed_cpu_us']:9.0f} us")
    print(f"{'DataLoader, CPU per batch':<50} {result['dataloader_cpu_us']:9.0f} us")
    print(f"best ratio when CPU-bound: {result['bound']:.2f}x")
    print(f"wrote {results.write(result, args.out)}")
    return 0
