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
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import Field

from pinfeed_server.datasets import arrow
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind


class HfParams(arrow.ArrowParams):
    path: str = Field(description="the save_to_disk folder, relative to the data root")
    split: str | None = Field(None, description="the split of a DatasetDict folder")


def _json(path: Path, shown: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{shown}: missing (not a save_to_disk folder)") from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{shown}: not valid JSON: {exc}") from None


def _folder(p: HfParams, ctx: DatasetContext) -> tuple[Path, str]:
    folder = ctx.resolve_dir(p.path)
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json", f"{p.path}/dataset_dict.json").get("splits")
        if p.split is None or not isinstance(splits, list) or p.split not in splits:
            raise DatasetError(f"{p.path} is a DatasetDict: give split, one of {splits}")
        rel = f"{p.path}/{p.split}"
        return ctx.resolve_dir(rel), rel
    if p.split is not None:
        raise DatasetError(f"{p.path} is a single dataset, not a DatasetDict: leave out split")
    return folder, p.path


def _tables(folder: Path, shown: str) -> list[pa.Table]:
    state = _json(folder / "state.json", f"{shown}/state.json")
    try:
        names = [str(f["filename"]) for f in state["_data_files"]]
    except (KeyError, TypeError):
        raise DatasetError(f"{shown}/state.json: no _data_files list") from None
    if not names:
        raise DatasetError(f"{shown}/state.json lists no Arrow file")
    tables: list[pa.Table] = []
    for name in names:
        path = (folder / name).resolve()
        if not path.is_relative_to(folder):
            raise DatasetError(f"{shown}/state.json: data file {name!r} is outside the folder")
        if not path.is_file():
            raise DatasetError(f"{shown}/{name}: missing")
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{shown}/{name}: not a complete Arrow stream ({exc})") from None
        if tables:
            arrow.same_schema(table.schema, tables[0].schema, f"{shown}/{name}", names[0])
        tables.append(table)
    return tables


def build(p: HfParams, ctx: DatasetContext) -> Any:
    folder, shown = _folder(p, ctx)
    table = pa.concat_tables(_tables(folder, shown))
    if table.num_rows == 0:
        raise DatasetError(f"{shown}: no rows")
    info = folder / "dataset_info.json"
    feats = _json(info, f"{shown}/dataset_info.json").get("features") if info.is_file() else None
    specs, keys = arrow.select(table.schema, p.columns, p.native_dtypes, feats)
    frame = arrow.Frame(table, specs, arrow.image_decoder(p.image_size, ctx.resolve))
    return arrow.dataset(table.num_rows, specs, keys, lambda i: (frame, i))


KIND = Kind("hf", HfParams, build, __doc__)
