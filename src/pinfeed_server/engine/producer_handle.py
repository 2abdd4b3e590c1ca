"""The loader's current producer: made by its executor, resized or swapped live, closed.

A change of process count is applied in place where the executor's producer can
(``Executor.resizes_live``: a pool grows and shrinks), or by a swap between two
batches (0 <-> N workers: the in-server producer and a pool): the new producer starts
while the old one runs on, then, between two submits, takes over; the old one finishes
what it holds (results still publish in order) before it closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pinfeed_server.engine.collate import Layout
from pinfeed_server.engine.producers import (
    Executor,
    ProcessFactory,
    Producer,
    ProducerContext,
    Task,
)
from pinfeed_server.engine.ring import Ring


class ProducerHandle:
    def __init__(
        self,
        executor: Executor,
        context: Callable[[int], ProducerContext],
        spawn: Callable[[], ProcessFactory] | None = None,
    ) -> None:
        """``context(processes)``: the producer context for that many processes;
        ``spawn()``: how a locally forking executor forks its processes (the dataset's
        zygote, started on first use); None: multiprocessing's forkserver."""
        self.executor = executor
        self._context = context
        self._spawn = spawn
        self._submit = threading.Lock()  # held around submit: a swap waits for it
        self._producer: Producer | None = None
        self.processes = 0

    def _make(self, processes: int) -> Producer:
        local = self.executor.forks_local and processes > 0
        spawn = self._spawn() if local and self._spawn is not None else None
        return self.executor.producer(self._context(processes), spawn)

    def start(self, processes: int) -> None:
        self._producer = self._make(processes)
        self.processes = processes

    @property
    def started(self) -> bool:
        return self._producer is not None

    def submit(self, task: Task) -> None:
        with self._submit:
            assert self._producer is not None, "submit before start"
            self._producer.submit(task)

    def prepare(self, task: Task) -> None:
        with self._submit:
            assert self._producer is not None, "prepare before start"
            self._producer.prepare(task)

    def resize(self, processes: int) -> None:
        old = self._producer
        if old is None or processes == self.processes:
            return  # not started yet: it starts with the config's count
        if self.executor.resizes_live(self.processes, processes):
            old.resize(processes)
        else:
            fresh = self._make(processes)
            with self._submit:
                self._producer = fresh
            old.close(drain=True)
        self.processes = processes

    def restart(self) -> None:
        """A fresh producer with the same processes in place of the current one (what
        it held is dropped: the engine restarts its plan around this)."""
        old = self._producer
        if old is None:
            return
        fresh = self._make(self.processes)
        with self._submit:
            self._producer = fresh
        old.close()

    def ring_ready(self, ring: Ring, layout: Layout) -> None:
        if self._producer is not None:
            self._producer.ring_ready(ring, layout)

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None:
        if self._producer is not None:
            self._producer.objects(epoch, fds, shared)

    def segments_changed(self) -> None:
        if self._producer is not None:
            self._producer.segments_changed()

    def busy_seconds(self) -> float:
        return self._producer.busy_seconds() if self._producer is not None else 0.0

    @property
    def restarts(self) -> int:
        return self._producer.restarts if self._producer is not None else 0

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
