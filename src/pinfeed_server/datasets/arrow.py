"""Arrow tables as samples, for the ``hf`` and ``parquet`` kinds.

What a sample holds follows ``datasets``' torch format (``.with_format("torch")``):
integers become int64 tensors, floats float32, booleans bool (``native_dtypes`` keeps
the column's own dtype instead); a fixed-size list (``List(..., length=n)``, nested) or
an ``Array2D``..``Array5D`` of fixed shape is a tensor of that shape; a variable-length
list is a 1-D tensor (2-D for a list of fixed-size lists) whose length varies from
sample to sample, so batches of it need a ``collate_fn``; a string is a ``str``; an
``Image`` feature (a struct of ``bytes`` and ``path``) is decoded with Pillow (EXIF
orientation applied, as ``datasets`` does) into a ``[C, H, W]`` tensor of the image's
own dtype, or, with ``image_size``, converted to RGB, its shorter side resized and
center-cropped as the ``images`` kind does: uint8 ``[3, size, size]``. ``ClassLabel``
columns are their int64 label. Columns are read through pyarrow over memory-mapped
files; only the rows a batch needs are touched.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from pydantic import Field

from pinfeed_server.datasets.base import DatasetError, Params
from pinfeed_server.datasets.images import fit, safe_formats

Columns = list[str] | dict[str, str] | None


class ArrowParams(Params):
    columns: Columns = Field(
        None,
        description="a list of column names (tuple samples, in that order), a dict of "
        "sample key -> column name (dict samples), or null: every column, by name",
    )
    image_size: int | None = Field(
        None, gt=0, le=8192, description="Image columns: RGB, shorter side resized, cropped"
    )
    native_dtypes: bool = Field(
        False, description="keep the columns' dtypes (datasets' torch format: int64/float32)"
    )


@dataclass(frozen=True)
class Spec:
    """How one selected column becomes a sample's value."""

    name: str
    form: str  # "number" | "array" | "list" | "str" | "image"
    dtype: Any  # numpy dtype of the tensor (number, array, list); None otherwise
    shape: tuple[int, ...]  # number: (), array: fixed shape, list: (-1,) or (-1, k)


def features(schema: pa.Schema) -> dict[str, Any]:
    """The ``datasets`` features kept in the schema metadata ({} when there are none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        found = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return {}
    return found if isinstance(found, dict) else {}


def same_schema(schema: pa.Schema, first: pa.Schema, shown: str, first_shown: str) -> None:
    """Refuse a file whose columns differ from the first file's, saying how."""
    if schema.equals(first, check_metadata=False):
        return
    if schema.names != first.names:
        problem = f"columns {schema.names}, {first_shown} has {first.names}"
    else:
        name = next(n for n in schema.names if schema.field(n).type != first.field(n).type)
        problem = f"column {name!r} is {schema.field(name).type}, in {first_shown} " + str(
            first.field(name).type
        )
    raise DatasetError(f"{shown}: schema differs from the first file's: {problem}")


def _numeric(t: pa.DataType) -> bool:
    return (
        (pa.types.is_integer(t) and not pa.types.is_uint64(t))
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
    )


def _dtype(t: pa.DataType, native: bool) -> Any:
    dt = np.dtype(t.to_pandas_dtype())
    if native or dt.kind == "b":
        return dt
    return np.dtype(np.int64) if dt.kind in "iu" else np.dtype(np.float32)


def spec_of(field: pa.Field, feature: Any, native: bool) -> Spec:
    name, t = field.name, field.type
    if isinstance(t, pa.BaseExtensionType):  # Array2D-5D, where datasets is imported
        t = t.storage_type
    ftype = feature.get("_type") if isinstance(feature, dict) else None
    if ftype == "Image":
        children = {t.field(i).name for i in range(t.num_fields)} if pa.types.is_struct(t) else ()
        if not {"bytes", "path"} <= set(children):
            raise DatasetError(f"column {name!r}: an Image feature stored as {t}, not a struct")
        return Spec(name, "image", None, ())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Spec(name, "str", None, ())
    if _numeric(t):
        return Spec(name, "number", _dtype(t, native), ())
    if ftype in ("Array2D", "Array3D", "Array4D", "Array5D"):
        shape = tuple(feature.get("shape") or ())
        inner = t
        while pa.types.is_list(inner) or pa.types.is_fixed_size_list(inner):
            inner = inner.value_type
        if not shape or None in shape or not _numeric(inner):
            raise DatasetError(f"column {name!r}: {ftype} of shape {shape} is not fixed-size")
        return Spec(name, "array", _dtype(inner, native), shape)
    shape_: list[int] = []
    inner = t
    while pa.types.is_fixed_size_list(inner):
        shape_.append(inner.list_size)
        inner = inner.value_type
    if shape_ and _numeric(inner):
        return Spec(name, "array", _dtype(inner, native), tuple(shape_))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        if _numeric(v):
            return Spec(name, "list", _dtype(v, native), (-1,))
        if pa.types.is_fixed_size_list(v) and _numeric(v.value_type):
            return Spec(name, "list", _dtype(v.value_type, native), (-1, v.list_size))
    raise DatasetError(
        f"column {name!r}: type {t} is not supported (numbers, fixed-size lists and "
        "Array2D-5D, variable-length lists of numbers, strings, Image, ClassLabel); "
        "leave it out with 'columns'"
    )


def select(
    schema: pa.Schema, columns: Columns, native: bool, feats: dict[str, Any] | None = None
) -> tuple[list[Spec], list[str] | None]:
    """(specs of the selected columns, the sample's dict keys or None for tuples);
    ``feats``: the ``datasets`` features, when the schema's metadata lacks them."""
    names = schema.names
    if columns is None:
        wanted, keys = names, names
    elif isinstance(columns, dict):
        wanted, keys = list(columns.values()), list(columns)
    else:
        wanted, keys = columns, None
    if not wanted:
        raise DatasetError("columns must select at least one column")
    missing = [c for c in wanted if c not in names]
    if missing:
        raise DatasetError(f"no column {', '.join(map(repr, missing))}; columns are {names}")
    feats = features(schema) or feats or {}
    specs = [spec_of(schema.field(c), feats.get(c), native) for c in wanted]
    return specs, (list(keys) if keys is not None else None)


def _flat(arr: pa.Array, depth: int) -> np.ndarray[Any, Any]:
    for _ in range(depth):
        arr = arr.flatten()
    flat: np.ndarray[Any, Any] = arr.to_numpy(zero_copy_only=False)
    return flat


class Frame:
    """The selected columns of one table, sample by sample (record batch by batch)."""

    def __init__(self, table: pa.Table, specs: list[Spec], image: Callable[[Any, int], Any]):
        self.specs, self._image = specs, image
        batches = table.select([s.name for s in specs]).to_batches()
        self.offsets = np.cumsum([0, *(b.num_rows for b in batches)], dtype=np.int64)
        self._cols: list[list[Any]] = []
        for b in batches:
            cols: list[Any] = []
            for s, arr in zip(specs, b.columns, strict=True):
                if isinstance(arr, pa.ExtensionArray):
                    arr = arr.storage
                if s.form in ("number", "array", "list", "str") and arr.null_count:
                    raise DatasetError(f"column {s.name!r} has {arr.null_count} null values")
                if s.form == "number":
                    cols.append(arr.to_numpy(zero_copy_only=False))
                elif s.form == "array":
                    cols.append(_flat(arr, len(s.shape)).reshape(len(arr), *s.shape))
                else:
                    cols.append(arr)
            self._cols.append(cols)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[list[Any], int]:
        b = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self._cols[b], index - int(self.offsets[b])

    def arrays(self, index: int) -> list[Any]:
        """The sample's values as numpy arrays (numbers, arrays, lists, images) or str."""
        cols, j = self._locate(index)
        out: list[Any] = []
        for s, col in zip(self.specs, cols, strict=True):
            if s.form in ("number", "array"):
                out.append(col[j])
            elif s.form == "list":
                values = col[j].values
                out.append(_flat(values, len(s.shape) - 1).reshape(s.shape))
            elif s.form == "str":
                out.append(col[j].as_py())
            else:
                out.append(self._image(col[j].as_py(), index))
        return out

    def sample(self, index: int) -> list[Any]:
        out: list[Any] = []
        for s, v in zip(self.specs, self.arrays(index), strict=True):
            if s.form == "str":
                out.append(v)
            elif s.form == "image":
                out.append(torch.from_numpy(np.ascontiguousarray(v)))
            else:
                out.append(torch.from_numpy(np.array(v, dtype=s.dtype)))
        return out


def image_decoder(size: int | None, resolve: Callable[[str], Path]) -> Callable[[Any, int], Any]:
    """``datasets.Image().decode_example`` (then ``images``' resize and crop with
    ``size``) as a ``[C, H, W]`` array view; a ``path`` is opened inside the data root."""

    def decode(value: Any, index: int) -> Any:
        if not isinstance(value, dict):
            raise DatasetError(f"row {index}: no image")
        data, path = value.get("bytes"), value.get("path")
        img: Image.Image
        try:
            if data is not None:
                img = Image.open(io.BytesIO(data), formats=safe_formats())
            elif path is not None:
                img = Image.open(resolve(path), formats=safe_formats())
            else:
                raise DatasetError(f"row {index}: an image with neither bytes nor path")
            img.load()
            if img.getexif().get(ExifTags.Base.Orientation) is not None:
                img = ImageOps.exif_transpose(img)
            if size is not None:
                img = fit(img.convert("RGB"), size)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
            raise DatasetError(f"row {index}: cannot decode the image: {exc}") from None
        arr = np.asarray(img)
        return (arr[:, :, None] if arr.ndim == 2 else arr).transpose(2, 0, 1)

    return decode


class ArrowDataset:
    """Map-style samples over frames; ``frame_of(index) -> (frame, index in it)``."""

    def __init__(
        self, length: int, specs: list[Spec], keys: list[str] | None, frame_of: Any
    ) -> None:
        self._length, self.specs, self._keys, self._frame_of = length, specs, keys, frame_of

    def __len__(self) -> int:
        return self._length

    def _check(self, index: int) -> int:
        i = int(index) + (self._length if int(index) < 0 else 0)
        if not 0 <= i < self._length:
            raise IndexError(f"index {index} out of range for {self._length} rows")
        return i

    def __getitem__(self, index: int) -> Any:
        frame, j = self._frame_of(self._check(index))
        items = frame.sample(j)
        if self._keys is not None:
            return dict(zip(self._keys, items, strict=True))
        return tuple(items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._length} rows, columns {[s.name for s in self.specs]})"


class ArrowBatchDataset(ArrowDataset):
    """Every column fixed-size: a batch is written row by row into the slot's views."""

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        views = [o.numpy() for o in out]
        for row, index in enumerate(indices):
            frame, j = self._frame_of(self._check(index))
            for s, v, arr in zip(self.specs, views, frame.arrays(j), strict=True):
                dst = v[row, ...]  # a view, also of a scalar's row
                if dst.shape != np.shape(arr):
                    raise DatasetError(
                        f"column {s.name!r}: row {index} has shape {list(np.shape(arr))}, the "
                        f"batch {list(dst.shape)} (stack expects each tensor to be equal size)"
                    )
                np.copyto(dst, arr, casting="unsafe")


def dataset(length: int, specs: list[Spec], keys: list[str] | None, frame_of: Any) -> Any:
    fixed = all(s.form in ("number", "array", "image") for s in specs)
    cls = ArrowBatchDataset if fixed else ArrowDataset
    return cls(length, specs, keys, frame_of)
