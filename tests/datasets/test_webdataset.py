"""The ``webdataset`` kind: WebDataset's grouping, decoding, shard splitting and
shuffle buffer, against the ``webdataset`` library itself under DataLoader (at the
Dataset level: serving an IterableDataset is the iterable branch's), and its checks
on hostile shards."""

from __future__ import annotations

import functools
import io
import itertools
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest
from pinfeed_server.datasets import DatasetContext, DatasetError, build_dataset
from pinfeed_server.datasets.images import fit
from tests.conftest import Server
from tests.datasets.parity import check_parity, own
from tests.helpers import assert_same, unique

# webdataset's gopen leaves shard files for the garbage collector to close.
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

COUNTS = [7, 3, 5, 1, 6]  # uneven shards
PATTERN = "shards/train-{000000..000004}.tar"


def write_shards(root: Path, counts: list[int] = COUNTS, size: tuple[int, int] = (12, 9)) -> None:
    """Shards written by webdataset's own TarWriter: jpg, png, cls, json, txt, bin."""
    rng = np.random.default_rng(0)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    i = 0
    for k, n in enumerate(counts):
        with wds.TarWriter(str(root / f"shards/train-{k:06d}.tar")) as sink:
            for _ in range(n):
                img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
                sample = {
                    "__key__": f"sample{i:05d}",
                    "cls": int(rng.integers(0, 10)),
                    "json": {"i": i, "w": float(rng.random())},
                    "txt": f"caption {i}",
                    "bin": rng.bytes(5),
                }
                sample["png" if i % 3 == 0 else "jpg"] = img
                sink.write(sample)
                i += 1


def _build(root: Path, **params: Any) -> Any:
    return build_dataset("webdataset", {"shards": PATTERN, **params}, DatasetContext(root))


def _islice(src: Iterator[Any], rank: int, world: int) -> Iterator[Any]:
    yield from itertools.islice(src, rank, None, world)


def reference(
    root: Path, fields: list[str], shuffle: int | None = None, rank: int = 0, world: int = 1
) -> Any:
    ds = wds.WebDataset(
        str(root / PATTERN),
        shardshuffle=False,
        nodesplitter=functools.partial(_islice, rank=rank, world=world),
        workersplitter=wds.split_by_worker,
        empty_check=False,
    )
    if shuffle is not None:
        ds = ds.shuffle(shuffle, seed=5)
    return ds.decode("torchrgb8").to_tuple(*fields)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    write_shards(tmp_path)
    return tmp_path


FIELDS = ["jpg;png", "cls", "json", "txt", "bin"]


def test_samples_equal_webdataset(root: Path) -> None:
    ds = _build(root, fields=FIELDS)
    want = list(reference(root, FIELDS))
    got = list(ds)
    assert len(ds) == len(got) == len(want) == sum(COUNTS)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"sample {i}")
    image, cls, meta, text, raw = got[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 9, 12)
    assert isinstance(cls, int) and meta["i"] == 0 and text == "caption 0"
    assert isinstance(raw, bytes) and len(raw) == 5


def test_fields_dict_and_image_size(root: Path) -> None:
    ds = _build(root, fields={"image": "png;jpg", "label": "cls"}, image_size=6)
    for got, (pil, cls) in zip(
        ds,
        wds.WebDataset(str(root / PATTERN), shardshuffle=False)
        .decode("pil")
        .to_tuple("png;jpg", "cls"),
        strict=True,
    ):
        want = torch.from_numpy(np.array(fit(pil, 6))).permute(2, 0, 1).contiguous()
        assert_same(got, {"image": want, "label": cls})


@pytest.mark.parametrize("batch_size", [1, 7])
@pytest.mark.parametrize("shuffle", [None, 4])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_parity_under_dataloader(
    root: Path, batch_size: int, shuffle: int | None, num_workers: int
) -> None:
    """Batches equal the library's under DataLoader, shards split over workers, the
    shuffle buffer's order equal, over 2 epochs (shards as uneven as COUNTS)."""
    fields = ["jpg;png", "cls", "json"]
    params: dict[str, Any] = {"fields": fields, "shuffle_buffer": shuffle, "seed": 5}
    ds = _build(root, **params)
    ref = reference(root, fields, shuffle)
    got_loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers)
    ref_loader = DataLoader(ref, batch_size=batch_size, num_workers=num_workers)
    for epoch in range(2):
        got, want = list(got_loader), list(ref_loader)
        assert len(got) == len(want) > 0
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"epoch {epoch} batch {i}")
    if shuffle is not None:  # the buffer does reorder
        order = [int(b[2]["i"][j]) for b in got for j in range(len(b[2]["i"]))]
        assert sorted(order) == list(range(sum(COUNTS))) and order != sorted(order)


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("given", ["params", "env"])
def test_split_by_rank(
    root: Path, rank: int, world: int, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rank``/``world_size`` from the params, or from RANK/WORLD_SIZE as WebDataset's
    ``split_by_node`` reads them (what a pinfeed worker sets to its loader's)."""
    if given == "params":
        ds = _build(root, fields=["cls", "json"], rank=rank, world_size=world)
        monkeypatch.setenv("RANK", "0")  # fixed in the params: the env does not count
        monkeypatch.setenv("WORLD_SIZE", "1")
    else:
        ds = _build(root, fields=["cls", "json"])
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
    ref = reference(root, ["cls", "json"], rank=rank, world=world)
    for nw in (0, 2):
        want = list(DataLoader(ref, 2, num_workers=nw))
        got = list(DataLoader(ds, 2, num_workers=nw))
        assert len(ds) == sum(COUNTS[rank::world])
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def _tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("name", ["../evil.cls", "/etc/evil.cls", "a/../../evil.cls"])
def test_refuses_path_traversal_members(root: Path, name: str) -> None:
    _tar(root / "shards/train-000002.tar", {"x.cls": b"1", name: b"2"})
    with pytest.raises(DatasetError, match=r"train-000002\.tar: member .* is a path traversal"):
        _build(root, fields=["cls"])


def test_refuses_links_that_escape(root: Path) -> None:
    with tarfile.open(root / "shards/train-000001.tar", "w") as tar:
        info = tarfile.TarInfo("x.cls")
        info.type, info.linkname = tarfile.SYMTYPE, "../../../etc/passwd"
        tar.addfile(info)
    with pytest.raises(DatasetError, match="path traversal"):
        _build(root, fields=["cls"])


@pytest.mark.parametrize("cut", ["empty", "in a header", "in the first member", "in the last"])
def test_refuses_truncated_shards(root: Path, cut: str) -> None:
    path = root / "shards/train-000004.tar"
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    at = {
        "empty": 0,
        "in a header": members[3].offset + 100,
        "in the first member": members[0].offset_data + members[0].size // 2,
        "in the last": members[-1].offset_data + members[-1].size - 1,
    }[cut]
    path.write_bytes(path.read_bytes()[:at])
    with pytest.raises(DatasetError, match=r"train-000004\.tar: (truncated|not a readable tar)"):
        _build(root, fields=["cls"])


def test_refuses_bad_shards_and_params(root: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"sample 0 has no 'npy' field"):
        _build(root, fields=["cls", "npy"])
    _tar(root / "shards/train-000003.tar", {"a.cls": b"1", "a.CLS": b"2"})
    with pytest.raises(DatasetError, match="duplicate file name"):
        _build(root, fields=["cls"])
    (root / "shards/train-000003.tar").unlink()
    with pytest.raises(DatasetError, match=r"file 'shards/train-000003\.tar' not found"):
        _build(root, fields=["cls"])
    with pytest.raises(DatasetError, match="outside the data root"):
        build_dataset(
            "webdataset", {"shards": "../x-{0..1}.tar", "fields": ["cls"]}, DatasetContext(root)
        )
    for bad in (
        {"fields": []},
        {"fields": ["cls"], "rank": 2, "world_size": 2},
        {"fields": ["cls"], "rank": 1},
    ):
        with pytest.raises(DatasetError, match=r"fields must|rank 2 must be below|go together"):
            _build(root, **bad)
    with pytest.raises(DatasetError, match="invalid params"):
        _build(root, fields=["cls"], shuffle_buffer=0)
    with pytest.raises(DatasetError, match="expand to more than 1,000,000 files"):
        build_dataset(
            "webdataset",
            {"shards": "x-{0..99999999999}.tar", "fields": ["cls"]},
            DatasetContext(root),
        )


def test_http_refuses_hostile_shards(admin: Client, server: Server) -> None:
    rel = unique("wds")
    _tar(server.data_root / rel / "a-0.tar", {"x.cls": b"1"})
    _tar(server.data_root / rel / "a-1.tar", {"../../x.cls": b"1"})
    with pytest.raises(InvalidRequest, match=r"a-1\.tar: member '\.\./\.\./x\.cls' is a path"):
        admin.create_dataset(
            unique("wds"), "webdataset", {"shards": f"{rel}/a-{{0..1}}.tar", "fields": ["cls"]}
        )


@pytest.fixture(scope="module")
def served(server: Server) -> str:
    rel = unique("wds")
    write_shards(server.data_root / rel)
    return rel


SERVED_FIELDS = ["jpg;png", "cls", "json"]


def test_http_describes(admin: Client, server: Server, served: str) -> None:
    name = unique("wds")
    info = admin.create_dataset(
        name, "webdataset", {"shards": f"{served}/{PATTERN}", "fields": SERVED_FIELDS}
    )
    try:
        assert info["length"] == sum(COUNTS)
        assert info["sample"] == [
            {"dtype": "uint8", "shape": [3, 9, 12]},
            {"dtype": "int64", "shape": []},
            {"i": {"dtype": "int64", "shape": []}, "w": {"dtype": "float64", "shape": []}},
        ]
    finally:
        admin.delete_dataset(name)


@pytest.mark.parametrize("batch_size", [1, 7])
@pytest.mark.parametrize("shuffle", [None, 4])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_parity_through_the_server(
    admin: Client,
    server: Server,
    served: str,
    batch_size: int,
    shuffle: int | None,
    num_workers: int,
) -> None:
    """pinfeed's batches equal DataLoader's over the webdataset library's pipeline,
    with the same workers, over 2 epochs (the IterableDataset engine of the iterable
    branch: round-robin over workers, uneven shards running out)."""
    name = unique("wds")
    params = {
        "shards": f"{served}/{PATTERN}",
        "fields": SERVED_FIELDS,
        "shuffle_buffer": shuffle,
        "seed": 5,
    }
    admin.create_dataset(name, "webdataset", params)
    try:
        check_parity(
            admin,
            server,
            name,
            reference(server.data_root / served, SERVED_FIELDS, shuffle),
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
        )
    finally:
        admin.delete_dataset(name)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_rank_splits_shards(
    admin: Client, server: Server, served: str, num_workers: int
) -> None:
    """A loader's rank/world_size reach the kind as RANK/WORLD_SIZE (split_by_node)."""
    from pinfeed import Loader

    name = unique("wds")
    params = {"shards": f"{served}/{PATTERN}", "fields": ["cls", "json"]}
    admin.create_dataset(name, "webdataset", params)
    try:
        for rank in (0, 1):
            loader = unique("wds-rank")
            admin.create_loader(
                loader,
                dataset=name,
                batch_size=2,
                num_workers=num_workers,
                rank=rank,
                world_size=2,
            )
            ref = reference(server.data_root / served, ["cls", "json"], rank=rank, world=2)
            want = list(DataLoader(ref, 2, num_workers=num_workers))
            try:
                with Loader(loader, socket=server.socket) as got_loader:
                    got = [own(b) for b in got_loader]
            finally:
                admin.delete_loader(loader)
            assert len(got) == len(want) > 0
            for g, w in zip(got, want, strict=True):
                assert_same(g, w)
    finally:
        admin.delete_dataset(name)
