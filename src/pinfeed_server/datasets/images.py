"""``images``: a folder of class subfolders of JPEG/PNG files, as torchvision's ImageFolder.

``{"path": "train", "size": 224}``. ImageFolder's semantics: the classes are the
subfolder names, sorted, and a sample's label is its class's index; each class folder
is walked recursively (symlinks followed), folders in sorted path order and files
sorted within each, keeping ``.jpg``, ``.jpeg`` and ``.png`` in any case; a class
without a single image is an error. A sample is decoded with Pillow and converted to
RGB, its shorter side is resized to ``size`` (bilinear, as torchvision's ``Resize`` on
a PIL image) and it is center-cropped to ``size`` x ``size`` (``CenterCrop``):
``(uint8 tensor [3, size, size], label)``, the label an ``int`` (int64 once batched,
as under DataLoader). With ``"crop": false`` the resized image is kept whole
(``[3, H, W]``, the shorter side ``size``): the deterministic stage of an ImageNet
pipeline, cached once per node, whose random crop is the loader's ``transform``.
``"decode": "draft"`` decodes a JPEG at a reduced scale first (``Image.draft``):
faster for large JPEGs, not bit-identical with a full decode (docs/architecture/cache.md
has the figures).

Every class folder, subfolder and file must resolve inside the data root: a symlink
that leads out is refused when the dataset is built, a link back to an enclosing
folder (a loop) is not followed, and files are opened by their resolved path with
``O_NOFOLLOW``, so a file swapped for a link later is refused too.

``"path": "s3://bucket/train/"`` reads the folder from a store: the keys under the
prefix are its files (the first folder below the prefix a class), in the same order,
each object fetched whole into the node's object cache (``remote/``).
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

import numpy as np
import torch
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError
from pydantic import Field

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params
from pinfeed_server.datasets.remote import RemoteDataset
from pinfeed_server.datasets.shared import SharedArrays, StringTable, string_arrays
from pinfeed_server.remote import Manifest, RemoteObject, is_remote
from pinfeed_server.remote.file import Local
from pinfeed_server.remote.url import S3Url

EXTENSIONS = (".jpg", ".jpeg", ".png")


class ImagesParams(Params):
    path: str = Field(description="folder of class subfolders, relative to the data root")
    size: int = Field(gt=0, le=8192, description="shorter side resized to this, then cropped")
    crop: bool = Field(
        True,
        description="center-crop to size x size after the resize (torchvision's CenterCrop); "
        "false: keep the aspect ratio (samples may differ in shape: a loader's transform "
        "crops them, e.g. RandomResizedCrop)",
    )
    decode: Literal["full", "draft"] = Field(
        "full",
        description="full: decode every pixel (what torchvision's loader gives); draft: let "
        "libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale where that still leaves the "
        "shorter side >= size (Pillow's Image.draft), then resize: several times faster "
        "for JPEGs much larger than size, close to but NOT bit-identical with a full decode",
    )


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _refuse(shown: str, root: str) -> DatasetError:
    return DatasetError(f"{shown!r} is a symlink that leads outside the data root {root!r}")


def _walk(top: str, real_top: str, root: str) -> list[tuple[str, str, list[tuple[str, bool]]]]:
    """``(shown dirpath, real dirpath, [(file name, is symlink)])`` for ``top`` and every
    folder below, like ``os.walk(top, followlinks=True)`` but with every real path
    checked against ``root`` and a link back to an enclosing folder (a loop) not
    followed. ``os.scandir`` only: no stat of a plain file (its type comes with the
    directory entry)."""
    found: list[tuple[str, str, list[tuple[str, bool]]]] = []
    stack: list[tuple[str, str, frozenset[str]]] = [(top, real_top, frozenset({real_top}))]
    while stack:
        shown, real, ancestors = stack.pop()
        files: list[tuple[str, bool]] = []
        try:
            entries = list(os.scandir(real))
        except OSError:
            continue  # os.walk skips folders it cannot list, too
        for entry in entries:
            if entry.is_dir():
                sub_shown = os.path.join(shown, entry.name)
                sub_real = os.path.realpath(entry.path) if entry.is_symlink() else entry.path
                if not _inside(sub_real, root):
                    raise _refuse(sub_shown, root)
                if sub_real not in ancestors:
                    stack.append((sub_shown, sub_real, ancestors | {sub_real}))
            else:
                files.append((entry.name, entry.is_symlink()))
        found.append((shown, real, files))
    return found


def scan(folder: Path, root: Path) -> tuple[list[str], SharedArrays]:
    """ImageFolder's ``find_classes`` and ``make_dataset``: the classes, and the samples
    as shared arrays: ``dirs`` (each folder's real path, a string table), ``dir_label``,
    and per sample its file name (a table; the real path itself for a symlinked file)
    and its folder (``sample_dir``)."""
    root_s = str(root)
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    if not classes:
        raise DatasetError(f"no class folder in {str(folder)!r}")
    dirs: list[bytes] = []
    dir_label: list[int] = []
    names: list[bytes] = []
    sample_dir: list[int] = []
    empty: list[str] = []
    for label, name in enumerate(classes):
        shown = os.path.join(str(folder), name)
        real = os.path.realpath(shown)
        if not _inside(real, root_s):
            raise _refuse(shown, root_s)
        before = len(names)
        for shown_dir, real_dir, files in sorted(_walk(shown, real, root_s)):
            d = len(dirs)
            dirs.append(os.fsencode(real_dir))
            dir_label.append(label)
            for fname, link in sorted(files):
                if not fname.lower().endswith(EXTENSIONS):
                    continue
                if link:
                    path = os.path.realpath(os.path.join(real_dir, fname))
                    if not _inside(path, root_s):
                        raise _refuse(os.path.join(shown_dir, fname), root_s)
                    names.append(os.fsencode(path))
                else:
                    names.append(os.fsencode(fname))
                sample_dir.append(d)
        if len(names) == before:
            empty.append(name)
    if empty:
        raise DatasetError(f"class folders without a .jpg, .jpeg or .png file: {', '.join(empty)}")
    dir_bytes, dir_offsets = string_arrays(dirs)
    name_bytes, name_offsets = string_arrays(names)
    index = SharedArrays(
        f"images-{os.path.basename(folder)}",
        {
            "dir_bytes": dir_bytes,
            "dir_offsets": dir_offsets,
            "dir_label": np.asarray(dir_label, dtype=np.int64),
            "name_bytes": name_bytes,
            "name_offsets": name_offsets,
            "sample_dir": np.asarray(sample_dir, dtype=np.int32),
        },
    )
    return classes, index


@functools.cache
def safe_formats() -> tuple[str, ...]:
    """Every Pillow format but EPS (to load one, Pillow runs Ghostscript on the file's
    PostScript, in the server), in Pillow's order: what every kind opens images with,
    by their content, whatever their names say. An EPS file is then a sample error
    ("cannot identify image file"), as any file Pillow cannot read."""
    Image.init()
    return tuple(f for f in Image.ID if f != "EPS")


def decode(
    source: str | BinaryIO, size: int, crop: bool = True, draft: bool = False
) -> Image.Image:
    """Open ``source`` (a path, no symlink; or an open binary file) as RGB, resize its
    shorter side to ``size`` and, with ``crop``, center-crop; ``draft``: decode a JPEG
    at a reduced scale first."""
    if isinstance(source, str):
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        source = os.fdopen(fd, "rb")
    with source as f:
        img: Image.Image = Image.open(f, formats=safe_formats())
        size_before = img.size
        if draft and img.format == "JPEG":
            w, h = size_before
            scale = size / min(w, h)
            # libjpeg's scale: the largest reduction that keeps both sides >= these
            img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
        img.load()
        # convert() copies even an RGB image: skip it then (the same pixels)
        if img.mode != "RGB":
            img = img.convert("RGB")
    return fit(img, size, crop, size_before)


def fit(
    img: Image.Image, size: int, crop: bool = True, source: tuple[int, int] | None = None
) -> Image.Image:
    """torchvision's ``Resize(size)`` (shorter side, bilinear) then, with ``crop``,
    ``CenterCrop(size)``. ``source``: the image's size before a draft decode reduced it
    (the output size is the full decode's)."""
    w, h = source or img.size
    short, long = (w, h) if w <= h else (h, w)
    if short != size or img.size != (w, h):
        new_short, new_long = size, int(size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    if not crop:
        return img
    w, h = img.size
    top = round((h - size) / 2.0)
    left = round((w - size) / 2.0)
    return img.crop((left, top, left + size, top + size))


class Samples(Sequence[tuple[str, int]]):
    def __init__(self, dataset: ImagesDataset) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(index, slice):
            return [self._dataset.sample(i) for i in range(len(self))[index]]
        return self._dataset.sample(index)


class Files:
    """A local folder's samples, in ``SharedArrays`` (``scan``): built once in the
    server, mapped by its zygote and workers, pickled as a file descriptor; no list of
    paths anywhere."""

    def __init__(self, index: SharedArrays) -> None:
        self._index = index
        self._dirs = StringTable(index["dir_bytes"], index["dir_offsets"])
        self._names = StringTable(index["name_bytes"], index["name_offsets"])
        self._sample_dir = index["sample_dir"]
        self._dir_label = index["dir_label"]

    def __reduce__(self) -> tuple[Any, ...]:
        return (Files, (self._index,))

    def __len__(self) -> int:
        return len(self._sample_dir)

    def sample(self, index: int) -> tuple[str, int]:
        d = int(self._sample_dir[index])
        name = self._names[index]
        path = name if name.startswith(os.sep) else os.path.join(self._dirs[d], name)
        return path, int(self._dir_label[d])

    def open(self, index: int) -> str:
        return self.sample(index)[0]


class Objects:
    """A folder's samples in a store: ``manifest``'s objects, whole, in ImageFolder's
    order, and each one's label; read through the node's object cache."""

    def __init__(self, remote: Local, manifest: Manifest, labels: NDArray[np.int64]) -> None:
        self.remote, self.manifest, self.labels = remote, manifest, labels

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, index: int) -> tuple[str, int]:
        return self.manifest.objects[index].url, int(self.labels[index])

    def open(self, index: int) -> BinaryIO:
        return io.BufferedReader(RemoteObject(self.remote, self.manifest, index).open())

    def units(
        self, indices: NDArray[np.int64]
    ) -> list[tuple[NDArray[np.int64], NDArray[np.int64]]]:
        return [self.manifest.objects_units(indices)]


class ImagesDataset:
    """ImageFolder's samples (``files``: a local folder's, or a store's), decoded."""

    def __init__(
        self,
        classes: list[str],
        files: Files | Objects,
        size: int,
        crop: bool = True,
        decode: str = "full",
    ) -> None:
        self.classes = classes
        self.class_to_idx = {name: i for i, name in enumerate(classes)}
        self.size = size
        self.crop = crop
        self.decode = decode
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def _index(self, index: int) -> int:
        n = len(self.files)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} images")
        return index % n

    def sample(self, index: int) -> tuple[str, int]:
        """ImageFolder's ``samples[index]``: (real path, or the object's URL; label)."""
        return self.files.sample(self._index(index))

    @property
    def samples(self) -> Samples:
        """ImageFolder's ``samples``, as a read-only view (built on access, never stored)."""
        return Samples(self)

    def _hwc(self, index: int) -> tuple[np.ndarray[Any, Any], int]:
        i = self._index(index)
        path, label = self.files.sample(i)
        try:
            img = decode(self.files.open(i), self.size, self.crop, self.decode == "draft")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DatasetError(f"cannot decode {path}: {exc}") from None
        return np.asarray(img), label  # read-only, HxWxC

    # The HWC -> CHW transposes are numpy copies on purpose: torch would spread this
    # strided copy over its intra-op threads, and on a few shared cores (the server's
    # in-process producer, DataLoader's main process) that costs 3x the decode itself.

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        hwc, label = self._hwc(index)
        return torch.from_numpy(hwc.transpose(2, 0, 1).copy()), label

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        # Decode each image straight into its row of the slot: no per-sample CHW tensor
        # and no stack.
        images, labels = out[0].numpy(), out[1].numpy()
        for row, index in enumerate(indices):
            hwc, label = self._hwc(index)
            np.copyto(images[row], hwc.transpose(2, 0, 1))
            labels[row] = label

    def __repr__(self) -> str:
        return f"ImagesDataset({len(self)} images, {len(self.classes)} classes)"


def scan_objects(listed: Manifest, prefix: str) -> tuple[list[str], list[int], list[int]]:
    """``scan`` over a listing: the classes (the first folder below ``prefix``), and
    which objects are samples (ImageFolder's order: by folder, then by name) with their
    labels."""
    files: dict[str, list[tuple[str, str, int]]] = {}
    for k, obj in enumerate(listed.objects):
        rel = obj.key[len(prefix) :]
        cls, _, rest = rel.partition("/")
        if not rest:
            continue  # a file beside the class folders: ImageFolder skips it too
        folder, _, name = f"{cls}/{rest}".rpartition("/")
        found = files.setdefault(cls, [])
        if name.lower().endswith(EXTENSIONS):
            found.append((folder, name, k))
    if not files:
        raise DatasetError(f"no class folder in {listed.name!r}")
    classes = sorted(files)
    empty = [c for c in classes if not files[c]]
    if empty:
        raise DatasetError(f"class folders without a .jpg, .jpeg or .png file: {', '.join(empty)}")
    keep: list[int] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for _, _, k in sorted(files[cls]):
            keep.append(k)
            labels.append(label)
    return classes, keep, labels


def build(p: ImagesParams, ctx: DatasetContext) -> Any:
    if is_remote(p.path):
        url = p.path.rstrip("/") + "/"
        listed = ctx.manifest(url, blocks=False)
        classes, keep, labels = scan_objects(listed, S3Url.parse(url).key)
        manifest = listed.select(keep)
        files = Objects(ctx.remote, manifest, np.asarray(labels, dtype=np.int64))  # type: ignore[arg-type]
        inner = ImagesDataset(classes, files, p.size, p.crop, p.decode)
        return RemoteDataset(inner, manifest, files.units, listed)
    classes, index = scan(ctx.resolve_dir(p.path), ctx.data_root.resolve())
    return ImagesDataset(classes, Files(index), p.size, p.crop, p.decode)


KIND = Kind("images", ImagesParams, build, __doc__, ship_build=True)
