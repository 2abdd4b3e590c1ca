"""A mixture loader's sources as one map-style dataset: ``Sources`` is their
concatenation (sample ``offsets[s] + i`` is source ``s``'s sample ``i``, as
``torch.utils.data.ConcatDataset``), which the loader's plan indexes by the mixing
rule (``engine/mixture.py``).

Not a kind a dataset is registered as: the service builds it for a loader with
``mixture`` from the sources' own (kind, params), and a worker or a zygote builds it
again from the same (``build_dataset`` knows ``KIND``). Each source is read as its
kind reads it, without its node cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch.utils._pytree import tree_leaves
from torch.utils.data import default_collate

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params


class SourceParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    params: dict[str, Any]


class SourcesParams(Params):
    sources: list[SourceParams]


class Sources:
    """The sources, concatenated."""

    def __init__(self, names: Sequence[str], datasets: Sequence[Any]) -> None:
        self.names = list(names)
        self.datasets = list(datasets)
        lengths = [len(d) for d in self.datasets]
        self.lengths = tuple(lengths)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return s, i - int(self.offsets[s])

    def __getitem__(self, index: int) -> Any:
        s, i = self.locate(index)
        return self.datasets[s][i]

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        # sample by sample, each into its row: the sources' own batched reads would need
        # the rows of one source together, and a mixture's batch interleaves them
        for row, index in enumerate(indices):
            s, i = self.locate(index)
            fetch = getattr(self.datasets[s], "fetch_into", None)
            if fetch is not None:
                fetch([i], [o[row : row + 1] for o in out])
            else:  # default_collate of one sample: its leaves, each [1, ...]
                one = default_collate([self.datasets[s][i]])
                for o, leaf in zip(out, tree_leaves(one), strict=True):
                    o[row : row + 1].copy_(leaf)

    def sources_of(self, indices: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Each sample's source."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def tokens_in(self, indices: Sequence[int]) -> np.ndarray[Any, Any]:
        """Per source, the tokens of samples ``indices`` where a source counts them
        (``tokens`` datasets), else 0."""
        out = np.zeros(len(self.datasets), dtype=np.int64)
        idx = np.asarray(indices, dtype=np.int64)
        which = self.sources_of(idx)
        for s in np.unique(which).tolist():
            count: Callable[[Sequence[int]], int] | None = getattr(
                self.datasets[s], "tokens_in", None
            )
            if count is not None:
                out[s] = count((idx[which == s] - self.offsets[s]).tolist())
        return out

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}: {k}" for n, k in zip(self.names, self.lengths, strict=True))
        return f"Sources({shown})"


def kind(build_source: Callable[[str, dict[str, Any], DatasetContext], Any]) -> Kind[Any]:
    """The mixture kind, building each source with ``build_source`` (the kinds'
    registry's ``build_dataset``, handed in: the registry imports this module)."""

    def build(p: SourcesParams, ctx: DatasetContext) -> Sources:
        built = []
        for src in p.sources:
            ds = build_source(src.kind, src.params, ctx)
            if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
                raise DatasetError(f"mixture source {src.name!r} is not a map-style dataset")
            built.append(ds)
        return Sources([s.name for s in p.sources], built)

    return Kind("mixture", SourcesParams, build, __doc__)
