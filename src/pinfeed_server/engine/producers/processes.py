"""A pool's worker processes: started together (all or none, bounded), and reaped.

A worker is started with its pipe's other end and ``WorkerSpec``; the pool then sends
it the ring's first segment (``reduction.send_handle``), where the loader has its ring
yet, and it answers once it has mapped the ring and got its dataset (``worker.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from pinfeed_server.engine.producers.base import Task
from pinfeed_server.engine.producers.codec import decode_result
from pinfeed_server.engine.producers.worker import WorkerSpec, worker_main

START_TIMEOUT_S = 120

ProcessFactory = Callable[..., Any]  # multiprocessing.Process(target=, args=, name=, daemon=)


@dataclass
class Worker:
    wid: int
    process: Any
    conn: Connection
    # Reentrant: the collector holds a replacement's while re-sending through _give.
    send_lock: threading.RLock = field(default_factory=threading.RLock)
    outstanding: dict[int, Task] = field(default_factory=dict)
    busy_s: float = 0.0
    started: dict[int, float] = field(default_factory=dict)
    segments: set[int] = field(default_factory=lambda: {0})  # ring segments it has mapped
    generation: int = -1  # the ring's generation it last synced with
    objects: int = 0  # the trainer's objects it has (the pool's count of OBJECTS sent)


def start_workers(
    process: ProcessFactory,
    ctx: BaseContext,
    spec: WorkerSpec,
    ring_fd: int | None,
    ids: Iterable[int],
) -> list[Worker]:
    """Start a worker per id and wait (bounded) until each has mapped the ring (where
    ``ring_fd``: a loader sized from its first batches has none yet) and got its
    dataset; all or none (a RuntimeError says which failed and why)."""
    started = []
    for wid in ids:
        parent, child = ctx.Pipe(duplex=True)
        proc = process(
            target=worker_main,
            args=(wid, child, spec),
            name=f"pinfeed-worker-{spec.loader}-{wid}",
            daemon=True,
        )
        proc.start()
        child.close()
        if ring_fd is not None:
            reduction.send_handle(parent, ring_fd, proc.pid)
        started.append(Worker(wid, proc, parent, segments=set() if ring_fd is None else {0}))
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for w in started:
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"worker {w.wid} did not start within {START_TIMEOUT_S} s")
            error = decode_result(w.conn.recv_bytes()[1:])[0].error
            if error is not None:
                raise RuntimeError(f"worker {w.wid} failed to start: {error.detail}")
    except BaseException:
        for w in started:
            w.process.kill()
            w.process.join(5)
            w.conn.close()
        raise
    return started


class Piped(Protocol):
    """A child process and its pipe: a pool worker, the Ray executor's bridge."""

    process: Any
    conn: Connection


def reap(worker: Piped, timeout: float) -> None:
    """Wait up to ``timeout`` for a worker told to STOP, kill it past that, close its pipe."""
    worker.process.join(timeout)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(1)
    worker.conn.close()
