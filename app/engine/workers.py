"""The worker pool: ``num_workers`` processes that collate batches into ring slots.

Workers are forked from a forkserver that has already imported torch and the dataset
kinds, so starting one costs milliseconds and never forks the server's threads. Each
worker builds the dataset from its spec (memory-mapped kinds share pages; nothing is
pickled per worker), maps the ring once, then serves tasks ``(seq, slot, indices)``
from its pipe and answers ``(seq, strings_json, error)``, both as fixed ``struct``
layouts (nothing is pickled per batch).

A worker that dies is replaced and its outstanding tasks are sent to the new one;
a task that kills workers repeatedly comes back as an error for that batch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import forkserver, reduction
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pinfeed._protocol import ErrorInfo
from pinfeed_server.datasets import DatasetContext, build_dataset
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.errors import SampleError, error_info
from pinfeed_server.engine.ring import map_ring

log = logging.getLogger("pinfeed.workers")

MAX_TASK_RETRIES = 2

# (seq, strings_json, error or None)
Result = tuple[int, bytes, ErrorInfo | None]

# The pipe's wire format (send_bytes/recv_bytes). A task: seq, slot, then the indices
# as int64; an empty message tells the worker to exit. A result: seq and a flag, then
# the batch's strings JSON, or (flag 1) its ErrorInfo as JSON. seq -1 is the start-up report.
_TASK = struct.Struct("<qI")
_RESULT = struct.Struct("<qB")
_STOP = b""


def encode_task(seq: int, slot: int, indices: list[int]) -> bytes:
    return _TASK.pack(seq, slot) + array("q", indices).tobytes()


def decode_task(buf: bytes) -> tuple[int, int, list[int]]:
    seq, slot = _TASK.unpack_from(buf)
    return seq, slot, memoryview(buf)[_TASK.size :].cast("q").tolist()


def encode_result(seq: int, strings: bytes, error: ErrorInfo | None) -> bytes:
    if error is None:
        return _RESULT.pack(seq, 0) + strings
    return _RESULT.pack(seq, 1) + json.dumps(error.to_json(), default=str).encode()


def decode_result(buf: bytes) -> Result:
    seq, is_error = _RESULT.unpack_from(buf)
    payload = buf[_RESULT.size :]
    if is_error:
        return seq, b"", ErrorInfo.from_json(json.loads(payload))
    return seq, payload, None


@dataclass(frozen=True)
class WorkerSpec:
    loader: str
    kind: str
    params: dict[str, Any]
    context: DatasetContext
    layout: dict[str, Any]
    ring_size: int
    slot_bytes: int
    seed: int


def worker_main(worker_id: int, conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    torch.set_num_threads(1)
    seed = spec.seed + worker_id
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        fd = reduction.recv_handle(conn)
        mm, base = map_ring(fd, spec.ring_size)
        os.close(fd)
        dataset = build_dataset(spec.kind, spec.params, spec.context)
        writer = SlotWriter(dataset, Layout.from_json(spec.layout), base, spec.slot_bytes)
    except BaseException as exc:
        conn.send_bytes(encode_result(-1, b"", error_info(exc)))
        return
    conn.send_bytes(encode_result(-1, b"", None))  # ready
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the server went away
        if task == _STOP:
            break
        seq, slot, indices = decode_task(task)
        try:
            result = encode_result(seq, writer.write(slot, indices), None)
        except Exception as exc:
            result = encode_result(seq, b"", error_info(exc))
        conn.send_bytes(result)
    writer.close()
    del base
    mm.close()


@dataclass
class _Worker:
    wid: int
    process: Any
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    outstanding: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    busy_s: float = 0.0
    started: dict[int, float] = field(default_factory=dict)


class WorkerPool:
    """Processes that fill slots; results go to ``on_result`` from one collector thread."""

    def __init__(
        self,
        spec: WorkerSpec,
        ring_fd: int,
        num_workers: int,
        on_result: Callable[[Result], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self._ring_fd = ring_fd
        self._ctx = mp.get_context("forkserver")
        self._on_result = on_result
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._retiring: list[_Worker] = []  # finish their tasks, then exit (a live shrink)
        self._retries: dict[int, int] = {}
        self._stop = threading.Event()
        self._next_id = 0
        self.restarts = 0
        self._workers.extend(self._spawn(num_workers))
        self._collector = threading.Thread(
            target=self._collect, name=f"pinfeed-collect-{spec.loader}", daemon=True
        )
        self._collector.start()

    @property
    def size(self) -> int:
        return len(self._workers)

    def _spawn(self, count: int = 1) -> list[_Worker]:
        """Start ``count`` workers together and wait (bounded) until each has mapped the
        ring and built its dataset; all or none."""
        started = []
        for _ in range(count):
            parent, child = self._ctx.Pipe(duplex=True)
            wid = self._next_id
            self._next_id += 1
            proc = self._ctx.Process(
                target=worker_main,
                args=(wid, child, self.spec),
                name=f"pinfeed-worker-{self.spec.loader}-{wid}",
                daemon=True,
            )
            proc.start()
            child.close()
            reduction.send_handle(parent, self._ring_fd, proc.pid)
            started.append(_Worker(wid, proc, parent))
        deadline = time.monotonic() + 120
        try:
            for w in started:
                if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"worker {w.wid} did not start within 120 s")
                _, _, error = decode_result(w.conn.recv_bytes())
                if error is not None:
                    raise RuntimeError(f"worker {w.wid} failed to start: {error.detail}")
        except BaseException:
            for w in started:
                w.process.kill()
                w.process.join(5)
                w.conn.close()
            raise
        return started

    def resize(self, num_workers: int) -> None:
        """Grow or shrink live: new workers take new tasks at once; removed ones first
        finish what they hold, so no batch is lost or produced twice."""
        if num_workers < 1:
            raise ValueError("a worker pool needs at least one worker")
        if len(self._workers) < num_workers:
            new = self._spawn(num_workers - len(self._workers))
            with self._lock:
                self._workers.extend(new)
        with self._lock:
            while len(self._workers) > num_workers:
                worker = min(self._workers, key=lambda w: len(w.outstanding))
                self._workers.remove(worker)
                self._retiring.append(worker)

    def _retire_idle(self) -> None:
        with self._lock:
            idle = [w for w in self._retiring if not w.outstanding]
            for w in idle:
                self._retiring.remove(w)
        for w in idle:
            self._send(w, _STOP)
            w.process.join(5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1)
            w.conn.close()

    def submit(self, seq: int, slot: int, indices: list[int]) -> None:
        self._give(None, seq, slot, indices)

    def _give(self, worker: _Worker | None, seq: int, slot: int, indices: list[int]) -> None:
        """Make the task ``worker``'s (the least loaded one's if None) and send it."""
        with self._lock:
            if worker is None:
                worker = min(self._workers, key=lambda w: len(w.outstanding))
            worker.outstanding[seq] = (slot, indices)
            worker.started.setdefault(seq, time.perf_counter())
        self._send(worker, encode_task(seq, slot, indices))

    def _send(self, worker: _Worker, message: bytes) -> None:
        try:
            with worker.send_lock:
                worker.conn.send_bytes(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the collector sees the death and re-sends the worker's tasks

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

    def _receive(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                seq, strings, error = decode_result(worker.conn.recv_bytes())
                with self._lock:
                    worker.outstanding.pop(seq, None)
                    t0 = worker.started.pop(seq, None)
                    if t0 is not None:
                        worker.busy_s += time.perf_counter() - t0
                    self._retries.pop(seq, None)
                self._on_result((seq, strings, error))
        except (EOFError, OSError):
            pass  # dead: its sentinel fires and _replace handles it

    def _replace(self, dead: _Worker) -> None:
        dead.process.join(1)
        code = dead.process.exitcode
        self._receive(dead)  # results it sent before dying
        self.restarts += 1
        with self._lock:
            retiring = dead in self._retiring
        log.warning(
            "loader %s: worker %d died (exit code %s)%s",
            self.spec.loader,
            dead.wid,
            code,
            "" if retiring else "; replacing it",
        )
        new: list[_Worker] = []
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
        with self._lock:
            (self._retiring if retiring else self._workers).remove(dead)
            self._workers.extend(new)
            target = new[0] if new else min(self._workers, key=lambda w: len(w.outstanding))
            tasks = sorted(dead.outstanding.items())
        dead.conn.close()
        for i, (seq, (slot, indices)) in enumerate(tasks):
            if i == 0:
                # Workers take tasks in order: only the oldest was being made when it
                # died. A task that keeps killing workers is a poison batch: it alone
                # comes back as an error; those queued behind it are simply re-sent.
                tries = self._retries.get(seq, 0) + 1
                self._retries[seq] = tries
                if tries > MAX_TASK_RETRIES:
                    died = SampleError(
                        f"worker died (exit code {code}) {tries} times producing "
                        f"the batch of indices {indices[:8]}...",
                        index=None,
                        error_type="WorkerDied",
                    )
                    self._on_result((seq, b"", died.info()))
                    continue
            self._give(target, seq, slot, indices)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._collector.join(timeout)
        everyone = self._workers + self._retiring
        for w in everyone:
            self._send(w, _STOP)
        deadline = time.monotonic() + timeout
        for w in everyone:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1)
            w.conn.close()
        self._workers.clear()
        self._retiring.clear()


def configure_forkserver(tmp_dir: Path) -> None:
    """Preload torch and the dataset kinds in the forkserver, and start it now, so the
    first loader with workers does not wait for it.

    multiprocessing keeps its listener in a ``pymp-*`` directory under the temp dir and
    removes it only at a clean exit; pointing the temp dir at ``tmp_dir`` (emptied at
    every start) keeps a SIGKILLed server from leaving those behind in /tmp.

    Called while the server has no other thread yet, the forkserver is forked from the
    server instead of started as a new interpreter: it (and every worker forked from
    it) then shares the server's pages of torch and the dataset kinds copy-on-write,
    instead of importing them again (about 170 MiB less per node). Later, with threads
    running, a fork would not be safe, so a forkserver that has to be restarted is a
    new interpreter, as multiprocessing does it.
    """
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True, mode=0o700)
    tempfile.tempdir = str(tmp_dir)
    try:
        mp.set_forkserver_preload(["pinfeed_server.engine.workers"])
    except Exception:  # pragma: no cover - older Pythons raise if already started
        log.debug("forkserver preload not set", exc_info=True)
    if threading.active_count() == 1 and sys.platform == "linux":
        gc.collect()  # no garbage to inherit: nothing the children hold is finalized there
        spawnv_passfds = mp_util.spawnv_passfds
        mp_util.spawnv_passfds = _fork_passfds  # used by ensure_running, for this call only
        try:
            forkserver.ensure_running()
        finally:
            mp_util.spawnv_passfds = spawnv_passfds
        log.debug("forkserver forked from the server")
        return
    threading.Thread(
        target=forkserver.ensure_running, name="pinfeed-forkserver", daemon=True
    ).start()


def _fork_passfds(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds``, but forked instead of exec'd: the child
    keeps only stdio and ``passfds``, gets default signal handling back, and runs the
    ``-c`` program it would have been started with (the forkserver's or the resource
    tracker's main loop)."""
    program = str(args[list(args).index("-c") + 1])
    keep = {0, 1, 2, *passfds}
    pid = os.fork()
    if pid != 0:
        return pid
    status = 1
    try:
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(name))
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        exec(program, {"__name__": "__pinfeed_forked__"})  # multiprocessing's own program
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)
