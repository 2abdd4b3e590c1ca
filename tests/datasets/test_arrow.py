"""The ``hf`` and ``parquet`` kinds: every column type against ``datasets``' own torch
format, their checks on hostile files, and parity under DataLoader through a server."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import datasets as hd
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest, Loader
from pinfeed_server.datasets import DatasetContext, DatasetError, build_dataset
from pinfeed_server.datasets.images import fit
from tests.conftest import Server
from tests.datasets.parity import GRID, check_parity
from tests.fixtures.collate import pad_ids
from tests.helpers import assert_same, unique

hd.disable_progress_bars()

ROWS = 23
FIXED = ["image", "label", "vec", "x", "arr", "flag", "small"]


def _png(rng: np.random.Generator, w: int, h: int, mode: str = "RGB") -> bytes:
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG" if mode != "RGB" else "JPEG", quality=90)
    return buf.getvalue()


def make_dataset(rows: int = ROWS, seed: int = 0, image: tuple[int, int] = (10, 7)) -> hd.Dataset:
    """Every column type the kinds read, written by ``datasets`` itself."""
    rng = np.random.default_rng(seed)
    features = hd.Features(
        {
            "image": hd.Image(),
            "label": hd.ClassLabel(names=["cat", "dog", "eel"]),
            "vec": hd.List(hd.Value("float32"), length=3),
            "x": hd.Value("float64"),
            "arr": hd.Array2D((2, 3), "int16"),
            "flag": hd.Value("bool"),
            "small": hd.Value("uint8"),
            "ids": hd.List(hd.Value("int32")),
            "text": hd.Value("string"),
        }
    )
    return hd.Dataset.from_dict(
        {
            "image": [{"bytes": _png(rng, *image), "path": None} for _ in range(rows)],
            "label": rng.integers(0, 3, rows).tolist(),
            "vec": rng.random((rows, 3), dtype=np.float32).tolist(),
            "x": rng.random(rows).tolist(),
            "arr": list(rng.integers(-500, 500, (rows, 2, 3)).astype(np.int16)),
            "flag": (rng.random(rows) > 0.5).tolist(),
            "small": rng.integers(0, 256, rows).tolist(),
            "ids": [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(0, 9, rows)],
            "text": [f"row {i}" for i in range(rows)],
        },
        features=features,
    )


def write_hf(root: Path, rel: str, **kw: Any) -> Path:
    make_dataset(**kw).save_to_disk(str(root / rel), num_shards=2)
    return root / rel


def write_parquet(root: Path, rel: str, files: int = 2, **kw: Any) -> list[str]:
    ds = make_dataset(**kw)
    (root / rel).mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(files):
        name = f"{rel}/part-{k:03d}.parquet"
        # small row groups, so a dataset spans several
        ds.shard(files, k, contiguous=True).to_parquet(str(root / name), batch_size=5)
        out.append(name)
    return out


def _build(root: Path, kind: str, **params: Any) -> Any:
    return build_dataset(kind, params, DatasetContext(root))


def _reference(root: Path, kind: str, where: Any, cache: Path) -> hd.Dataset:
    if kind == "hf":
        return hd.load_from_disk(str(root / where))
    files = [str(root / f) for f in where]
    return hd.load_dataset("parquet", data_files=files, split="train", cache_dir=str(cache))


@pytest.fixture(params=["hf", "parquet"])
def files(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, Any, hd.Dataset]:
    """(kind, data root, what to register, the reference read back by ``datasets``)."""
    root = tmp_path / "root"
    kind = request.param
    where: Any = "ds" if kind == "hf" else write_parquet(root, "pq")
    if kind == "hf":
        write_hf(root, "ds")
    return kind, root, where, _reference(root, kind, where, tmp_path / "cache")


def _params(kind: str, where: Any, **kw: Any) -> dict[str, Any]:
    return {"path": where, **kw} if kind == "hf" else {"paths": where, **kw}


def test_every_column_as_datasets_torch_format(files: tuple[str, Path, Any, hd.Dataset]) -> None:
    kind, root, where, ref = files
    ds = _build(root, kind, **_params(kind, where))
    want = ref.with_format("torch")
    assert len(ds) == len(want) == ROWS
    for i in [*range(ROWS), -1]:
        assert_same(ds[i], want[i], f"row {i}")
    sample = ds[0]
    assert sample["image"].shape == (3, 7, 10) and sample["image"].dtype == torch.uint8
    assert sample["label"].dtype == sample["small"].dtype == torch.int64  # as datasets
    assert sample["x"].dtype == torch.float32 and sample["arr"].shape == (2, 3)
    lengths = {ds[i]["ids"].shape[0] for i in range(ROWS)}
    assert len(lengths) > 2  # variable-length rows
    with pytest.raises(IndexError):
        ds[ROWS]


def test_columns_tuple_dict_and_native_dtypes(files: tuple[str, Path, Any, hd.Dataset]) -> None:
    kind, root, where, ref = files
    want = ref.with_format("torch")
    tup = _build(root, kind, **_params(kind, where, columns=["label", "image"]))
    renamed = _build(root, kind, **_params(kind, where, columns={"y": "label", "v": "vec"}))
    native = _build(root, kind, **_params(kind, where, columns=["small", "x"], native_dtypes=True))
    for i in (0, 5, ROWS - 1):
        assert_same(tup[i], (want[i]["label"], want[i]["image"]))
        assert_same(renamed[i], {"y": want[i]["label"], "v": want[i]["vec"]})
        small, x = native[i]
        assert small.dtype == torch.uint8 and x.dtype == torch.float64
        assert small.item() == want[i]["small"].item()
        assert x.item() == ref[i]["x"]


def test_fetch_into_equals_collate(files: tuple[str, Path, Any, hd.Dataset]) -> None:
    kind, root, where, _ = files
    ds = _build(root, kind, **_params(kind, where, columns=FIXED))
    idx = [4, 0, ROWS - 1, 4, 11, 17, 2]
    want = next(iter(DataLoader(torch.utils.data.Subset(ds, idx), batch_size=len(idx))))
    out = [torch.zeros_like(w) for w in want]
    ds.fetch_into(idx, out)
    assert_same(out, want)
    # variable-length or string columns: no batch path, samples go through collate
    assert not hasattr(_build(root, kind, **_params(kind, where, columns=["ids"])), "fetch_into")


def test_image_size_resizes_and_crops_as_images_does(
    files: tuple[str, Path, Any, hd.Dataset],
) -> None:
    kind, root, where, ref = files
    ds = _build(root, kind, **_params(kind, where, columns=["image"], image_size=5))
    for i in (0, 9):
        want = torch.from_numpy(np.array(fit(ref[i]["image"].convert("RGB"), 5))).permute(2, 0, 1)
        (got,) = ds[i]
        assert got.shape == (3, 5, 5)
        assert_same(got, want.contiguous())


def test_variable_length_columns_with_a_collate_fn(
    files: tuple[str, Path, Any, hd.Dataset],
) -> None:
    """Dataset level: the ragged ``ids`` column under DataLoader with a padding
    collate_fn equals the reference's (the server side needs the loader's collate_fn)."""
    kind, root, where, ref = files

    def pad(samples: list[Any]) -> Any:
        ids = [s["ids"] if isinstance(s, dict) else s[0] for s in samples]
        return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=-1)

    ds = _build(root, kind, **_params(kind, where, columns={"ids": "ids"}))
    want = list(DataLoader(ref.select_columns(["ids"]).with_format("torch"), 4, collate_fn=pad))
    got = list(DataLoader(ds, 4, collate_fn=pad))
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def test_images_by_path_stay_inside_the_root(tmp_path: Path) -> None:
    """An Image ``path`` (without bytes; ``save_to_disk`` embeds them, a Parquet file
    may not) is relative to the data root and must resolve inside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    Image.new("RGB", (4, 3), (1, 2, 3)).save(root / "img" / "a.png")
    Image.new("RGB", (4, 3), (9, 9, 9)).save(tmp_path / "outside.png")
    paths = [str(root / "img" / "a.png"), "img/a.png", str(tmp_path / "outside.png"), "../x"]
    image = pa.array([{"bytes": None, "path": p} for p in paths])
    meta = {"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}})}
    pq.write_table(pa.table({"image": image}).replace_schema_metadata(meta), root / "p.parquet")
    ds = _build(root, "parquet", paths="p.parquet")
    assert ds[0]["image"].shape == (3, 3, 4) and torch.equal(ds[0]["image"], ds[1]["image"])
    assert ds[0]["image"][:, 0, 0].tolist() == [1, 2, 3]
    for i in (2, 3):
        with pytest.raises(DatasetError, match="outside the data root"):
            ds[i]


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.97])
def test_truncated_files_name_the_file(tmp_path: Path, keep: float) -> None:
    write_hf(tmp_path, "ds")
    arrow_file = sorted((tmp_path / "ds").glob("*.arrow"))[1]
    _truncate(arrow_file, keep)
    with pytest.raises(DatasetError, match=rf"ds/{arrow_file.name}: not a complete Arrow stream"):
        _build(tmp_path, "hf", path="ds")
    names = write_parquet(tmp_path, "pq")
    _truncate(tmp_path / names[1], keep)
    with pytest.raises(DatasetError, match=rf"{names[1]}: not a readable Parquet file"):
        _build(tmp_path, "parquet", paths="pq/*.parquet")


def test_hostile_and_wrong_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_hf(root, "ds")
    write_hf(tmp_path, "outside")
    with pytest.raises(DatasetError, match="outside the data root"):
        _build(root, "hf", path="../outside")
    (root / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(DatasetError, match="outside the data root"):
        _build(root, "hf", path="link")
    state = json.loads((root / "ds" / "state.json").read_text())
    state["_data_files"].append({"filename": "../../outside/data-00000-of-00002.arrow"})
    (root / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DatasetError, match="is outside the folder"):
        _build(root, "hf", path="ds")
    state["_data_files"][-1] = {"filename": "gone.arrow"}
    (root / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DatasetError, match=r"ds/gone\.arrow: missing"):
        _build(root, "hf", path="ds")
    (root / "ds" / "state.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"ds/state\.json: not valid JSON"):
        _build(root, "hf", path="ds")
    (root / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty/state\.json: missing"):
        _build(root, "hf", path="empty")
    hd.DatasetDict({"train": make_dataset(4), "test": make_dataset(3)}).save_to_disk(
        str(root / "dd")
    )
    assert len(_build(root, "hf", path="dd", split="test")) == 3
    with pytest.raises(
        DatasetError, match=r"a DatasetDict: give split, one of \['train', 'test'\]"
    ):
        _build(root, "hf", path="dd")
    with pytest.raises(DatasetError, match="leave out split"):
        _build(root, "hf", path="dd/train", split="x")
    with pytest.raises(DatasetError, match=r"no column 'nope'"):
        _build(root, "hf", path="dd", split="train", columns=["label", "nope"])


def test_wrong_schemas(tmp_path: Path) -> None:
    names = write_parquet(tmp_path, "pq")
    make_dataset(3).remove_columns(["x"]).to_parquet(str(tmp_path / "pq" / "part-009.parquet"))
    differs = r"pq/part-009\.parquet: schema differs from the first file's: columns \['image', "
    with pytest.raises(DatasetError, match=differs):
        _build(tmp_path, "parquet", paths="pq/*.parquet")
    assert len(_build(tmp_path, "parquet", paths=names)) == ROWS
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"s": pa.array([{"a": 1}, {"a": 2}]), "n": [1, 2]})
    pq.write_table(table, tmp_path / "struct.parquet")
    with pytest.raises(DatasetError, match=r"column 's': type struct<a: int64> is not supported"):
        _build(tmp_path, "parquet", paths="struct.parquet")
    assert _build(tmp_path, "parquet", paths="struct.parquet", columns=["n"])[1] == (
        torch.tensor(2),
    )
    pq.write_table(pa.table({"n": pa.array([1, None])}), tmp_path / "nulls.parquet")
    with pytest.raises(DatasetError, match=r"column 'n' has 1 null values"):
        _build(tmp_path, "parquet", paths="nulls.parquet")[0]
    with pytest.raises(DatasetError, match="matches no file"):
        _build(tmp_path, "parquet", paths="nothing-*.parquet")
    with pytest.raises(DatasetError, match="outside the data root"):
        _build(tmp_path / "pq", "parquet", paths=["../struct.parquet"])


@pytest.fixture(scope="module")
def served(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same rows as an hf folder and as Parquet files under the server's data root,
    with their references: ``datasets``' torch format of the fixed-size columns."""
    rel = unique("arrow")
    root = server.data_root
    write_hf(root, f"{rel}/hf")
    names = write_parquet(root, f"{rel}/pq")
    cache = tmp_path_factory.mktemp("hf-cache")
    return {
        "hf": (f"{rel}/hf", _reference(root, "hf", f"{rel}/hf", cache)),
        "parquet": (f"{rel}/pq/*.parquet", _reference(root, "parquet", names, cache)),
    }


@pytest.mark.parametrize("kind", ["hf", "parquet"])
def test_http_describes_and_refuses(
    admin: Client, server: Server, served: dict[str, Any], kind: str
) -> None:
    where, _ = served[kind]
    name = unique(kind)
    info = admin.create_dataset(name, kind, _params(kind, where, columns=["image", "label"]))
    try:
        assert info["length"] == ROWS
        assert info["sample"] == [
            {"dtype": "uint8", "shape": [3, 7, 10]},
            {"dtype": "int64", "shape": []},
        ]
    finally:
        admin.delete_dataset(name)
    bad = unique(f"{kind}-bad")
    if kind == "hf":
        write_hf(server.data_root, bad)
        victim = sorted((server.data_root / bad).glob("*.arrow"))[0]
        params = {"path": bad}
    else:
        victim = server.data_root / write_parquet(server.data_root, bad)[0]
        params = {"paths": f"{bad}/*.parquet"}
    _truncate(victim, 0.6)
    with pytest.raises(InvalidRequest, match=rf"{bad}/{victim.name}: not a (complete|readable)"):
        admin.create_dataset(unique(kind), kind, params)
    with pytest.raises(InvalidRequest, match="no column 'nope'"):
        admin.create_dataset(unique(kind), kind, _params(kind, where, columns=["nope"]))


@pytest.mark.parametrize("kind", ["hf", "parquet"])
@pytest.mark.parametrize(("batch_size", "shuffle", "num_workers"), GRID)
def test_parity_with_datasets_torch_format(
    admin: Client,
    server: Server,
    served: dict[str, Any],
    kind: str,
    batch_size: int,
    shuffle: bool,
    num_workers: int,
) -> None:
    where, ref = served[kind]
    name = unique(kind)
    admin.create_dataset(name, kind, _params(kind, where, columns={c: c for c in FIXED}))
    try:
        check_parity(
            admin,
            server,
            name,
            ref.select_columns(FIXED).with_format("torch"),
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
        )
    finally:
        admin.delete_dataset(name)


@pytest.mark.parametrize("kind", ["hf", "parquet"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_variable_length_columns_through_the_server(
    admin: Client, server: Server, served: dict[str, Any], kind: str, num_workers: int
) -> None:
    """The ragged ``ids`` column, padded per batch by the loader's ``collate_fn`` in the
    server: DataLoader's batches over ``with_format("torch")``, shapes changing per batch."""
    where, ref = served[kind]
    name, loader_name = unique(kind), unique(f"{kind}-ragged")
    admin.create_dataset(name, kind, _params(kind, where, columns=["ids"]))
    try:
        admin.create_loader(
            loader_name,
            dataset=name,
            batch_size=2,
            shuffle=True,
            seed=11,
            num_workers=num_workers,
            collate_fn="tests.fixtures.collate:pad_ids",
        )
        want_loader = DataLoader(
            ref.select_columns(["ids"]).with_format("torch"),
            batch_size=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(11),
            num_workers=num_workers,
            collate_fn=pad_ids,
        )
        with Loader(loader_name, socket=server.socket) as loader:
            for epoch in range(2):
                want = list(want_loader)
                got = [b.clone() for b in loader]
                assert len(got) == len(want) > 1, f"epoch {epoch}"
                assert len({b.shape[1] for b in want}) > 1  # the padding changes per batch
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert_same(g, w, f"epoch {epoch} batch {i}")
    finally:
        admin.delete_loader(loader_name)
        admin.delete_dataset(name)
