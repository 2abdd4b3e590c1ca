"""The bridge: a child process of the server that is the Ray driver of one loader.

Ray runs in this process, not in the server: a Ray driver whose cluster goes away
exits (or hangs in its client), and that must cost the loader, never the server. The
bridge maps the loader's ring (as a local worker does: segment 0 at start, later
segments as the pipe announces them, ``worker.receive_segment``), starts its actors
(``ray_actor.BatchActor``), sends batch ``i`` to actor ``i % num_workers`` with the
reseed it needs (``seeding.Streams``, as the pool does), gets each batch's bytes from
Ray's object store, copies them into the task's ring slot (the one host copy) and
reports the result over its pipe. The ring is reached through a ``SlotSpace`` (a slot
in whichever segment holds it), as a worker's writer reaches it.

Faults: a dead actor (its process killed, its node stopped) is replaced (Ray places
the new one on a live node; one placed on a node that is gone but not yet known dead
is started again) and its outstanding tasks are sent to the replacement in order,
reseeded; a batch lost with its node is made again. The head going away ends
the bridge: a watchdog probes the GCS and, when it stops answering, reports
``FATAL_TAG`` + the reason and exits; the server fails the loader and starts a new
bridge once the cluster answers again (``ray.py``).

Pipe: from the server ``TASK_TAG`` + task (``codec``), ``RESIZE_TAG`` + count,
``SEGMENT_TAG``/``DROP_TAG`` (a ring segment to map, its fd following, or to unmap),
``STOP``; to the server ``RESULT_TAG`` + result, ``RESTART_TAG`` (an actor replaced),
``FATAL_TAG`` + reason.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from pinfeed.errors import SampleError
from pinfeed_server.datasets import build_dataset
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import Result, Task, error_info, regroup
from pinfeed_server.engine.producers.codec import (
    DROP_TAG,
    FATAL_TAG,
    RESIZE_TAG,
    RESTART_TAG,
    RESULT_TAG,
    SEGMENT_TAG,
    STARTUP_SEQ,
    STOP,
    TASK_TAG,
    decode_count,
    decode_result,
    decode_task,
    encode_result,
)
from pinfeed_server.engine.producers.seeding import PlannedHistory, Streams
from pinfeed_server.engine.producers.worker import WorkerSpec, receive_segment
from pinfeed_server.engine.ring import SegmentInfo, SlotSpace, map_ring

log = logging.getLogger("pinfeed.ray")

START_TIMEOUT_S = 120.0  # actors to build their datasets (a cold Ray worker imports torch)
MAX_TASK_RETRIES = 2
SPAWN_TRIES = 3  # starts of one new actor whose process dies before it is ready
RESPAWN_PAUSE_S = 1.0  # before starting it again: the GCS to learn of a dead node
PROBE_EVERY_S = 1.0
WAIT_S = 0.02  # how long one ray.wait waits for a batch before it looks for new tasks
PROBE_FAILURES = 3  # consecutive unanswered probes of the GCS: the cluster is lost


@dataclass(frozen=True)
class BridgeSpec:
    """What the bridge is started with (pickled once)."""

    worker: WorkerSpec  # what each actor is built from
    config: LoaderConfig
    streams: int  # DataLoader's num_workers as created: the RNG streams (seeding.py)
    processes: int  # actors to start (a live PATCH or autotune changes it later)
    address: str
    endpoint: tuple[str, int]  # the GCS's host and port, for the watchdog


@dataclass
class _Actor:
    handle: Any
    pid: int
    outstanding: dict[int, Task] = field(default_factory=dict)  # seq -> task, in order


class Bridge:
    def __init__(self, conn: Connection, spec: BridgeSpec, space: SlotSpace) -> None:
        import ray

        from pinfeed_server.engine.producers.ray_actor import BatchActor

        self._ray = ray
        self._conn = conn
        self._spec = spec
        self._space = space  # the ring's slots, over every segment mapped here
        self._maps: dict[int, mmap.mmap] = {}  # segments after 0, by id
        self._slot_bytes = spec.worker.slot_bytes
        dataset = build_dataset(spec.worker.kind, spec.worker.params, spec.worker.context)
        self.streams = Streams(
            spec.config,
            spec.streams,
            PlannedHistory(spec.config, spec.streams, dataset, spec.worker.context.allowed_plugins),
            replay=spec.worker.snapshots,
        )
        # Any: Ray's ActorClass typing does not follow .options().remote()
        remote: Any = ray.remote(BatchActor)
        self._cls: Any = remote.options(
            num_cpus=spec.config.ray_num_cpus, max_restarts=0, max_concurrency=1
        )
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._pending: dict[Any, tuple[_Actor, Task]] = {}
        self._retries: dict[int, int] = {}
        self._retiring: list[_Actor] = []
        self._stop = threading.Event()
        self.actors: list[_Actor] = self._spawn(spec.processes)

    # -- actors ------------------------------------------------------------------------
    def _spawn(self, count: int) -> list[_Actor]:
        """Start ``count`` actors and wait until each is ready. One that dies before it
        ran, not by an exception in its ``__init__`` (Ray placed it on a node that is
        gone but not yet known dead: the GCS marks a node dead only after its health
        checks fail), is started again, on another node once Ray knows: at most
        SPAWN_TRIES starts of each, within START_TIMEOUT_S. An exception in the actor's ``__init__``
        (the dataset failed to build) is raised at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        handles: list[Any] = [self._cls.remote(self._spec.worker) for _ in range(count)]
        pids: list[int] = []
        tries = 1
        try:
            while (i := len(pids)) < count:
                h = handles[i]
                try:
                    left = max(deadline - time.monotonic(), 0.0)
                    pids.append(self._ray.get(h.ready.remote(), timeout=left))
                    tries = 1
                except self._ray.exceptions.RayActorError as exc:
                    if exc.actor_init_failed or tries >= SPAWN_TRIES:
                        raise
                    tries += 1
                    log.warning("a new actor died before it ran; starting another (%s)", exc)
                    with contextlib.suppress(Exception):
                        self._ray.kill(h)
                    time.sleep(RESPAWN_PAUSE_S)
                    handles[i] = self._cls.remote(self._spec.worker)
        except BaseException:
            for h in handles:
                with contextlib.suppress(Exception):
                    self._ray.kill(h)
            raise
        return [_Actor(h, pid) for h, pid in zip(handles, pids, strict=True)]

    def _actor_of(self, task: Task) -> _Actor:
        return self.actors[self.streams.worker_of(task.index) % len(self.actors)]

    def give(self, task: Task) -> None:
        """Send the task to its actor, reseeded where its RNG is not at this batch.
        Under the lock, so an actor's calls are submitted in ``streams``' order."""
        assert task.indices is not None
        with self._lock:
            actor = self._actor_of(task)
            reseed = self.streams.prepare(task.epoch, task.index, task.seq)
            ref = actor.handle.make.remote(task.seq, task.epoch, task.index, task.indices, reseed)
            actor.outstanding[task.seq] = task
            self._pending[ref] = (actor, task)

    def resize(self, n: int) -> None:
        new = self._spawn(n - len(self.actors)) if n > len(self.actors) else []
        with self._lock:
            regroup(self.actors, self._retiring, new, n, self.streams)

    def _replace(self, dead: _Actor, why: str) -> None:
        """An actor died: start another in its place and re-send its tasks in order."""
        with self._lock:
            if dead not in self.actors:
                if dead in self._retiring and not dead.outstanding:
                    self._retiring.remove(dead)
                return
        log.warning("actor pid %d lost (%s); replacing it", dead.pid, why)
        with contextlib.suppress(Exception):
            self._ray.kill(dead.handle)  # unavailable rather than dead: free its CPUs
        new = self._spawn(1)[0]
        self._send(RESTART_TAG)
        with self._lock:
            position = self.actors.index(dead)
            self.actors[position] = new
            for stream in range(position, self.streams.count, len(self.actors)):
                self.streams.forget(stream)
            tasks = sorted(dead.outstanding.items())
            dead.outstanding.clear()
            for ref in [r for r, (a, _) in self._pending.items() if a is dead]:
                del self._pending[ref]
            for i, (seq, task) in enumerate(tasks):
                if i == 0 and self._poisoned(seq, task):
                    continue
                self.give(task)

    def _poisoned(self, seq: int, task: Task) -> bool:
        """The oldest task of a dead actor was being made: one that kills actors
        repeatedly comes back as that batch's error."""
        tries = self._retries.get(seq, 0) + 1
        self._retries[seq] = tries
        if tries <= MAX_TASK_RETRIES:
            return False
        self.streams.poison(task.epoch, task.index)
        died = SampleError(
            f"a Ray actor died {tries} times producing the batch of indices "
            f"{(task.indices or [])[:8]}...",
            index=None,
            error_type="RuntimeError",
            error_module="builtins",
            reason="worker-died",
        )
        self._result(Result(seq, error=died.info()))
        return True

    # -- results -------------------------------------------------------------------------
    def _send(self, message: bytes) -> None:
        with self._send_lock:
            self._conn.send_bytes(message)

    def _result(self, result: Result) -> None:
        self._send(RESULT_TAG + encode_result(result))

    def _finish(self, ref: Any) -> None:
        with self._lock:
            entry = self._pending.pop(ref, None)
        if entry is None:
            return  # an actor already replaced
        actor, task = entry
        try:
            encoded, data, snapshot = self._ray.get(ref)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorDiedError) as exc:
            self._replace(actor, type(exc).__name__)
            return
        except self._ray.exceptions.RayError as exc:  # the batch's object lost with its node
            log.warning("batch %d lost (%s); making it again", task.seq, type(exc).__name__)
            with self._lock:
                actor.outstanding.pop(task.seq, None)
                self.streams.forget(self.streams.worker_of(task.index))
                if not self._poisoned(task.seq, task):
                    self.give(task)
            return
        result, _ = decode_result(encoded)
        if data is not None:
            start = task.slot * self._slot_bytes
            self._space[start : start + data.nbytes].numpy()[:] = data  # the one host copy
        del data  # let the object store free it
        with self._lock:
            actor.outstanding.pop(task.seq, None)
            self._retries.pop(task.seq, None)
            if snapshot is not None:
                self.streams.snapshot(task.epoch, task.index, snapshot, task.seq)
            done = [a for a in self._retiring if not a.outstanding]
            for a in done:
                self._retiring.remove(a)
        for a in done:
            self._ray.kill(a.handle)
        self._result(result)

    def maps(self) -> list[mmap.mmap]:
        return list(self._maps.values())

    # -- loops ---------------------------------------------------------------------------
    def _read(self) -> None:
        """The server's messages, in order, from this thread."""
        try:
            while not self._stop.is_set():
                message = self._conn.recv_bytes()
                if message == STOP:
                    break
                if message[:1] == RESIZE_TAG:
                    self.resize(decode_count(message))
                elif message[:1] in (SEGMENT_TAG, DROP_TAG):
                    # Before any task into a new segment; a dropped one has no slot in use.
                    receive_segment(message, self._conn, self._space, self._maps)
                elif message[:1] == TASK_TAG:
                    self.give(decode_task(message[1:]))
        except (EOFError, OSError):
            pass  # the server went away
        except Exception as exc:
            self._fatal(f"the Ray bridge failed: {type(exc).__name__}: {exc}")
        self._stop.set()

    def _watch(self) -> None:
        """End the bridge when the head stops answering (a driver without its GCS
        would otherwise hang, then exit at Ray's own, much later, timeout)."""
        failures = 0
        while not self._stop.wait(PROBE_EVERY_S):
            try:
                socket.create_connection(self._spec.endpoint, timeout=PROBE_EVERY_S).close()
                failures = 0
            except OSError as exc:
                failures += 1
                if failures >= PROBE_FAILURES:
                    self._fatal(f"the Ray head at {self._spec.address} stopped answering ({exc})")

    def _fatal(self, reason: str) -> None:
        try:
            self._send(FATAL_TAG + reason.encode())
        finally:
            os._exit(3)  # Ray's threads cannot be joined reliably without their cluster

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._read, name="pinfeed-ray-read", daemon=True),
            threading.Thread(target=self._watch, name="pinfeed-ray-watch", daemon=True),
        ]
        for t in threads:
            t.start()
        while not self._stop.is_set():
            with self._lock:
                refs = list(self._pending)
            if not refs:
                self._stop.wait(WAIT_S)
                continue
            # ray.wait, not ObjectRef.future(): only a wait (or get) pulls a batch held
            # in another node's object store to this one. Tasks given meanwhile join the
            # next wait, WAIT_S later at most.
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=WAIT_S, fetch_local=True)
            for ref in ready:
                try:
                    self._finish(ref)
                except Exception as exc:  # a replacement that cannot start: no capacity
                    self._fatal(f"a lost Ray actor could not be replaced: {exc}")
        with self._lock:
            actors = self.actors + self._retiring
        for a in actors:
            self._ray.kill(a.handle)


def local_ip(endpoint: tuple[str, int]) -> str:
    """The address this host uses toward the head (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in endpoint[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(endpoint)
        return str(s.getsockname()[0])


def bridge_main(conn: Connection, spec: BridgeSpec) -> None:
    """Entry point of the bridge process."""
    fd = reduction.recv_handle(conn)
    mm, base = map_ring(fd, spec.worker.ring_size)
    os.close(fd)
    space = SlotSpace(spec.worker.slot_bytes)
    space.add(SegmentInfo(0, 0, spec.worker.ring_size // spec.worker.slot_bytes), base)
    try:
        import ray

        ray.init(
            address=spec.address,
            # This node's address as the cluster sees it, so that the driver joins the
            # Ray node of this machine and actors reach it; Ray's own guess probes the
            # internet and may pick another node's raylet.
            _node_ip_address=local_ip(spec.endpoint),
            namespace="pinfeed",
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=True,
        )
        bridge = Bridge(conn, spec, space)
    except BaseException as exc:
        conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ, error=error_info(exc))))
        os._exit(2)
    conn.send_bytes(RESULT_TAG + encode_result(Result(STARTUP_SEQ)))
    t0 = time.monotonic()
    bridge.run()
    log.info("bridge done after %.0f s", time.monotonic() - t0)
    ray.shutdown()
    del base
    space.parts = ()
    for m in [mm, *bridge.maps()]:
        with contextlib.suppress(BufferError):
            m.close()
