"""The node's sample cache: a dataset's samples, decoded once per node, served to every
epoch, loader and job of the dataset.

    spec.py         CacheSpec: what POST /v1/datasets asks (max_bytes, persist)
    build.py        check, size and make a dataset's cache when it is opened
    determinism.py  the check: the same sample on every read, no RNG drawn
    dataset.py      CachedDataset: dataset[i] through the cache; pickles to the zygote
    shipped.py      ShippedCaches: pinfeed.DataLoader's cache=, by name, shared, refcounted
    store.py        SampleCache: lookups, inserts made once, the fixed subset, counts
    region.py       the mapped region: header, counters, index, records (memfd or file)
    record.py       one sample as bytes, and back as views (no unpickling)
    locks.py        byte-range locks every process shares (samples, allocator, slots)
    counters.py     hits and misses, one slot per process
    persist.py      the region in a file: reopened, or rebuilt when stale/truncated
    fingerprint.py  what made a file: kind, params, the files' sizes and mtimes, code
    stats.py        CacheStats: the one snapshot every view reads

Entry points: ``build`` and ``check`` (a registered dataset's cache, made when the
service opens it), ``CachedDataset`` (what loaders read), ``ShippedCaches`` (a
trainer's). docs/architecture/cache.md has the design.
"""

from __future__ import annotations

from pinfeed_server.cache.build import build, cache_path, check, reservation
from pinfeed_server.cache.dataset import CachedDataset
from pinfeed_server.cache.determinism import NotCacheable
from pinfeed_server.cache.spec import CacheSpec
from pinfeed_server.cache.stats import CacheStats

__all__ = [
    "CacheSpec",
    "CacheStats",
    "CachedDataset",
    "NotCacheable",
    "build",
    "cache_path",
    "check",
    "reservation",
]
