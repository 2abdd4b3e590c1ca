"""``Unbatched(collate_fn)``: DataLoader's ``batch_size=None``, as a collate a server runs.

Without automatic batching (``batch_size=None``, no ``batch_sampler``) DataLoader's
sampler yields one index at a time, its fetcher reads ``dataset[index]`` (never
``__getitems__``), or an iterable's next item, and each item it yields is
``collate_fn(sample)``: ``default_convert`` unless the script gives its own, so a
sample keeps its shape, with no batch dimension. ``pinfeed.DataLoader`` feeds such an
index as a batch of one and ships this wrapper as the loader's ``collate_fn``; the
server's fetch reads the one sample as DataLoader's does where the collate is one
(``pinfeed_server.engine.collate.fetch_samples``).

The batched read DataLoader is tuned with (a ``BatchSampler`` given as ``sampler=``,
``batch_size=None``: ``dataset[indices]`` makes the whole batch in one call) is
``by_list``: each index list is fed as it is, and read as ``dataset[indices]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Unbatched:
    """The collate of a loader without automatic batching: ``collate_fn`` of the one
    sample of each batch of one."""

    def __init__(self, collate_fn: Callable[[Any], Any], by_list: bool = False) -> None:
        self.collate_fn = collate_fn
        self.by_list = by_list  # each fed batch is one index list: dataset[indices]

    def __call__(self, samples: list[Any]) -> Any:
        (sample,) = samples
        return self.collate_fn(sample)

    def __repr__(self) -> str:
        name = getattr(self.collate_fn, "__qualname__", type(self.collate_fn).__qualname__)
        return f"Unbatched({name})"
