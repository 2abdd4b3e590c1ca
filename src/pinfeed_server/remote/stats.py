"""What the node's reads from the store cost and what the cache saved: counters, and the
snapshot every view (``GET /v1/node``, ``/metrics``, a loader's stats, ``pinfeed
status``) reads.

``Counts`` is one set of counters under a lock: the node's own (every request the
server made to the store) and one per loader (what its batches needed: a unit found in
the cache is a hit, one fetched for it a miss; its bytes and requests are those
fetched for it, by its look-ahead or while a batch waited; ``wait_s`` the time its
batches waited for the store, the stall a slow store causes).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields


@dataclass
class Counts:
    requests: int = 0  # GETs, HEADs and LISTs sent to the store, retries included
    bytes: int = 0  # body bytes received from the store
    retries: int = 0  # requests tried again (throttling, resets, truncation, 5xx)
    throttled: int = 0  # of those, answers of 503 SlowDown / 429
    errors: int = 0  # reads that failed for good (reported to a batch or a registration)
    hits: int = 0  # units a read found in the cache
    misses: int = 0  # units a read had to fetch (or wait for)
    prefetched: int = 0  # units fetched ahead of their batch
    wait_s: float = 0.0  # seconds reads waited for the store

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CacheState:
    max_bytes: int
    held_bytes: int
    entries: int
    pinned: int
    evictions: int
    eviction: str  # the rule: "next-use" or "lru"
    wasted: int = 0  # units fetched ahead and evicted before any read: fetched twice


@dataclass(frozen=True)
class RemoteStats:
    """The node's: its counts, its cache, and each loader's counts by name."""

    counts: dict[str, float]
    cache: CacheState
    loaders: dict[str, dict[str, float]]

    def to_json(self) -> dict[str, object]:
        return {"store": self.counts, "cache": asdict(self.cache), "loaders": self.loaders}

    @property
    def hit_ratio(self) -> float:
        seen = self.counts["hits"] + self.counts["misses"]
        return self.counts["hits"] / seen if seen else 0.0
