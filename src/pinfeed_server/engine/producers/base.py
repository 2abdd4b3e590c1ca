"""The producer seam: what the loader engine asks of whatever makes its batches.

The engine owns the order of things: the batch plan (which batch comes next), the
slot table, the in-order publisher and the consumers. A producer owns only the making:
it gets a ``Task`` (a sequence number, the batch's place ``(epoch, index)``, the ring
slot to fill and, from an index plan, the sample indices), writes the batch into that
slot, and reports a ``Result`` through ``ctx.on_result``, from any thread and in any
order. Its health it reports too: ``ctx.on_fatal`` once it can make nothing more (the
loader fails, with the reason), ``ctx.on_recovered`` once it can again (the loader is
ready again and production goes on where it stopped: a remote backend that came back).

    submit(task)        hand over one batch to make; never blocks on the making (but
                        ``inline.py`` makes it in the caller's thread: the engine's
                        producer thread, or a trainer's session's, ``LoaderEngine.drive``)
    resize(n)           change the number of processes live, losing no task
    ring_ready(r, l)    a loader sized from its first batches (``ctx.ring`` None; their
                        results propose a layout) has its ring ``r`` of layout ``l``
    objects(e, fds, s)  a pinfeed.DataLoader's objects changed: from epoch ``e`` on, its
                        batches are made with the objects of payloads ``fds`` (a chain:
                        ``pinfeed.payload``) and shared memory ``s``, as DataLoader's
                        workers get them then
    segments_changed()  the ring lost a segment: unmap it (added ones are mapped lazily,
                        before the first task into them: ``ctx.ring.generation``)
    busy_seconds()      time spent making batches (worker_busy_share)
    restarts            workers replaced after dying
    close(drain)        stop (after finishing every task held, if ``drain``); idempotent;
                        the engine frees the ring afterwards

Which producer a loader gets is its executor's business (``executor.py``, one module
per executor, registered in ``__init__``): ``local`` (``inline.py`` at 0 processes, in
the engine's thread as DataLoader's main process; ``pool.py``, worker
processes forked from the dataset's zygote that collate straight into the ring),
``thread`` (``threads.py``: threads of the server), ``ray`` (``ray.py``: a bridge
process that drives Ray actors and copies their batches into the ring).

What a producer needs to reproduce DataLoader's batches is all here: ``task.epoch`` and
``task.index`` name the batch, ``ctx.streams`` is DataLoader's ``num_workers`` (the RNG
streams, fixed for the loader's life: batch ``i`` is stream ``i % streams``'s), so a
producer derives the worker seed and the replay from ``ctx.config.seed``
(``seeding.py``) whatever number of processes it runs (``ctx.processes``). An
IterableDataset's plan yields ``None`` instead of index lists: ``task.index`` is then a
turn of DataLoader's round-robin, drawn from that stream's iterator
(``iterating.py``); the producer reports ``rows`` (a short last batch), ``rows=0`` for
a turn whose stream has run out, and ``end=True`` once every stream has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pinfeed.errors import SampleError
from pinfeed.protocol import ErrorInfo
from pinfeed_server.datasets import DatasetContext, Kind
from pinfeed_server.engine.collate import Layout, SlotWriter, dataset_error
from pinfeed_server.engine.config import LoaderCode, LoaderConfig
from pinfeed_server.engine.ring import OwnBuffer, Ring
from pinfeed_server.engine.sampler import BatchPlan

M = TypeVar("M")  # a producer's process: a worker, an actor


# Not frozen, though never changed: two are made per batch, and a frozen dataclass
# costs 3x more to build.
@dataclass(slots=True)
class Task:
    """One batch to make: ``seq`` orders publication; ``(epoch, index)`` is its place."""

    seq: int
    epoch: int
    index: int
    slot: int
    indices: list[int] | None  # None: the producer draws the batch from its iterator
    seed: int | None = None  # the epoch's base seed, where the trainer drew it (FedPlan)
    shared: int | None = None  # the epoch's shared seed, a datapipe's (FedPlan)


@dataclass(slots=True)
class Result:
    """What became of a task. ``error``: the batch failed (a sample raised); ``end``:
    the producer's stream for the task's epoch ran out, the slot holds nothing;
    ``rows == 0`` (no error, not ``end``): the task yields nothing and is skipped (an
    iterable's turn whose worker has run out while others go on)."""

    seq: int
    strings: bytes = b""  # the batch's strings JSON (b"" when it has none)
    error: ErrorInfo | None = None
    end: bool = False
    rows: int | None = None  # rows written; None: one per index of the task
    rng: bytes = b""  # the global RNG states after it, for the trainer (inline.py)
    # A pinfeed.DataLoader's batch that is not in its slot: its buffer of its own (made
    # before the ring was sized, or too large for a slot: ``collate.SlotWriter``), and
    # the ring layout it proposes (while the loader has no ring).
    own: OwnBuffer | None = None
    proposal: Layout | None = None


def batch_result(seq: int, body: bytes, writer: SlotWriter, rows: int | None = None) -> Result:
    """The result of a batch ``writer`` just wrote (``body``: what ``write`` returned),
    with its buffer of its own and its ring proposal, if any."""
    own, proposal = writer.take()
    return Result(seq, body, rows=rows, own=own, proposal=proposal)


def error_info(exc: BaseException) -> ErrorInfo:
    """A failed batch's ``Result.error``, as the consumer will hear it: a ``SampleError``
    (``BatchTooLarge`` too) as it is; anything else making the batch raised (the
    dataset's code, even a pinfeed error of its own) a sample-error naming its type and
    the end of its traceback. Call it in the ``except`` clause (it reads the traceback)."""
    if isinstance(exc, SampleError):
        return exc.info()
    return dataset_error(exc, f"{type(exc).__name__}: {exc}", None).info()


class _Forgets(Protocol):
    count: int

    def forget(self, worker: int) -> None: ...


def regroup(members: list[M], retiring: list[M], new: list[M], n: int, streams: _Forgets) -> None:
    """A live resize to ``n`` processes, under the producer's lock: ``new`` join, those
    past ``n`` go to ``retiring`` (to finish what they hold). The RNG streams stay the
    loader's num_workers as created (DataLoader's worker ids); those now served by
    another process move there."""
    before = len(members)
    members.extend(new)
    while len(members) > n:
        retiring.append(members.pop())
    for stream in range(streams.count):
        if stream % before != stream % n:
            streams.forget(stream)


@dataclass(frozen=True)
class ProducerContext:
    """Everything a producer may use to make one loader's batches."""

    config: LoaderConfig  # the loader's, as it is now
    streams: int  # DataLoader's num_workers as created: the RNG streams (seeding.py)
    processes: int  # the processes (threads, actors) to run now; 0: in the caller
    kind: Kind[Any]  # the dataset's kind and params: a producer elsewhere rebuilds it
    params: dict[str, Any]
    datasets: DatasetContext
    dataset: Any  # the server's own instance, for producers in the server process
    plan: BatchPlan  # the engine's (a replay reads its history: seeding.history_of)
    code: LoaderCode  # its collate_fn and worker_init_fn, resolved or shipped
    # None until a loader sized from its first batches has its ring (``ring_ready``)
    layout: Layout | None
    ring: Ring | None
    on_result: Callable[[Result], None]
    on_fatal: Callable[[str], None]
    on_recovered: Callable[[], None]
    iterable: bool = False  # an IterableDataset's loader (the dataset may not be here)
    # DataLoader's rule on sizes (a pinfeed.DataLoader's loader): a batch larger than the
    # slots, or made before the ring is sized, goes into a buffer of its own
    own: bool = False
    # A pinfeed.DataLoader's objects where they changed since the loader was made: the
    # epoch they apply from, their payloads and the shared memory they map; None: as made
    objects: tuple[int, list[int], list[int]] | None = None

    @property
    def draws_rng(self) -> bool:
        return draws_rng(self.kind, self.config, self.params) or self.code.collate_fn is not None


def draws_rng(kind: Kind[Any], config: LoaderConfig, params: dict[str, Any] | None = None) -> bool:
    """Whether making a batch may draw from the global RNGs (the dataset's kind says so,
    unless its params declare ``draws_rng: false``, or the loader's ``transform`` or
    ``collate_fn`` might; shipped code is the ``shipped`` kind's, which may): then each
    batch must come from its own stream's RNG state, and a stream moved elsewhere is
    replayed (``seeding.py``)."""
    declared = (params or {}).get("draws_rng", True)
    return (
        (kind.draws_rng and declared is not False)
        or config.transform is not None
        or config.collate_fn is not None
    )


class Producer(Protocol):
    """Makes a loader's batches; see the module docstring."""

    @property
    def restarts(self) -> int: ...

    def submit(self, task: Task) -> None: ...

    def prepare(self, task: Task) -> None:
        """``task`` was fed ahead of the trainer's RNG states it is to be made on, which
        are still to come (its ``submit`` follows once they came): a producer that makes
        batches on them (``inline.py``) makes it now, on a guess; the others nothing."""
        ...

    def resize(self, num_workers: int) -> None: ...

    def ring_ready(self, ring: Ring, layout: Layout) -> None: ...

    def objects(self, epoch: int, fds: list[int], shared: list[int]) -> None: ...

    def segments_changed(self) -> None: ...

    def busy_seconds(self) -> float: ...

    def close(self, drain: bool = False) -> None: ...
