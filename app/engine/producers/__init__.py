"""Producers: what makes a loader's batches, behind one interface (``base.py``).

    base.py        the seam: Task, Result, Producer, ProducerContext
    inline.py      num_workers=0: in the server's producer thread
    pool.py        local worker processes (worker.py: their side; codec.py: the pipe)
    forkserver.py  the process the zygotes (and workers without one) are forked from
    zygote.py      a dataset's process, holding its one build; its workers fork from it

A new way of making batches is one module here and one line in ``producer_kind`` /
``make_producer``; the engine does not change.
"""

from __future__ import annotations

from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import (
    Producer,
    ProducerContext,
    ProducerFactory,
    Result,
    Task,
)
from pinfeed_server.engine.producers.forkserver import configure_forkserver
from pinfeed_server.engine.producers.inline import InlineProducer
from pinfeed_server.engine.producers.pool import ProcessFactory, WorkerPool


def producer_kind(config: LoaderConfig) -> str:
    """Which producer makes ``config``'s batches; fixed for a loader's life."""
    return "pool" if config.num_workers > 0 else "inline"


def make_producer(ctx: ProducerContext, processes: ProcessFactory | None = None) -> Producer:
    """The producer for ``ctx.config``; it starts its workers before returning (made
    by ``processes``, the dataset's zygote's, when given)."""
    if producer_kind(ctx.config) == "pool":
        return WorkerPool(ctx, processes)
    return InlineProducer(ctx)


__all__ = [
    "InlineProducer",
    "Producer",
    "ProducerContext",
    "ProducerFactory",
    "Result",
    "Task",
    "WorkerPool",
    "configure_forkserver",
    "make_producer",
    "producer_kind",
]
