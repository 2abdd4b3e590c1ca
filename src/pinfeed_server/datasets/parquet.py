"""``parquet``: Parquet files (a list, or a glob, under the data root), read with pyarrow.

``{"paths": "train-*.parquet", "columns": {"x": "image", "y": "label"}}``. The files are
memory-mapped; their row groups are decoded when a batch needs them and the latest
``row_group_cache`` kept (per process), so a shuffled epoch over many row groups
decodes some of them more than once: Parquet has no random access below a row group.
Rows are in file order then row order, as ``load_dataset("parquet", data_files=...)``
gives them, and samples are what its ``.with_format("torch")`` gives (``arrow``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from pinfeed_server.datasets import arrow
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind


class ParquetParams(arrow.ArrowParams):
    paths: list[str] | str = Field(
        description="Parquet files relative to the data root, or one glob pattern"
    )
    row_group_cache: int = Field(4, ge=1, le=4096, description="decoded row groups kept")


def _files(paths: list[str] | str, ctx: DatasetContext) -> list[tuple[str, Path]]:
    if isinstance(paths, list):
        rels = paths
    elif any(c in paths for c in "*?["):
        root = ctx.data_root.resolve()
        try:
            rels = sorted(str(m.relative_to(root)) for m in root.glob(paths) if m.is_file())
        except (ValueError, NotImplementedError) as exc:
            raise DatasetError(f"glob {paths!r}: {exc}") from None
        if not rels:
            raise DatasetError(f"glob {paths!r} matches no file under the data root")
    else:
        rels = [paths]
    if not rels:
        raise DatasetError("paths must name at least one Parquet file")
    return [(rel, ctx.resolve(rel)) for rel in rels]


def _open(shown: str, path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{shown}: not a readable Parquet file ({exc})") from None


class RowGroups:
    """Index -> (decoded row group, row in it), the latest ``size`` row groups kept."""

    def __init__(self, files: list[tuple[str, pq.ParquetFile]], names: list[str], size: int):
        self._files, self._names, self._size = files, names, size
        counts = [
            (f, g, pf.metadata.row_group(g).num_rows)
            for f, (_, pf) in enumerate(files)
            for g in range(pf.metadata.num_row_groups)
        ]
        self._file = np.array([c[0] for c in counts], dtype=np.int32)
        self._group = np.array([c[1] for c in counts], dtype=np.int32)
        self.starts = np.cumsum([0, *(c[2] for c in counts)], dtype=np.int64)
        self._cache: OrderedDict[int, arrow.Frame] = OrderedDict()
        self._lock = threading.Lock()
        self.make: Any = None  # table -> Frame, set by build

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __call__(self, index: int) -> tuple[arrow.Frame, int]:
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        with self._lock:
            frame = self._cache.get(k)
            if frame is not None:
                self._cache.move_to_end(k)
        if frame is None:
            shown, pf = self._files[int(self._file[k])]
            try:
                table = pf.read_row_group(int(self._group[k]), columns=self._names)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DatasetError(f"{shown}: row group {self._group[k]}: {exc}") from None
            frame = self.make(table)
            with self._lock:
                self._cache[k] = frame
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
        return frame, index - int(self.starts[k])


def build(p: ParquetParams, ctx: DatasetContext) -> Any:
    files = [(shown, _open(shown, path)) for shown, path in _files(p.paths, ctx)]
    schema = files[0][1].schema_arrow
    for shown, pf in files[1:]:
        arrow.same_schema(pf.schema_arrow, schema, shown, files[0][0])
    specs, keys = arrow.select(schema, p.columns, p.native_dtypes)
    groups = RowGroups(files, [s.name for s in specs], p.row_group_cache)
    if len(groups) == 0:
        raise DatasetError(f"{files[0][0]}: no rows")
    decoder = arrow.image_decoder(p.image_size, ctx.resolve)
    groups.make = lambda table: arrow.Frame(table, specs, decoder)
    return arrow.dataset(len(groups), specs, keys, groups)


KIND = Kind("parquet", ParquetParams, build, __doc__)
