"""``CachedDataset``: ``dataset[i]`` through the node's cache, shared by every loader of
the dataset and by the processes its workers are forked from.

The service builds one per cached dataset (``build.py``) and uses it where it used the
dataset: every loader's producers read through it (a loader's own ``transform`` is
applied on top, per loader), and the dataset's zygote (``engine/producers/zygote.py``)
gets it, so its workers inherit the mapped region. It pickles (to a process that
multiprocessing starts) as the region's file descriptor and the base dataset: by value
where its kind ships its build (``images``: shared arrays, themselves file
descriptors), or as its build spec, rebuilt where it lands (``rebuilt_in_zygote``),
so no sample and no index is ever copied into a worker.

Only ``__getitem__`` goes through the cache (DataLoader's per-sample reads); any other
attribute is the base dataset's, but for the batched reads that would go around it
(``fetch_into``, ``__getitems__``).
"""

from __future__ import annotations

import copy
import operator
from typing import Any

from pinfeed.rng import capture, restore
from pinfeed_server.cache import record
from pinfeed_server.cache.region import Region
from pinfeed_server.cache.store import SampleCache
from pinfeed_server.datasets import DatasetContext, build_dataset

Source = tuple[str, dict[str, Any], DatasetContext]  # kind, params, context


class CachedDataset:
    def __init__(self, base: Any, cache: SampleCache, source: Source, ship_base: bool) -> None:
        self.base = base
        self.cache = cache
        self._source = source
        self._ship_base = ship_base

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: Any) -> Any:
        try:
            i = operator.index(index)
        except TypeError:
            return self.base[index]  # not a position: the dataset's own business
        n = len(self.cache)
        if not -n <= i < n:
            return self.base[index]  # its own IndexError
        return self.cache.get(i % n, self.base.__getitem__)

    def __getattr__(self, name: str) -> Any:
        # Not the read paths that would go around the cache (a kind's batched read).
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.base, name)

    def __copy__(self) -> CachedDataset:
        return CachedDataset(self.base, self.cache, self._source, self._ship_base)

    def check_transform(self, transform: Any, index: int) -> str | None:
        """Why ``transform`` cannot run over this cache (it writes into its input, which
        a worker gets as a read-only view of the cache), or None. The RNGs are put back."""
        sample = self[index]  # the server's copy
        planned = record.plan(sample)
        if planned is None:
            return None
        before = record.payload_bytes(planned)  # bytes now: a plan views the sample
        saved = capture()
        try:
            transform(sample)
        except Exception:
            return None  # its error is the batch's, as under DataLoader
        finally:
            restore(saved)
        after = record.plan(sample)
        if after is None or record.payload_bytes(after) != before:
            return (
                f"transform writes into the sample it is given (sample {index} changed); the "
                "workers get a cached sample as a read-only view of the node's cache: make "
                "it return new tensors (e.g. x = x.clone() first, or out-of-place ops)"
            )
        return None

    def rebuilt_in_zygote(self) -> CachedDataset:
        """This dataset, pickled with its base as a build spec (a base that does not
        pickle, or a kind whose zygote builds its own)."""
        clone = copy.copy(self)
        clone._ship_base = False
        return clone

    def __reduce__(self) -> tuple[Any, ...]:
        base = self.base if self._ship_base else _Build(*self._source)
        cache = self.cache
        return (_attached, (base, cache.region, cache.checksums, self._source))

    def __repr__(self) -> str:
        return f"CachedDataset({self.base!r}, {self.cache.samples()}/{len(self)} stored)"


_OWN = frozenset({"base", "cache", "_source", "_ship_base", "fetch_into"})


class _Build:
    """A dataset's build spec that pickles as the call that builds it."""

    def __init__(self, kind: str, params: dict[str, Any], context: DatasetContext) -> None:
        self.spec = (kind, params, context)

    def __reduce__(self) -> tuple[Any, ...]:
        return (build_dataset, self.spec)


def _attached(base: Any, region: Region, checksums: bool, source: Source) -> CachedDataset:
    return CachedDataset(base, SampleCache(region, checksums=checksums), source, False)
