"""``hf``: a folder written by ``datasets``' ``save_to_disk``, memory-mapped with pyarrow.

``{"path": "cifar", "split": "train", "columns": ["img", "label"]}``. The folder holds
``state.json`` (its Arrow files) and the Arrow IPC stream files themselves, which are
memory-mapped and never read whole, as ``datasets.load_from_disk`` maps them; a
``DatasetDict`` folder (``dataset_dict.json``) needs ``split``. Samples are what
``load_from_disk(path).with_format("torch")[i]`` gives (see ``arrow`` for each column
type), a dict by column name, or what ``columns`` selects.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray
from pydantic import Field

from pinfeed_server.datasets import arrow
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind
from pinfeed_server.datasets.remote import RemoteDataset, Spans
from pinfeed_server.remote import Manifest, RemoteObject, is_remote
from pinfeed_server.remote.file import Local
from pinfeed_server.remote.url import S3Url


class HfParams(arrow.ArrowParams):
    path: str = Field(description="the save_to_disk folder, relative to the data root")
    split: str | None = Field(None, description="the split of a DatasetDict folder")


class Folder:
    """A save_to_disk folder under the data root."""

    def __init__(self, ctx: DatasetContext, rel: str) -> None:
        self.ctx, self.shown, self.path = ctx, rel, ctx.resolve_dir(rel)

    def read(self, name: str) -> bytes | None:
        """File ``name``'s bytes (None: no such file)."""
        try:
            return (self.path / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as exc:
            raise DatasetError(f"{self.shown}/{name}: {exc}") from None

    def sub(self, name: str) -> Folder:
        return Folder(self.ctx, f"{self.shown}/{name}")

    def table(self, name: str) -> pa.Table:
        path = (self.path / name).resolve()
        if not path.is_relative_to(self.path):
            raise DatasetError(f"{self.shown}/state.json: data file {name!r} is outside the folder")
        if not path.is_file():
            raise DatasetError(f"{self.shown}/{name}: missing")
        return _stream(str(path), f"{self.shown}/{name}")


class ObjectFolder:
    """A save_to_disk folder in a store: the objects under a prefix, each fetched
    whole into the node's object cache and mapped from there."""

    def __init__(self, remote: Local, listed: Manifest, url: S3Url) -> None:
        self.remote, self.listed, self.url = remote, listed, url
        self.shown = str(url).rstrip("/")
        self.keys = {o.key: k for k, o in enumerate(listed.objects)}
        self.used: list[int] = []  # the objects of the tables read, in order

    def _object(self, name: str) -> RemoteObject | None:
        if "/" in name or name in ("", ".", ".."):
            raise DatasetError(f"{self.shown}/state.json: data file {name!r} is outside the folder")
        k = self.keys.get(self.url.child(name).key)
        return None if k is None else RemoteObject(self.remote, self.listed, k)

    def read(self, name: str) -> bytes | None:
        obj = self._object(name)
        return None if obj is None else obj.pread(0, obj.size)

    def sub(self, name: str) -> ObjectFolder:
        sub = ObjectFolder(self.remote, self.listed, self.url.child(name))
        sub.used = self.used
        return sub

    def table(self, name: str) -> pa.Table:
        obj = self._object(name)
        if obj is None:
            raise DatasetError(f"{self.shown}/{name}: missing")
        fd = obj.open_fd()
        try:  # mapped by its name: the mapping outlives the descriptor and an eviction
            table = _stream(f"/proc/self/fd/{fd}", f"{self.shown}/{name}")
        finally:
            os.close(fd)
        self.used.append(obj.k)
        return table


def _stream(path: str, shown: str) -> pa.Table:
    try:
        with pa.memory_map(path) as source:
            return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{shown}: not a complete Arrow stream ({exc})") from None


def _json(folder: Folder | ObjectFolder, name: str) -> Any:
    shown = f"{folder.shown}/{name}"
    data = folder.read(name)
    if data is None:
        raise DatasetError(f"{shown}: missing (not a save_to_disk folder)")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise DatasetError(f"{shown}: not valid JSON: {exc}") from None


def _split(folder: Folder | ObjectFolder, p: HfParams) -> Folder | ObjectFolder:
    if folder.read("dataset_dict.json") is not None:
        splits = _json(folder, "dataset_dict.json").get("splits")
        if p.split is None or not isinstance(splits, list) or p.split not in splits:
            raise DatasetError(f"{p.path} is a DatasetDict: give split, one of {splits}")
        return folder.sub(p.split)
    if p.split is not None:
        raise DatasetError(f"{p.path} is a single dataset, not a DatasetDict: leave out split")
    return folder


def _tables(folder: Folder | ObjectFolder) -> list[pa.Table]:
    state = _json(folder, "state.json")
    try:
        names = [str(f["filename"]) for f in state["_data_files"]]
    except (KeyError, TypeError):
        raise DatasetError(f"{folder.shown}/state.json: no _data_files list") from None
    if not names:
        raise DatasetError(f"{folder.shown}/state.json lists no Arrow file")
    tables: list[pa.Table] = []
    for name in names:
        table = folder.table(name)
        if tables:
            arrow.same_schema(table.schema, tables[0].schema, f"{folder.shown}/{name}", names[0])
        tables.append(table)
    return tables


class TableSpans:
    """Each row's Arrow file (one whole object) in the listing."""

    def __init__(self, listed: Manifest, objects: list[int], rows: list[int]) -> None:
        self.listed = listed
        self.objects = np.array(objects, dtype=np.int64)
        self.starts = np.cumsum([0, *rows], dtype=np.int64)

    def __call__(self, indices: NDArray[np.int64]) -> Spans:
        t = np.searchsorted(self.starts, indices, side="right") - 1
        return [self.listed.objects_units(self.objects[t])]


def build(p: HfParams, ctx: DatasetContext) -> Any:
    root: Folder | ObjectFolder
    if is_remote(p.path):
        url = S3Url.parse(p.path.rstrip("/") + "/")
        listed = ctx.manifest(str(url), blocks=False)
        root = ObjectFolder(ctx.remote, listed, url)  # type: ignore[arg-type]
    else:
        root = Folder(ctx, p.path)
    folder = _split(root, p)
    tables = _tables(folder)
    table = pa.concat_tables(tables)
    if table.num_rows == 0:
        raise DatasetError(f"{folder.shown}: no rows")
    info = folder.read("dataset_info.json")
    feats = _json(folder, "dataset_info.json").get("features") if info is not None else None
    specs, keys = arrow.select(table.schema, p.columns, p.native_dtypes, feats)
    frame = arrow.Frame(table, specs, arrow.image_decoder(p.image_size, ctx.resolve))
    dataset = arrow.dataset(table.num_rows, specs, keys, lambda i: (frame, i))
    if not isinstance(folder, ObjectFolder):
        return dataset
    spans = TableSpans(folder.listed, folder.used, [t.num_rows for t in tables])
    return RemoteDataset(dataset, folder.listed, spans)


KIND = Kind("hf", HfParams, build, __doc__)
