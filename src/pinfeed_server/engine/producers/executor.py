"""The executor seam: what decides how a loader's batches are made, and its rules.

A loader names its executor (``executor``, default ``"local"``); the engine asks it for
a producer (``base.Producer``) for the number of processes the config wants, and for
every rule that depends on where batches are made, so neither the engine nor the
service knows the executors apart:

    forks_local       its processes are forked on this node, from the dataset's zygote
    counts_workers    its processes count against PINFEED_MAX_WORKERS (this node's CPUs)
    refusal()         why a new loader cannot run on it (a 422), or None
    live_refusal()    why a live change cannot be applied (a 409), or None
    resizes_live()    whether its producer changes its process count in place, or the
                      engine swaps it for a new one between two batches
    producer()        the producer for ``ctx.processes`` (``spawn`` forks from the
                      zygote, for executors that fork locally)

A new executor is one module implementing this and one line in ``executors()``
(``__init__.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

from pinfeed_server.datasets import Kind
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.producers.base import Producer, ProducerContext
from pinfeed_server.engine.producers.processes import ProcessFactory


class Executor(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def forks_local(self) -> bool: ...

    @property
    def counts_workers(self) -> bool: ...

    def refusal(self, config: LoaderConfig, kind: Kind[Any], iterable: bool) -> str | None: ...

    def live_refusal(self, old: LoaderConfig, new: LoaderConfig, iterable: bool) -> str | None: ...

    def resizes_live(self, old: int, new: int) -> bool: ...

    def producer(self, ctx: ProducerContext, spawn: ProcessFactory | None) -> Producer: ...
