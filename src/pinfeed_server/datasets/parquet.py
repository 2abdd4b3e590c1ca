"""``parquet``: Parquet files (a list, or a glob, under the data root), read with pyarrow.

``{"paths": "train-*.parquet", "columns": {"x": "image", "y": "label"}}``. The files are
memory-mapped; their row groups are decoded when a batch needs them and the latest
``row_group_cache`` kept (per process), so a shuffled epoch over many row groups
decodes some of them more than once: Parquet has no random access below a row group.
Rows are in file order then row order, as ``load_dataset("parquet", data_files=...)``
gives them, and samples are what its ``.with_format("torch")`` gives (``arrow``).

``s3://`` paths (a list of object URLs, or one URL, a glob in its last components) are
read by range through the node's object cache (``remote/``): the footer, then each row
group's column chunks, the blocks holding them fetched once for the node.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray
from pydantic import Field

from pinfeed_server.datasets import arrow
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind
from pinfeed_server.datasets.remote import RemoteDataset, Spans
from pinfeed_server.remote import Manifest, RemoteObject, is_remote
from pinfeed_server.remote.url import S3Url


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


def _open(shown: str, source: Path | RemoteObject) -> pq.ParquetFile:
    try:
        if isinstance(source, RemoteObject):
            return pq.ParquetFile(source.open())
        return pq.ParquetFile(source, memory_map=True)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{shown}: not a readable Parquet file ({exc})") from None


def _glob_match(key: str, pattern: str) -> bool:
    """``key`` matches ``pattern`` component by component (``*`` stays within one, as
    in the data root's glob)."""
    parts, want = key.split("/"), pattern.split("/")
    return len(parts) == len(want) and all(
        fnmatch.fnmatchcase(a, b) for a, b in zip(parts, want, strict=True)
    )


def _objects(paths: list[str] | str, ctx: DatasetContext) -> tuple[Manifest, Manifest]:
    """(the files' manifest, the listing it came from) for ``s3://`` paths."""
    if isinstance(paths, list):
        listed = ctx.manifest(paths, blocks=True, single=True)
        return listed, listed
    if not any(c in paths for c in "*?["):
        listed = ctx.manifest([paths], blocks=True, single=True)
        return listed, listed
    url = S3Url.parse(paths)
    fixed = re.split(r"[*?\[]", url.key, maxsplit=1)[0].rpartition("/")[0]
    listed = ctx.manifest(str(S3Url(url.bucket, fixed)), blocks=True)
    keep = [k for k, o in enumerate(listed.objects) if _glob_match(o.key, url.key)]
    if not keep:
        raise DatasetError(f"glob {paths!r} matches no object in the store")
    return listed.select(keep), listed


def _byte_ranges(pf: pq.ParquetFile, names: list[str]) -> list[tuple[int, int]]:
    """Per row group, the bytes ``[start, stop)`` its chunks of columns ``names`` span."""
    wanted = set(names)
    out = []
    meta = pf.metadata
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        chunks = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.split(".")[0] not in wanted:
                continue
            first = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset is not None:
                first = min(first, col.dictionary_page_offset)
            chunks.append((first, first + col.total_compressed_size))
        out.append((min(c[0] for c in chunks), max(c[1] for c in chunks)))
    return out


class GroupSpans:
    """The blocks each sample's row group lies in (its selected columns' chunks)."""

    def __init__(self, manifest: Manifest, groups: RowGroups, ranges: list[tuple[int, int]]):
        self.manifest, self.groups = manifest, groups
        self.starts = np.array([r[0] for r in ranges], dtype=np.int64)
        self.stops = np.array([r[1] for r in ranges], dtype=np.int64)

    def __call__(self, indices: NDArray[np.int64]) -> Spans:
        k = np.searchsorted(self.groups.starts, indices, side="right") - 1
        files = self.groups.file_of[k].astype(np.int64)
        return [self.manifest.spans(files, self.starts[k], self.stops[k])]


class RowGroups:
    """Index -> (decoded row group, row in it), the latest ``size`` row groups kept."""

    def __init__(self, files: list[tuple[str, pq.ParquetFile]], names: list[str], size: int):
        self._files, self._names, self._size = files, names, size
        counts = [
            (f, g, pf.metadata.row_group(g).num_rows)
            for f, (_, pf) in enumerate(files)
            for g in range(pf.metadata.num_row_groups)
        ]
        self.file_of = np.array([c[0] for c in counts], dtype=np.int32)
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
            shown, pf = self._files[int(self.file_of[k])]
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
    remote = is_remote(p.paths if isinstance(p.paths, str) else (p.paths or [""])[0])
    if remote:
        manifest, listed = _objects(p.paths, ctx)
        files = [
            (o.url, _open(o.url, RemoteObject(ctx.remote, manifest, k)))  # type: ignore[arg-type]
            for k, o in enumerate(manifest.objects)
        ]
    else:
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
    dataset = arrow.dataset(len(groups), specs, keys, groups)
    if not remote:
        return dataset
    names = [s.name for s in specs]
    ranges = [r for _, pf in files for r in _byte_ranges(pf, names)]
    return RemoteDataset(dataset, manifest, GroupSpans(manifest, groups, ranges), listed)


KIND = Kind("parquet", ParquetParams, build, __doc__)
