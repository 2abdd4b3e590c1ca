"""The check a dataset passes before it is cached: the same sample every time, no RNG.

A cache serves the sample it stored, forever: a dataset that draws from the global
RNGs in ``__getitem__`` (a random augmentation) or returns something else on a second
read would be served its first draw in every epoch, which no DataLoader gives. So a
few samples (the first, the middle, the last, a few between) are read twice, with
``torch``'s, ``random``'s and numpy's global RNG states compared around each read,
and the two reads compared byte for byte (as records: ``record.py``). What moved is
named, with what to do. The RNG states are put back afterwards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from pinfeed.rng import RngState, capture, restore
from pinfeed_server.cache import record
from pinfeed_server.errors import DomainError

PROBES = 8
FIX = (
    "a cached dataset must return the same sample on every read: move the random "
    'augmentation into the loader\'s "transform" ("pkg.mod:callable", called per sample '
    "after the cache), or register the dataset without a cache"
)
KEEPS = (
    "the cache keeps tensors, numpy arrays, numbers, strings, bytes and None, in "
    "lists, tuples, dicts and namedtuples"
)


class NotCacheable(DomainError, ValueError):
    """A dataset the cache cannot keep; the message says why and what to do."""


@dataclass(frozen=True)
class Probe:
    indices: list[int]
    sizes: list[int]  # record bytes of each probed sample
    digest: str  # sha256 of the length and the probed samples' bytes: "the same data"

    @property
    def mean_size(self) -> float:
        return sum(self.sizes) / max(1, len(self.sizes))


def _moved(before: RngState, after: RngState) -> list[str]:
    """Which of the global RNGs (``pinfeed.rng.capture``'s) moved between two states."""
    names = ("torch's", "random's", "numpy's")
    same = (torch.equal(before[0], after[0]), before[1] == after[1], before[2] == after[2])
    return [name for name, kept in zip(names, same, strict=True) if not kept]


def probe_indices(length: int) -> list[int]:
    if length <= PROBES:
        return list(range(length))
    return sorted({round(k * (length - 1) / (PROBES - 1)) for k in range(PROBES)})


def check(what: str, dataset: Any, fix: str = FIX) -> Probe:
    """Read the probe samples of ``dataset`` (``what``, as messages name it: "dataset
    'x'") twice; NotCacheable naming what moved and ``fix``, what to do. Call it with
    the process's RNGs to itself (holding ``GLOBAL_RNG``: ``global_rng.py``)."""
    saved = capture()
    sizes: list[int] = []
    indices = probe_indices(len(dataset))
    digest = hashlib.sha256(len(dataset).to_bytes(8, "little"))
    try:
        for i in indices:
            reads: list[list[bytes]] = []
            size = 0
            for attempt in ("first", "second"):
                before = capture()
                try:
                    sample = dataset[i]
                except Exception as exc:
                    raise NotCacheable(
                        f"{what}: reading sample {i} to check it raised {type(exc).__name__}: {exc}"
                    ) from None
                moved = _moved(before, capture())
                if moved:
                    raise NotCacheable(
                        f"{what} cannot be cached: the {attempt} read of sample "
                        f"{i} moved {' and '.join(moved)} global RNG: {fix}"
                    )
                p = record.plan(sample)
                if p is None:
                    raise NotCacheable(
                        f"{what} cannot be cached: sample {i} holds a type the "
                        f"cache does not store ({type(sample).__name__} or inside it); {KEEPS}"
                    )
                reads.append(record.payload_bytes(p))
                size = p.size
            if reads[0] != reads[1]:
                raise NotCacheable(
                    f"{what} cannot be cached: two reads of sample {i} differ: {fix}"
                )
            sizes.append(size)
            for part in reads[0]:
                digest.update(len(part).to_bytes(8, "little") + part)
    finally:
        restore(saved)
    return Probe(indices, sizes, digest.hexdigest())
