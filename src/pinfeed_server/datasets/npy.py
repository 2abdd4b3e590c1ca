"""``npy``: memory-mapped ``.npy`` arrays, one per field, never read whole.

``paths`` as a list gives tuple samples, as a dict gives dict samples.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params, gather_rows


class NpyParams(Params):
    paths: list[str] | dict[str, str]


class NpyDataset:
    def __init__(self, arrays: list[np.ndarray[Any, Any]], keys: list[str] | None) -> None:
        lengths = {a.shape[0] if a.ndim else -1 for a in arrays}
        if -1 in lengths:
            raise DatasetError("every array needs at least one dimension")
        if len(lengths) != 1:
            raise DatasetError(f"arrays must have equal length, got lengths {sorted(lengths)}")
        for a in arrays:
            if not a.dtype.isnative:
                raise DatasetError(f"array dtype {a.dtype} is not in native byte order")
            try:
                torch.from_numpy(np.zeros(0, dtype=a.dtype))
            except TypeError:
                raise DatasetError(f"array dtype {a.dtype} has no torch equivalent") from None
        self.arrays = arrays
        # Tensors over the same read-only mappings, for index_select: it gathers rows
        # 1.2-5x faster than np.take(axis=0) (5x on 600 KB rows, where np.take copies
        # element-chunk by chunk). Never written through: torch has no read-only tensors,
        # hence its warning, silenced here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self._tensors = [torch.from_numpy(a) for a in arrays]
        self._keys = keys
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        # np.array copies the row out of the read-only mapping, as a Dataset
        # that reads a memory-mapped file would.
        items = [torch.from_numpy(np.array(a[index])) for a in self.arrays]
        if self._keys is not None:
            return dict(zip(self._keys, items, strict=True))
        return tuple(items)

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        gather_rows(self._tensors, indices, out)


def build(p: NpyParams, ctx: DatasetContext) -> NpyDataset:
    if isinstance(p.paths, dict):
        keys: list[str] | None = list(p.paths)
        rels = list(p.paths.values())
    else:
        keys, rels = None, p.paths
    if not rels:
        raise DatasetError("paths must name at least one .npy file")
    arrays = []
    for rel in rels:
        path = ctx.resolve(rel)
        try:
            arrays.append(np.load(path, mmap_mode="r", allow_pickle=False))
        except ValueError as exc:
            raise DatasetError(f"{rel}: not a plain .npy array ({exc})") from None
    return NpyDataset(arrays, keys)


KIND = Kind("npy", NpyParams, build, __doc__)
