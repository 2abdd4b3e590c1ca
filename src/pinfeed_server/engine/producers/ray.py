"""``executor: "ray"``: a loader's batches made by ``num_workers`` Ray actors.

The server side of the Ray executor. Ray itself runs in a child process, the bridge
(``ray_bridge.py``: the Ray driver; it maps the ring and copies each batch from the
object store into its slot), so that a lost cluster costs a loader, not the server.
This class hands the bridge tasks over a pipe, collects results, and keeps every task
it sent until its result came, so a bridge that ends loses none:

- the bridge reports ``FATAL`` (the head stopped answering) or just exits: the loader
  fails with the reason (trainers get it, nothing hangs); this producer then probes
  the head every ``RECONNECT_S`` and, once a new bridge starts, re-sends the tasks in
  flight, in order, and the loader is ready again (``ctx.on_recovered``).
- actors lost inside a running bridge are the bridge's business (replaced, their
  tasks re-sent); each replacement counts in ``restarts``.

The bridge maps the ring as a worker does: this class announces each segment the
ring gains or closes (``worker.send_segments``) before a task that may use it.

The cluster's address is the server's ``PINFEED_RAY_ADDRESS``, which ``RayExecutor``
holds (``executor.py``: the seam). Refused (``RayExecutor.refusal``): an
``IterableDataset`` (its workers' iterators would have to be fast-forwarded on a
replacement actor, and its epochs end by judgement of the pool; not built for Ray), no
cluster, and 0 workers, at creation and at a PATCH: a Ray loader's batches are made by
its actors, never in the server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing as mp
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

from pinfeed_server.datasets import Kind
from pinfeed_server.engine.collate import Layout
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import Producer, ProducerContext, Task
from pinfeed_server.engine.producers.codec import (
    FATAL_TAG,
    RESTART_TAG,
    STOP,
    TASK_TAG,
    decode_result,
    encode_count,
    encode_task,
)
from pinfeed_server.engine.producers.processes import ProcessFactory, reap
from pinfeed_server.engine.producers.ray_bridge import BridgeSpec, bridge_main
from pinfeed_server.engine.producers.worker import WorkerSpec, send_segments
from pinfeed_server.engine.ring import Ring

log = logging.getLogger("pinfeed.ray")

START_TIMEOUT_S = 180.0  # ray.init, then every actor building its dataset
RECONNECT_S = 2.0


def ray_endpoint(address: str) -> tuple[str, int]:
    """``host:port`` of a Ray GCS address (``ray://host:port`` too)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"PINFEED_RAY_ADDRESS={address!r} is not host:port (the Ray head's GCS)")
    return host.strip("[]"), int(port)


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Refuse a Ray address that is unusable now: Ray not installed, or no answer."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "PINFEED_RAY_ADDRESS is set but Ray is not installed: pip install 'pinfeed[ray]'"
        )
    host, port = ray_endpoint(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise ValueError(
            f"PINFEED_RAY_ADDRESS={address} cannot be reached ({exc}); start the Ray head "
            "(ray start --head) or unset PINFEED_RAY_ADDRESS"
        ) from None


class RayExecutor:
    """``executor: "ray"``: ``num_workers`` Ray actors on the server's cluster."""

    name = "ray"
    forks_local = False  # actors run on the cluster: no zygote here
    counts_workers = False  # nor against PINFEED_MAX_WORKERS

    def __init__(self, address: str | None) -> None:
        self.address = address

    def refusal(self, config: LoaderConfig, kind: Kind[Any], iterable: bool) -> str | None:
        if config.num_workers == 0:
            return "executor 'ray' needs num_workers >= 1 (the number of Ray actors)"
        if iterable:
            return (
                f"loader {config.name!r}: executor 'ray' does not take an IterableDataset (a "
                "replaced actor cannot take over its worker's iterator); use executor 'local'"
            )
        if self.address is None:
            return (
                f"loader {config.name!r} asks for executor 'ray', but this server has no Ray "
                "cluster: start it with PINFEED_RAY_ADDRESS=<head>:6379"
            )
        return None

    def live_refusal(self, old: LoaderConfig, new: LoaderConfig, iterable: bool) -> str | None:
        if new.num_workers == 0:
            return (
                f"loader {new.name!r} has executor 'ray': its batches are made by Ray actors, "
                "at least one; num_workers=0 (in the server) needs executor 'local'"
            )
        return None

    def resizes_live(self, old: int, new: int) -> bool:
        return True  # the bridge starts or stops actors

    def producer(self, ctx: ProducerContext, spawn: ProcessFactory | None) -> Producer:
        assert self.address is not None  # refusal() saw to it
        return RayProducer(ctx, self.address)


@dataclass
class _Link:
    """One bridge process, its pipe, and the ring segments it has mapped."""

    process: Any
    conn: Connection
    segments: set[int] = field(default_factory=lambda: {0})
    generation: int = -1  # the ring's generation it last synced with


class RayProducer:
    def __init__(self, ctx: ProducerContext, address: str) -> None:
        self.name = ctx.config.name
        self._spec = BridgeSpec(
            WorkerSpec.of(ctx),
            ctx.config,
            ctx.streams,
            ctx.processes,
            address,
            ray_endpoint(address),
        )
        assert ctx.ring is not None, "a Ray loader has its ring from the start"
        self._ring = ctx.ring
        self._ring_fd = ctx.ring.fd
        self._on_result = ctx.on_result
        self._on_fatal = ctx.on_fatal
        self._on_recovered = ctx.on_recovered
        self._mp = mp.get_context("forkserver")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._outstanding: dict[int, Task] = {}  # sent, no result yet: re-sent to a new bridge
        self._idle = threading.Condition(self._lock)  # notified as results come
        self._started: dict[int, float] = {}
        self._busy_s = 0.0
        self._num_workers = ctx.processes
        self._stop = threading.Event()
        self.restarts = 0
        self._link = self._spawn()
        self._thread = threading.Thread(
            target=self._collect, name=f"pinfeed-ray-{self.name}", daemon=True
        )
        self._thread.start()

    def _spawn(self) -> _Link:
        """Start a bridge and wait (bounded) until its actors are up."""
        parent, child = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=bridge_main,
            args=(child, self._spec),
            name=f"pinfeed-ray-bridge-{self.name}",
            daemon=True,
        )
        proc.start()
        child.close()
        try:
            reduction.send_handle(parent, self._ring_fd, proc.pid)
            ready = wait([parent, proc.sentinel], START_TIMEOUT_S)
            if parent not in ready:
                raise RuntimeError(
                    f"the Ray executor did not start within {START_TIMEOUT_S:.0f} s"
                    if not ready
                    else f"the Ray bridge exited (code {proc.exitcode}) while starting"
                )
            error = decode_result(parent.recv_bytes()[1:])[0].error
            if error is not None:
                raise RuntimeError(f"the Ray executor failed to start: {error.detail}")
        except BaseException:
            proc.kill()
            proc.join(5)
            parent.close()
            raise
        return _Link(proc, parent)

    # -- the producer seam ---------------------------------------------------------------
    def prepare(self, task: Task) -> None:
        """Nothing: workers make batches on their own streams, none on a trainer's."""

    def submit(self, task: Task) -> None:
        with self._lock:
            self._outstanding[task.seq] = task
            self._started[task.seq] = time.perf_counter()
            link = self._link
        self._send(link, TASK_TAG + encode_task(task))

    def resize(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError("a Ray loader has at least one actor (the service refuses 0)")
        with self._lock:
            self._num_workers = num_workers
            link = self._link
        self._send(link, encode_count(num_workers))

    def ring_ready(self, ring: Ring, layout: Layout) -> None:
        raise RuntimeError("executor 'ray' serves no loader sized from its first batches")

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None:
        raise RuntimeError("executor 'ray' serves no trainer's objects")

    def segments_changed(self) -> None:
        """The ring closed a segment: the bridge unmaps it now (not at its next task)."""
        with self._lock:
            link = self._link
        self._send(link)

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self, drain: bool = False) -> None:
        if self._stop.is_set():
            return
        if drain:  # a bounded wait for every result (the engine's producer swap)
            deadline = time.monotonic() + START_TIMEOUT_S
            with self._lock:
                while self._outstanding and time.monotonic() < deadline:
                    self._idle.wait(0.2)
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            link = self._link
        self._send(link, STOP)
        reap(link, 10)

    def _send(self, link: _Link, *messages: bytes) -> None:
        """The ring's segment news first, then ``messages``. A bridge that is gone: the
        collector sees it and re-sends to the next one."""
        with self._send_lock, contextlib.suppress(OSError):
            generation = self._ring.generation
            if link.generation != generation:
                link.segments = send_segments(
                    self._ring, link.conn, link.process.pid, link.segments
                )
                link.generation = generation
            for message in messages:
                link.conn.send_bytes(message)

    # -- the collector -------------------------------------------------------------------
    def _collect(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                link = self._link
            reason = self._drain(link.process, link.conn)
            if reason is None:
                continue
            if self._stop.is_set():
                return
            link.process.join(1)
            log.error("loader %s: %s", self.name, reason)
            self._on_fatal(reason)
            self._reconnect()

    def _drain(self, proc: Any, conn: Connection) -> str | None:
        """Take what the bridge sent; the reason it ended, or None while it runs."""
        ready = wait([conn, proc.sentinel], timeout=0.5)
        fatal: str | None = None
        try:
            while conn.poll():
                message = conn.recv_bytes()
                if message[:1] == RESTART_TAG:
                    self.restarts += 1
                elif message[:1] == FATAL_TAG:
                    fatal = message[1:].decode(errors="replace")
                else:
                    self._result(message)
        except (EOFError, OSError):
            pass
        if fatal is not None or proc.sentinel in ready:
            proc.join(5)
            return "the Ray executor lost its cluster: " + (
                fatal or f"its bridge process exited (code {proc.exitcode})"
            )
        return None

    def _result(self, message: bytes) -> None:
        result, _ = decode_result(message[1:])
        with self._lock:
            self._outstanding.pop(result.seq, None)
            t0 = self._started.pop(result.seq, None)
            if t0 is not None:
                self._busy_s += time.perf_counter() - t0
            self._idle.notify_all()
        self._on_result(result)

    def _reconnect(self) -> None:
        """Wait for the cluster, start a new bridge, re-send what was in flight."""
        while not self._stop.wait(RECONNECT_S):
            try:
                check_ray_address(self._spec.address, timeout=RECONNECT_S)
                link = self._spawn()
            except Exception as exc:
                log.info("loader %s: the Ray cluster is not back yet: %s", self.name, exc)
                continue
            with self._lock:
                old = self._link
                self._link = link
                tasks = sorted(self._outstanding.items())
                num_workers = self._num_workers
            old.conn.close()
            if num_workers != self._spec.processes:
                self._send(link, encode_count(num_workers))
            self._send(link, *(TASK_TAG + encode_task(task) for _, task in tasks))
            log.warning(
                "loader %s: the Ray cluster is back; %d tasks re-sent", self.name, len(tasks)
            )
            self._on_recovered()
            return
