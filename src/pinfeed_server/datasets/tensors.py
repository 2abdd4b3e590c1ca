"""``tensors``: a ``.pt`` or ``.safetensors`` file of equal-length tensors.

Like ``TensorDataset``: a tuple (or list) of tensors gives tuple (list) samples,
a dict gives dict samples; sample ``i`` indexes every tensor at ``i``.
``.pt`` files are loaded with ``weights_only=True`` only, memory-mapped so loaders
and workers share the file's pages; ``.safetensors`` files are memory-mapped
copy-on-write, never read whole. An ``s3://`` path is fetched whole into the node's
object cache and mapped from there, as a local file is.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params, gather_rows
from pinfeed_server.datasets.remote import RemoteDataset, Spans
from pinfeed_server.remote import RemoteObject, is_remote

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorsParams(Params):
    path: str


def _load_safetensors(path: Path, shown: str) -> dict[str, torch.Tensor]:
    with path.open("rb") as f:
        # ACCESS_COPY: a private mapping, so tensors are writable views that share
        # the page cache until someone writes (nobody does).
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        (header_len,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(mm[8 : 8 + header_len])
    except (struct.error, ValueError) as exc:
        raise DatasetError(f"{shown} is not a safetensors file: {exc}") from None
    base = 8 + header_len
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise DatasetError(f"tensor {name!r}: unsupported safetensors dtype {info['dtype']}")
        start, stop = info["data_offsets"]
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=stop - start, offset=base + start)
        out[name] = flat.view(dtype).view(info["shape"])
    return out


def _load(path: Path, shown: str) -> Any:
    """The file at ``path``, whose name (``shown``) says its format."""
    suffix = PurePosixPath(shown).suffix
    if suffix == ".safetensors":
        return _load_safetensors(path, shown)
    if suffix in (".pt", ".pth"):
        try:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except Exception as exc:
            # weights_only refuses pickled code; say so instead of a pickle trace.
            raise DatasetError(f"cannot load {shown} with weights_only=True: {exc}") from None
    raise DatasetError(f"{shown}: expected a .pt, .pth or .safetensors file")


class TensorsDataset:
    def __init__(self, data: Any) -> None:
        if isinstance(data, dict):
            keys = list(data)
            tensors = list(data.values())
        elif isinstance(data, (tuple, list)):
            keys = None
            tensors = list(data)
        elif isinstance(data, torch.Tensor):
            keys, tensors = None, [data]
            data = (data,)
        else:
            raise DatasetError(f"expected a tuple, list or dict of tensors, got {type(data)}")
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
            raise DatasetError("every entry must be a tensor with at least one dimension")
        lengths = {t.shape[0] for t in tensors}
        if len(lengths) != 1:
            raise DatasetError(f"tensors must have equal length, got lengths {sorted(lengths)}")
        self._kind: type = dict if keys is not None else type(data)
        self._keys = keys
        self.tensors = tensors
        self._length: int = int(lengths.pop())

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        items = [t[index] for t in self.tensors]
        if self._keys is not None:
            return dict(zip(self._keys, items, strict=True))
        return list(items) if self._kind is list else tuple(items)

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        gather_rows(self.tensors, indices, out)


def _whole(indices: NDArray[np.int64]) -> Spans:
    """Every sample reads the one object (unit 0), mapped whole."""
    uid = np.zeros(len(indices), dtype=np.int64)
    return [(uid, uid.copy())]


def build(p: TensorsParams, ctx: DatasetContext) -> Any:
    if is_remote(p.path):
        manifest = ctx.manifest([p.path], blocks=False, single=True)
        fd = RemoteObject(ctx.remote, manifest, 0).open_fd()  # type: ignore[arg-type]
        try:  # mapped by its name: the mapping outlives the descriptor and an eviction
            data = _load(Path(f"/proc/self/fd/{fd}"), p.path)
        finally:
            os.close(fd)
        return RemoteDataset(TensorsDataset(data), manifest, _whole)
    path = ctx.resolve(p.path)
    return TensorsDataset(_load(path, path.name))


KIND = Kind("tensors", TensorsParams, build, __doc__)
