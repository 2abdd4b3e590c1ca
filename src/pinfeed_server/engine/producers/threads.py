"""``executor: "thread"``: ``num_workers`` threads of the server make the batches.

For datasets whose ``__getitem__`` spends its time in code that releases the GIL
(Pillow's decode and resize, numpy, torch ops, reads from memory maps): threads share
the server's one copy of the dataset and write into the ring directly, with no worker
processes, pipes or per-worker memory. What they cannot do is keep DataLoader's
per-worker RNG streams (the global RNGs are one per process), so a dataset that may
draw from them (a ``python`` dataset, a ``transform``, a ``collate_fn``) is refused with
the reason, as is an IterableDataset (its streams are per worker too); those run on
``local``.

Any thread takes the next task (batches are published in plan order whatever order they
finish in); with ``num_workers=0`` the batches are made in the engine's thread
(``inline.py``), as for ``local``. The dataset's ``__getitem__`` must be thread-safe,
which the built-in kinds are.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from pinfeed_server.datasets import Kind
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import (
    Producer,
    ProducerContext,
    Result,
    Task,
    draws_rng,
    error_info,
)
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.processes import ProcessFactory
from pinfeed_server.engine.ring import Ring

log = logging.getLogger("pinfeed.workers")

CLOSE_TIMEOUT_S = 10.0


class ThreadExecutor:
    name = "thread"
    forks_local = False  # threads of the server: no process is forked
    counts_workers = True  # but they take this node's CPUs like worker processes

    def refusal(self, config: LoaderConfig, kind: Kind[Any], iterable: bool) -> str | None:
        if iterable:
            return (
                f"loader {config.name!r}: executor 'thread' does not take an IterableDataset "
                "(its iterators are per-worker streams); use executor 'local'"
            )
        if draws_rng(kind, config, None):
            return (
                f"loader {config.name!r}: executor 'thread' serves datasets that draw no "
                f"global RNG, and a {kind.name!r} dataset, a transform or a collate_fn may "
                "(threads share one process's RNGs, so DataLoader's per-worker streams cannot "
                "be kept); use executor 'local'"
            )
        return None

    def live_refusal(self, old: LoaderConfig, new: LoaderConfig, iterable: bool) -> str | None:
        return None

    def resizes_live(self, old: int, new: int) -> bool:
        return (old == 0) == (new == 0)  # threads come and go; 0 <-> N swaps

    def producer(self, ctx: ProducerContext, spawn: ProcessFactory | None) -> Producer:
        if ctx.processes > 0:
            return ThreadPool(ctx)
        return InlineProducer(ctx)


class ThreadPool:
    """Threads taking tasks from one queue; see the module docstring."""

    restarts = 0  # a thread never dies: a failing batch is that batch's error

    def __init__(self, ctx: ProducerContext) -> None:
        self._ctx = ctx
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._size = 0  # threads meant to run: started, less the stop tokens queued
        self._closed = False
        self.resize(ctx.processes)

    def _run(self) -> None:
        ctx = self._ctx
        ring = ctx.ring
        assert ring is not None, "a thread pool's loader has its ring from the start"
        writer = SlotWriter(ctx.dataset, ctx.layout, ring.space, ring.slot_bytes)
        generation = ring.generation
        try:
            while (task := self._tasks.get()) is not None:
                if generation != ring.generation:  # a segment came or went: fresh views
                    writer.close()
                    writer = SlotWriter(ctx.dataset, ctx.layout, ring.space, ring.slot_bytes)
                    generation = ring.generation
                t0 = time.perf_counter()
                assert task.indices is not None  # refusal(): no iterables here
                try:
                    result = Result(task.seq, writer.write(task.slot, task.indices))
                except Exception as exc:
                    result = Result(task.seq, error=error_info(exc))
                with self._lock:
                    self._busy_s += time.perf_counter() - t0
                ctx.on_result(result)
                with self._lock:
                    self._outstanding -= 1
                    self._idle.notify_all()
        finally:
            writer.close()

    # -- the producer seam ---------------------------------------------------------------
    def prepare(self, task: Task) -> None:
        """Nothing: workers make batches on their own streams, none on a trainer's."""

    def submit(self, task: Task) -> None:
        with self._lock:
            self._outstanding += 1
        self._tasks.put(task)

    def resize(self, num_workers: int) -> None:
        """More threads start at once; fewer: as many take a stop token from the queue,
        behind the tasks already in it, so none is lost."""
        if num_workers < 1:
            raise ValueError("a thread pool has at least one thread; the engine swaps it for 0")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            for _ in range(num_workers, self._size):
                self._tasks.put(None)
            for i in range(self._size, num_workers):
                name = f"pinfeed-thread-{self._ctx.config.name}-{i}"
                t = threading.Thread(target=self._run, name=name, daemon=True)
                self._threads.append(t)
                t.start()
            self._size = num_workers

    def ring_ready(self, ring: Ring, layout: Layout) -> None:
        raise RuntimeError("executor 'thread' serves no loader sized from its first batches")

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None:
        raise RuntimeError("executor 'thread' serves no trainer's objects")

    def segments_changed(self) -> None:
        pass  # each thread renews its views before its next task (ring.generation)

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self, drain: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if drain:
                deadline = time.monotonic() + CLOSE_TIMEOUT_S
                while self._outstanding and time.monotonic() < deadline:
                    self._idle.wait(0.2)
            threads = list(self._threads)
        if not drain:  # what no thread has taken yet is not made
            while True:
                try:
                    self._tasks.get_nowait()
                except queue.Empty:
                    break
        for _ in threads:
            self._tasks.put(None)
        for t in threads:
            t.join(CLOSE_TIMEOUT_S)
            if t.is_alive():
                log.warning("loader %s: a thread is still making a batch", self._ctx.config.name)
