"""Loaders that trainers make: ``pinfeed.DataLoader(dataset, ...)`` over the script's own
objects, sent by value over the data-plane socket (a CREATE and its payload memfd).

Their objects are loaded here (the trainer's code, run under ``GLOBAL_RNG``), put behind
the node's cache where the trainer asked for one (``cache=``), and built as any loader
is (``build.py``), with the trainer's sampler feeding the plan (``engine/fed_plan.py``).
Such a loader is in no registry: it goes when its trainer's connection does, or, named,
waits warm for the next trainer that asks for it with the same config and objects.
When it goes, what holds its objects goes with it: its zygote, the payload memfd, its
share of a cache, and the objects themselves (collected, as they are in reference
cycles).
"""

from __future__ import annotations

import contextlib
import functools
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
from pinfeed_server.cache.region import Region
from pinfeed_server.cache.shipped import ShippedCaches
from pinfeed_server.datasets import shipped
from pinfeed_server.engine import (
    NAME_PATTERN,
    FedPlan,
    LoaderCode,
    LoaderConfig,
    LoaderEngine,
    Peer,
    Zygotes,
    is_iterable,
)
from pinfeed_server.global_rng import GLOBAL_RNG
from pinfeed_server.service.build import Builder, LoaderSpec
from pinfeed_server.service.table import LoaderRecord, Owner

log = logging.getLogger("pinfeed")

# A trainer-made loader's zygote, apart from the registered datasets' ('~' is in no name).
OWNED_ZYGOTE = "~"
COLLECT_RETRY_S = (0.05, 10.0)  # a closed loader's objects: first retry, give up after


class TrainerLoaders:
    def __init__(self, zygotes: Zygotes, caches: ShippedCaches, builder: Builder) -> None:
        """``caches``: the node's caches of trainers' datasets (``cache=``)."""
        self._zygotes = zygotes
        self._caches = caches
        self._builder = builder
        self._ids = itertools.count()

    def name_for(self, request: protocol.Create, peer: Peer) -> str:
        """The loader's name: the trainer's, or one of its own for an unnamed loader."""
        return request.name or f"trainer-{peer.pid}-{next(self._ids)}"

    def reattach(self, record: LoaderRecord, request: protocol.Create, peer: Peer) -> LoaderEngine:
        """Loader ``record``, the one of ``request``'s name, handed over warm to the
        trainer at ``peer`` (its epochs start afresh); a Conflict saying why not."""
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
        record.engine.restart_fed()
        owner.peer, owner.attached = peer, True
        return record.engine

    def start(
        self, name: str, request: protocol.Create, payload_fd: int, peer: Peer
    ) -> LoaderRecord:
        """Loader ``name`` for the trainer at ``peer``, over the objects in its payload,
        started; raises the pinfeed error that says why not (the data plane sends it)."""
        fd = os.dup(payload_fd)
        try:
            engine = self._start(name, request, fd)
        except BaseException:
            os.close(fd)
            raise
        cache_key = ShippedCaches.key(request.cache_name, name) if request.cache else None
        owner = Owner(peer, request.digest, fd, request.name is not None, cache_key)
        log.info("loader %s made by the trainer pid %d (uid %d)", name, peer.pid, peer.uid)
        return LoaderRecord(name, name, time.time(), engine, owner)

    def _start(self, name: str, request: protocol.Create, fd: int) -> LoaderEngine:
        with GLOBAL_RNG:  # the trainer's code runs here: not on a loader's RNGs
            objects = shipped.load(fd)
        if not request.cache:
            return self._build(name, request, fd, objects, None)
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
            return self._build(name, request, fd, objects, region)
        except BaseException:
            self._caches.release(name)
            raise

    def _build(
        self,
        name: str,
        request: protocol.Create,
        fd: int,
        objects: shipped.Shipped,
        cache_region: Region | None,
    ) -> LoaderEngine:
        """Loader ``name`` over a trainer's ``objects`` (its dataset behind the node's
        cache, whose region is ``cache_region``, where it asked for one). Its
        ``batch_size`` is the rows a slot holds (the CREATE's ``max_rows``): DataLoader's
        ``batch_size``, or its batch_sampler's largest batch, which its plan feeds."""
        rows = request.max_rows
        try:
            cfg = LoaderConfig(
                name=name,
                dataset=name,  # a label: its dataset is its own, never registered
                batch_size=rows,
                seed=0,  # its trainer draws the seeds
                drop_last=request.drop_last,
                num_workers=request.num_workers,
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
            iterable=is_iterable(objects.dataset),
            reported=request.batches_per_epoch,
            samples=request.samples,
            fed_turns=request.num_workers == 0,
        )
        params = shipped.params(objects)
        zygote = functools.partial(
            self._zygotes.get,
            OWNED_ZYGOTE + name,
            objects,
            shipped.KIND.name,
            params,
            fd,
            cache_region,
        )
        spec = LoaderSpec(
            cfg,
            objects.dataset,
            shipped.KIND,
            params,
            spawn=lambda: zygote().process_factory,
            code=LoaderCode(objects.collate_fn, objects.worker_init_fn),
            plan=plan,
        )
        engine = self._builder.build(spec)
        if cfg.num_workers == 0:
            # This process reads the shipped objects' pages itself: map them in now,
            # beside the trainer's start, not by faults in its first epoch.
            threading.Thread(
                target=payload.populate, args=(objects.mapping,), name=f"populate-{name}"
            ).start()
        return engine

    def close(self, record: LoaderRecord) -> None:
        """Close trainer's loader ``record`` (out of the table) and let go of its objects:
        the zygote that holds them, their memfd, its share of a cache, the objects."""
        engine, owner = record.engine, record.owner
        assert engine is not None and owner is not None
        record.engine = None  # nothing here holds the loader while it is collected
        engine.close()
        self._zygotes.discard(OWNED_ZYGOTE + record.name)
        os.close(owner.payload_fd)
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
