"""The ``images`` kind: ImageFolder semantics, path safety, and parity with a Pillow
ImageFolder-style Dataset under DataLoader, through a real server and ``pinfeed.Loader``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from bench.references import PilImageFolder
from pinfeed import Client, InvalidRequest, Loader
from pinfeed_server.datasets import DatasetContext, DatasetError, build_dataset
from tests.conftest import Server
from tests.helpers import assert_same, unique

SIZE = 24


def _image(rng: np.random.Generator, w: int, h: int, mode: str) -> Image.Image:
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    return img.convert(mode) if mode != "RGB" else img


def make_tree(root: Path) -> Path:
    """Three classes given out of order, a nested subfolder, JPEG and PNG in several
    modes and sizes (portrait, landscape, square, smaller than SIZE), upper-case
    extensions and files that are not images."""
    rng = np.random.default_rng(0)
    files = {
        "zebra/01.jpg": (40, 30, "RGB"),
        "zebra/00.PNG": (30, 41, "RGBA"),
        "zebra/sub/02.jpeg": (24, 24, "L"),
        "zebra/sub-b/03.png": (17, 29, "P"),
        "apple/b.png": (64, 25, "RGB"),
        "apple/a.JPG": (25, 64, "RGB"),
        "apple/c.jpg": (33, 33, "L"),
        "mango/x.png": (50, 50, "LA"),
        "mango/y.jpg": (31, 47, "RGB"),
        "mango/z.jpg": (47, 31, "RGB"),
        "mango/w.png": (20, 12, "RGB"),
    }
    for rel, (w, h, mode) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        img = _image(rng, w, h, mode)
        if rel.lower().endswith((".jpg", ".jpeg")):
            img.save(path, format="JPEG", quality=90)
        else:
            img.save(path, format="PNG")
    (root / "apple" / "notes.txt").write_text("not an image")
    (root / "README").write_text("a file next to the class folders is no class")
    return root


@pytest.fixture(scope="module")
def folder(server: Server) -> str:
    rel = unique("images")
    make_tree(server.data_root / rel)
    return rel


def _ctx(root: Path) -> DatasetContext:
    return DatasetContext(root)


def test_imagefolder_semantics(tmp_path: Path) -> None:
    make_tree(tmp_path / "data")
    ds = build_dataset("images", {"path": "data", "size": SIZE}, _ctx(tmp_path))
    ref = PilImageFolder(tmp_path / "data", SIZE)
    assert ds.classes == ["apple", "mango", "zebra"] == ref.classes
    assert [os.path.basename(p) for p, _ in ds.samples] == [
        os.path.basename(p) for p, _ in ref.samples
    ]
    assert [label for _, label in ds.samples] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    for i in range(len(ref)):
        image, label = ds[i]
        assert image.dtype == torch.uint8 and image.shape == (3, SIZE, SIZE)
        assert image.is_contiguous()
        assert_same((image, label), ref[i], f"sample {i}")


def test_uncropped_equals_the_reference_uncropped(tmp_path: Path) -> None:
    """W9's deterministic stage: the images kind with "crop": false and the bench's
    ImageFolder uncropped (DataLoader's side of W9) give the same pixels."""
    make_tree(tmp_path / "data")
    ds = build_dataset("images", {"path": "data", "size": SIZE, "crop": False}, _ctx(tmp_path))
    ref = PilImageFolder(tmp_path / "data", SIZE, crop=False)
    shapes = set()
    for i in range(len(ref)):
        assert_same(ds[i], ref[i], f"sample {i}")
        shapes.add(tuple(ds[i][0].shape))
    assert len(shapes) > 1  # not all square: the aspect kept


def test_fetch_into_equals_collate(tmp_path: Path) -> None:
    make_tree(tmp_path / "data")
    ds = build_dataset("images", {"path": "data", "size": SIZE}, _ctx(tmp_path))
    want = next(iter(DataLoader(PilImageFolder(tmp_path / "data", SIZE), batch_size=len(ds))))
    images = torch.zeros(len(ds), 3, SIZE, SIZE, dtype=torch.uint8)
    labels = torch.zeros(len(ds), dtype=torch.int64)
    ds.fetch_into(list(range(len(ds))), [images, labels])
    assert_same([images, labels], want)


def test_data_root_itself_and_params(tmp_path: Path) -> None:
    make_tree(tmp_path)
    assert len(build_dataset("images", {"path": ".", "size": 8}, _ctx(tmp_path))) == 11
    for bad in ({"path": "."}, {"path": ".", "size": 0}, {"path": ".", "size": 8, "x": 1}):
        with pytest.raises(DatasetError, match="invalid params"):
            build_dataset("images", bad, _ctx(tmp_path))


def test_refuses_paths_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = make_tree(tmp_path / "outside")
    root.mkdir()
    with pytest.raises(DatasetError, match="outside the data root"):
        build_dataset("images", {"path": "../outside", "size": 8}, _ctx(root))
    with pytest.raises(DatasetError, match="outside the data root"):
        build_dataset("images", {"path": str(outside), "size": 8}, _ctx(root))
    (root / "link").symlink_to(outside)
    with pytest.raises(DatasetError, match="outside the data root"):
        build_dataset("images", {"path": "link", "size": 8}, _ctx(root))
    with pytest.raises(DatasetError, match="not found"):
        build_dataset("images", {"path": "missing", "size": 8}, _ctx(root))


@pytest.mark.parametrize("where", ["class", "subfolder", "file"])
def test_refuses_symlinks_that_escape(tmp_path: Path, where: str) -> None:
    root = make_tree(tmp_path / "root")
    outside = make_tree(tmp_path / "outside")
    if where == "class":
        (root / "escape").symlink_to(outside / "apple")
    elif where == "subfolder":
        (root / "apple" / "escape").symlink_to(outside / "mango")
    else:
        (root / "apple" / "escape.jpg").symlink_to(outside / "mango" / "y.jpg")
    with pytest.raises(DatasetError, match="leads outside the data root"):
        build_dataset("images", {"path": ".", "size": 8}, _ctx(root))


def test_symlinks_inside_the_root_are_followed_and_loops_cut(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    (root / "zebra" / "sub" / "loop").symlink_to(root / "zebra")
    (root / "apple" / "more").symlink_to(root / "mango")
    ds = build_dataset("images", {"path": ".", "size": 8}, _ctx(root))
    # apple gains mango's four images through the link; the link from zebra/sub back
    # to zebra is not followed, so zebra keeps its own four.
    labels = [label for _, label in ds.samples]
    assert (labels.count(0), labels.count(1), labels.count(2)) == (3 + 4, 4, 4)
    assert all(os.path.realpath(p) == p for p, _ in ds.samples)
    assert ds[4][0].shape == (3, 8, 8)


def test_empty_class_and_no_class(tmp_path: Path) -> None:
    make_tree(tmp_path / "data")
    (tmp_path / "data" / "empty").mkdir()
    (tmp_path / "data" / "empty" / "notes.txt").write_text("-")
    with pytest.raises(DatasetError, match="empty"):
        build_dataset("images", {"path": "data", "size": 8}, _ctx(tmp_path))
    (tmp_path / "flat").mkdir()
    with pytest.raises(DatasetError, match="no class folder"):
        build_dataset("images", {"path": "flat", "size": 8}, _ctx(tmp_path))


def test_corrupt_image_names_the_file(tmp_path: Path) -> None:
    make_tree(tmp_path)
    (tmp_path / "apple" / "a.JPG").write_bytes(b"not a jpeg")
    ds = build_dataset("images", {"path": ".", "size": 8}, _ctx(tmp_path))
    with pytest.raises(DatasetError, match=r"cannot decode .*a\.JPG"):
        ds[0]


def test_http_refuses_escapes(admin: Client) -> None:
    with pytest.raises(InvalidRequest, match="outside the data root"):
        admin.create_dataset(unique("images-bad"), "images", {"path": "..", "size": 8})


def _own(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_own(v) for v in batch)
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parity_with_dataloader(
    admin: Client, server: Server, folder: str, num_workers: int
) -> None:
    """Same batches, same order, over three epochs, as DataLoader over the reference."""
    name = unique("images")
    info = admin.create_dataset(name, "images", {"path": folder, "size": SIZE})
    assert info["length"] == 11
    assert info["sample"] == [
        {"dtype": "uint8", "shape": [3, SIZE, SIZE]},
        {"dtype": "int64", "shape": []},
    ]
    loader_name = unique("images-loader")
    admin.create_loader(
        loader_name, dataset=name, batch_size=4, shuffle=True, seed=7, num_workers=num_workers
    )
    ref = DataLoader(
        PilImageFolder(server.data_root / folder, SIZE),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=num_workers,
    )
    try:
        with Loader(loader_name, socket=server.socket) as loader:
            for epoch in range(3):
                want = list(ref)
                got = [_own(b) for b in loader]
                assert len(got) == len(want) == 3
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert_same(g, w, f"epoch {epoch} batch {i}")
    finally:
        admin.delete_loader(loader_name)
        admin.delete_dataset(name)


def test_uncropped_keeps_the_aspect(tmp_path: Path) -> None:
    """``"crop": false``: torchvision's ``Resize(size)`` alone (the shorter side to
    ``size``, the longer ``int(size * long / short)``), no ``CenterCrop``."""
    make_tree(tmp_path)
    ds = build_dataset("images", {"path": ".", "size": SIZE, "crop": False}, _ctx(tmp_path))
    for i in range(len(ds)):
        path, _ = ds.samples[i]
        with Image.open(path) as f:
            img = f.convert("RGB")
        w, h = img.size
        short, long = min(w, h), max(w, h)
        new = (SIZE, int(SIZE * long / short)) if w <= h else (int(SIZE * long / short), SIZE)
        if short != SIZE:
            img = img.resize(new, Image.Resampling.BILINEAR)
        want = torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy())
        got, _ = ds[i]
        assert got.shape == want.shape and torch.equal(got, want), path


def test_draft_decode_is_close_and_says_so(tmp_path: Path) -> None:
    """``"decode": "draft"``: a JPEG much larger than ``size`` is decoded at a reduced
    scale (close to, not equal to, the full decode; the same shape); one that cannot be
    reduced (a reduction would leave it smaller than ``size``) is decoded as it is."""
    rng = np.random.default_rng(5)
    big = tmp_path / "big" / "a"
    big.mkdir(parents=True)
    from bench.data import _jpeg

    for i in range(3):
        _jpeg(rng, 400, 300).save(big / f"{i}.jpg", format="JPEG", quality=90)
    params = {"path": "big", "size": SIZE, "crop": False}
    full = build_dataset("images", params, _ctx(tmp_path))
    draft = build_dataset("images", {**params, "decode": "draft"}, _ctx(tmp_path))
    for i in range(3):
        a, b = full[i][0], draft[i][0]
        assert a.shape == b.shape
        diff = (a.int() - b.int()).abs().float()
        assert 0 < diff.mean() < 8  # a reduced decode: close, not bit-identical
    small = build_dataset("images", {**params, "size": 256}, _ctx(tmp_path))
    small_draft = build_dataset(
        "images", {**params, "size": 256, "decode": "draft"}, _ctx(tmp_path)
    )
    assert all(torch.equal(small[i][0], small_draft[i][0]) for i in range(3))  # 300/2 < 256
    with pytest.raises(DatasetError, match="decode"):
        build_dataset("images", {**params, "decode": "fast"}, _ctx(tmp_path))


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\n%%EOF\n"


def test_an_eps_file_named_jpg_is_never_handed_to_ghostscript(tmp_path: Path) -> None:
    """Pillow reads EPS by running Ghostscript on the file's PostScript: every kind
    opens images without that format, so such a file is a sample's error, as a file
    Pillow cannot read, and nothing runs."""
    from PIL import EpsImagePlugin, UnidentifiedImageError

    from pinfeed_server.datasets.images import decode, safe_formats

    path = tmp_path / "cat" / "evil.jpg"
    path.parent.mkdir()
    path.write_bytes(EPS)
    with Image.open(path) as img:  # what Pillow would do with every format allowed
        assert isinstance(img, EpsImagePlugin.EpsImageFile)
    assert "EPS" not in safe_formats() and "JPEG" in safe_formats()
    with pytest.raises(UnidentifiedImageError):
        decode(str(path), SIZE)
