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
``by_list``: each index list is fed as it is, and read as ``dataset[indices]``. Any other
sampler may yield an index list too, item by item: that one is fed after
``protocol.ITEM_LIST`` and read as ``dataset[indices]`` the same way (``key``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pinfeed.protocol import ITEM_LIST


class Unbatched:
    """The collate of a loader without automatic batching: ``collate_fn`` of the one
    sample of each batch of one."""

    def __init__(self, collate_fn: Callable[[Any], Any], by_list: bool = False) -> None:
        self.collate_fn = collate_fn
        self.by_list = by_list  # each fed batch is one index list: dataset[indices]

    def key(self, indices: Sequence[int]) -> int | list[int]:
        """What the dataset is indexed with for a fed batch: its one index, or the
        index list the sampler yielded (``by_list``, or after ``ITEM_LIST``)."""
        if self.by_list:
            return list(indices)
        if indices[0] == ITEM_LIST:
            return list(indices[1:])
        (index,) = indices
        return index

    def __call__(self, samples: list[Any]) -> Any:
        (sample,) = samples
        return self.collate_fn(sample)

    def __repr__(self) -> str:
        name = getattr(self.collate_fn, "__qualname__", type(self.collate_fn).__qualname__)
        return f"Unbatched({name})"
