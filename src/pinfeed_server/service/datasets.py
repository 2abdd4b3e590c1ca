"""The registered datasets: each built once, behind its cache where it has one, and
shared by every loader of it (``POST /v1/datasets`` and the registry's rows).

A dataset is built at its registration (a file that will not open is refused then,
not at a loader's first batch) and again, after a restart, when something first needs
it. Its cache is checked (a dataset that draws or changes is refused, naming what
moved), admitted by the node's budget and mapped. The rule that a dataset in use stays
is the service's: it knows the loaders.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pinfeed import errors, protocol
from pinfeed_server import cache
from pinfeed_server.cache import CachedDataset, CacheSpec
from pinfeed_server.datasets import KINDS, DatasetContext, build_dataset
from pinfeed_server.engine import (
    Zygotes,
    dataset_len,
    describe,
    first_samples,
    is_iterable,
    probe,
)
from pinfeed_server.errors import DomainError, problem_of
from pinfeed_server.global_rng import GLOBAL_RNG
from pinfeed_server.node.budget import NodeBudget
from pinfeed_server.registry import DatasetRow, Registry
from pinfeed_server.schemas import DatasetCreate

log = logging.getLogger("pinfeed")


class Datasets:
    def __init__(
        self,
        registry: Registry,
        context: DatasetContext,
        budget: NodeBudget,
        zygotes: Zygotes,
        cache_dir: Path,
        lock: threading.RLock,
    ) -> None:
        """``zygotes``: the processes its loaders' workers fork from, one per dataset;
        ``cache_dir``: where persisted caches live; ``lock``: the service's."""
        self._registry = registry
        self._context = context
        self._budget = budget
        self._zygotes = zygotes
        self._cache_dir = cache_dir
        self._lock = lock
        self._built: dict[str, Any] = {}  # name -> built dataset, shared by its loaders

    def row(self, name: str) -> DatasetRow:
        """Dataset ``name``'s registry row; NotFound if there is none."""
        row = self._registry.dataset(name)
        if row is None:
            raise errors.NotFound(f"no dataset named {name!r}")
        return row

    def open(
        self, name: str, kind: str, params: dict[str, Any], spec: dict[str, Any] | None = None
    ) -> Any:
        """Dataset ``name``, built once (behind its cache, if ``spec`` asks for one) and
        shared by its loaders."""
        with self._lock:
            if name not in self._built:
                try:
                    ds = build_dataset(kind, params, self._context)
                except DomainError:
                    raise
                except Exception as exc:  # a corrupt file is the caller's problem, not a 500
                    log.warning("dataset %s cannot open", name, exc_info=True)
                    raise errors.InvalidRequest(
                        f"dataset {name!r} cannot open: {type(exc).__name__}: {exc}"
                    ) from None
                if spec is not None:
                    ds = self._cached(name, kind, params, ds, CacheSpec.model_validate(spec))
                self._built[name] = ds
            return self._built[name]

    def _cached(
        self, name: str, kind: str, params: dict[str, Any], ds: Any, spec: CacheSpec
    ) -> CachedDataset:
        """``ds`` behind a cache: checked (a 422 naming what moved), admitted by the
        node's budget (507), mapped (a persisted file reopened or rebuilt)."""
        with GLOBAL_RNG:  # the check watches the process's RNGs
            probe = cache.check(f"dataset {name!r}", ds)
        nbytes = cache.reservation(spec, probe, len(ds))
        self._budget.admit_cache(name, nbytes)
        return cache.build(
            name,
            ds,
            spec,
            (kind, params, self._context),
            nbytes,
            self._cache_dir,
            ship_base=KINDS[kind].ship_build,
        )

    def _caches(self) -> list[tuple[str, CachedDataset]]:
        return [(n, d) for n, d in list(self._built.items()) if isinstance(d, CachedDataset)]

    def reservations(self) -> dict[str, int]:
        """Each open cache's reserved bytes, by dataset name (the node budget's view)."""
        return {name: ds.cache.region.layout.total for name, ds in self._caches()}

    def cache_stats(self) -> dict[str, cache.CacheStats]:
        """The stats of every open dataset's cache, by dataset name."""
        return {name: ds.cache.stats() for name, ds in sorted(self._caches())}

    def create(self, body: DatasetCreate) -> None:
        """Build dataset ``body`` (a refusal says why) and register it."""
        with self._lock:
            self._forget(body.name)
            params = body.params
            spec = None if body.cache is None else body.cache.model_dump()
            self.open(body.name, body.kind, params, spec)
            self._registry.add_dataset(body.name, body.kind, params, spec)

    def describe_spec(self, kind: str, params: dict[str, Any]) -> protocol.Described:
        """A DESCRIBE (``pinfeed.ServerDataset``): what ``kind`` builds from ``params``
        here (its length, whether it is iterable), registering nothing."""
        ds = build_dataset(kind, params, self._context)
        return protocol.Described(dataset_len(ds), is_iterable(ds))

    def describe(self, name: str) -> dict[str, Any]:
        """Dataset ``name`` as ``GET /v1/datasets/{name}`` shows it (``DatasetPublic``):
        its length and first sample, or why it cannot open."""
        found = self.row(name)
        row: dict[str, Any] = {"name": name, "kind": found.kind, "params": found.params}
        row["created_at"] = found.created_at
        try:
            ds = self.open(name, found.kind, found.params, found.cache)
        except Exception as exc:  # refused as a request would be: shown as that problem
            shown = problem_of(exc) or exc
            return row | {"error": f"{type(shown).__name__}: {shown}"}
        try:
            if isinstance(ds, CachedDataset):
                row["cache"] = ds.cache.stats()
                ds = ds.base  # sample 0 as the dataset reads it: no hit or miss counted
            with GLOBAL_RNG:  # not while an inline loader has its RNGs swapped in
                sample = first_samples(ds)[0] if is_iterable(ds) else ds[0]
                row |= {"length": dataset_len(ds), "sample": describe(probe(sample, 1))}
        except Exception as exc:  # its first sample, shown as it raised
            row |= {"error": f"{type(exc).__name__}: {exc}"}
        return row

    def clear_cache(self, name: str) -> None:
        """Empty dataset ``name``'s cache and give its memory back (no loader of it may
        run: its workers may hold views of the cache)."""
        with self._lock:
            row = self.row(name)
            if row.cache is None:
                raise errors.NotFound(f"dataset {name!r} has no cache")
            ds = self.open(name, row.kind, row.params, row.cache)
            assert isinstance(ds, CachedDataset)
            ds.cache.clear()

    def delete(self, name: str) -> None:
        """Unregister dataset ``name``, drop its build and stop its zygote; its persisted
        cache file goes."""
        with self._lock:
            row = self.row(name)
            self._registry.delete_dataset(name)
            self._forget(name)  # the cache's memory goes once its zygote has unmapped it too
        self._zygotes.discard(name)
        if row.cache is not None and row.cache.get("persist"):
            cache.cache_path(self._cache_dir, name).unlink(missing_ok=True)

    def _forget(self, name: str) -> None:
        """Drop dataset ``name``'s build (and close its cache); under the lock."""
        ds = self._built.pop(name, None)
        if isinstance(ds, CachedDataset):
            ds.cache.close()

    def close(self) -> None:
        with self._lock:
            for name in list(self._built):
                self._forget(name)
