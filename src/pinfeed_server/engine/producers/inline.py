"""``num_workers=0``: batches made in the server process, as DataLoader's main process
makes them: in ``submit``'s caller, the engine's producer thread or the session thread of
the loader's one trainer while it is attached (``LoaderEngine.drive``).

Augmentations draw from RNGs owned by the loader: for its batches the process's global
``torch``/``random``/numpy states are the loader's, under one process-wide lock
(``pinfeed_server/global_rng.py``: they are swapped back only when another loader, or
the server's own code, takes them), so loaders in the same server never disturb each
other. The
loader's RNGs are seeded as DataLoader seeds the one worker of a
``num_workers=1, persistent_workers=False`` loader (``seeding.py``), each epoch afresh:
the batches equal that DataLoader's, and a resume replays at most one epoch.

A loader created with ``num_workers=N > 0`` and PATCHed to 0 keeps its N streams
(``seeding.py``): this producer then serves them as one worker process serving N
would (``WorkerRngs``: states swapped per batch, ``get_worker_info()`` and
``worker_init_fn`` as in a worker, a shallow copy of the dataset per stream), so its
batches stay ``DataLoader(num_workers=N)``'s.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data._utils import worker as torch_worker

from pinfeed.rng import RngState, capture, dump_state, load_state, restore
from pinfeed_server.datasets import shipped
from pinfeed_server.datasets.shipped import Shipped
from pinfeed_server.engine.collate import Layout, SlotWriter
from pinfeed_server.engine.fed_plan import FedPlan
from pinfeed_server.engine.iterable import EndJudge, is_iterable, shard_env
from pinfeed_server.engine.producers.base import (
    ProducerContext,
    Result,
    Task,
    batch_result,
    error_info,
)
from pinfeed_server.engine.producers.iterating import IterStreams, make_turn, write_samples
from pinfeed_server.engine.producers.seeding import Streams, WorkerRngs, apply, history_of
from pinfeed_server.engine.ring import Ring
from pinfeed_server.global_rng import GLOBAL_RNG
from pinfeed_server.malloc import keep_inline_batches, release_inline_batches


class InlineProducer:
    restarts = 0

    def __init__(self, ctx: ProducerContext) -> None:
        self._on_result = ctx.on_result
        self._ctx = ctx
        self._ring = ctx.ring  # None until a loader sized from its first batches has it
        self._layout = ctx.layout
        self._generation = -1 if ctx.ring is None else ctx.ring.generation
        self._busy_s = 0.0
        self._closed = False
        if ctx.ring is not None:
            keep_inline_batches(self, ctx.ring.slot_bytes)  # malloc.py says why
        # The loader's RNG states between its batches, while the globals hold another's.
        self.rng_state: RngState | None = None
        # A trainer-fed loader's last batch made on the trainer's states: (epoch, index,
        # the states after it), the states a batch fed ahead of its own is made on.
        self._after: tuple[int, int, bytes] | None = None
        # A batch fed ahead of its states, made on a guess (``prepare``): (seq, the
        # states it was made on, its result), till its states come (``submit``).
        self._guessed: tuple[int, bytes, Result] | None = None
        self._config = ctx.config
        # A trainer's objects from an epoch on, loaded, till that epoch's first batch.
        self._pending: tuple[int, Shipped] | None = None
        if ctx.objects is not None:  # as the trainer last sent them (a swap, a restart)
            held = _load(ctx.objects[1], ctx.objects[2])
            self._use(held.dataset, held.collate_fn, held.worker_init_fn)
        else:
            self._use(ctx.dataset, ctx.code.collate_fn, ctx.code.worker_init_fn)

    def _use(self, dataset: Any, collate_fn: Any, worker_init_fn: Any) -> None:
        """Make the loader's batches with these objects (a trainer's, as they changed)."""
        ctx = self._ctx
        self._dataset, self._collate = dataset, collate_fn
        self._writer = self._new_writer(dataset, collate_fn)
        self._fed_epoch = -1  # a trainer-fed iterable's epoch, and its iterator
        self._fed_iter: Iterator[Any] = iter(())
        # Created with workers: their streams, served here (see the module docstring).
        self._workers: WorkerRngs | None = None
        if ctx.iterable or is_iterable(dataset):
            # An iterable: one stream, its own RNGs (iterating.py); no index plan.
            self._iter: IterStreams | None = IterStreams(
                dataset, ctx.config, ctx.streams, worker=False
            )
            self._judge = EndJudge(1)
            return
        self._iter = None
        self.streams = Streams(
            ctx.config,
            ctx.streams,
            history_of(ctx.config, ctx.streams, ctx.plan, dataset, ctx.datasets.allowed_plugins),
            replay=ctx.draws_rng,
        )
        if self.streams.replay and ctx.streams > 0:
            self._workers = WorkerRngs(copy.copy(dataset), ctx.streams, worker_init_fn, collate_fn)

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None:
        """A pinfeed.DataLoader's objects as its trainer sent them (they changed): loaded
        now, and used from the first batch of ``epoch`` on."""
        self._pending = (epoch, _load(fds, shared))

    def _new_writer(self, dataset: Any, collate_fn: Any) -> SlotWriter:
        ring, ctx = self._ring, self._ctx
        return SlotWriter(
            dataset,
            self._layout,
            None if ring is None else ring.space,
            0 if ring is None else ring.slot_bytes,
            collate_fn,
            own=ctx.own,
            rows=ctx.plan.max_rows,
        )

    def submit(self, task: Task) -> None:
        """Make the batch now, in the caller's thread, and report it before returning."""
        t0 = time.perf_counter()
        self._before(task)
        make = self._on_trainers(task)
        if make is not None:
            assert isinstance(self._ctx.plan, FedPlan)
            result = self._on_trainer_rngs(self._ctx.plan, task, make)
            if result.end and self._iter is not None:  # the one iterator ran out
                result.end = self._judge.ran_out(task.epoch, task.index)
        elif self._iter is not None:
            result = self._make_from_iterator(self._iter, task)
        elif task.indices is None:
            raise ValueError("a map-style dataset's batches come from index lists")
        elif self._workers is not None:
            result = self._make_as_workers(task, task.indices)
        elif self.streams.replay:
            result = self._make_with_own_rngs(task, task.indices)
        else:  # a built-in kind: it draws nothing from the global RNGs
            result = self._make(task.seq, task.slot, task.indices)
        self._busy_s += time.perf_counter() - t0
        self._on_result(result)

    def prepare(self, task: Task) -> None:
        """A batch fed ahead of the trainer's RNG states, which are still to come: made
        now, on the states the batch before left (``_guess``), while the trainer steps;
        ``submit`` keeps it if the states that come are those."""
        t0 = time.perf_counter()
        self._before(task)
        make = self._on_trainers(task)
        if make is not None:
            self._guessed = self._guess(task, make)
        self._busy_s += time.perf_counter() - t0

    def _before(self, task: Task) -> None:
        """Before ``task`` is made: the trainer's objects from its epoch on, a writer on
        the ring's segments as they are now."""
        pending = self._pending
        if pending is not None and task.epoch >= pending[0]:
            self._pending = None
            held = pending[1]
            self._use(held.dataset, held.collate_fn, held.worker_init_fn)
        if self._ring is not None and self._generation != self._ring.generation:
            self.segments_changed()

    def _on_trainers(self, task: Task) -> Callable[[], Result] | None:
        """How ``task`` is made where it is made on the trainer's RNG states (a
        ``pinfeed.DataLoader`` without workers over objects that may draw, or over an
        IterableDataset), else None."""
        if not isinstance(self._ctx.plan, FedPlan):
            return None
        if self._iter is not None:
            return lambda: self._fed_turn(task)
        indices = task.indices
        if indices is None or self._workers is not None or not self.streams.replay:
            return None
        return lambda: self._make(task.seq, task.slot, indices)

    def _make_with_own_rngs(self, task: Task, indices: list[int]) -> Result:
        with GLOBAL_RNG.lent_to(self) as held:
            reseed = self.streams.prepare(task.epoch, task.index, task.seq)
            if reseed is not None:
                apply(reseed, self._dataset, worker=False, collate_fn=self._collate)
            elif not held and self.rng_state is not None:
                restore(self.rng_state)
            return self._make(task.seq, task.slot, indices)

    def _on_trainer_rngs(self, plan: FedPlan, task: Task, make: Callable[[], Result]) -> Result:
        """A ``pinfeed.DataLoader`` without workers: DataLoader makes its batches in the
        trainer, on the trainer's global RNGs, so ``make`` runs here on the states the
        trainer sent with the task (FEED), and the states after it go back with the
        result (RNG), for the trainer to carry on from, where the batch moved them (else
        the trainer's are already those: it waits, drawing nothing, for the batch). A
        batch the trainer sent no states with (its objects draw nothing:
        ``pinfeed.DataLoader`` feeds those ahead) is made here and sends none back. The
        globals are lent to this loader (``lent_to``): the server's own states are
        swapped out once, not each batch.

        A batch fed ahead of its states (the trainer drew nothing between its batches so
        far) is made at once on the states the batch before left, while the trainer
        steps; it stands if the states the trainer then sends are those (it drew
        nothing meanwhile: the same batch, made on the same states, in the same order
        of calls), else it is made again on them."""
        state, ahead = plan.trainer_rng(task.epoch, task.index)
        guessed, self._guessed = self._guessed, None
        if guessed is not None and guessed[0] != task.seq:
            guessed = None  # made for another task (dropped: a seek, a stop)
        if state is None and not ahead and guessed is None:
            return _attempt(task, make)  # nothing draws: the server's RNGs are untouched
        if state is None:
            if guessed is None:  # made now, while the states come (the engine waited
                guessed = self._guess(task, make)  # for them where it prepared it)
            state = plan.wait_rng(task.epoch, task.index)
            if state is None:  # never asked for: the epoch was left, a seek, a stop
                self._after = None
                return Result(task.seq, rows=0)
        if guessed is not None and state == guessed[1]:
            made = guessed[2]
            self._after = (task.epoch, task.index, made.rng)
            made.rng = _moved(state, made.rng)
            return made
        with GLOBAL_RNG.lent_to(self):
            load_state(state)
            result = _attempt(task, make)
            result.rng = dump_state()
        self._after = (task.epoch, task.index, result.rng)
        result.rng = _moved(state, result.rng)
        return result

    def _guess(self, task: Task, make: Callable[[], Result]) -> tuple[int, bytes, Result] | None:
        """``task`` made on the states the batch before it left, the trainer's states
        still to come: (its seq, those states, the result, with the states after it);
        None where the batch before was not made here on the trainer's states."""
        after = self._after
        if after is None or after[:2] != (task.epoch, task.index - 1):
            return None
        with GLOBAL_RNG.lent_to(self) as held:
            if not held:
                load_state(after[2])
            made = _attempt(task, make)
            made.rng = dump_state()
        return task.seq, after[2], made

    def _make_as_workers(self, task: Task, indices: list[int]) -> Result:
        assert self._workers is not None
        with GLOBAL_RNG:
            server, info = capture(), torch_worker._worker_info
            try:
                reseed = self.streams.prepare(task.epoch, task.index, task.seq)
                if reseed is not None:
                    self._workers.reseed(reseed)
                self._workers.enter(task.index)
                self._writer.dataset = self._workers.dataset
                return self._make(task.seq, task.slot, indices)
            finally:
                self._workers.park()
                self._writer.dataset = self._dataset
                restore(server)
                torch_worker._worker_info = info

    def _fed_turn(self, task: Task) -> Result:
        """An IterableDataset without workers, as DataLoader iterates it in the trainer
        (no seeding, no worker info): one iterator per epoch, a batch per ``next()``."""
        if self._fed_epoch != task.epoch:
            self._fed_epoch, self._fed_iter = task.epoch, iter(copy.copy(self._dataset))
        samples = list(itertools.islice(self._fed_iter, self._config.batch_size))
        short = len(samples) < self._config.batch_size
        if not samples or (short and self._config.drop_last):
            return Result(task.seq, end=True, rows=0)
        return write_samples(self._writer, task, samples)

    def _make_from_iterator(self, streams: IterStreams, task: Task) -> Result:
        cfg = self._config
        with GLOBAL_RNG, shard_env(cfg.rank, cfg.world_size):
            server = capture()
            try:
                result = make_turn(streams, self._writer, task)
            finally:
                streams.park()
                restore(server)
        if result.end:  # the one stream ran out: the epoch's end
            result.end = self._judge.ran_out(task.epoch, task.index)
        return result

    def _make(self, seq: int, slot: int, indices: list[int]) -> Result:
        writer = self._writer
        try:
            return batch_result(seq, writer.write(slot, indices), writer)
        except Exception as exc:
            return Result(seq, error=error_info(exc))

    def resize(self, num_workers: int) -> None:
        if num_workers != 0:
            raise ValueError("the in-server producer has no workers; the engine swaps it")

    def ring_ready(self, ring: Ring, layout: Layout) -> None:
        """The ring, sized from the first batches: the next batches go into its slots."""
        self._ring, self._layout = ring, layout
        keep_inline_batches(self, ring.slot_bytes)
        self.segments_changed()

    def segments_changed(self) -> None:
        """A new writer: the old one's cached slot views may be of a closed segment."""
        assert self._ring is not None
        self._generation = self._ring.generation
        old = self._writer
        self._writer = self._new_writer(old.dataset, old.collate_fn)
        old.close()

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self, drain: bool = False) -> None:  # nothing outstanding: submit makes it
        if not self._closed:
            self._closed = True
            self._writer.close()
            release_inline_batches(self)


def _load(fds: list[int], shared: list[int]) -> Shipped:
    """A trainer's objects from their payloads, loaded here, its code on the server's own
    RNG states (a DatasetError, as a loader's failure, where they cannot be)."""
    with GLOBAL_RNG:
        return shipped.load(fds, shared)


def _moved(before: bytes, after: bytes) -> bytes:
    """The states a batch left, to send to the trainer (RNG), or none where they are
    those it was made on: the trainer waited for the batch with those in its globals."""
    return after if after != before else b""


def _attempt(task: Task, make: Callable[[], Result]) -> Result:
    """``make()``, its exception as the task's failed result."""
    try:
        return make()
    except Exception as exc:
        return Result(task.seq, error=error_info(exc))
