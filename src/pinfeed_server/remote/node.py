"""``Remote``: the node's access to the object store, as the datasets see it.

It holds what is one per server: the client (``client.py``) and its counts, the object
cache (``cache.py``), the pool of GETs that fetch ahead, the link workers ask through
(``link.py``), and each loader's reader (``reader.py``). Datasets call ``manifest``
when they are built (the allow-list checked, the objects listed) and ``local`` for a
unit's file; a ``Remote`` pickled into a worker's zygote is a ``RemoteLink``, which
answers ``local`` the same way. Nothing starts before the first remote dataset.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pinfeed_server.remote.cache import ObjectCache
from pinfeed_server.remote.client import S3Client
from pinfeed_server.remote.errors import ObjectMissing
from pinfeed_server.remote.link import LinkServer, RemoteLink
from pinfeed_server.remote.objects import Manifest, ObjectInfo, Unit
from pinfeed_server.remote.reader import Reader
from pinfeed_server.remote.reads import RemoteReads
from pinfeed_server.remote.retry import Backoff
from pinfeed_server.remote.stats import Counts, RemoteStats
from pinfeed_server.remote.url import S3Url, check_allowed

LISTINGS_LENT = 64  # listings kept for zygotes to ask for (``Remote.lent``)
# what a loader's reads count and the node's totals add up (the rest the client counts)
LOADER_TOTALS = ("hits", "misses", "prefetched", "wait_s")


@dataclass(frozen=True)
class RemoteConfig:
    """The PINFEED_REMOTE_* settings (``settings.py`` has their documentation)."""

    allow: tuple[str, ...] = ()
    cache_dir: Path = Path("objects")
    max_bytes: int = 1 << 34
    block_bytes: int = 8 << 20
    concurrency: int = 32
    ahead_bytes: int = 1 << 29
    eviction: str = "next-use"
    retries: int = 10
    retry_s: float = 60.0
    verify: bool = True
    backoff: Backoff = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backoff", Backoff(self.retries, deadline_s=self.retry_s))


class Remote:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.counts = Counts()
        self._lock = threading.Lock()
        self._cache: ObjectCache | None = None
        self._client: S3Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._link: LinkServer | None = None
        self._readers: dict[int, Reader] = {}
        # the latest listing of each request, lent to zygotes that ask (``lent``)
        self._listings: OrderedDict[tuple[str, bool, bool], Manifest] = OrderedDict()

    def _open(self) -> tuple[S3Client, ObjectCache]:
        with self._lock:
            if self._cache is None or self._client is None:
                self._client = S3Client(self.counts, self.config.backoff)
                self._cache = ObjectCache(
                    self.config.cache_dir,
                    self.config.max_bytes,
                    self._client,
                    eviction=self.config.eviction,
                    concurrency=self.config.concurrency,
                    verify=self.config.verify,
                )
            return self._client, self._cache

    @property
    def cache(self) -> ObjectCache:
        return self._open()[1]

    @property
    def endpoint(self) -> str:
        return self._open()[0].endpoint

    # -- what datasets use ---------------------------------------------------------------
    def manifest(self, urls: str | list[str], *, blocks: bool, single: bool = False) -> Manifest:
        """The objects at ``urls``: object URLs with ``single`` (each one object), else
        every object under the prefix, sorted by key; whole objects or blocks."""
        shown = urls if isinstance(urls, str) else ", ".join(urls)
        parsed = [S3Url.parse(u) for u in ([urls] if isinstance(urls, str) else urls)]
        for url in parsed:
            check_allowed(url, self.config.allow)
        client, _ = self._open()
        objects: list[ObjectInfo]
        if single:
            objects = [client.head(url, shown) for url in parsed]
        else:
            objects = [o for url in parsed for o in client.list(url, shown)]
            if not objects:
                raise ObjectMissing(f"no object under {shown} (dataset {shown})")
        block = self.config.block_bytes if blocks else None
        found = Manifest(shown, client.endpoint, objects, block)
        with self._lock:
            self._listings[(shown, blocks, single)] = found
            self._listings.move_to_end((shown, blocks, single))
            while len(self._listings) > LISTINGS_LENT:
                self._listings.popitem(last=False)
        return found

    def lent(self, urls: str | list[str], blocks: bool, single: bool) -> Manifest:
        """What a zygote that builds a dataset over ``urls`` is given: the listing this
        server made for the same request last (the objects and ETags the server's own
        build of it reads), or one made now."""
        shown = urls if isinstance(urls, str) else ", ".join(urls)
        with self._lock:
            found = self._listings.get((shown, blocks, single))
        return found or self.manifest(urls, blocks=blocks, single=single)

    def local(self, unit: Unit, dataset: str) -> Path:
        return self.cache.get(unit, dataset)

    def __reduce__(self) -> tuple[Any, ...]:
        _, cache = self._open()
        with self._lock:
            if self._link is None:
                self._link = LinkServer(self.local, self.lent)
            link = self._link
        return (RemoteLink, (cache.root, link.address, link.authkey))

    # -- loaders -------------------------------------------------------------------------
    def reader(self, name: str, dataset: RemoteReads) -> Reader:
        _, cache = self._open()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.config.concurrency, thread_name_prefix="pinfeed-fetch"
                )
            # What is fetched ahead must still be there when its batch comes: under
            # next-use the cache lets in only what it keeps until then (``room_for``);
            # under either rule a quarter of the cache at most (more, under LRU in a cache
            # smaller than the dataset, evicts what it fetched before it is read, and
            # fetches it again: 28 GETs a sample measured)
            ahead = min(self.config.ahead_bytes, self.config.max_bytes // 4)
            reader = Reader(name, dataset, cache, self._pool, ahead, self.config.concurrency)
            self._readers[id(reader)] = reader
        return reader

    def forget(self, reader: Reader) -> None:
        reader.close()
        with self._lock:
            if self._readers.pop(id(reader), None) is not None:
                # the node's totals keep what a deleted loader's reads found
                snap = reader.counts.snapshot()
                self.counts.add(**{k: snap[k] for k in LOADER_TOTALS})

    def stats(self) -> RemoteStats | None:
        with self._lock:
            cache = self._cache
            readers = list(self._readers.values())
        if cache is None:
            return None
        loaders: dict[str, dict[str, float]] = {}
        for r in readers:
            snap = r.counts.snapshot()
            mine = loaders.setdefault(r.name, dict.fromkeys(snap, 0.0))
            for k, v in snap.items():
                mine[k] += v
        node = self.counts.snapshot()
        for k in LOADER_TOTALS:
            node[k] = sum(r[k] for r in loaders.values()) + node[k]
        return RemoteStats(node, cache.state(), loaders)

    def close(self) -> None:
        with self._lock:
            if self._link is not None:
                self._link.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
