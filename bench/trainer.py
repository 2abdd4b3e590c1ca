"""One trainer process of a measurement: ``python -m bench.trainer '<json spec>'``.

Each run is a fresh process, so its memory and start-up are its own. The parent
(``bench.suite``) talks to it over stdin/stdout, one JSON line per message:

    trainer -> {"event": "ready", "ttfb_s": ...}    set up, first batch received
    parent  -> "go"                                 (all trainers of a run start together)
    trainer -> {"event": "result", ...}             timed window done
    parent  -> EOF                                  memory sampled: clean up and exit

Systems (``SYSTEMS``): ``pinfeed`` (``pinfeed.Loader`` over a loader created here
through ``pinfeed.Client``), ``dataloader`` (``torch.utils.data.DataLoader`` as usually
written, over the workload's reference Dataset, ``bench.references``, or the very object
the server builds), ``dataloader-tuned`` (``bench.references.tuned_loader``: one batched
read a batch) and ``roofline`` (the same gather into a preallocated buffer, in this one
process). Both DataLoaders: ``persistent_workers`` with workers, ``pin_memory`` with
CUDA, ``prefetch_factor`` 2, seed 0 (the same batches as pinfeed's).

A section may bring its own systems: ``spec["module"]`` names a module whose
``SYSTEMS`` has the spec's system (``bench.llm``).

Modes (``MODES``): ``throughput`` (samples/s over all but the first batch), ``timed``
(samples/s over a window of seconds, after the queues filled before it are drained),
``handoff`` (latency of ``next()`` on a ready batch) and ``training`` (a fixed step per
batch standing for the GPU: the trainer's stall share and its own CPU per batch).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.child import Reporting, emit


def _wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"expected 'go' from the parent, got {line!r}")


def _rows(batch: Any) -> int:
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(batch.shape[0])


class Run:
    """An iterable of epochs plus its first iterator (already past the first batch)."""

    def __init__(self, epochs: Callable[[], Iterator[Any]], cleanup: Callable[[], None]) -> None:
        self.new_epoch = epochs
        self.cleanup = cleanup
        self.it: Iterator[Any] = iter(())
        self.first_rows = 0

    def start(self) -> None:
        self.it = self.new_epoch()
        self.first_rows = _rows(next(self.it))


def _dataset(spec: dict[str, Any]) -> Any:
    from pathlib import Path

    from bench.data import PLUGINS
    from pinfeed_server.datasets import DatasetContext, build_dataset

    ctx = DatasetContext(Path(spec["data_root"]), PLUGINS)
    return build_dataset(spec["kind"], spec["params"], ctx)


def _collate_fn(spec: dict[str, Any]) -> Callable[[list[Any]], Any] | None:
    """The workload's collate_fn, for DataLoader and the roofline (pinfeed's runs in the
    server's workers)."""
    from bench.data import PLUGINS
    from pinfeed_server.plugins import resolve

    return resolve(spec["collate_fn"], PLUGINS) if spec.get("collate_fn") else None


def _reference(spec: dict[str, Any]) -> Any:
    from pathlib import Path

    from bench import references

    return references.build(spec["reference"], Path(spec["data_root"]), spec["params"])


def _pinfeed(spec: dict[str, Any], warm: bool = False) -> tuple[Run, float]:
    from pinfeed import Client

    admin = Client(spec["url"])
    name = spec["loader"]
    t0 = time.perf_counter()
    admin.create_loader(
        name,
        dataset=spec["dataset"],
        batch_size=spec["batch_size"],
        shuffle=spec["shuffle"],
        seed=0,
        num_workers=spec["num_workers"],
        # as the DataLoader below: one base seed for the run, workers' RNGs carried on
        persistent_workers=spec["num_workers"] > 0,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=2,
        **({"collate_fn": spec["collate_fn"]} if spec.get("collate_fn") else {}),
        **({"transform": spec["transform"]} if spec.get("transform") else {}),
    )
    if warm:
        # A loader created ahead of the trainer: wait (bounded) until its ring is full,
        # then time attach + first batch alone.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            slots = admin.loader(name).get("slots", {})
            if slots and slots.get("ready", 0) >= max(1, slots.get("total", 1) - 1):
                break
            time.sleep(0.05)
        t0 = time.perf_counter()
    return attach(admin, name, spec["socket"], t0)


def attach(admin: Any, name: str, socket: str, t0: float) -> tuple[Run, float]:
    """A trainer on the loader ``name`` that ``admin`` (a ``pinfeed.Client``) made: its
    Run, the first batch taken, and the seconds since ``t0``; its cleanup closes the
    Loader, deletes the loader and closes ``admin``."""
    from pinfeed import Loader

    loader = Loader(name, socket=socket)

    def cleanup() -> None:
        loader.close()
        try:
            admin.delete_loader(name)
        finally:
            admin.close()

    run = Run(lambda: iter(loader), cleanup)
    run.start()
    return run, time.perf_counter() - t0


def _dataloader_args(spec: dict[str, Any]) -> dict[str, Any]:
    """What both DataLoaders share: workers, pinning, prefetch, the seed."""
    nw = spec["num_workers"]
    return {
        "num_workers": nw,
        "pin_memory": torch.cuda.is_available(),
        "persistent_workers": nw > 0,
        "prefetch_factor": 2 if nw > 0 else None,
        "generator": torch.Generator().manual_seed(0),
    }


def _transformed(spec: dict[str, Any], ds: Any) -> Any:
    """The workload's dataset as a pinfeed loader with its ``transform`` reads it."""
    if not spec.get("transform"):
        return ds
    from bench.data import PLUGINS
    from pinfeed.transformed import Transformed
    from pinfeed_server.plugins import resolve

    return Transformed(ds, resolve(spec["transform"], PLUGINS, what="transform"))


def _dataloader(spec: dict[str, Any]) -> tuple[Run, float]:
    from torch.utils.data import DataLoader

    ds = _transformed(spec, _reference(spec) if spec.get("reference") else _dataset(spec))
    t0 = time.perf_counter()
    dl = DataLoader(
        ds,
        batch_size=spec["batch_size"],
        shuffle=spec["shuffle"],
        collate_fn=_collate_fn(spec),
        **_dataloader_args(spec),
    )
    run = Run(lambda: iter(dl), lambda: None)
    run.start()
    return run, time.perf_counter() - t0


def _pinfeed_dataloader(spec: dict[str, Any], reference: str = "reference") -> tuple[Run, float]:
    """The one-line switch: the very DataLoader call above with ``pinfeed.DataLoader``,
    on the trainer's own dataset object (shipped to the server at construction);
    ``reference``: the spec's key naming that Dataset (``getitems``: one with
    ``__getitems__``)."""
    import pinfeed

    if spec.get(reference):
        spec = {**spec, "reference": spec[reference]}
    ds = _reference(spec) if spec.get("reference") else _dataset(spec)
    t0 = time.perf_counter()
    dl = pinfeed.DataLoader(
        ds,
        batch_size=spec["batch_size"],
        shuffle=spec["shuffle"],
        collate_fn=_collate_fn(spec),
        socket=spec["socket"],
        **_dataloader_args(spec),
    )
    run = Run(lambda: iter(dl), dl.close)
    run.start()
    return run, time.perf_counter() - t0


def _dataloader_tuned(spec: dict[str, Any], switched: bool = False) -> tuple[Run, float]:
    """What a performance engineer writes with DataLoader alone: one batched read a
    batch (``bench.references.tuned_loader``), pinned with CUDA; ``switched``: that very
    script with ``pinfeed.DataLoader`` in its place (the one-line switch of a tuned one)."""
    from pathlib import Path

    from bench.references import tuned_loader

    extra: dict[str, Any] = {}
    if switched:
        import pinfeed

        extra = {"cls": pinfeed.DataLoader, "socket": spec["socket"]}
    t0 = time.perf_counter()
    dl = tuned_loader(
        spec["tuned"],
        Path(spec["data_root"]),
        spec["params"],
        batch_size=spec["batch_size"],
        shuffle=spec["shuffle"],
        **_dataloader_args(spec),
        **extra,
    )
    run = Run(lambda: iter(dl), dl.close if switched else lambda: None)  # type: ignore[attr-defined]
    run.start()
    return run, time.perf_counter() - t0


def _floor(spec: dict[str, Any], ipc: bool = False) -> tuple[Run, float]:
    """The least a batch handed over by another process can cost, all in this one
    process, without that process: per batch, the messages a trainer and the data plane
    exchange (the trainer's NEXT, handing back the last batch's slot; the server's BATCH
    head and dims, ``protocol``'s own encodings) over a SEQPACKET socket pair, and the
    batch's views over a buffer, as the trainer builds them. No other process, no
    wake-up, no making.

    ``ipc``: another process on the other end, as a server is, answering each NEXT with
    a BATCH head and dims, and the trainer keeping two NEXTs in flight, as
    ``pinfeed.Loader`` does: what any two processes pay to hand over a batch on this
    machine, the wake-ups each way."""
    from pinfeed import protocol as p

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shape = (spec["batch_size"], *spec["sample_shape"])
    dims = struct.pack(f"<{len(shape)}q", *shape)
    n = spec["samples"] // spec["batch_size"]
    slots = 4
    buf_a, buf_b = bytearray(p.MAX_MESSAGE), bytearray(p.MAX_MESSAGE)

    def answer(i: int) -> None:
        b.send(p.BATCH_HEAD.pack(p.BATCH, i % slots, i, 0, i, 0) + dims)

    pid = os.fork() if ipc else None
    if pid == 0:  # the other end: a NEXT in, a BATCH out, until the trainer closes
        a.close()
        try:
            i = 0
            while b.recv_into(buf_b):
                answer(i)
                i += 1
        finally:
            os._exit(0)
    typed = torch.zeros(1 << 20, dtype=torch.uint8).view(getattr(torch, spec["dtype"]))
    stride = torch.empty(shape).stride()
    in_flight = p.NEXTS_IN_FLIGHT if ipc else 1

    def epoch() -> Iterator[Any]:
        asked = 0
        for i in range(n):
            while asked < min(n, i + in_flight):
                a.send(p.encode_release(p.NEXT, [(asked - 1) % slots], 0))
                if pid is None:
                    b.recv_into(buf_b)
                    answer(asked)
                asked += 1
            got = a.recv_into(buf_a)
            _, slot, *_ = p.BATCH_HEAD.unpack_from(buf_a)
            assert got > p.BATCH_HEAD.size
            yield [torch.as_strided(typed, shape, stride, slot * 64)]

    def cleanup() -> None:
        a.close()
        b.close()
        if pid is not None:
            os.waitpid(pid, 0)

    run = Run(epoch, cleanup)
    run.start()
    return run, 0.0


def _roofline(spec: dict[str, Any]) -> tuple[Run, float]:
    """The same gather (``fetch_into``, else per-sample reads stacked into the buffer)
    into one preallocated buffer, one process, one thread: no IPC, no handoff."""
    torch.set_num_threads(1)
    ds = _dataset(spec)
    bs = spec["batch_size"]
    collate = _collate_fn(spec)
    if collate is not None:  # the same reads and collate_fn, in this one process
        return _roofline_collate(spec, ds, bs, collate)
    iterable = isinstance(ds, torch.utils.data.IterableDataset)
    sample = next(iter(ds)) if iterable else ds[0]
    if isinstance(sample, dict):
        sample = list(sample.values())
    leaves = list(sample) if isinstance(sample, (tuple, list)) else [sample]
    outs = [
        torch.empty((bs, *torch.as_tensor(v).shape), dtype=torch.as_tensor(v).dtype) for v in leaves
    ]
    gen = torch.Generator().manual_seed(0)
    n = len(ds)
    fetch = getattr(ds, "fetch_into", None)

    def epoch() -> Iterator[Any]:
        perm = torch.randperm(n, generator=gen).tolist() if spec["shuffle"] else range(n)
        stream = iter(ds) if iterable else None
        for start in range(0, n, bs):
            idx = perm[start : start + bs]
            views = [o[: len(idx)] for o in outs]
            if fetch is not None:
                fetch(idx, views)
            else:
                samples = [next(stream) for _ in idx] if stream else [ds[i] for i in idx]
                for j, v in enumerate(views):
                    torch.stack([torch.as_tensor(s[j]) for s in samples], out=v)
            yield views

    t0 = time.perf_counter()
    run = Run(epoch, lambda: None)
    run.start()
    return run, time.perf_counter() - t0


def _roofline_collate(
    spec: dict[str, Any], ds: Any, bs: int, collate: Callable[[list[Any]], Any]
) -> tuple[Run, float]:
    gen = torch.Generator().manual_seed(0)
    n = len(ds)

    def epoch() -> Iterator[Any]:
        perm = torch.randperm(n, generator=gen).tolist() if spec["shuffle"] else range(n)
        for start in range(0, n, bs):
            yield collate([ds[i] for i in perm[start : start + bs]])

    t0 = time.perf_counter()
    run = Run(epoch, lambda: None)
    run.start()
    return run, time.perf_counter() - t0


def throughput(run: Run, epochs: int) -> dict[str, Any]:
    """The rest of the first epoch and ``epochs - 1`` more, timed."""
    rows = 0
    t0 = time.perf_counter()
    for batch in run.it:
        rows += _rows(batch)
    for _ in range(epochs - 1):
        for batch in run.new_epoch():
            rows += _rows(batch)
    seconds = time.perf_counter() - t0
    return {"samples": rows, "seconds": seconds, "samples_per_s": rows / seconds}


def timed(run: Run, seconds: float, warmup: int) -> dict[str, Any]:
    """Samples and batches over a window of at least ``seconds``, across as many epochs
    as it takes, after ``warmup`` batches taken untimed (a ``window`` event marks its
    start, for the parent's CPU count): whatever a system queued before the window
    (pinfeed's ring, DataLoader's prefetch) is drained before it, for every system
    alike, so the window counts only what is made in it (up to the queue's depth, small
    against seconds of batches)."""

    def batches() -> Iterator[Any]:
        empty = 0
        while empty < 2:  # an epoch without batches twice in a row: nothing to time
            got = False
            for batch in run.it:
                got = True
                yield batch
            empty = 0 if got else empty + 1
            run.it = run.new_epoch()

    it = batches()
    for _ in range(warmup):
        next(it)
    emit("window")
    rows = n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    now = t0
    for batch in it:
        rows += _rows(batch)
        n += 1
        del batch
        now = time.perf_counter()
        if now >= end:
            break
    wall = now - t0
    return {
        "samples": rows,
        "batches": n,
        "seconds": wall,
        "samples_per_s": rows / wall,
        "batches_per_s": n / wall,
        "warmup_batches": warmup,
    }


def _step(seconds: float) -> None:
    """A stand-in for a training step: the trainer's CPU stays busy (as when it runs or
    launches the model), so what is timed next is the handoff, not a wake from idle."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _percentiles(lat: list[float]) -> dict[str, Any]:
    us = sorted(x * 1e6 for x in lat)

    def pct(p: float) -> float:
        return us[min(len(us) - 1, int(p * len(us)))]

    return {
        "n": len(us),
        "p50_us": pct(0.5),
        "p90_us": pct(0.9),
        "p99_us": pct(0.99),
        "mean_us": sum(us) / len(us),
        "min_us": us[0],
    }


def _floor_after_step(step_s: float, n: int) -> dict[str, Any]:
    """What the same machine charges, after the same step, for the least a handoff from
    another process can do: one send and one recv on a SEQPACKET socket pair and two
    tensor views over a buffer (no other process, no wake-up)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    base = torch.empty(16 << 20, dtype=torch.uint8)
    buf = bytearray(4096)
    lat: list[float] = []
    with a, b:
        for _ in range(n):
            _step(step_s)
            t = time.perf_counter()
            b.send(b"N" * 16)
            a.recv_into(buf)
            torch.as_strided(base, (256, 3, 64, 64), (12288, 4096, 64, 1), 64)
            torch.as_strided(base, (256,), (1,), 64)
            lat.append(time.perf_counter() - t)
    return _percentiles(lat)


def handoff(run: Run, batches: int, step_s: float) -> dict[str, Any]:
    """Latency of ``next()`` when the batch is already prepared: the trainer works
    ``step_s`` (long enough for both systems to refill their queues) before every
    ``next()``. ``floor_after_step``: this machine's charge for the bare operations."""
    lat: list[float] = []
    while len(lat) < batches:
        _step(step_s)
        t = time.perf_counter()
        try:
            batch = next(run.it)
        except StopIteration:
            # An epoch boundary: DataLoader restarts its prefetch here; not a ready batch.
            run.it = run.new_epoch()
            next(run.it)
            continue
        lat.append(time.perf_counter() - t)
        del batch
    return {
        **_percentiles(lat),
        "floor_after_step": _floor_after_step(step_s, min(batches, 100)),
        "step_s": step_s,
    }


def _cpu_self_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_children_s() -> float:
    """CPU seconds of this process's descendants: the live ones (DataLoader's workers
    live as long as the loader) and those already reaped."""
    import psutil

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = r.ru_utime + r.ru_stime
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def training(run: Run, batches: int, step_s: float, step_kind: str) -> dict[str, Any]:
    """A training loop whose step takes ``step_s`` per batch: ``sleep`` (the GPU's time:
    the trainer's CPU idle, as while it waits on a CUDA stream) or ``spin`` (the CPU
    busy). Reported: the stall share (time blocked in ``next()``, epoch ends included,
    over the loop's wall time), and the CPU seconds of this process (``RUSAGE_SELF``:
    the trainer itself, DataLoader's pin thread included) and of its children
    (DataLoader's workers) per batch."""
    step = time.sleep if step_kind == "sleep" else _step
    wait = 0.0
    rows = n = 0
    self0, kids0 = _cpu_self_s(), _cpu_children_s()
    t0 = time.perf_counter()
    while n < batches:
        t = time.perf_counter()
        try:
            batch = next(run.it)
        except StopIteration:
            wait += time.perf_counter() - t
            run.it = run.new_epoch()
            continue
        wait += time.perf_counter() - t
        rows += _rows(batch)
        n += 1
        del batch
        step(step_s)
    total = time.perf_counter() - t0
    self_s, kids_s = _cpu_self_s() - self0, _cpu_children_s() - kids0
    return {
        "batches": n,
        "samples": rows,
        "seconds": total,
        "samples_per_s": rows / total,
        "step_s": step_s,
        "step_kind": step_kind,
        "stall_s": wait,
        "stall_share": wait / total,
        "trainer_cpu_s": self_s,
        "trainer_children_cpu_s": kids_s,
        "trainer_cpu_ms_per_batch": self_s / n * 1e3,
        "trainer_children_cpu_ms_per_batch": kids_s / n * 1e3,
    }


# A system makes a Run (its first batch already taken) and its time to first batch.
SYSTEMS: dict[str, Callable[[dict[str, Any]], tuple[Run, float]]] = {
    "pinfeed": lambda spec: _pinfeed(spec, warm=spec.get("mode") == "handoff"),
    # A named loader as "pinfeed", over a python dataset of the reference object itself.
    "pinfeed-python": lambda spec: _pinfeed(spec, warm=spec.get("mode") == "handoff"),
    "dataloader": _dataloader,
    "dataloader-tuned": _dataloader_tuned,
    "pinfeed-dataloader": _pinfeed_dataloader,
    "pinfeed-dataloader-tuned": lambda spec: _dataloader_tuned(spec, switched=True),
    # pinfeed.DataLoader over the workload's Dataset with a batched __getitems__
    "pinfeed-dataloader-getitems": lambda spec: _pinfeed_dataloader(spec, "getitems"),
    "roofline": _roofline,
    "floor": _floor,
    "floor-ipc": lambda spec: _floor(spec, ipc=True),
}
MODES: dict[str, Callable[[Run, dict[str, Any]], dict[str, Any]]] = {
    "throughput": lambda run, spec: throughput(run, spec["epochs"]),
    "timed": lambda run, spec: timed(run, spec["seconds"], spec.get("warmup", 0)),
    "handoff": lambda run, spec: handoff(run, spec["handoff_batches"], spec["handoff_step_s"]),
    "training": lambda run, spec: training(
        run, spec["train_batches"], spec["step_ms"] / 1e3, spec.get("step_kind", "sleep")
    ),
}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    with Reporting() as r:
        system, mode = spec["system"], spec.get("mode", "throughput")
        # a section's own systems (bench.llm's): its module's SYSTEMS
        systems = importlib.import_module(spec["module"]).SYSTEMS if "module" in spec else SYSTEMS
        if system not in systems:
            raise ValueError(f"unknown system {system!r}")
        run, ttfb = systems[system](spec)
        emit("ready", ttfb_s=ttfb, pid=os.getpid())
        _wait_go()
        result = MODES[mode](run, spec)
        emit("result", ttfb_s=ttfb, cuda=torch.cuda.is_available(), **result)
        sys.stdin.read()  # the parent closes stdin once it has sampled memory
        run.it = iter(())
        run.cleanup()
    return r.status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
