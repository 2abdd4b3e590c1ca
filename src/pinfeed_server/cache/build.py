"""A dataset's cache, made when the dataset is opened: checked, sized, mapped.

``check`` reads a few samples twice (``determinism.py``: a dataset that draws RNG or
changes is refused, naming what moved); ``reservation`` is the memory the cache will
hold, which the node's budget admits before ``build`` maps it: ``max_bytes`` if given,
else the whole dataset as estimated from the probed samples (their mean record size,
plus a margin for samples larger than those), never more than the region the dataset
can fill. ``build`` makes the region (a memfd, or with ``persist`` the dataset's file
under the cache directory, reopened or rebuilt: ``persist.py``) and wraps the dataset.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from pinfeed_server.cache.dataset import CachedDataset
from pinfeed_server.cache.determinism import FIX, NotCacheable, Probe
from pinfeed_server.cache.determinism import check as check_samples
from pinfeed_server.cache.fingerprint import fingerprint
from pinfeed_server.cache.persist import CacheBusy, open_file
from pinfeed_server.cache.region import Layout, Region
from pinfeed_server.cache.spec import CacheSpec
from pinfeed_server.cache.store import SampleCache
from pinfeed_server.datasets import DatasetContext

log = logging.getLogger("pinfeed.cache")

MARGIN = 1.10  # an estimated whole-dataset cache: samples up to 10% larger than the probes'


def check(what: str, dataset: Any, fix: str = FIX) -> Probe:
    """NotCacheable where ``dataset`` (``what``, as messages name it: "dataset 'x'")
    cannot be cached: the message says why, and ``fix`` what to do where it draws or
    changes."""
    iterable = isinstance(dataset, IterableDataset)  # DataLoader's test
    if iterable or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise NotCacheable(
            f"{what}: cache is for map-style datasets (__len__, __getitem__); "
            "an IterableDataset's samples have no index to keep them by"
        )
    if len(dataset) == 0:
        raise NotCacheable(f"{what} has no sample to cache")
    return check_samples(what, dataset, fix)


def reservation(spec: CacheSpec, probe: Probe, length: int) -> int:
    """The bytes the cache of a dataset of ``length`` samples will hold."""
    whole = Layout(length, int(probe.mean_size * length * MARGIN) + max(probe.sizes)).total
    return whole if spec.max_bytes is None else min(spec.max_bytes, whole)


def cache_path(cache_dir: Path, name: str) -> Path:
    return cache_dir / f"{name}.pfcache"


def build(
    name: str,
    dataset: Any,
    spec: CacheSpec,
    source: tuple[str, dict[str, Any], DatasetContext],
    max_bytes: int,
    cache_dir: Path,
    ship_base: bool,
) -> CachedDataset:
    """``dataset`` behind a cache of at most ``max_bytes`` (admitted by the caller)."""
    layout = Layout.within(len(dataset), max_bytes)
    region: Region | None = None
    reason: str | None = None
    if spec.persist:
        path = cache_path(cache_dir, name)
        try:
            region, reason = open_file(path, layout, fingerprint(*source))
        except CacheBusy as exc:
            log.warning("dataset %s: %s; its cache is kept in memory only", name, exc)
        if reason is not None:
            log.warning("dataset %s: cache file %s was %s: rebuilt", name, path, reason)
    persisted = region is not None
    if region is None:
        region = Region.memfd(name, layout)
    cache = SampleCache(region, checksums=persisted, persisted=persisted, rebuilt_reason=reason)
    return CachedDataset(dataset, cache, source, ship_base)
