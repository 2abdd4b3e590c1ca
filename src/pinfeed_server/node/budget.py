"""The node's limits on all loaders and caches together, and the admission functions.

PINFEED_MAX_WORKERS bounds the worker processes (and threads) that take this node's
CPUs; PINFEED_MAX_SHM_BYTES the memory every ring and every dataset's sample cache
holds or is about to (a cache reserves its ``max_bytes`` when its dataset is opened,
as a ring reserves its slots), and PINFEED_CACHE_MAX_BYTES the caches' share of it. A
new loader, a loader restarted from the registry and every live change (a PATCH,
autotune) is admitted by ``admit``, a cache by ``admit_cache``, or refused with the
domain error that says what to do (409 worker-limit, 507 insufficient-memory, mapped
to problem+json by the API).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pinfeed.errors import InsufficientMemory, WorkerLimit
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.loader import LoaderEngine


class NodeBudget:
    def __init__(
        self,
        max_workers: int,
        max_shm_bytes: int,
        loaders: Callable[[], Mapping[str, LoaderEngine]],
        caches: Callable[[], Mapping[str, int]] = dict,
        max_cache_bytes: int | None = None,
    ) -> None:
        """``caches()``: each cached dataset's reserved bytes, by dataset name."""
        self.max_workers = max_workers
        self.max_shm_bytes = max_shm_bytes
        self.max_cache_bytes = max_shm_bytes if max_cache_bytes is None else max_cache_bytes
        self._loaders = loaders
        self._caches = caches

    def workers_used(self, but: str | None = None) -> int:
        """Node workers of every loader, or of every loader but ``but``."""
        return sum(e.node_workers for n, e in list(self._loaders().items()) if n != but)

    def rings_used(self, but: str | None = None) -> int:
        """Ring bytes of every loader, or of every loader but ``but``."""
        return sum(e.reserved_bytes() for n, e in list(self._loaders().items()) if n != but)

    def cache_used(self, but: str | None = None) -> int:
        """Bytes reserved by every dataset's cache, or by every one but dataset ``but``'s."""
        return sum(b for n, b in list(self._caches().items()) if n != but)

    def shm_used(self, but: str | None = None) -> int:
        """The budget in use: every ring (but loader ``but``'s) and every cache."""
        return self.rings_used(but) + self.cache_used()

    def admit_cache(
        self, dataset: str, nbytes: int, smaller: str = "(or lower) cache.max_bytes"
    ) -> None:
        """Refuse a cache of ``nbytes`` for ``dataset`` where the node cannot take it;
        ``smaller``: the setting that makes it smaller, as the refusal names it."""
        free_cache = max(0, self.max_cache_bytes - self.cache_used(dataset))
        free = max(0, self.max_shm_bytes - self.rings_used() - self.cache_used(dataset))
        if nbytes <= min(free, free_cache):
            return
        which = (
            f"{free_cache} bytes of PINFEED_CACHE_MAX_BYTES={self.max_cache_bytes}"
            if free_cache < free
            else f"{free} bytes of PINFEED_MAX_SHM_BYTES={self.max_shm_bytes}"
        )
        raise InsufficientMemory(
            f"dataset {dataset!r} needs a cache of {nbytes} bytes; {which} are free. Give "
            f"{smaller} to keep a fixed subset of it, drop another dataset's cache, or "
            "raise the budget",
            need_bytes=nbytes,
            free_bytes=min(free, free_cache),
        )

    def admit(
        self, config: LoaderConfig, ring_bytes: int, workers: int, replaces: str | None = None
    ) -> None:
        """Refuse ``config`` (a new loader's, or loader ``replaces``'s new one), whose
        ring holds ``ring_bytes`` and whose processes take ``workers`` of the node's,
        where the node's limits cannot take it."""
        but = replaces if replaces is not None else config.name
        used = self.workers_used(but)
        if used + workers > self.max_workers:
            free = max(0, self.max_workers - used)
            raise WorkerLimit(
                f"loader {config.name!r} asks for {workers} worker processes; {free} of "
                f"PINFEED_MAX_WORKERS={self.max_workers} are free ({used} held by other "
                "loaders). Lower num_workers, delete a loader, or raise PINFEED_MAX_WORKERS",
                max_workers=self.max_workers,
                free_workers=free,
            )
        free_bytes = max(0, self.max_shm_bytes - self.shm_used(but))
        if ring_bytes > free_bytes:
            raise InsufficientMemory(
                f"loader {config.name!r} needs a ring of {ring_bytes} bytes; {free_bytes} "
                f"bytes of PINFEED_MAX_SHM_BYTES={self.max_shm_bytes} are free. Lower "
                "batch_size, num_workers or prefetch_factor, or raise the budget",
                need_bytes=ring_bytes,
                free_bytes=free_bytes,
            )
