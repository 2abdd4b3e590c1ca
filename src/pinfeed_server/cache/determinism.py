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
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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


RngStates = tuple[Any, Any, Any]


def capture_rngs() -> RngStates:
    """torch's, random's and numpy's global RNG states."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def restore_rngs(states: RngStates) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _moved(before: RngStates, after: RngStates) -> list[str]:
    moved = []
    if not torch.equal(before[0], after[0]):
        moved.append("torch's")
    if before[1] != after[1]:
        moved.append("random's")
    b, a = before[2], after[2]
    if b[0] != a[0] or not np.array_equal(b[1], a[1]) or b[2:] != a[2:]:
        moved.append("numpy's")
    return moved


def probe_indices(length: int) -> list[int]:
    if length <= PROBES:
        return list(range(length))
    return sorted({round(k * (length - 1) / (PROBES - 1)) for k in range(PROBES)})


def check(what: str, dataset: Any, fix: str = FIX) -> Probe:
    """Read the probe samples of ``dataset`` (``what``, as messages name it: "dataset
    'x'") twice; NotCacheable naming what moved and ``fix``, what to do. Call it with
    the process's RNGs to itself (holding ``GLOBAL_RNG``: ``global_rng.py``)."""
    saved = capture_rngs()
    sizes: list[int] = []
    indices = probe_indices(len(dataset))
    digest = hashlib.sha256(len(dataset).to_bytes(8, "little"))
    try:
        for i in indices:
            reads: list[list[bytes]] = []
            size = 0
            for attempt in ("first", "second"):
                before = capture_rngs()
                try:
                    sample = dataset[i]
                except Exception as exc:
                    raise NotCacheable(
                        f"{what}: reading sample {i} to check it raised {type(exc).__name__}: {exc}"
                    ) from None
                moved = _moved(before, capture_rngs())
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
        restore_rngs(saved)
    return Probe(indices, sizes, digest.hexdigest())
