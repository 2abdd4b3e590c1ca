"""The producer seam: what the loader engine asks of whatever makes its batches.

The engine owns the order of things: the batch plan (which batch comes next), the
slot table, the in-order publisher and the consumers. A producer owns only the making:
it gets a ``Task`` (a sequence number, the batch's place ``(epoch, index)``, the ring
slot to fill and, from an index plan, the sample indices), writes the batch into that
slot, and reports a ``Result`` through ``on_result``, from any thread and in any order.
A producer that can no longer make anything calls ``on_fatal`` once; the loader fails.

    submit(task)        hand over one batch to make; never blocks on the making
    resize(n)           change the number of workers live, losing no task
    segments_changed()  the ring lost a segment: unmap it (added ones are mapped lazily,
                        before the first task into them: ``ctx.ring.generation``)
    busy_seconds()      time spent making batches (worker_busy_share)
    restarts            workers replaced after dying
    close(drain)        stop (after finishing every task held, if ``drain``); idempotent;
                        the engine frees the ring afterwards

Implementations: ``inline`` (``num_workers=0``: made in the engine's producer
thread, as DataLoader's main process does), ``pool`` (local worker processes that
collate straight into the shared ring) and ``ray`` (Ray actors; ``ray.py``).
``make_producer`` in ``__init__`` picks one.

How the next ones plug in, with no change to the engine:

- A remote executor (Ray actors): its ``submit`` ships ``(task.epoch, task.index,
  task.indices)`` to an actor that builds the dataset from ``ctx.kind``/``ctx.params``
  and returns the batch's bytes; a thread of the producer copies them into
  ``ctx.ring.space[task.slot * ctx.ring.slot_bytes:]`` (the one host copy; ``space``
  finds the segment the slot is in) and calls
  ``on_result(Result(task.seq, strings))``. An actor lost mid-task is the producer's
  business (resubmit elsewhere, count ``restarts``); the engine sees results only.
- An iterator (``IterableDataset``, ``engine/iterable.py``): a batch plan that yields
  ``None`` instead of index lists; ``task.index`` is a *turn* of DataLoader's
  round-robin (worker ``index % N``'s ``index // N``-th request), which the producer
  draws from that worker's iterator (``producers/iterating.py``). It reports ``rows``
  (a worker's last batch may be short), ``rows=0`` for a turn whose worker has run
  out (skipped), and, once every iterator of the epoch is done, ``Result(seq,
  end=True)``. The publisher then publishes the epoch's END, drops the epoch's tasks
  still in flight (in order, their slots freed) and moves the plan to the next epoch.
- Per-worker RNG seeding as DataLoader does it: ``task.epoch`` and ``task.index``
  name the batch, so a producer can derive the worker (``index % num_workers``) and
  that epoch's worker seed from ``ctx.config.seed`` without the engine's help.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pinfeed.errors import SampleError
from pinfeed.protocol import ErrorInfo
from pinfeed_server.datasets import DatasetContext
from pinfeed_server.engine.collate import Layout
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.ring import Ring


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


def error_info(exc: BaseException) -> ErrorInfo:
    """A failed batch's ``Result.error``, as the consumer will hear it: a ``SampleError``
    (``BatchTooLarge`` too) as it is; anything else making the batch raised (the
    dataset's code, even a pinfeed error of its own) a sample-error naming its type and
    the end of its traceback. Call it in the ``except`` clause (it reads the traceback)."""
    if isinstance(exc, SampleError):
        return exc.info()
    return SampleError(
        f"{type(exc).__name__}: {exc}",
        index=None,
        error_type=type(exc).__name__,
        where=traceback.format_exc(limit=-3),
    ).info()


ResultSink = Callable[[Result], None]
FatalSink = Callable[[str], None]


@dataclass(frozen=True)
class ProducerContext:
    """Everything a producer may use to make one loader's batches."""

    config: LoaderConfig
    kind: str  # the dataset's kind and params: a producer elsewhere rebuilds it from them
    params: dict[str, Any]
    datasets: DatasetContext
    dataset: Any  # the server's own instance, for producers in the server process
    layout: Layout
    ring: Ring
    on_result: ResultSink
    on_fatal: FatalSink
    # Processes to start (a live PATCH); None: config.num_workers. ``config`` stays the
    # loader's as created: its num_workers is the RNG streams' (seeding.py).
    processes: int | None = None
    # A producer that failed the loader (a lost cluster) and can make batches again.
    on_recovered: Callable[[], None] | None = None

    @property
    def num_processes(self) -> int:
        return self.config.num_workers if self.processes is None else self.processes


class Producer(Protocol):
    """Makes a loader's batches; see the module docstring."""

    @property
    def restarts(self) -> int: ...

    def submit(self, task: Task) -> None: ...

    def resize(self, num_workers: int) -> None: ...

    def segments_changed(self) -> None: ...

    def busy_seconds(self) -> float: ...

    def close(self, drain: bool = False) -> None: ...


ProducerFactory = Callable[[ProducerContext], Producer]
