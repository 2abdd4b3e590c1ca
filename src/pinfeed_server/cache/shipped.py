"""The caches of the one-line path: ``pinfeed.DataLoader(dataset, ..., cache=...)``.

A trainer's shipped dataset has no registered name to hang a cache on, so the trainer
names the cache: ``cache="imagenet-train"`` is one cache on the node, shared by every
``pinfeed.DataLoader`` that names it, in any job, while any of them runs;
``cache=True`` is a cache of that loader's own. What is cached is the deterministic
part, split as a named loader splits it: for ``pinfeed.Transformed(d, t)``, ``d`` (and
``t`` is called per sample after the cache, in the workers, on DataLoader's worker RNG
streams); for any other dataset, the whole of it. It is checked as a registered
dataset's cache is (``determinism.check``: a dataset that draws or changes is refused,
naming what moved), sized and admitted by the node's budget the same way, and read
through the same ``CachedDataset``.

"The same data" is what a loader joining a named cache must bring: the same length and
the same bytes at the probed samples (the probe's digest); another dataset under that
name is an error naming the cache. A difference only in samples the probe does not
read is not seen: the name is the trainer's promise, the digest the check of it.

A cache goes with the last loader that uses it (nothing stays in the server after its
trainers), and its memory with it. Not persisted: that is for registered datasets,
whose files pinfeed can fingerprint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pinfeed.transformed import Transformed
from pinfeed_server.cache.build import check, reservation
from pinfeed_server.cache.dataset import CachedDataset, Source
from pinfeed_server.cache.determinism import NotCacheable
from pinfeed_server.cache.region import Layout, Region
from pinfeed_server.cache.spec import CacheSpec
from pinfeed_server.cache.stats import CacheStats
from pinfeed_server.cache.store import SampleCache
from pinfeed_server.datasets import DatasetContext

PREFIX = "~"  # a shipped cache's key, as the node's budget and /metrics name it
FIX = (
    "a cached dataset must return the same sample on every read: pass "
    "pinfeed.Transformed(dataset, transform), whose dataset part is cached and whose "
    "transform (the random augmentation) runs per sample after the cache, or leave cache= out"
)


def behind(dataset: Any, cache: SampleCache, source: Source) -> Any:
    """``dataset`` with its deterministic part read through ``cache``: the base of a
    ``Transformed`` (its transform still applied after it, per sample), or the whole."""
    if isinstance(dataset, Transformed):
        return Transformed(CachedDataset(dataset.dataset, cache, source, True), dataset.transform)
    return CachedDataset(dataset, cache, source, True)


def attached(dataset: Any, region: Region, context: DatasetContext) -> Any:
    """In a zygote: its freshly loaded ``dataset`` behind the server's cache ``region``."""
    return behind(dataset, SampleCache(region, checksums=False), _source(context))


def _source(context: DatasetContext) -> Source:
    return ("shipped", {}, context)


@dataclass
class _Entry:
    cache: SampleCache
    digest: str
    users: set[str] = field(default_factory=set)


class ShippedCaches:
    """The node's caches of shipped datasets, by key, each with the loaders using it."""

    def __init__(self, context: DatasetContext, admit: Callable[[str, int, str], None]) -> None:
        """``admit(key, nbytes, smaller)``: the node budget's admission (raises where it
        cannot, naming ``smaller``, the setting that makes a cache smaller)."""
        self._context = context
        self._admit = admit
        self._lock = threading.RLock()  # the budget's admission reads reservations()
        self._entries: dict[str, _Entry] = {}

    @staticmethod
    def key(cache_name: str | None, loader: str) -> str:
        """The key of a cache named ``cache_name``, or of ``loader``'s own (None)."""
        return PREFIX + (cache_name if cache_name is not None else f"own-{loader}")

    def attach(
        self, cache_name: str | None, loader: str, dataset: Any, max_bytes: int | None
    ) -> tuple[Any, Region]:
        """``dataset`` (the shipped one) with its deterministic part behind the cache
        named ``cache_name`` (None: ``loader``'s own), made now or joined, for ``loader``;
        and the cache's region, for the zygote. NotCacheable where the dataset cannot be
        cached or is not the named cache's data. Call it with the process's RNGs to
        itself (the check reads samples)."""
        key = self.key(cache_name, loader)
        base = dataset.dataset if isinstance(dataset, Transformed) else dataset
        what = f"cache={cache_name!r}" if cache_name is not None else "cache=True"
        probe = check(f"the dataset of pinfeed.DataLoader({what})", base, FIX)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                nbytes = reservation(CacheSpec(max_bytes=max_bytes), probe, len(base))
                self._admit(key, nbytes, "(or lower) pinfeed.DataLoader's cache_max_bytes=")
                region = Region.memfd(key, Layout.within(len(base), nbytes))
                entry = _Entry(SampleCache(region, checksums=False), probe.digest)
                self._entries[key] = entry
            elif entry.digest != probe.digest:
                raise NotCacheable(
                    f"pinfeed.DataLoader({what}): that cache holds another dataset's "
                    f"samples (its length or the samples {probe.indices} differ from this "
                    "one's): name another cache, or give it the same dataset"
                )
            entry.users.add(loader)
        # (a transform that writes into its input is refused by the loader's prepare,
        # as a named loader's is)
        return behind(dataset, entry.cache, _source(self._context)), entry.cache.region

    def release(self, loader: str) -> None:
        """``loader`` is gone: a cache no other loader uses goes, and its memory."""
        with self._lock:
            gone = []
            for key, entry in self._entries.items():
                entry.users.discard(loader)
                if not entry.users:
                    gone.append(key)
            closing = [self._entries.pop(key).cache for key in gone]
        for cache in closing:
            cache.close()

    def reservations(self) -> dict[str, int]:
        """Each cache's reserved bytes, by key (the node budget's view)."""
        with self._lock:
            return {k: e.cache.region.layout.total for k, e in self._entries.items()}

    def stats(self) -> dict[str, CacheStats]:
        with self._lock:
            return {k: e.cache.stats() for k, e in sorted(self._entries.items())}

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.cache.close()


__all__ = ["NotCacheable", "ShippedCaches", "attached", "behind"]
