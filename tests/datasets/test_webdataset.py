"""The ``webdataset`` kind: WebDataset's grouping, decoding, shard splitting and
shuffle buffer, against the ``webdataset`` library itself under DataLoader (at the
Dataset level: serving an IterableDataset is the iterable branch's), and its checks
on hostile shards.

Decoders: samples with ``jpg``/``png``, ``cls``, ``json``, ``txt``, ``npy``, ``npz``,
``mp``, ``ten``, ``seg.json``, ``npy.gz`` and ``gz`` members equal
``.decode("torchrgb8")``'s, sample for sample and under DataLoader (num_workers 0 and 2)
and through the server. The extensions whose WebDataset decoder runs code (pickle,
``torch.load``, Ghostscript) are refused at registration only: the kind decodes only
the members that ``fields`` names, so one that no field names is never decoded (a
pickle that would run code is left alone, where WebDataset runs it). What fails at the
first batch instead is content: an object array (numpy would unpickle it), an EPS
image under another extension, a gzip bomb, naming the shard, sample and extension."""

from __future__ import annotations

import functools
import gzip
import io
import itertools
import pickle
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
    """Shards written by webdataset's own TarWriter: jpg, png, cls, json, txt, bin, and
    the array members: npy (every other one Fortran-ordered), npz, ten, mp, seg.json,
    npy.gz (gzipped by TarWriter) and gz (gzipped bytes)."""
    rng = np.random.default_rng(0)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    i = 0
    for k, n in enumerate(counts):
        with wds.TarWriter(str(root / f"shards/train-{k:06d}.tar")) as sink:
            for _ in range(n):
                img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
                arr = rng.standard_normal((2, 3)).astype(np.float32)
                sample = {
                    "__key__": f"sample{i:05d}",
                    "cls": int(rng.integers(0, 10)),
                    "json": {"i": i, "w": float(rng.random())},
                    "txt": f"caption {i}",
                    "bin": rng.bytes(5),
                    "npy": np.asfortranarray(arr) if i % 2 else arr,
                    "npz": {
                        "ids": rng.integers(0, 1000, 4),
                        "mask": rng.random((2, 2)) > 0.5,
                        "emb": rng.standard_normal(3).astype(np.float16),
                    },
                    "ten": [rng.integers(0, 9, (2, 2)).astype(np.int32), np.full(3, i, np.float64)],
                    "mp": {"k": i, "tags": ["a", "b"][: i % 2 + 1], "raw": b"\x00\x01"},
                    "seg.json": [i, i + 1],
                    "npy.gz": rng.integers(0, 256, 6, dtype=np.uint8),
                    "gz": gzip.compress(f"zipped {i}".encode()),
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


# A field for every decoder write_shards' members meet (bin: FIELDS); ten (read-only
# arrays, which default_collate warns about) only where nothing collates them
DECODED = ["jpg;png", "cls", "json", "txt", "npy", "npz", "mp", "seg.json", "npy.gz", "gz"]


def test_decoders_equal_webdataset(root: Path) -> None:
    """Every decoded member equals ``.decode("torchrgb8")``'s: the same Python, numpy
    and torch types, dtypes, shapes, memory order and values."""
    fields = [*DECODED, "ten"]
    got, want = list(_build(root, fields=fields)), list(reference(root, fields))
    assert len(got) == len(want) == sum(COUNTS)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"sample {i}")
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            if isinstance(b, np.ndarray):
                assert a.shape == b.shape and a.flags.f_contiguous == b.flags.f_contiguous, j
    _, _, _, _, npy, npz, mp, seg, npy_gz, gz, ten = got[1]
    assert type(npy) is np.ndarray and npy.dtype == np.float32 and npy.flags.f_contiguous
    assert npy.flags.writeable  # read_array's own array, as WebDataset's
    assert type(npz) is dict and list(npz) == ["ids", "mask", "emb"]
    assert [a.dtype for a in npz.values()] == [np.int64, np.bool_, np.float16]
    assert mp == {"k": 1, "tags": ["a", "b"], "raw": b"\x00\x01"} and seg == [1, 2]
    assert npy_gz.dtype == np.uint8 and npy_gz.shape == (6,) and gz == b"zipped 1"
    assert type(ten) is list and [a.dtype for a in ten] == [np.int32, np.float64]
    assert not ten[0].flags.writeable and list(ten[1]) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_decoders_under_dataloader(root: Path, num_workers: int) -> None:
    """The decoded members batch for batch under DataLoader: npy arrays stacked into
    tensors, npz dicts into dicts of tensors, txt into lists of str, mp's dicts as
    default_collate makes them (batch size 1: its lists vary in length), 2 epochs."""
    for batch_size in (1, 5):
        fields = DECODED if batch_size == 1 else [f for f in DECODED if f != "mp"]
        ds, ref = _build(root, fields=fields), reference(root, fields)
        got_loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers)
        ref_loader = DataLoader(ref, batch_size=batch_size, num_workers=num_workers)
        for epoch in range(2):
            got, want = list(got_loader), list(ref_loader)
            assert len(got) == len(want) > 0
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_same(g, w, f"batch size {batch_size} epoch {epoch} batch {i}")
        assert isinstance(got[0][4], torch.Tensor) and got[0][4].shape == (batch_size, 2, 3)
        assert isinstance(got[0][5], dict) and got[0][5]["mask"].dtype == torch.bool


class _Runs:
    """Pickled, runs ``_record`` when it is unpickled: code in a shard."""

    def __reduce__(self) -> Any:
        return (_record, ("unpickled",))


_ran: list[str] = []


def _record(what: str) -> str:
    _ran.append(what)
    return what


RUN_CODE = ["pyd", "pickle", "pkl", "pth", "seg.pyd", "pyd.gz", "eps", "ps"]


@pytest.mark.parametrize("ext", [*RUN_CODE, "cbor"])
@pytest.mark.parametrize("how", ["field", "alternative", "dict"])
def test_refuses_extensions_that_run_code(root: Path, ext: str, how: str) -> None:
    """A field naming an extension whose WebDataset decoder would run the shard's code
    (or that pinfeed cannot decode as WebDataset does) is refused at registration,
    saying why and what to do, before a shard is read."""
    fields: Any = {
        "field": ["cls", ext],
        "alternative": ["cls", f"npy;{ext}"],
        "dict": {"label": "cls", "x": ext},
    }[how]
    why = {
        "pyd": "pickle.loads, which runs code from the shard inside the server",
        "pth": "torch.load, which unpickles: it runs code from the shard inside the server",
        "ps": "Ghostscript",
        "cbor": "the 'cbor' package, which pinfeed does not use",
    }[{"pickle": "pyd", "pkl": "pyd", "seg.pyd": "pyd", "pyd.gz": "pyd", "eps": "ps"}.get(ext, ext)]
    with pytest.raises(DatasetError) as caught:
        build_dataset(
            "webdataset", {"shards": "absent-{0..3}.tar", "fields": fields}, DatasetContext(root)
        )
    msg = str(caught.value)
    assert msg.startswith(f"field extension {ext!r} is refused: WebDataset decodes it with ")
    assert why in msg
    assert ("'python' dataset kind" in msg) == (ext != "cbor")
    assert "npy" in msg or "png" in msg


def test_members_no_field_names_are_never_decoded(tmp_path: Path) -> None:
    """A pickle member that no field names is left alone (WebDataset unpickles it, so
    runs its code, then ``to_tuple`` drops it): the same samples, no code run."""
    with wds.TarWriter(str(tmp_path / "p-0.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"s{i}", "cls": i, "pyd": _Runs(), "npy": np.arange(i + 1)})
    _ran.clear()
    ds = build_dataset(
        "webdataset", {"shards": "p-{0..0}.tar", "fields": ["npy", "cls"]}, DatasetContext(tmp_path)
    )
    got = list(ds)
    assert _ran == []
    want = list(
        wds.WebDataset(str(tmp_path / "p-0.tar"), shardshuffle=False)
        .decode()
        .to_tuple("npy", "cls")
    )
    assert _ran == ["unpickled"] * 3  # the reference did run it
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def _array_bytes(save: Any, value: Any) -> bytes:
    buf = io.BytesIO()
    save(buf, value)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("ext", "data", "match"),
    [
        ("npy", _array_bytes(np.save, np.array([1, "a"], dtype=object)), "an object array"),
        (
            "npz",
            _array_bytes(lambda f, v: np.savez(f, x=v), np.array([{}], dtype=object)),
            "an object array",
        ),
        ("npz", pickle.dumps({"x": 1}), "not an npz file"),
        ("npy", pickle.dumps({"x": 1}), "the magic string is not correct"),
        (
            "jpg",
            b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n",
            "cannot identify image",
        ),
        ("ten", b"~TenBin~" + (10**9).to_bytes(8, "little"), "runs past the end"),
        ("npy.gz", b"not gzip", "Not a gzipped file"),
    ],
)
def test_refuses_content_at_the_first_batch(
    tmp_path: Path, ext: str, data: bytes, match: str
) -> None:
    """What only the data shows fails the sample, naming the shard, the sample and the
    extension: an object array (numpy would unpickle it; loaded with allow_pickle=False),
    a pickle in an npy or npz member, an EPS image in a jpg (no Ghostscript), a tenbin
    chunk past the end, a gz that is not gzip."""
    _tar(tmp_path / "b-0.tar", {"s0.cls": b"1", "s1.cls": b"2", f"s1.{ext}": data})
    ds = build_dataset(
        "webdataset",
        {"shards": "b-{0..0}.tar", "fields": ["cls", f"{ext};cls"]},
        DatasetContext(tmp_path),
    )
    with pytest.raises(DatasetError) as caught:
        list(ds)
    assert str(caught.value).startswith(f"b-0.tar: sample 1 .{ext}: ")
    assert match in str(caught.value)
    if match == "an object array":
        assert "allow_pickle=False" in str(caught.value) and "runs code" in str(caught.value)


def test_inflating_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzipped member and an npz's arrays decompress to at most INFLATE_LIMIT bytes."""
    from pinfeed_server.datasets import webdataset

    npz = _array_bytes(lambda f, v: np.savez_compressed(f, a=v, b=v), np.zeros(100, np.int64))
    _tar(tmp_path / "g-0.tar", {"s0.txt.gz": gzip.compress(b"x" * 1000), "s0.npz": npz})
    ds = build_dataset(
        "webdataset",
        {"shards": "g-{0..0}.tar", "fields": ["txt.gz", "npz"]},
        DatasetContext(tmp_path),
    )
    assert [(t, sorted(d)) for t, d in ds] == [("x" * 1000, ["a", "b"])]
    monkeypatch.setattr(webdataset, "INFLATE_LIMIT", 999)
    with pytest.raises(DatasetError, match=r"sample 0 \.txt\.gz: decompresses to more than 999 "):
        list(ds)
    monkeypatch.setattr(webdataset, "INFLATE_LIMIT", 1000)
    with pytest.raises(DatasetError, match=r"sample 0 \.npz: its arrays take more than 1,000 "):
        list(ds)


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
    with pytest.raises(DatasetError, match=r"sample 0 has no 'wav' field"):
        _build(root, fields=["cls", "wav"])
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


@pytest.mark.parametrize("fields", [["cls", "pyd"], {"x": "npy;pth"}])
def test_http_refuses_extensions_that_run_code(admin: Client, server: Server, fields: Any) -> None:
    """422 at registration, with why and what to do, through ``pinfeed.Client``."""
    rel = unique("wds")
    _tar(server.data_root / rel / "a-0.tar", {"x.cls": b"1", "x.pyd": pickle.dumps(1)})
    ext = "pyd" if isinstance(fields, list) else "pth"
    with pytest.raises(
        InvalidRequest,
        match=rf"'{ext}' is refused: WebDataset decodes it with .*runs code from the shard "
        r"inside the server.* 'python' dataset kind",
    ):
        admin.create_dataset(
            unique("wds"), "webdataset", {"shards": f"{rel}/a-{{0..0}}.tar", "fields": fields}
        )


def test_http_object_array_at_the_first_batch(admin: Client, server: Server) -> None:
    """An object array registers (its shard's headers are fine) and fails the loader's
    first batch: 422 at creation, where the server reads the first sample, naming it."""
    rel = unique("wds")
    obj = _array_bytes(np.save, np.array([None, 1], dtype=object))
    _tar(server.data_root / rel / "a-0.tar", {"s0.cls": b"1", "s0.npy": obj})
    name = unique("wds")
    info = admin.create_dataset(
        name, "webdataset", {"shards": f"{rel}/a-{{0..0}}.tar", "fields": ["npy", "cls"]}
    )
    try:
        assert "a-0.tar: sample 0 .npy: an object array" in info["error"]
        with pytest.raises(
            InvalidRequest, match=r"a-0\.tar: sample 0 \.npy: an object array .*allow_pickle=False"
        ):
            admin.create_loader(unique("wds"), dataset=name, batch_size=1)
    finally:
        admin.delete_dataset(name)


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


# Dict samples: a str leaf comes back from a loader as a list, as DataLoader gives it
# for a dict sample (for a tuple sample DataLoader gives a tuple: engine/collate.py).
# Not mp (its lists vary in length) nor gz (bytes: no default-collated loader carries them).
SERVED_DECODED = {
    "image": "jpg;png",
    "label": "cls",
    "meta": "json",
    "caption": "txt",
    "x": "npy",
    "arrays": "npz",
    "seg": "seg.json",
    "zipped": "npy.gz",
}


def _as_dict(keys: list[str], sample: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(keys, sample, strict=True))


@pytest.mark.parametrize("shuffle", [None, 4])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_decoders_through_the_server(
    admin: Client, server: Server, served: str, shuffle: int | None, num_workers: int
) -> None:
    """npy, npz, json, txt, cls, jpg/png (and seg.json, npy.gz) through a loader
    equal DataLoader over WebDataset's pipeline, batch for batch over 2 epochs."""
    name = unique("wds")
    params = {
        "shards": f"{served}/{PATTERN}",
        "fields": SERVED_DECODED,
        "shuffle_buffer": shuffle,
        "seed": 5,
    }
    admin.create_dataset(name, "webdataset", params)
    ref = reference(server.data_root / served, list(SERVED_DECODED.values()), shuffle)
    try:
        check_parity(
            admin,
            server,
            name,
            ref.map(functools.partial(_as_dict, list(SERVED_DECODED))),
            batch_size=4,
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
