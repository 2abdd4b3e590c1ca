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

The cluster's address is the server's ``PINFEED_RAY_ADDRESS`` (``configure_ray``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

from pinfeed_server.engine.producers.base import ProducerContext, Task
from pinfeed_server.engine.producers.codec import STOP, decode_result, encode_task
from pinfeed_server.engine.producers.inline import SWITCH
from pinfeed_server.engine.producers.ray_bridge import (
    FATAL_TAG,
    RESTART_TAG,
    BridgeSpec,
    bridge_main,
    encode_count,
)
from pinfeed_server.engine.producers.seeding import TASK_TAG
from pinfeed_server.engine.producers.worker import WorkerSpec
from pinfeed_server.settings import check_ray_address, ray_endpoint

log = logging.getLogger("pinfeed.ray")

START_TIMEOUT_S = 180.0  # ray.init, then every actor building its dataset
RECONNECT_S = 2.0

_address: str | None = None


def configure_ray(address: str | None) -> None:
    """The cluster ``executor: "ray"`` loaders use (the server's PINFEED_RAY_ADDRESS)."""
    global _address
    _address = address


def ray_address() -> str | None:
    return _address


class RayProducer:
    def __init__(self, ctx: ProducerContext) -> None:
        if _address is None:
            raise RuntimeError("executor 'ray' needs PINFEED_RAY_ADDRESS")
        self.name = ctx.config.name
        worker = WorkerSpec(
            ctx.config.name,
            ctx.kind,
            ctx.params,
            ctx.datasets,
            ctx.layout.to_json(),
            ctx.ring.size,
            ctx.ring.slot_bytes,
            ctx.config.worker_init_fn,
            ctx.config.num_workers,
            snapshots=ctx.kind == "python",  # as the pool: built-in kinds draw no RNG
        )
        self._spec = BridgeSpec(worker, ctx.config, _address, ray_endpoint(_address))
        self._ring_fd = ctx.ring.fd
        self._on_result = ctx.on_result
        self._on_fatal = ctx.on_fatal
        self._on_recovered = ctx.on_recovered
        self._mp = mp.get_context("forkserver")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._outstanding: dict[int, Task] = {}  # sent, no result yet: re-sent to a new bridge
        self._started: dict[int, float] = {}
        self._busy_s = 0.0
        self._num_workers = ctx.config.num_workers
        self._stop = threading.Event()
        self.restarts = 0
        self._proc, self._conn = self._spawn()
        self._thread = threading.Thread(
            target=self._collect, name=f"pinfeed-ray-{self.name}", daemon=True
        )
        self._thread.start()

    def _spawn(self) -> tuple[Any, Connection]:
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
            error = decode_result(parent.recv_bytes()[1:]).error
            if error is not None:
                raise RuntimeError(f"the Ray executor failed to start: {error.detail}")
        except BaseException:
            proc.kill()
            proc.join(5)
            parent.close()
            raise
        return proc, parent

    # -- the producer seam ---------------------------------------------------------------
    def submit(self, task: Task) -> None:
        with self._lock:
            self._outstanding[task.seq] = task
            self._started[task.seq] = time.perf_counter()
            conn = self._conn
        self._send(conn, TASK_TAG + encode_task(task))

    def resize(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(SWITCH)
        with self._lock:
            self._num_workers = num_workers
            conn = self._conn
        self._send(conn, encode_count(num_workers))

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            proc, conn = self._proc, self._conn
        self._send(conn, STOP)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(1)
        conn.close()

    def _send(self, conn: Connection, message: bytes) -> None:
        # A bridge that is gone: the collector sees it and re-sends to the next one.
        with self._send_lock, contextlib.suppress(OSError):
            conn.send_bytes(message)

    # -- the collector -------------------------------------------------------------------
    def _collect(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                proc, conn = self._proc, self._conn
            reason = self._drain(proc, conn)
            if reason is None:
                continue
            if self._stop.is_set():
                return
            proc.join(1)
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
        result = decode_result(message[1:])
        with self._lock:
            self._outstanding.pop(result.seq, None)
            t0 = self._started.pop(result.seq, None)
            if t0 is not None:
                self._busy_s += time.perf_counter() - t0
        self._on_result(result)

    def _reconnect(self) -> None:
        """Wait for the cluster, start a new bridge, re-send what was in flight."""
        while not self._stop.wait(RECONNECT_S):
            try:
                check_ray_address(self._spec.address, timeout=RECONNECT_S)
                proc, conn = self._spawn()
            except Exception as exc:
                log.info("loader %s: the Ray cluster is not back yet: %s", self.name, exc)
                continue
            with self._lock:
                old = self._conn
                self._proc, self._conn = proc, conn
                tasks = sorted(self._outstanding.items())
                num_workers = self._num_workers
            old.close()
            if num_workers != self._spec.config.num_workers:
                self._send(conn, encode_count(num_workers))
            for _, task in tasks:
                self._send(conn, TASK_TAG + encode_task(task))
            log.warning(
                "loader %s: the Ray cluster is back; %d tasks re-sent", self.name, len(tasks)
            )
            if self._on_recovered is not None:
                self._on_recovered()
            return
