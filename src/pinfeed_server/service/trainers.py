"""Loaders that trainers make: ``pinfeed.DataLoader(dataset, ...)`` over the script's own
objects, sent by value over the data-plane socket (a CREATE and its payload memfd).

Their objects are loaded here only where this process runs them (no workers: it makes
the batches, as DataLoader's main process does) or checks them for the node's cache
(``cache=``), the trainer's code run under ``GLOBAL_RNG``; with workers they are loaded
in the dataset's zygote and its workers alone. The loader is built as any loader is
(``build.py``), with the trainer's sampler feeding the plan (``engine/fed_plan.py``) and
its ring sized from its first batches. Such a loader is in no registry: it goes when
its trainer's connection does, or, named, waits warm for the next trainer that asks for
it with the same config and objects. When it goes, what holds its objects goes with
it: its zygote, its share of a cache, and the objects themselves (collected, as they
are in reference cycles); the engine closes their payloads.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import re
import threading
import time
import weakref
from typing import Any

from pydantic import ValidationError

from pinfeed import errors, payload, protocol
from pinfeed.payload import Chain
from pinfeed_server.cache.region import Region
from pinfeed_server.cache.shipped import ShippedCaches
from pinfeed_server.datasets import shipped
from pinfeed_server.engine import (
    MAX_WORKERS,
    NAME_PATTERN,
    FedPlan,
    LoaderCode,
    LoaderConfig,
    LoaderEngine,
    Peer,
    Zygote,
    Zygotes,
)
from pinfeed_server.global_rng import GLOBAL_RNG
from pinfeed_server.node.budget import NodeBudget
from pinfeed_server.service.build import Builder, LoaderSpec
from pinfeed_server.service.table import LoaderRecord, Owner

log = logging.getLogger("pinfeed")

# A trainer-made loader's zygote, apart from the registered datasets' ('~' is in no name).
OWNED_ZYGOTE = "~"
COLLECT_RETRY_S = (0.05, 10.0)  # a closed loader's objects: first retry, give up after


class TrainerLoaders:
    def __init__(
        self, zygotes: Zygotes, caches: ShippedCaches, builder: Builder, budget: NodeBudget
    ) -> None:
        """``caches``: the node's caches of trainers' datasets (``cache=``)."""
        self._zygotes = zygotes
        self._caches = caches
        self._builder = builder
        self._budget = budget
        self._ids = itertools.count()

    def name_for(self, request: protocol.Create, peer: Peer) -> str:
        """The loader's name: the trainer's, or one of its own for an unnamed loader."""
        return request.name or f"trainer-{peer.pid}-{next(self._ids)}"

    def reattach(
        self,
        record: LoaderRecord,
        request: protocol.Create,
        payload_fd: int,
        shared: list[int],
        peer: Peer,
    ) -> LoaderEngine:
        """Loader ``record``, the one of ``request``'s name, handed over warm to the
        trainer at ``peer`` (its epochs start afresh) with its objects (payload
        ``payload_fd``, the ``shared`` memory they map; the loader keeps duplicates); a
        Conflict saying why not."""
        name, owner = record.name, record.owner
        if owner is None:
            raise errors.Conflict(
                f"a loader named {name!r} exists, made over HTTP: attach to it with "
                "pinfeed.Loader(name), or give pinfeed.DataLoader another name"
            )
        if owner.digest != request.digest:
            raise errors.Conflict(
                f"loader {name!r} runs another configuration or other objects than this "
                "pinfeed.DataLoader's; give it another name, or delete the loader "
                f"(DELETE /v1/loaders/{name}) to make it anew"
            )
        if owner.attached:
            raise errors.Conflict(
                f"loader {name!r} is in use by the trainer pid {owner.peer.pid}; a named "
                "pinfeed.DataLoader serves one trainer at a time"
            )
        assert record.engine is not None  # a trainer's loader has started
        record.engine.restart_fed(os.dup(payload_fd), [os.dup(fd) for fd in shared])
        owner.peer, owner.attached = peer, True
        return record.engine

    def start(
        self, name: str, request: protocol.Create, payload_fd: int, shared: list[int], peer: Peer
    ) -> LoaderRecord:
        """Loader ``name`` for the trainer at ``peer``, over the objects in its payload
        (and the ``shared`` memory they map; the loader keeps duplicates), started;
        raises the pinfeed error that says why not (the data plane sends it)."""
        chain = Chain()  # the payloads of its objects, as they change (OBJECTS)
        chain.add(os.dup(payload_fd), [os.dup(fd) for fd in shared])
        try:
            engine = self._start(name, request, chain)
        except BaseException:
            chain.close()
            raise
        cache_key = ShippedCaches.key(request.cache_name, name) if request.cache else None
        owner = Owner(peer, request.digest, request.name is not None, cache_key)
        log.info("loader %s made by the trainer pid %d (uid %d)", name, peer.pid, peer.uid)
        return LoaderRecord(name, name, time.time(), engine, owner)

    def _start(self, name: str, request: protocol.Create, chain: Chain) -> LoaderEngine:
        """A trainer's loader over the objects in payload ``chain`` (the loader owns it),
        loaded here only where this process runs or checks them."""
        objects = None
        if request.num_workers == 0 or request.cache:
            with GLOBAL_RNG:  # the trainer's code runs here: not on a loader's RNGs
                objects = shipped.load(chain.fds, chain.shared)
        if not request.cache:
            return self._build(name, request, chain, objects, None)
        assert objects is not None
        name_ok = request.cache_name is None or re.fullmatch(NAME_PATTERN, request.cache_name)
        if not name_ok:
            raise errors.InvalidRequest(
                f"pinfeed.DataLoader: cache={request.cache_name!r}: a cache's name is "
                "letters, digits, '.', '_' and '-', 1-63 characters"
            )
        with GLOBAL_RNG:  # the check reads the trainer's dataset
            objects.dataset, region = self._caches.attach(
                request.cache_name, name, objects.dataset, request.cache_max_bytes
            )
        try:
            return self._build(name, request, chain, objects, region)
        except BaseException:
            self._caches.release(name)
            raise

    def _build(
        self,
        name: str,
        request: protocol.Create,
        chain: Chain,
        objects: shipped.Shipped | None,
        cache_region: Region | None,
    ) -> LoaderEngine:
        """Loader ``name`` over a trainer's ``objects`` (None: not loaded here; its
        dataset behind the node's cache, whose region is ``cache_region``, where it
        asked for one). No sample is read: its ring is sized from the first batches its
        producer makes, when the trainer's loop asks. Its ``batch_size`` is the rows a
        slot holds (the CREATE's ``max_rows``): DataLoader's ``batch_size``, or its
        batch_sampler's largest batch, which its plan feeds."""
        rows = request.max_rows or 1
        # DataLoader's num_workers are its RNG streams; its processes are as many as the
        # node has room for (one serves several streams where it has less), never none.
        processes = request.num_workers
        if processes:
            free = self._budget.max_workers - self._budget.workers_used()
            processes = max(1, min(processes, free, MAX_WORKERS))
        try:
            cfg = LoaderConfig(
                name=name,
                dataset=name,  # a label: its dataset is its own, never registered
                batch_size=rows,
                seed=0,  # its trainer draws the seeds
                drop_last=request.drop_last,
                num_workers=processes,
                prefetch_factor=request.prefetch_factor,
                pin_memory=request.pin_memory,
                persistent_workers=request.persistent_workers,
                executor=request.executor,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise errors.InvalidRequest(f"pinfeed.DataLoader: {problems}") from None
        plan = FedPlan(
            request.length or 0,
            rows,
            iterable=request.iterable,
            reported=request.batches_per_epoch,
            samples=request.samples,
            fed_turns=request.num_workers == 0,
        )
        params = shipped.params(request.draws)

        def zygote() -> Zygote:  # its objects as last shipped (a zygote started again)
            payload = (chain.fds, chain.shared)
            return self._zygotes.get(
                OWNED_ZYGOTE + name, objects, shipped.KIND.name, params, payload, cache_region
            )

        code = LoaderCode(None, None)  # its objects run only in its workers
        if objects is not None:
            code = LoaderCode(objects.collate_fn, objects.worker_init_fn)
        spec = LoaderSpec(
            cfg,
            None if objects is None else objects.dataset,
            shipped.KIND,
            params,
            spawn=lambda: zygote().process_factory,
            code=code,
            plan=plan,
            iterable=request.iterable,
            objects=chain,
            streams=request.num_workers,
        )
        engine = self._builder.build(spec)
        if objects is not None and cfg.num_workers == 0:
            # This process reads the shipped objects' pages itself: map them in now,
            # beside the trainer's start, not by faults in its first epoch.
            threading.Thread(
                target=payload.populate, args=(objects.mapping,), name=f"populate-{name}"
            ).start()
        return engine

    def close(self, record: LoaderRecord) -> None:
        """Close trainer's loader ``record`` (out of the table) and let go of its objects:
        the zygote that holds them (the engine closed their memfds), its share of a
        cache, the objects."""
        engine = record.engine
        assert engine is not None and record.owner is not None
        record.engine = None  # nothing here holds the loader while it is collected
        engine.close()
        self._zygotes.discard(OWNED_ZYGOTE + record.name)
        self._caches.release(record.name)  # a cache no other loader reads goes
        gone = _weak([engine, engine.dataset])
        del engine
        _collect_until_gone(record.name, gone)


def _weak(objs: list[Any]) -> list[weakref.ref[Any]]:
    refs = []
    for obj in objs:
        with contextlib.suppress(TypeError):  # an object that takes no weak reference
            refs.append(weakref.ref(obj))
    return refs


def _collect_until_gone(name: str, gone: list[weakref.ref[Any]], waited: float = 0.0) -> None:
    """Collect until what ``gone`` refers to (a closed loader, its dataset) is freed: the
    trainer's objects and their pages are in reference cycles, which only a collection
    frees, and one of the loader's threads may still be ending. At once, and again from
    a timer, backing off, for ``COLLECT_RETRY_S[1]`` at most."""
    gc.collect()
    if all(ref() is None for ref in gone):
        return
    if waited >= COLLECT_RETRY_S[1]:
        log.warning("loader %s: its objects still referenced %.0f s after it closed", name, waited)
        return
    pause = max(COLLECT_RETRY_S[0], waited)
    timer = threading.Timer(pause, _collect_until_gone, (name, gone, waited + pause))
    timer.daemon = True
    timer.start()
