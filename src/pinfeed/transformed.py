"""``Transformed(dataset, transform)``: ``Transformed(d, t)[i] == t(d[i])``.

The split of a sample's stages that pinfeed's sample cache rests on: ``dataset[i]``
is the deterministic part (read, decode, resize), which a server may decode once per
node and keep; ``transform`` is the random augmentation, drawn per loader on
DataLoader's worker RNG streams. A loader over a dataset with ``"transform":
"pkg.mod:callable"`` yields what ``DataLoader(Transformed(dataset, callable), ...)``
yields, and this class is that reference, in the trainer library so that a training
script can say it in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset


class Transformed(Dataset[Any]):
    """A map-style dataset whose sample ``i`` is ``transform(dataset[i])``."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.dataset[index])

    def __repr__(self) -> str:
        name = getattr(self.transform, "__qualname__", type(self.transform).__qualname__)
        return f"Transformed({self.dataset!r}, {name})"
