"""The local worker pool: ``num_workers`` processes that collate batches into ring slots.

Workers are forked from a forkserver that has already imported torch and the dataset
kinds (``forkserver.py``), so starting one costs milliseconds and never forks the
server's threads. Batch ``i`` of an epoch goes to worker ``i % num_workers`` over its
pipe, as DataLoader's round-robin has it, and each worker makes its batches in order,
so its RNG stream is DataLoader's worker's (``seeding.py``: a task that does not follow
on from the worker's last one comes with a reseed). Results come back to one collector
thread, which hands them to ``on_result`` (``codec.py`` is the pipe's format,
``worker.py`` the process's side).

A worker that dies is replaced (same worker id, reseeded and replayed to where its
RNG was) and its outstanding tasks are sent to the new one; a task that kills workers
repeatedly comes back as an error for that batch.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import wait

from pinfeed.errors import SampleError
from pinfeed_server.engine.collate import Layout
from pinfeed_server.engine.iterable import EndJudge, IterRoutes, is_iterable
from pinfeed_server.engine.producers.base import ProducerContext, Result, Task, regroup
from pinfeed_server.engine.producers.codec import (
    RESEED_TAG,
    SNAPSHOT_TAG,
    STOP,
    TASK_TAG,
    decode_pickled,
    decode_result,
    encode_objects,
    encode_pickled,
    encode_ring,
    encode_task,
)
from pinfeed_server.engine.producers.processes import (
    START_TIMEOUT_S,
    ProcessFactory,
    Worker,
    reap,
    start_workers,
)
from pinfeed_server.engine.producers.seeding import Streams, history_of
from pinfeed_server.engine.producers.worker import WorkerSpec, send_segments
from pinfeed_server.engine.ring import OwnBuffer, Ring

log = logging.getLogger("pinfeed.workers")

MAX_TASK_RETRIES = 2


class WorkerPool:
    """Processes that fill slots; results go to ``on_result`` from one collector thread."""

    def __init__(self, ctx: ProducerContext, spawn: ProcessFactory | None = None) -> None:
        self.name = ctx.config.name
        iterable = ctx.iterable or is_iterable(ctx.dataset)
        self.spec = WorkerSpec.of(ctx)
        # An iterable's turns: its workers position their iterators themselves.
        self._judge = EndJudge(ctx.streams) if iterable else None
        self.streams: Streams | IterRoutes = (
            IterRoutes(ctx.streams)
            if iterable
            else Streams(
                ctx.config,
                ctx.streams,
                history_of(
                    ctx.config, ctx.streams, ctx.plan, ctx.dataset, ctx.datasets.allowed_plugins
                ),
                replay=self.spec.snapshots,
            )
        )
        # None until a loader sized from its first batches has them (ring_ready)
        self._ring, self._layout = ctx.ring, ctx.layout
        # A trainer's objects as last sent (the epoch they apply from, their payloads),
        # and how many times they were: a worker behind gets them before its next task.
        self._objects = ctx.objects
        self._objects_sent = 0 if ctx.objects is None else 1
        # Without global RNG draws (built-in kinds) the streams do not matter: batches
        # go round-robin over the processes there are, whatever the loader started with.
        # An iterable's turn belongs to its worker's stream.
        self._round_robin = not self.spec.snapshots and not iterable
        self._ctx = mp.get_context("forkserver")
        # Workers are forked from the dataset's zygote when the service gives one.
        self._process = spawn or self._ctx.Process
        self._on_result = ctx.on_result
        self._on_fatal = ctx.on_fatal
        self._lock = threading.Lock()
        self._workers: list[Worker] = []  # position = DataLoader's worker id
        self._retiring: list[Worker] = []  # finish their tasks, then exit (a live shrink)
        self._retries: dict[int, int] = {}
        self._stop = threading.Event()
        self._next_id = 0
        self.restarts = 0
        self._idle = threading.Condition(self._lock)  # notified as tasks complete
        self._workers.extend(self._spawn(ctx.processes))
        self._collector = threading.Thread(
            target=self._collect, name=f"pinfeed-collect-{self.name}", daemon=True
        )
        self._collector.start()

    @property
    def size(self) -> int:
        return len(self._workers)

    def _spawn(self, count: int = 1) -> list[Worker]:
        ids = range(self._next_id, self._next_id + count)
        self._next_id += count
        ring = self._ring
        return start_workers(
            self._process, self._ctx, self.spec, None if ring is None else ring.fd, ids
        )

    def resize(self, num_workers: int) -> None:
        """Grow or shrink live: new workers take new tasks at once; removed ones first
        finish what they hold, so no batch is lost or produced twice."""
        if num_workers < 1:
            raise ValueError("a pool has at least one worker; the engine swaps it for 0")
        new = (
            self._spawn(num_workers - len(self._workers))
            if len(self._workers) < num_workers
            else []
        )
        with self._lock:
            regroup(self._workers, self._retiring, new, num_workers, self.streams)

    def _retire_idle(self) -> None:
        with self._lock:
            idle = [w for w in self._retiring if not w.outstanding]
            for w in idle:
                self._retiring.remove(w)
        for w in idle:
            self._send(w, STOP)
            reap(w, 5.0)

    def prepare(self, task: Task) -> None:
        """Nothing: workers make batches on their own streams, none on a trainer's."""

    def submit(self, task: Task) -> None:
        self._give(task)

    def _process_of(self, task: Task) -> Worker:
        """Batch ``i``'s worker is ``i % num_workers`` (DataLoader's id, fixed at
        creation); after a live resize, process ``id % processes`` serves it."""
        if self._round_robin:
            return self._workers[task.index % len(self._workers)]
        return self._workers[self.streams.worker_of(task.index) % len(self._workers)]

    def _give(self, task: Task) -> None:
        """Send the task to its worker, after the reseed it needs. The worker's send
        lock is held from ``prepare`` to the send, so that its pipe carries tasks in the
        order ``streams`` saw them."""
        while True:
            with self._lock:
                worker = self._process_of(task)
            with worker.send_lock:
                with self._lock:
                    if self._process_of(task) is not worker:
                        continue  # replaced or resized meanwhile: pick again
                    reseed = self.streams.prepare(task.epoch, task.index, task.seq)
                    worker.outstanding[task.seq] = task
                    worker.started.setdefault(task.seq, time.perf_counter())
                self._sync(worker)
                if reseed is not None:
                    self._send_locked(worker, encode_pickled(RESEED_TAG, reseed))
                self._send_locked(worker, TASK_TAG + encode_task(task))
                return

    def ring_ready(self, ring: Ring, layout: Layout) -> None:
        """The ring, sized from the first batches: every worker maps it now (``_sync``);
        workers started from now on map it at start."""
        with self._lock:
            self._ring, self._layout = ring, layout
            self.spec = self.spec.with_ring(layout, ring.segments()[0][0].nslots * ring.slot_bytes)
            everyone = self._workers + self._retiring
        for w in everyone:
            with w.send_lock:
                self._sync(w)

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None:
        """A pinfeed.DataLoader's objects changed: every worker gets them now (OBJECTS,
        their payloads' and shared memory's fds), and uses them from ``epoch``'s first
        batch on."""
        with self._lock:
            self._objects = (epoch, fds, shared)
            self._objects_sent += 1
            everyone = self._workers + self._retiring
        for w in everyone:
            with w.send_lock:
                self._sync(w)

    def _sync(self, worker: Worker) -> None:
        """Send ``worker`` the trainer's objects where they changed, map the ring's new
        segments in it and unmap its closed ones (first the ring itself, where the
        worker has none yet: a RING and segment 0's fd); under the worker's send lock,
        before a task that may use them."""
        objects = self._objects
        if objects is not None and worker.objects != self._objects_sent:
            epoch, fds, shared = objects
            with contextlib.suppress(OSError):  # a dead one: its reaper's
                worker.conn.send_bytes(encode_objects(epoch, len(fds), len(shared)))
                for fd in (*fds, *shared):
                    reduction.send_handle(worker.conn, fd, worker.process.pid)
            worker.objects = self._objects_sent
        ring = self._ring
        if ring is None or worker.generation == ring.generation:
            return
        if not worker.segments:
            assert self._layout is not None
            with ring.lock, contextlib.suppress(OSError):  # a dead one: its reaper's
                info, fd = ring.segments()[0]
                worker.conn.send_bytes(encode_ring(self._layout, info.nslots))
                reduction.send_handle(worker.conn, fd, worker.process.pid)
            worker.segments = {0}
        worker.segments = send_segments(ring, worker.conn, worker.process.pid, worker.segments)
        worker.generation = ring.generation

    def segments_changed(self) -> None:
        """The ring closed a segment: every worker unmaps it now (not at its next task)."""
        with self._lock:
            everyone = self._workers + self._retiring
        for w in everyone:
            with w.send_lock:
                self._sync(w)

    def _send(self, worker: Worker, message: bytes) -> None:
        with worker.send_lock:
            self._send_locked(worker, message)

    def _send_locked(self, worker: Worker, message: bytes) -> None:
        # A dead worker: the collector sees its death and re-sends its tasks.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
            worker.conn.send_bytes(message)

    def busy_seconds(self) -> float:
        with self._lock:
            return sum(w.busy_s for w in self._workers)

    def _collect(self) -> None:
        while not self._stop.is_set():
            self._retire_idle()
            with self._lock:
                watched = self._workers + self._retiring
                by_conn = {w.conn: w for w in watched}
                by_sentinel = {w.process.sentinel: w for w in watched}
            ready = wait([*by_conn, *by_sentinel], timeout=0.2)
            for obj in ready:
                if obj in by_conn:
                    self._receive(by_conn[obj])
            for obj in ready:
                if obj in by_sentinel and not self._stop.is_set():
                    self._replace(by_sentinel[obj])

    def _receive(self, worker: Worker) -> None:
        try:
            while worker.conn.poll():
                message = worker.conn.recv_bytes()
                if message[:1] == SNAPSHOT_TAG:
                    epoch, index, state, seq = decode_pickled(message)
                    with self._lock:
                        self.streams.snapshot(epoch, index, state, seq)
                    continue
                result, own = decode_result(message[1:])
                if own:  # the batch's buffer of its own: its fd is next on the pipe
                    result.own = OwnBuffer(reduction.recv_handle(worker.conn))
                with self._lock:
                    task = worker.outstanding.pop(result.seq, None)
                    if result.end and self._judge is not None and task is not None:
                        # A stream ran out: the epoch's END, or a turn that yields nothing.
                        result.end = self._judge.ran_out(task.epoch, task.index)
                    t0 = worker.started.pop(result.seq, None)
                    if t0 is not None:
                        worker.busy_s += time.perf_counter() - t0
                    self._retries.pop(result.seq, None)
                self._on_result(result)
                with self._lock:
                    self._idle.notify_all()
        except (EOFError, OSError):
            pass  # dead: its sentinel fires and _replace handles it

    def _replace(self, dead: Worker) -> None:
        dead.process.join(1)
        code = dead.process.exitcode
        self._receive(dead)  # results it sent before dying
        self.restarts += 1
        with self._lock:
            retiring = dead in self._retiring
        log.warning(
            "loader %s: worker %d died (exit code %s)%s",
            self.name,
            dead.wid,
            code,
            "" if retiring else "; replacing it",
        )
        new: list[Worker] = []
        if not retiring:
            # Start the replacement before the dead worker leaves the pool, so the pool
            # is never empty for the producer's submit().
            try:
                new = self._spawn()
            except Exception as exc:
                self._on_fatal(
                    f"worker {dead.wid} died (exit code {code}) and no replacement could "
                    f"start: {exc}"
                )
                return
        # The replacement's send lock is held until the dead worker's tasks are re-sent,
        # so that a newer task does not overtake them (and cost a second replay).
        with new[0].send_lock if new else contextlib.nullcontext():
            with self._lock:
                if retiring:
                    self._retiring.remove(dead)
                else:
                    position = self._workers.index(dead)
                    self._workers[position] = new[0]  # the same streams, fresh RNGs
                    for stream in range(position, self.streams.count, len(self._workers)):
                        self.streams.forget(stream)
                tasks = sorted(dead.outstanding.items())
            dead.conn.close()
            self._resend(tasks, code, dead.process.pid)

    def _resend(self, tasks: list[tuple[int, Task]], code: int | None, pid: int) -> None:
        for i, (seq, task) in enumerate(tasks):
            if i == 0:
                # Workers take tasks in order: only the oldest was being made when it
                # died. A task that keeps killing workers is a poison batch: it alone
                # comes back as an error; those queued behind it are simply re-sent.
                tries = self._retries.get(seq, 0) + 1
                self._retries[seq] = tries
                if tries > MAX_TASK_RETRIES and self._judge is not None:
                    # An iterator that kills its worker cannot be fast-forwarded past.
                    self._on_fatal(
                        f"worker {self.streams.worker_of(task.index)} died (exit code "
                        f"{code}) {tries} times making batch {task.index} of epoch "
                        f"{task.epoch}: its iterator cannot be fast-forwarded past it"
                    )
                    return
                if tries > MAX_TASK_RETRIES:
                    with self._lock:
                        self.streams.poison(task.epoch, task.index)
                    self._on_result(_worker_died(task, code, tries, pid))
                    continue
            self._give(task)

    def _drain(self, timeout: float) -> None:
        """Wait (bounded) until no task is outstanding: each has reported its result."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(w.outstanding for w in self._workers + self._retiring):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("loader %s: closing with tasks outstanding", self.name)
                    return
                self._idle.wait(min(left, 0.2))

    def close(self, drain: bool = False, timeout: float = 5.0) -> None:
        if drain and not self._stop.is_set():
            self._drain(START_TIMEOUT_S)
        self._stop.set()
        self._collector.join(timeout)
        everyone = self._workers + self._retiring
        for w in everyone:
            self._send(w, STOP)
        deadline = time.monotonic() + timeout
        for w in everyone:
            reap(w, max(0.0, deadline - time.monotonic()))
        self._workers.clear()
        self._retiring.clear()


def _worker_died(task: Task, code: int | None, tries: int, pid: int) -> Result:
    """The batch whose making killed its worker ``tries`` times, the last one ``pid``:
    DataLoader's RuntimeError, in its words (a signal named), which a trainer catches as
    ``RuntimeError`` (and as ``SampleError``)."""
    indices = (task.indices or [])[:8]
    if code is not None and code < 0:
        how = f"is killed by signal: {signal.strsignal(-code)}."
    else:
        how = f"exited unexpectedly (exit code {code})."
    died = SampleError(
        f"DataLoader worker (pid {pid}) {how} It died {tries} times making the batch of "
        f"indices {indices}...: the sample (or collate_fn) crashes its process",
        index=None,
        error_type="RuntimeError",
        error_module="builtins",
        reason="worker-died",
    )
    return Result(task.seq, error=died.info())
