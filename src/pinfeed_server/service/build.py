"""The one way a loader is built: a prepared spec -> a started engine.

Both ways in come here: a loader registered over HTTP (its config, over a registered
dataset) and a trainer's ``pinfeed.DataLoader`` (its objects, its fed plan). Each
brings a ``LoaderSpec``; ``Builder.build`` checks it against its dataset
(``engine.prepare``: plugins, plan, slot layout), has the node admit it (the service's
``admit``: the arbiter's room, then the budget), makes its ``LoaderEngine`` and starts
it. A loader whose slots no sample sizes yet (a trainer's: DataLoader reads none before
the loop asks) is admitted for its workers now and for its ring once its first batches
size it (``Sizing``). What the engine is then (a loader of the table, its registry row,
its owner) is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pinfeed_server.engine
from pinfeed.payload import Chain
from pinfeed_server.datasets import DatasetContext, Kind
from pinfeed_server.engine import (
    BatchPlan,
    Executor,
    LoaderCode,
    LoaderConfig,
    LoaderEngine,
    ProcessFactory,
    Sizing,
    ring_slots,
)

# The node's admission of a loader: its config, the ring bytes it will hold, the node
# workers it takes; raises the domain error that says why not.
Admit = Callable[[LoaderConfig, int, int], None]


@dataclass(frozen=True)
class LoaderSpec:
    """A loader to build: its config and the dataset it reads (of ``kind``, rebuilt from
    ``params`` elsewhere), and what its way in brings."""

    config: LoaderConfig
    dataset: Any  # None: a trainer's objects, which run only in its workers
    kind: Kind[Any]
    params: dict[str, Any]
    spawn: Callable[[], ProcessFactory]  # how its local workers fork: its dataset's zygote
    code: LoaderCode | None = None  # a trainer's objects; None: what the config names
    plan: BatchPlan | None = None  # a trainer's fed plan; None: the config's sampler
    resumed: dict[str, Any] | None = None  # its elastic epoch, from the registry
    keep: Callable[[dict[str, Any] | None], None] | None = None  # where a new one is kept
    iterable: bool | None = None  # what its dataset is, where it is not here (None: ask it)
    objects: Chain | None = None  # a trainer's payloads, which the engine then owns
    streams: int | None = None  # DataLoader's num_workers, where more than its processes


class Builder:
    def __init__(
        self,
        context: DatasetContext,
        executors: dict[str, Executor],
        admit: Admit,
        admit_ring: Admit,
        shm_free: Callable[[], int],
    ) -> None:
        """``admit``: the node's admission of a new loader; ``admit_ring``: of the ring a
        loader's first batches sized; ``shm_free()``: the memory budget left."""
        self._context = context
        self._executors = executors
        self._admit = admit
        self._admit_ring = admit_ring
        self._shm_free = shm_free

    def build(self, spec: LoaderSpec) -> LoaderEngine:
        """``spec`` prepared, admitted, made and started (its ring and producer come up
        in its boot thread: state "starting"). Raises the domain error that refuses it."""
        cfg = spec.config

        def cap() -> int:
            # Without max_batch_bytes, a collate_fn loader's slot (a per-batch layout's)
            # takes at most a quarter of the budget left (collate.loader_layout).
            return self._shm_free() // (4 * ring_slots(cfg))

        ready = pinfeed_server.engine.prepare(
            cfg,
            spec.dataset,
            spec.kind,
            self._executors,
            self._context.allowed_plugins,
            cap(),
            code=spec.code,
            plan=spec.plan,
            iterable=spec.iterable,
        )
        workers = cfg.num_workers if ready.executor.counts_workers else 0
        sizing = None
        if ready.layout is None:  # sized from its first batches: its ring admitted then
            self._admit(cfg, 0, workers)
            sizing = Sizing(self._admit_ring, cap)
        else:
            self._admit(cfg, ring_slots(cfg) * ready.layout.slot_bytes, workers)
        engine = LoaderEngine(
            cfg,
            ready.dataset,  # its transform over the shared dataset (and its cache)
            spec.kind,
            spec.params,
            self._context,
            ready.layout,
            ready.plan,
            ready.code,
            ready.executor,
            spawn=spec.spawn,
            resumed=spec.resumed,
            keep=spec.keep,
            sizing=sizing,
            iterable=spec.iterable,
            objects=spec.objects,
            streams=spec.streams,
        )
        engine.start()
        return engine
