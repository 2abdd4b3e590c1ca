"""A batch made again (``Loader.replay``, a REPLAY connection), beside the running epoch.

The batch is made by a producer of its own: the loader's dataset, code and layout, a
fresh ``seeding.Streams`` over a private copy of the plan's history, and a ring of one
slot made for it. The running epoch's producer, worker streams, slot table and
consumers are not touched: the replay shares nothing with them but the dataset (read
only) and the plan's records (read only).

Its RNG state is the original's: DataLoader's worker ``index % num_workers`` seeded
from the epoch's base seed, then that worker's earlier batches of the epoch made and
dropped (of every epoch since 0, with persistent workers), as a worker that replaces a
dead one gets there (``seeding.py``). So a replay of batch k costs about k /
num_workers batches of a worker's time, and one of a past epoch, or of a past run
after a server restart, is the same as one of the current epoch: all of it follows
from the loader's config, seed and elastic record, which the registry keeps.

Where it is made: a loader that draws from the global RNGs and has worker streams gets
one worker process (forked from the dataset's zygote, as its workers are, serving every
stream as a pool shrunk live does); otherwise the batch is made in the calling thread
(``inline.py``: a loader without workers, or a dataset that draws no RNG).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pinfeed.errors import InvalidPosition, LoaderFailed, NotFound
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.producers import ProducerContext, Result, Task
from pinfeed_server.engine.producers.base import draws_rng
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.pool import WorkerPool
from pinfeed_server.engine.ring import Ring

# Above any sequence number a loader reaches: never taken for a task of an earlier plan.
REPLAY_SEQ = 2**62
TIMEOUT_S = 600.0


@dataclass
class Replayed:
    """A batch made again into slot 0 of ``ring`` (the caller sends its fd, then closes
    it); ``result`` is what the producer reported (an error, or the batch's strings)."""

    epoch: int
    index: int
    indices: list[int]
    worker: int | None
    ring: Ring
    result: Result


def replay(engine: LoaderEngine, epoch: int, index: int) -> Replayed:
    """Make batch ``index`` of ``epoch`` of ``engine`` again. ``InvalidPosition``: no
    such batch; ``LoaderFailed``: its producer failed."""
    if engine.iterable:
        raise InvalidPosition(
            f"loader {engine.config.name!r} iterates an IterableDataset: its batches are "
            "drawn from iterators, not sample indices, and cannot be made again one by one"
        )
    try:
        indices = engine.batch_indices(epoch, index)
    except NotFound as exc:  # as HTTP says it; on the data plane a position's error
        raise InvalidPosition(exc.detail) from None
    layout = engine.layout
    if layout is None:
        raise InvalidPosition(
            f"loader {engine.config.name!r} has made no batch yet: there is none to make again"
        )
    kind, params, context = engine.source
    rng = draws_rng(kind, engine.config) or engine.code.collate_fn is not None
    processes = 1 if rng and engine.streams > 0 else 0
    ring = Ring(f"{engine.config.name}-replay", 1, layout.slot_bytes, lock=False)
    done = threading.Event()
    got: list[Result] = []
    fatal: list[str] = []

    def on_result(result: Result) -> None:
        got.append(result)
        done.set()

    def on_fatal(detail: str) -> None:
        fatal.append(detail)
        done.set()

    ctx = ProducerContext(
        engine.config,
        engine.streams,
        processes,
        kind,
        params,
        context,
        engine.dataset,
        engine.sampler,
        engine.code,
        layout,
        ring,
        on_result,
        on_fatal,
        lambda: None,
    )
    try:
        spawn = engine.spawn() if processes and engine.spawn is not None else None
        producer = WorkerPool(ctx, spawn) if processes else InlineProducer(ctx)
        try:
            producer.submit(Task(REPLAY_SEQ, epoch, index, 0, indices))
            if not done.wait(TIMEOUT_S):
                raise LoaderFailed(f"the replay of batch {index} of epoch {epoch} timed out")
        finally:
            producer.close()
        if fatal:
            raise LoaderFailed(f"the replay's worker failed: {fatal[0]}")
    except BaseException:
        ring.close()
        raise
    return Replayed(epoch, index, indices, engine.worker_of(index), ring, got[0])
