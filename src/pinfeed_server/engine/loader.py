"""One loader: batch plan -> producer -> in-order publisher -> consumers.

The plan (``sampler.py``) says which batch comes next; a producer (``producers/``:
in-process, worker pool, ...) makes it into a free ring slot; the publisher
(``publisher.py``) hands results to the consumers (``consumers.py``) in plan order,
with an END marker after each epoch. The engine does not know which producer it has.

Prefetch starts when the loader is created and runs on across epoch boundaries,
bounded only by free ring slots. ``seek`` (set_epoch, resume) moves production to any
(epoch, index): work for the old position is discarded by sequence number, never
published. ``resume`` (a trainer's ``load_state_dict``) also changes the plan when the
state is of another world size: one epoch becomes this rank's share of what the old
ranks left (``pinfeed.elastic``), kept through ``keep`` (the registry) across a server
restart.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from pinfeed import elastic
from pinfeed.errors import (
    Conflict,
    GroupMemberLost,
    InsufficientMemory,
    InvalidPosition,
    InvalidState,
    LoaderBusy,
    LoaderFailed,
    NotFound,
    PinfeedError,
    ServerUnavailable,
)
from pinfeed.payload import Chain
from pinfeed.protocol import ErrorInfo, align
from pinfeed_server.datasets import DatasetContext, Kind
from pinfeed_server.engine.autotune import Sample, Tuner
from pinfeed_server.engine.collate import Layout, layout_bytes, with_rows
from pinfeed_server.engine.config import (
    LiveChange,
    LoaderCode,
    LoaderConfig,
    prefetch_depth,
    ring_slots,
    streams_of,
)
from pinfeed_server.engine.consumers import BatchItem, Consumers, EndItem, ErrorItem, Item
from pinfeed_server.engine.custom_sampler import oversize
from pinfeed_server.engine.fed_plan import FedPlan, Pending
from pinfeed_server.engine.fetching import fetching_for
from pinfeed_server.engine.iterable import MAX_TURN, IterablePlan, is_iterable, plan_len
from pinfeed_server.engine.mixture import served_by
from pinfeed_server.engine.producer_handle import ProducerHandle
from pinfeed_server.engine.producers import (
    Executor,
    ProcessFactory,
    ProducerContext,
    Result,
    Task,
)
from pinfeed_server.engine.producers.base import error_info
from pinfeed_server.engine.producers.seeding import History, history_of
from pinfeed_server.engine.publisher import Publisher
from pinfeed_server.engine.resizer import RingResizer
from pinfeed_server.engine.ring import Ring, SlotState, SlotTable
from pinfeed_server.engine.sampler import BatchPlan, ElasticEpoch, EpochSampler, with_last
from pinfeed_server.engine.stats import LoaderStats, StatsSnapshot
from pinfeed_server.engine.status import LoaderState, LoaderStatus, MemberStatus, SlotCounts
from pinfeed_server.metric import built

log = logging.getLogger("pinfeed.loader")

__all__ = ["Admit", "BatchItem", "EndItem", "ErrorItem", "Item", "LoaderConfig", "LoaderEngine"]

# The node's admission of a configuration (``node/budget.py``): raises a domain error.
# Called with the new config, the ring bytes it will hold and the node workers it takes.
Admit = Callable[[LoaderConfig, int, int], None]
# Where a loader's elastic epoch is kept (the registry): its record's JSON, or None.
Keep = Callable[[dict[str, Any] | None], None]

PRODUCER_THREAD = "pinfeed-produce-"
# GET .../batches/{epoch}/{index} draws at most this many samples' worth of epochs to
# reach the one asked for (``History.walk_samples``): about 5 s on 2 cores. Further is
# refused, where it held an HTTP thread and a core for hours (epoch 2**31 - 1 of a
# shuffled loader was a valid request).
LOOKUP_WALK_MAX = 200_000_000
# The most batches a session's ``drive`` makes before it looks at its socket again.
DRIVE_MAX = 64
# A production step (``LoaderEngine._production``): True, a batch handed to the producer;
# else what the step waits for, to call with a timeout (a thread that may block: the
# producer thread) or to leave (a trainer's session, back to its socket).
Wait = Callable[[float], object]
Step = Literal[True] | Wait


def _at_once(timeout: float) -> None:
    """Wait for nothing: a step that yields only to let its runner look elsewhere."""


@dataclass(frozen=True)
class Sizing:
    """How a loader created without a layout gets its ring: sized from its first batches,
    as they are made (``pinfeed.DataLoader``'s: no sample is read before the trainer's
    loop asks for one, and where it has workers, only in them). ``admit``: the node's
    admission of the ring (its domain error fails the loader, which the trainer hears);
    ``cap()``: the most bytes a slot of a per-batch layout (a ``collate_fn``'s) may take.
    Such a loader has DataLoader's rule on sizes too: a batch larger than the slots goes
    into a buffer of its own, never an error (``collate.SlotWriter``'s ``own``)."""

    admit: Admit
    cap: Callable[[], int]


class LoaderEngine:
    """States: starting -> ready | failed (-> ready again, when its producer recovers);
    draining -> closed when deleted."""

    def __init__(
        self,
        config: LoaderConfig,
        dataset: Any,
        kind: Kind[Any],
        params: dict[str, Any],
        context: DatasetContext,
        layout: Layout | None,
        plan: BatchPlan,
        code: LoaderCode,
        executor: Executor,
        spawn: Callable[[], ProcessFactory] | None = None,
        resumed: dict[str, Any] | None = None,
        keep: Keep | None = None,
        *,
        sizing: Sizing | None = None,
        iterable: bool | None = None,
        objects: Chain | None = None,
        streams: int | None = None,
    ) -> None:
        """``plan``: the batch plan the ring was sized with (``prepare.py``: a custom
        sampler's first epoch is iterated once, at creation); ``code``: its collate_fn
        and worker_init_fn; ``spawn``: how the executor forks local processes (the
        dataset's zygote); ``resumed``: the elastic epoch it had (the registry's, after
        a server restart); ``keep``: where a new one is recorded. ``layout`` None: the
        ring is sized from the first batches (``sizing``). ``dataset`` may be None where
        this process must not hold the trainer's objects (they run only in its workers):
        then ``iterable`` says what it is. ``objects``: a trainer's loader's, the payloads
        its objects need (the engine owns them), as they change (``objects_changed``).
        ``streams``: DataLoader's ``num_workers`` where it is more than the processes
        ``config`` runs (a trainer's loader on a node short of worker processes: one
        process serves several workers' RNG streams, as a pool shrunk live does)."""
        if (layout is None) != (sizing is not None):
            raise ValueError("a loader without a layout is sized from its first batches")
        self.config = config
        self.dataset = dataset
        self.layout = layout
        self.sizing = sizing
        self._grown = False  # the ring grew for a trainer that held every slot (relieve)
        self.objects = objects
        self._objects_from: int | None = None  # the epoch the trainer's last OBJECTS applies from
        self.sampler = plan
        self.iterable = is_iterable(dataset) if iterable is None else iterable
        self.batches_per_epoch = plan_len(plan)  # DataLoader's len(), or None
        self._turns = MAX_TURN if isinstance(plan, IterablePlan) else len(plan)  # seek's bound
        # DataLoader's num_workers as created: the RNG streams, whatever number of
        # processes the loader runs later (config.num_workers).
        self.streams = streams_of(config) if streams is None else streams
        self.state: LoaderState = "starting"
        self.failure: ErrorInfo | None = None
        self.stats = LoaderStats()
        self.tuner = self._tuner_for(config)
        self.nslots = ring_slots(config, sizing is not None)  # segment 0's (as created)
        self.ring: Ring | None = None
        self.resizer: RingResizer | None = None
        self._source = (kind, params, context)
        self.code = code
        self.producer = ProducerHandle(executor, self._producer_context, spawn)
        self._reconfigure = threading.Lock()  # one live change or ring upkeep at a time
        self.slots = SlotTable(self.nslots)
        self.slots.set_limit(prefetch_depth(config))
        self.consumers = Consumers(config.group_size, config.group_mode, self.slots)
        self.consumers.by_arrival = self.iterable
        self._stop = threading.Event()
        self._cond = threading.Condition()
        # The production steps (``_production``), run by one thread at a time: the
        # producer thread, or a trainer's session (``drive``); ``_wake`` brings the
        # producer thread back when a session no longer makes the batches.
        self._stepping = threading.Lock()
        self._steps: Iterator[Step] = iter(())
        self._wake = threading.Event()
        self._driver: int | None = None  # the member attached with drives=True
        self.publisher = Publisher(
            config.name,
            self.consumers,
            self.slots,
            self.stats,
            0 if layout is None else layout.slot_bytes,
            config.on_error,
        )
        self._gen = 0  # bumped by seek: the producer restarts at _cursor
        self._cursor = (0, 0)  # (epoch, index) the producer makes next
        self.cuda_registered: set[int] = set()
        self._threads: list[threading.Thread] = []
        # member -> when the NEXT it waits on found no batch (monotonic); the node
        # arbiter counts these waits before the trainer reports them
        self._pending: dict[int, float] = {}
        self.spawn = spawn
        self._keep = keep
        self._history: History | None = None  # the batch lookup's (HTTP, replay)
        self._history_lock = threading.Lock()
        # a dataset in an object store: its batches wait for their objects (fetching.py)
        self.fetching = fetching_for(config.name, dataset, context.remote, plan, config.batch_size)
        # a mixture's per-source counts (engine/mixture.py)
        self.served = None if config.mixture is None else served_by(config.mixture, dataset)
        if resumed is not None:
            self._restore(resumed)

    def _restore(self, record: dict[str, Any]) -> None:
        """The elastic epoch the registry kept; one that no longer fits is dropped."""
        plan = self.sampler
        try:
            parsed = elastic.Elastic.from_json(record)
            if not isinstance(plan, EpochSampler) or plan.plan() is None or parsed is None:
                raise InvalidState("the loader's plan is not a distributed one")
            plan.resume(plan.resumed(parsed), since=0)
        except InvalidState as exc:
            log.warning("loader %s: its elastic epoch is dropped: %s", self.config.name, exc)

    @property
    def source(self) -> tuple[Kind[Any], dict[str, Any], DatasetContext]:
        """The dataset's kind and params, and the datasets' context: what a producer
        elsewhere (a worker process, a replay) rebuilds the dataset from."""
        return self._source

    def _producer_context(self, processes: int) -> ProducerContext:
        kind, params, context = self._source
        return ProducerContext(
            self.config,
            self.streams,
            processes,
            kind,
            params,
            context,
            self.dataset,
            self.sampler,
            self.code,
            self.layout,
            self.ring,
            self._on_result,
            self._fail,
            self._recovered,
            iterable=self.iterable,
            own=self.sizing is not None,
            objects=self._current_objects(),
        )

    def _current_objects(self) -> tuple[int, list[int], list[int]] | None:
        """A trainer's objects where they changed since the loader was made: the epoch
        they apply from, their payloads and the shared memory they map (what a new
        producer starts with)."""
        if self.objects is None or self._objects_from is None:
            return None
        return self._objects_from, self.objects.fds, self.objects.shared

    def objects_changed(self, epoch: int, fd: int, shared: list[int]) -> None:
        """A pinfeed.DataLoader's objects as its trainer has them at ``epoch``'s start
        (an OBJECTS: they changed; payload memfd ``fd`` and the ``shared`` memory they
        map, which the engine owns from now): the batches of that epoch on are made with
        them, as DataLoader hands its workers the objects as they are at ``iter()``."""
        if self.objects is None:
            for f in (fd, *shared):
                os.close(f)
            raise ValueError(f"loader {self.config.name!r} has no trainer's objects")
        with self._reconfigure:  # not while a producer is swapped for another
            self.objects.add(fd, shared)
            self._objects_from = epoch
            self.producer.objects(epoch, self.objects.fds, self.objects.shared)

    @staticmethod
    def _tuner_for(config: LoaderConfig) -> Tuner | None:
        spec = config.autotune
        return Tuner(spec, config.num_workers, config.prefetch_factor) if spec else None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        t = threading.Thread(
            target=self._boot, name=f"pinfeed-boot-{self.config.name}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def _boot(self) -> None:
        try:
            # Under the reconfigure lock: a live change made while starting waits, then
            # applies to the ring and producer made here from the config it changed.
            with self._reconfigure:
                if self.layout is not None:
                    self._make_ring(self.layout)
                self.producer.start(self.config.num_workers)
        except Exception as exc:
            log.exception("loader %s failed to start", self.config.name)
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        with self._cond:
            if self.state == "starting":
                self.state = "ready"
            self._cond.notify_all()
        self._start_producing()

    def _make_ring(self, layout: Layout) -> Ring:
        """The loader's ring for ``layout``, with the slots its config wants (under
        ``_reconfigure``)."""
        ring = Ring(self.config.name, self.nslots, layout.slot_bytes)
        self.resizer = RingResizer(ring, self.slots)
        self.ring = ring
        if self._ring_slots(self.config) != self.nslots:
            self.resizer.retarget(self._ring_slots(self.config))
        return ring

    def _size_ring(self, proposal: Layout) -> None:
        """A loader sized from its first batches: its ring, from the layout the first
        batch made proposes (for the most rows fed so far, a per-batch layout's slot
        capped by the node's memory), admitted by the node, then handed to the producer.
        Where the node refuses it the loader fails, and its trainer hears why."""
        assert self.sizing is not None
        with self._reconfigure:
            if self.ring is not None or self._stop.is_set():
                return
            plan = self.sampler
            rows = max(proposal.batch_size, plan.largest if isinstance(plan, FedPlan) else 0)
            layout = with_rows(proposal, rows)
            if layout.per_batch:
                first = layout_bytes(layout)
                capped = max(first, min(layout.slot_bytes, self.sizing.cap()))
                layout = replace(layout, slot_bytes=align(max(capped, 64)))
            try:
                self.sizing.admit(
                    self.config,
                    self._ring_slots(self.config) * layout.slot_bytes,
                    self.node_workers,
                )
                # The layout first: a session that sees the ring sends it with it.
                self.layout = layout
                ring = self._make_ring(layout)
            except (PinfeedError, OSError) as exc:
                detail = exc.detail if isinstance(exc, PinfeedError) else str(exc)
                log.warning("loader %s: its ring cannot be made: %s", self.config.name, detail)
                self._fail(detail)
                return
            self.publisher.slot_bytes = layout.slot_bytes
            self.producer.ring_ready(ring, layout)
        log.info(
            "loader %s: ring sized from its first batch: %d slots of %d bytes",
            self.config.name,
            ring.nslots,
            layout.slot_bytes,
        )

    def _start_producing(self) -> None:
        with self._stepping:
            self._end_steps()
            self._steps = self._production()
        thread = threading.Thread(
            target=self._produce, name=PRODUCER_THREAD + self.config.name, daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _fail(self, detail: str) -> None:
        with self._cond:
            self.state = "failed"
            self.failure = LoaderFailed(detail).info()
            self._cond.notify_all()
        self._stop.set()

    def _recovered(self) -> None:
        """The producer that failed the loader can make batches again (a remote
        backend came back): ``failed`` -> ``ready``, producing from where production
        stopped. The producer re-sends the tasks it held itself."""
        for t in [t for t in self._threads if t.name.startswith(PRODUCER_THREAD)]:
            t.join(10)  # it saw the stop event and ends
        with self._cond:
            if self.state != "failed":
                return  # deleted meanwhile, or never failed
            self.state, self.failure = "ready", None
            self._stop.clear()
            self._threads = [t for t in self._threads if t.is_alive()]
            self._cond.notify_all()
        self._start_producing()

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.state == "starting":
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"loader {self.config.name} still starting after {timeout}s")
                self._cond.wait(min(left, 0.5))

    def stop(self) -> None:
        """Stop producing (idempotent); consumers get 'stopping' once the queue is empty."""
        with self._cond:
            if self.state not in ("draining", "closed"):
                self.state = "draining"
            self._cond.notify_all()
        self._stop.set()
        self._wake.set()  # a parked producer thread ends now
        if isinstance(self.sampler, FedPlan):
            self.sampler.interrupt()
        with self.slots.cond:
            self.slots.cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self.state == "closed":
                return
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(10)
        stepping = self._stepping.acquire(timeout=10)  # a session's drive ends first
        try:
            if stepping:  # else a step still runs (a batch stuck in its making)
                self._end_steps()
            self.producer.close()
        finally:
            if stepping:
                self._stepping.release()
        if self.fetching is not None:
            self.fetching.close()
        if self.ring is not None:
            self.ring.close()
        if self.objects is not None:
            self.objects.close()
        with self._cond:
            self.state = "closed"
            self._cond.notify_all()

    # -- producer ----------------------------------------------------------------------
    def _produce(self) -> None:
        """The producer thread: runs the production steps, except while a trainer's
        session makes the batches itself (``drive``)."""
        try:
            while not self._stop.is_set():
                if self._session_makes():
                    self._wake.wait(0.5)  # until it no longer does (detach, a swap)
                    self._wake.clear()
                    continue
                with self._stepping:
                    step = next(self._steps, None)
                if step is None:
                    return  # stopped
                if step is not True:
                    step(0.5)  # for a free slot, or the trainer's FEED or RNG states
        except Exception as exc:  # a bug here must reach the consumer, not vanish
            log.exception("loader %s: producer failed", self.config.name)
            self._fail(f"producer failed: {type(exc).__name__}: {exc}")

    def _session_makes(self) -> bool:
        """Whether the production steps run in the session thread of the loader's one
        trainer (``drive``) rather than in the producer thread: where nothing but that
        trainer frees a slot or feeds the plan (one consumer, attached, which drives)
        and no step blocks (not an object store's fetching, whose steps wait for
        objects; a trainer-fed plan's steps yield what they wait for, the trainer's FEED
        or RNG states, which come on that session's socket). Then the slot a trainer
        hands back is filled again without waking another thread: without workers the
        session makes the batch itself (``inline.py`` makes it in ``submit``'s caller);
        with workers it hands the task to a worker (``submit`` never waits on the
        making). On 2 cores each hand-over between two of the server's threads cost
        about 40 us, and a batch took two without workers, one with."""
        return (
            self._driver is not None
            and self.consumers.size == 1
            and self.consumers.attached == 1
            and self.fetching is None
        )

    def drive(self) -> None:
        """Run the production steps into the free slots in the calling thread: a
        trainer's session, before it waits for its next message or item, where
        ``_session_makes``. Returns once no slot is free (or after ``DRIVE_MAX``
        batches); at once where another thread runs them."""
        if not self._session_makes() or not self._stepping.acquire(blocking=False):
            return
        try:
            for _ in range(DRIVE_MAX):
                if next(self._steps, None) is not True:
                    return
        except Exception as exc:  # as in the producer thread: the loader fails
            log.exception("loader %s: producer failed", self.config.name)
            self._fail(f"producer failed: {type(exc).__name__}: {exc}")
        finally:
            self._stepping.release()

    def _end_steps(self) -> None:
        """Close the production steps (under ``_stepping``): a generator left at a yield
        holds its epoch's order (16 MB at 2 M samples) and, through the engine, itself,
        a cycle that only the garbage collector would have freed."""
        steps, self._steps = self._steps, iter(())
        if isinstance(steps, Generator):
            steps.close()

    def _production(self) -> Iterator[Step]:
        """The producer's work as steps, for whichever thread runs them (under
        ``_stepping``): True after each batch handed to the producer, else what it waits
        for (``Step``: a free slot, the trainer's FEED or RNG states), which its runner
        waits for or leaves to the trainer's next message; it ends once the loader
        stops."""
        while not self._stop.is_set():
            with self._cond:
                gen, (epoch, index) = self._gen, self._cursor
            yield from self._produce_from(gen, epoch, index)

    def _free_slot(self) -> Generator[Step, None, int | None]:
        """A free slot marked filling, yielding the wait for one while there is none;
        None once the loader stops."""
        while not self._stop.is_set():
            slot = self.slots.try_acquire()
            if slot is not None:
                return slot
            yield self._room
        return None

    def _room(self, timeout: float) -> None:
        self.slots.wait_for_room(self._stop, timeout)

    def _produce_from(self, gen: int, epoch: int, index: int) -> Iterator[Step]:
        """Produce from (epoch, index) on until a seek (new generation) or stop."""
        plan = self.sampler
        fed = plan if isinstance(plan, FedPlan) else None
        index = max(index, plan.span(epoch)[0])  # an elastic epoch starts at its first
        if self.fetching is not None:
            self.fetching.start(epoch, index)
        while not self._stop.is_set():
            # A trainer-fed epoch's end is known only once its sampler ran out, after its
            # last batch was fed: no look-ahead, an END of its own follows (_end_fed).
            items: Iterator[tuple[int, list[int] | None, bool] | Pending]
            if fed is None:
                items = with_last(plan.batches(epoch, index), index)
            else:
                items = self._fed_items(fed, epoch, index)
            empty = True
            for item in items:
                if isinstance(item, Pending):  # its FEED: from the trainer's next message
                    yield item.wait
                    continue
                i, indices, last = item
                empty = False
                slot = yield from self._free_slot()
                if slot is None:
                    return
                with self._cond:
                    if self._gen != gen:
                        self.slots.move(slot, SlotState.FILLING, SlotState.FREE)
                        return
                    rows = 0 if indices is None else len(indices)
                    seq = self.publisher.add(epoch, i, slot, rows, last)
                    self._cursor = (epoch, i + 1)
                if self.served is not None and indices is not None:
                    self.served.planned(epoch, i, indices)
                if self.sizing is None and self.layout is not None:
                    error = oversize(indices, self.layout.batch_size)
                    if error is not None:  # a batch_sampler's batch larger than the slots
                        self._on_result(Result(seq, error=error))
                        continue
                if self.fetching is not None:
                    try:
                        self.fetching.gate(seq, epoch, i, indices)
                    except Exception as exc:  # the store's error is the batch's
                        self._on_result(Result(seq, error=error_info(exc)))
                        continue
                seed = shared = None
                if fed is not None:
                    seed, shared = fed.base_seed(epoch), fed.shared_seed(epoch)
                task = Task(seq, epoch, i, slot, indices, seed, shared)
                states = None if fed is None else fed.states_pending(epoch, i)
                if states is not None:  # fed ahead of the trainer's RNG states
                    self.producer.prepare(task)  # made on a guess meanwhile (inline.py)
                    while not states.done():
                        yield states.wait
                    with self._cond:
                        moved = self._gen != gen
                    if moved or self._stop.is_set():  # a seek or stop came first
                        self._on_result(Result(seq, rows=0))
                        return
                self.producer.submit(task)
                yield True
            if fed is not None and not (yield from self._end_fed(gen, epoch)):
                return
            epoch, index = epoch + 1, plan.span(epoch + 1)[0]
            with self._cond:
                if self._gen != gen:
                    return
                self._cursor = (epoch, index)
            if empty:  # an epoch without batches (a sampler's): a trainer's session goes
                yield _at_once  # back to its socket rather than run through such epochs

    def _end_fed(self, gen: int, epoch: int) -> Generator[Step, None, bool]:
        """The trainer's sampler ran out: the epoch's END, after its batches (an END
        result of its own, published in order). False if a seek or stop came first."""
        slot = yield from self._free_slot()
        if slot is None:
            return False
        with self._cond:
            if self._gen != gen:
                self.slots.move(slot, SlotState.FILLING, SlotState.FREE)
                return False
            seq = self.publisher.add(epoch, self._cursor[1], slot, 0, False)
        self._on_result(Result(seq, end=True))
        return True

    @staticmethod
    def _fed_items(
        fed: FedPlan, epoch: int, index: int
    ) -> Iterator[tuple[int, list[int] | None, bool] | Pending]:
        """A trainer-fed epoch's ``(index, indices, False)`` from ``index`` on, or a
        ``Pending`` where the next has not been fed (the step yields it: it must not
        block)."""
        for got in fed.arrivals(epoch, index):
            if isinstance(got, Pending):
                yield got
                continue
            yield index, got, False
            index += 1

    # -- publisher -----------------------------------------------------------------------
    def _on_result(self, result: Result) -> None:
        """A producer's result, from any thread, in any order: publish in sampler order."""
        if self.fetching is not None:
            self.fetching.release(result.seq)
        if result.proposal is not None and self.ring is None:
            self._size_ring(result.proposal)
        with self._cond:
            ended = self.publisher.accept(result)
            if ended is not None and self._cursor[0] <= ended:
                # An iterator ran out before the plan did: produce the next epoch.
                self._move_to(ended + 1, 0)
            self._cond.notify_all()

    def _move_to(self, epoch: int, index: int) -> None:
        """Production goes on at (epoch, index): a new generation (under ``self._cond``)."""
        self._gen += 1
        self._cursor = (epoch, index)
        if self.served is not None:
            self.served.forget()  # batches made ahead of a seek are made again
        if isinstance(self.sampler, FedPlan):
            self.sampler.interrupt()  # the producer may be waiting for the trainer's feed

    def _position(self, epoch: int, index: int) -> tuple[int, int]:
        """(epoch, index) as a seek takes it: in an elastic epoch, a batch before its
        first is its first; InvalidPosition outside the epoch."""
        first, end = self.sampler.span(epoch) if 0 <= epoch < 2**31 else (0, None)
        bound = self._turns if end is None else end
        if not (0 <= index < bound and 0 <= epoch < 2**31):
            raise InvalidPosition(
                f"position ({epoch}, {index}) is outside the loader's {bound} batches in that epoch"
            )
        return epoch, max(index, first)

    def seek(self, member: int, epoch: int, index: int) -> None:
        """Make (epoch, index) the next batch; keep the warm queue if it already is."""
        epoch, index = self._position(epoch, index)
        with self._cond:
            if self.consumers.position(member, self.publisher.head) == (epoch, index):
                return
            self._seek_locked(epoch, index)
        self.upkeep()
        log.info("loader %s: seek to epoch %d batch %d", self.config.name, epoch, index)

    def _seek_locked(self, epoch: int, index: int) -> None:
        """The body of ``seek``, under ``self._cond``."""
        self._move_to(epoch, index)
        self.publisher.restart(epoch, index)
        self._cond.notify_all()

    def resume(self, member: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load a trainer's ``state_dict`` (version 2, ``pinfeed.elastic``): go on from
        its position, or, for a state of another world size or batch size, make the
        rest of its epoch this rank's share of what the old ranks left. Returns the
        RESUMED reply: the position, and the elastic epoch it is in (or None).
        ``InvalidState`` if the state does not fit this loader."""
        plan = self.sampler
        config = self.config
        distributed = isinstance(plan, EpochSampler) and plan.plan() is not None
        target = elastic.Target(
            plan.plan() if isinstance(plan, EpochSampler) else None,
            config.rank,
            config.world_size,
            config.batch_size,
            self.streams,
        )
        resumed = elastic.resume(state, target)
        record = resumed.elastic
        if record is not None and not distributed:
            raise InvalidState("only a distributed plan has elastic epochs")
        current = plan.elastic if isinstance(plan, EpochSampler) else None
        changed = (current.record if current is not None else None) != record
        new: ElasticEpoch | None = current
        if changed and isinstance(plan, EpochSampler):
            new = None if record is None else plan.resumed(record)  # outside the lock: O(n)
        with self._cond:
            if changed and isinstance(plan, EpochSampler):
                plan.resume(new, since=self.publisher.next_seq)
            epoch, index = self._position(resumed.epoch, resumed.index)
            if changed or self.consumers.position(member, self.publisher.head) != (epoch, index):
                # A changed plan: what was made ahead was made from the old one.
                self._seek_locked(epoch, index)
        if changed and self._keep is not None:
            self._keep(None if record is None else record.to_json())
        self.upkeep()
        log.info(
            "loader %s: resumed at epoch %d batch %d%s",
            config.name,
            epoch,
            index,
            ""
            if new is None
            else f" (elastic epoch {new.epoch}: batches {new.start}..{new.end - 1})",
        )
        return {"epoch": epoch, "index": index, "elastic": None if new is None else new.to_json()}

    def elastic_epoch(self) -> dict[str, Any] | None:
        """The elastic epoch a trainer is told of at attach (with its end), or None."""
        plan = self.sampler
        e = plan.elastic if isinstance(plan, EpochSampler) else None
        return None if e is None else e.to_json()

    def history(self) -> History:
        """The plan's history for lookups and replays: a private copy of the plan (the
        engine's own iteration is not disturbed) that follows its elastic epoch."""
        with self._history_lock:
            if self._history is None:
                context = self._source[2]
                self._history = history_of(
                    self.config, self.streams, self.sampler, self.dataset, context.allowed_plugins
                )
            return self._history

    def batch_indices(self, epoch: int, index: int) -> list[int]:
        """The sample indices of batch ``index`` of ``epoch``; NotFound if there is no
        such batch (outside the epoch, an IterableDataset's, a trainer-fed epoch that is
        not kept)."""
        if self.iterable:
            raise NotFound(
                f"loader {self.config.name!r} iterates an IterableDataset: its batches "
                "have no sample indices"
            )
        if not 0 <= epoch < 2**31:
            raise NotFound(f"no epoch {epoch}")
        history = self.history()
        with self._history_lock:  # one lookup at a time: the plan copy is not shared
            walk = history.walk_samples(epoch)
            if walk > LOOKUP_WALK_MAX:
                raise NotFound(
                    f"loader {self.config.name!r}: epoch {epoch}'s order follows from the "
                    "epochs before it, as DataLoader's generator draws them, and a lookup "
                    f"draws at most {LOOKUP_WALK_MAX:,} samples' worth of them; it would "
                    f"draw {walk:,} from the epoch looked up last (or from epoch 0, going "
                    "back): look up epochs on the way first, each within reach of the last"
                )
            batches = history.batches(epoch)
        indices = batches[index] if 0 <= index < len(batches) else None
        if indices is None:
            first = next((i for i, b in enumerate(batches) if b is not None), len(batches))
            raise NotFound(
                f"loader {self.config.name!r} has no batch {index} in epoch {epoch} "
                f"(its batches there: {first}..{len(batches) - 1})"
            )
        return list(indices)

    def worker_of(self, index: int) -> int | None:
        """DataLoader's worker that makes batch ``index`` (None: the main process)."""
        return index % self.streams if self.streams else None

    def skip_epoch(self, member: int) -> EndItem | None:
        """Abandon the rest of the member's epoch (its trainer broke out of the loop):
        the next item is the next epoch's first batch, and what was produced or is in
        flight for this one is dropped, not waited for. Returns the epoch's END, or None
        where the rest must be drained instead: a group (the other members still want
        those batches), or a member already at the epoch's end."""
        with self._cond:
            if self.consumers.size != 1:
                return None
            epoch, index = self.consumers.position(member, self.publisher.head)
            if index == 0:
                return None
            self._seek_locked(epoch + 1, 0)
            return EndItem(epoch, max(0, self.publisher.next_publish - 1))

    # -- a trainer-fed plan (pinfeed.DataLoader: its sampler runs in the trainer) -------
    def _fed(self) -> FedPlan:
        if not isinstance(self.sampler, FedPlan):
            raise ValueError(f"loader {self.config.name!r} makes its own batch plan: no FEED")
        return self.sampler

    def begin_fed_epoch(self, epoch: int, seed: int, shared: int | None = None) -> None:
        self._fed().begin(epoch, seed, shared)

    def feed(
        self,
        epoch: int,
        index: int,
        indices: list[int] | None,
        rng: bytes | None,
        ahead: bool = False,
    ) -> None:
        """Batch ``index`` of ``epoch`` from the trainer's sampler (None: it ran out);
        ``ahead``: before the trainer's RNG states (``FedPlan.feed``)."""
        plan = self._fed()
        if indices is None:
            plan.end(epoch)
        else:
            plan.feed(epoch, index, indices, rng, ahead=ahead)

    def restart_fed(self, fd: int, shared: list[int]) -> None:
        """A new trainer takes over a named trainer-fed loader: its epochs start afresh,
        on fresh worker streams (its producer restarted from the dataset's zygote, which
        stays warm), as a new DataLoader's would, with its objects (payload ``fd``, equal
        to the loader's first, and the ``shared`` memory they map: the engine owns them)."""
        plan = self._fed()
        with self._reconfigure:
            if self.objects is not None:
                self.objects.add(fd, shared)
                self._objects_from = 0
            else:
                for f in (fd, *shared):
                    os.close(f)
            self.producer.restart()
            with self._cond:
                plan.reset()
                self._seek_locked(0, 0)

    # -- live configuration ------------------------------------------------------------
    def reconfigure(self, change: LiveChange, admit: Admit) -> LoaderConfig:
        """The one way a running loader's configuration changes (a PATCH, autotune, the
        node arbiter): the executor's rules first (a 409 naming why), then ``admit``
        (the node's limits: it raises the domain error), then apply, keeping position
        and batches: the ring grows (a new segment) or retires segments to fit
        (``resizer.py``), and the producer resizes or is swapped between two batches
        (``producer_handle.py``). The RNG streams stay the loader's as created. Returns
        the new configuration."""
        with self._reconfigure:
            old = self.config
            try:
                new = change.applied_to(old)
            except ValueError as exc:
                raise Conflict(f"loader {old.name!r}: {exc}") from None
            refusal = self.producer.executor.live_refusal(old, new, self.iterable)
            if refusal is not None:
                raise Conflict(refusal)
            admit(new, self._ring_slots(new) * self.slot_bytes, self._node_workers(new))
            if self.resizer is not None:
                self.resizer.retarget(self._ring_slots(new))
            self.slots.set_limit(prefetch_depth(new))
            self.producer.resize(new.num_workers)
            self._wake.set()  # the producer thread looks again at who runs the steps
            self.config = new
            if new.autotune != old.autotune:
                self.tuner = self._tuner_for(new)
        self.upkeep()
        log.info(
            "loader %s: num_workers=%d prefetch_factor=%d (%d slots ahead; ring %d slots, "
            "%d wanted)",
            new.name,
            new.num_workers,
            new.prefetch_factor,
            prefetch_depth(new),
            self.ring.nslots if self.ring else 0,
            self._ring_slots(new),
        )
        return new

    def upkeep(self) -> None:
        """Close retired ring segments whose slots are all free, then add what the
        config still lacks; cheap when nothing is pending."""
        resizer = self.resizer
        if resizer is None or self._stop.is_set() or not resizer.pending:
            return
        # Never wait here (a data-plane thread, releasing a slot): a reconfigure in
        # progress runs this itself when it is done.
        if not self._reconfigure.acquire(blocking=False):
            return
        try:
            if resizer.upkeep():
                self.producer.segments_changed()
        finally:
            self._reconfigure.release()

    def reserved_bytes(self) -> int:
        """Ring memory this loader holds or is about to (the node budget's view of it)."""
        if self.resizer is not None:
            return self.resizer.reserved_bytes()
        return self._ring_slots(self.config) * self.slot_bytes

    def _ring_slots(self, config: LoaderConfig) -> int:
        """The slots ``config`` wants (a trainer that keeps its batches: one more)."""
        return ring_slots(config, keeps=self.sizing is not None)

    @property
    def slot_bytes(self) -> int:
        """A slot's bytes; 0 while the ring is still to be sized from the first batches."""
        return 0 if self.layout is None else self.layout.slot_bytes

    @property
    def node_workers(self) -> int:
        """This loader's processes that take the node's CPUs (PINFEED_MAX_WORKERS)."""
        return self._node_workers(self.config)

    def _node_workers(self, config: LoaderConfig) -> int:
        return config.num_workers if self.producer.executor.counts_workers else 0

    # -- consumer side (called from the data-plane threads) ------------------------------
    def attach(self, member: int | None, wait_s: float = 2.0, *, drives: bool = False) -> int:
        """Join the consumer group. A trainer that restarts at once may arrive before the
        server has seen its old connection close, so a busy member is waited for briefly.
        ``drives``: the member calls ``drive`` before each wait (a session), so the
        production steps may run in its thread (``_session_makes``)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                try:
                    joined = self.consumers.join(member)
                    if drives:
                        self._driver = joined
                    return joined
                except LookupError as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LoaderBusy(f"loader {self.config.name!r}: {exc}") from None
                    self._cond.wait(min(left, 0.1))

    def detach(self, member: int, leased: set[int]) -> None:
        with self._cond:
            self.consumers.leave(member, leased)
            if self._driver == member:
                self._driver = None
            self.cuda_registered.discard(member)
            self._pending.pop(member, None)
            self._cond.notify_all()
        self._wake.set()  # the producer thread makes the batches again
        self.upkeep()

    def release(self, member: int, slots: set[int] | list[int]) -> None:
        with self._cond:
            self.consumers.release(member, slots)
        if self._grown and self.slots.leased() <= self.nslots - prefetch_depth(self.config):
            self._shrink()
        self.upkeep()

    def relieve(self) -> ErrorItem | None:
        """A trainer-made loader whose trainer waits while it holds every slot (it keeps
        batches, as DataLoader lets it: a list of them, a loop a batch behind): the ring
        grows by as many slots again, within the node's budget, so that the next batch
        can be made; an error item (fatal) where the node has no room left. Called by a
        waiting session, with no lock held; nothing to do for any other loader."""
        ring, resizer = self.ring, self.resizer
        if self.sizing is None or ring is None or resizer is None or not self.slots.starved():
            return None
        target = max(ring.nslots, resizer.target) + self.nslots
        try:
            self.sizing.admit(self.config, target * ring.slot_bytes, self.node_workers)
        except PinfeedError as exc:
            held = self.slots.leased()
            too_many = InsufficientMemory(
                f"loader {self.config.name!r}: its trainer holds {held} batches (their "
                "tensors are still referenced) and the node has no room for more: "
                f"{exc.detail}. Keep fewer batches, or clone the ones you keep "
                "(batch.clone()), or give the loader copy=True",
            )
            return ErrorItem(-1, -1, -1, too_many.info())
        with self._reconfigure:
            resizer.retarget(target)
            self._grown = True
        self.upkeep()
        log.info(
            "loader %s: its trainer holds every slot: the ring grows to %d",
            self.config.name,
            target,
        )
        return None

    def _shrink(self) -> None:
        """Back to the slots the config wants, once the trainer let go of what it held
        (retired segments close as their slots come free)."""
        if not self._reconfigure.acquire(blocking=False):
            return  # a change in progress: the next release tries again
        try:
            if self.resizer is not None:
                self.resizer.retarget(self._ring_slots(self.config))
            self._grown = False
        finally:
            self._reconfigure.release()

    def position(self, member: int) -> tuple[int, int]:
        with self._cond:
            epoch, index = self.consumers.position(member, self.publisher.head)
            return epoch, max(index, self.sampler.span(epoch)[0])  # an elastic epoch's first

    def next_item(self, member: int, stop: threading.Event, timeout: float = 0.5) -> Item | None:
        """The member's next item in sampler order, or None if none came within
        ``timeout`` (the data plane then looks at its socket and asks again)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (item := self.consumers.take(member)) is None:
                self._pending.setdefault(member, time.monotonic())
                if self.state == "failed" and self.failure is not None:
                    self._pending.pop(member, None)
                    return ErrorItem(-1, -1, -1, self.failure)
                if stop.is_set() or self.state in ("draining", "closed"):
                    stopping = ServerUnavailable(
                        f"loader {self.config.name!r} was deleted or is stopping"
                    )
                    self._pending.pop(member, None)
                    return ErrorItem(-1, -1, -1, stopping.info())
                lost = self.consumers.lost(self.config.group_timeout_s)
                if lost:
                    gone = GroupMemberLost(
                        f"group members {lost} of loader {self.config.name!r} have "
                        f"been gone for over {self.config.group_timeout_s} s; the "
                        "group waits for them: restart them, or recreate the loader"
                    )
                    self._pending.pop(member, None)
                    return ErrorItem(-1, -1, -1, gone.info())
                left = deadline - time.monotonic()
                if left <= 0:
                    return None  # still pending: the data plane asks again
                self._cond.wait(left)
            self._pending.pop(member, None)
        if isinstance(item, BatchItem):
            self.stats.consumed(item.rows)
            if self.served is not None:
                self.served.taken(item.epoch, item.index)
        return item

    def stats_snapshot(self) -> StatsSnapshot:
        busy = self.producer.busy_seconds()
        members = max(1, self.consumers.attached)  # a sum of bools: no lock needed
        tuner = self.tuner
        report = tuner.report() if tuner is not None else None
        return self.stats.snapshot(self.config.name, busy, self.config.num_workers, members, report)

    def tune_sample(self) -> Sample:
        """The counters autotune measures over its intervals."""
        busy = self.producer.busy_seconds() + self.stats.busy_s
        members = max(1, self.consumers.attached)
        st = self.stats
        now = time.monotonic()
        pending = sum(now - t for t in list(self._pending.values()))
        return Sample(
            now, st.batches_consumed, st.samples_consumed, st.wait_s, busy, members, pending
        )

    def status(self) -> LoaderStatus:
        """Built without validation (``metric.built``: every value is typed here) and
        with the loader's lock held only to read the members' positions."""
        ring = self.ring
        with self._cond:
            head = self.publisher.head
            raw = [
                (m.index, m.connected, self.consumers.position(m.index, head))
                for m in self.consumers.members
            ]
            first = self.consumers.position(0, head)
        cuda = set(self.cuda_registered)
        members = [
            built(
                MemberStatus,
                {"member": i, "attached": up, "position": list(pos), "cuda_registered": i in cuda},
            )
            for i, up, pos in raw
        ]
        counts = self.slots.counts()
        counts["total"] = ring.nslots if ring else self.nslots
        return built(
            LoaderStatus,
            {
                "state": self.state,
                "failure": self.failure.to_json() if self.failure else None,
                "batches_per_epoch": self.batches_per_epoch,
                "ring_bytes": ring.size if ring else self.nslots * self.slot_bytes,
                "ring_segments": len(ring.space.parts) if ring else 0,  # one tuple: no lock
                "slot_bytes": self.slot_bytes,
                "slots": built(SlotCounts, counts),
                "page_locked": bool(ring and ring.page_locked),
                "consumer_attached": any(up for _, up, _ in raw),
                "consumer_cuda_registered": bool(cuda),
                "epoch": first[0],
                "position": first[1],
                "worker_restarts": self.producer.restarts,
                "members": members,
                "sources": None if self.served is None else self.served.report(),
            },
        )
