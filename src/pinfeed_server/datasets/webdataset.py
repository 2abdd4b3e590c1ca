"""``webdataset``: local WebDataset tar shards, an ``IterableDataset`` as WebDataset reads them.

``{"shards": "shards/train-{000000..000099}.tar", "fields": ["jpg;png", "cls"]}``.
``shards`` is a brace pattern (or a list of them) under the data root, expanded as
WebDataset expands it. A shard's regular files are grouped into samples as WebDataset
groups them: consecutive members with the same key (the path up to the first dot of
the file name) make one sample, keyed by their lower-cased extensions; ``__...__``
metadata files and names without an extension are skipped, an extension twice in a
sample is an error. ``fields`` picks what a sample is, as ``to_tuple`` does (a list:
tuple samples; a dict of key -> extension: dict samples; ``a;b``: the first present).

A field is decoded as ``.decode("torchrgb8")`` decodes it (``webdataset.autodecode``
1.0.2: ``gzfilter``, ``imagehandler("torchrgb8")``, then ``basichandlers``), by the
extension's last part (``seg.json`` is JSON) after one ``.gz`` is decompressed
(``npy.gz``: a gzipped npy, at most INFLATE_LIMIT bytes):

============================================  ==========================================
extension                                     a sample holds
============================================  ==========================================
``jpg`` ``jpeg`` ``png`` ``webp`` ``bmp``     RGB uint8 tensor ``[3, H, W]`` (Pillow;
``gif`` ``tif`` ... (IMAGES: WebDataset's     with ``image_size``, resized and cropped
Pillow list)                                  as ``images`` does)
``cls`` ``cls2`` ``index`` ``inx`` ``id``     ``int``
``json`` ``jsn``                              parsed (``json.loads``)
``txt`` ``text`` ``transcript``               ``str`` (UTF-8)
``npy``                                       ``np.ndarray`` (``numpy.lib.format.read_array``)
``npz``                                       ``dict`` of name -> ``np.ndarray`` (every
                                              array read, as WebDataset's ``dict(np.load)``;
                                              at most INFLATE_LIMIT bytes in all)
``ten`` ``tb``                                ``list`` of read-only ``np.ndarray`` (tenbin)
``mp`` ``msg``                                ``msgpack.unpackb``
``gz``                                        the decompressed ``bytes``
any other                                     ``bytes`` as stored
``pkl`` ``pickle`` ``pyd`` ``pth``            refused: pickle / ``torch.load`` would run
                                              code from the shard inside the server
``ps`` ``eps``                                refused: Pillow runs Ghostscript on them
``cbor``                                      refused: WebDataset needs the ``cbor``
                                              package, which pinfeed does not use
============================================  ==========================================

Only the members that ``fields`` names are decoded (the others are never read; WebDataset
decodes every member and ``to_tuple`` drops the rest: the same samples), so the refused
extensions are refused at registration, when a field (or an ``a;b`` alternative) names
one, with what to do instead (npy/npz/json, or a ``python`` dataset kind). Arrays load
with ``allow_pickle=False`` (WebDataset's default too): an object array fails the sample's
first batch naming the shard, the sample and the extension, as any member that does not
decode does. An image member is opened by its content with every Pillow format but EPS.

Shards are split by rank (``shards[rank::world_size]``) and then by DataLoader worker
(``[worker::num_workers]``), as WebDataset's ``split_by_node`` and ``split_by_worker``
do, shard order kept. The rank is the one ``split_by_node`` finds (``torch.distributed``
when initialized, else ``RANK``/``WORLD_SIZE`` in the environment, which a pinfeed
worker sets to its loader's ``rank``/``world_size``), unless the params fix
``rank``/``world_size``; ``len`` is that rank's sample count. ``shuffle_buffer`` shuffles samples
within each worker through WebDataset's buffer (``.shuffle(n, seed=seed)``: the same
picks from ``random.Random(seed)``, the same order every epoch). Every shard's
headers are read once when the dataset is built: a missing or truncated shard, a member
whose name is absolute or has a ``..`` component, or a sample missing a field is
refused naming the shard. Samples are read from
memory-mapped shards through the offsets found then (compact numpy arrays).

``s3://`` patterns (``s3://bucket/train/shard-{000000..000099}.tar``) read the shards
from a store: each shard is fetched whole into the node's object cache (the scan at
registration fetches every one once) and mapped from there.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import mmap
import os
import random
import re
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np
import torch
from braceexpand import braceexpand
from numpy.typing import NDArray
from PIL import Image
from pydantic import Field

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params
from pinfeed_server.datasets.images import fit, safe_formats
from pinfeed_server.datasets.remote import RemoteIterable, Spans
from pinfeed_server.remote import Manifest, RemoteObject, is_remote
from pinfeed_server.remote.url import S3Url

# webdataset.autodecode.IMAGE_EXTENSIONS (1.0.2: Pillow's formats), less ps/eps (REFUSED)
_IMAGE_EXTENSIONS = """
blp bmp dib bufr cur pcx dcx dds fit fits fli flc ftc ftu gbr gif grib h5 hdf png apng jp2
j2k jpc jpf jpx j2c icns ico im iim tif tiff jfif jpe jpg jpeg mpg mpeg msp pcd pxr pbm pgm
ppm pnm psd bw rgb rgba sgi ras tga icb vda vst webp wmf emf xbm xpm
"""
IMAGES = frozenset(_IMAGE_EXTENSIONS.split())
INTS = frozenset({"cls", "cls2", "index", "inx", "id"})
JSONS = frozenset({"json", "jsn"})
TEXTS = frozenset({"txt", "text", "transcript"})
MSGPACK = frozenset({"mp", "msg"})
_STORE = (
    "store the data as npy, npz or json instead, or read these shards with a 'python' "
    "dataset kind (a Dataset of your own, that trusts the shards itself)"
)
# What WebDataset's default decoders would run on the shard's data: refused when
# ``fields`` names one (at registration; a member no field names is never decoded).
REFUSED = {
    **dict.fromkeys(
        ("pkl", "pickle", "pyd"),
        "WebDataset decodes it with pickle.loads, which runs code from the shard inside "
        f"the server; {_STORE}",
    ),
    "pth": "WebDataset decodes it with torch.load, which unpickles: it runs code from the "
    f"shard inside the server; {_STORE}",
    **dict.fromkeys(
        ("ps", "eps"),
        "WebDataset decodes it with Pillow, which runs Ghostscript (a PostScript "
        "interpreter) on the shard's data inside the server; convert it to a raster image "
        "(png, jpg), or read these shards with a 'python' dataset kind",
    ),
    "cbor": "WebDataset decodes it with the 'cbor' package, which pinfeed does not use; "
    "store the data as json, mp (msgpack), npy or npz instead",
}
# bytes a ``.gz`` member, or an npz's arrays together, may decompress to (a bomb stops)
INFLATE_LIMIT = 1 << 30
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")  # np.load's test for an npz (zip) file
_TENBIN = b"~TenBin~"
# webdataset.tenbin's dtype codes; no 'u4': its table spells uint32 'unit32', so
# WebDataset neither writes nor reads uint32
_TENBIN_DTYPES = {
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
    "i1": "int8",
    "i2": "int16",
    "i4": "int32",
    "i8": "int64",
    "u1": "uint8",
    "u2": "uint16",
    "u8": "uint64",
}
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext
MAX_SHARDS = 1_000_000  # braceexpand builds a whole range at once: bound it first
_META = re.compile(r"__[^/]*__($|/)")
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")
_GROUP = re.compile(r"\{([^{}]*)\}")


def _braces(pattern: str) -> int:
    """An upper bound of the names ``pattern`` expands to (its innermost groups' sizes
    multiplied), found without expanding it."""
    n = 1
    for a, b, step in _RANGE.findall(pattern):
        n *= abs(int(b) - int(a)) // max(1, abs(int(step or 1))) + 1
    for body in _GROUP.findall(_RANGE.sub("", pattern)):
        n *= body.count(",") + 1
    return n


class WebDatasetParams(Params):
    shards: str | list[str] = Field(description="brace pattern(s) of tar shards, under the root")
    fields: list[str] | dict[str, str] = Field(
        description="extensions, as to_tuple (a list) or key -> extension (a dict); 'a;b'"
    )
    image_size: int | None = Field(None, gt=0, le=8192, description="resize + center crop")
    shuffle_buffer: int | None = Field(None, gt=0, description="samples in the shuffle buffer")
    seed: int = Field(0, description="the shuffle buffer's random.Random seed")
    rank: int | None = Field(
        None, ge=0, description="fixed rank (default: the loader's, as RANK in the env)"
    )
    world_size: int | None = Field(None, ge=1, description="with rank")


@dataclass(frozen=True)
class Shard:
    """One tar's samples: member ``m`` of sample ``s`` is ``first[s] <= m < first[s+1]``."""

    shown: str
    source: Path | RemoteObject  # a file under the data root, or an object in a store
    first: np.ndarray[Any, Any]  # int64 [samples + 1]
    offset: np.ndarray[Any, Any]  # int64 [members]: where a member's data starts
    size: np.ndarray[Any, Any]  # int64 [members]
    ext: np.ndarray[Any, Any]  # int16 [members]: index into the extension table

    @property
    def samples(self) -> int:
        return len(self.first) - 1


def _unsafe(name: str) -> bool:
    return name.startswith("/") or ".." in name.split("/")


def _size(source: Path | RemoteObject) -> int:
    return source.size if isinstance(source, RemoteObject) else source.stat().st_size


def _file(source: Path | RemoteObject) -> BinaryIO:
    if isinstance(source, RemoteObject):
        return io.BufferedReader(source.open(), 1 << 16)
    return source.open("rb")


def _map(source: Path | RemoteObject) -> mmap.mmap:
    """The whole shard, mapped (a store's: its file in the node's object cache)."""
    fd = (
        source.open_fd()
        if isinstance(source, RemoteObject)
        else os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    )
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def scan(shown: str, source: Path | RemoteObject, exts: dict[str, int]) -> Shard:
    """Read a shard's headers: its samples as WebDataset's ``group_by_keys`` forms them."""
    first: list[int] = []
    offset: list[int] = []
    size: list[int] = []
    ext: list[int] = []
    key: str | None = None
    seen: set[str] = set()
    total = _size(source)
    try:
        with _file(source) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for info in tar:
                link = (info.issym() or info.islnk()) and _unsafe(info.linkname)
                if _unsafe(info.name) or link:
                    raise DatasetError(
                        f"{shown}: member {info.name!r} is a path traversal (an absolute path "
                        "or a '..' component)"
                    )
                if not info.isreg() or _META.match(info.name):
                    continue
                if "/" not in info.name and info.name.startswith("__") and info.name.endswith("__"):
                    continue
                m = _KEY.match(info.name)
                if m is None:
                    continue
                prefix, suffix = m.group(1), m.group(2).lower()
                if prefix != key:
                    key, seen = prefix, set()
                    first.append(len(offset))
                if suffix in seen:
                    raise DatasetError(f"{shown}: {info.name}: duplicate file name in the sample")
                seen.add(suffix)
                if info.offset_data + info.size > total:
                    raise DatasetError(f"{shown}: truncated in member {info.name!r}")
                offset.append(info.offset_data)
                size.append(info.size)
                ext.append(exts.setdefault(suffix, len(exts)))
            end = tar.offset  # tarfile stops quietly at a cut header: the archive must end
            f.seek(end)  # with a zero block, as every tar writer ends it
            if f.read(512) != bytes(512):
                raise DatasetError(f"{shown}: truncated at byte {end} (no end-of-archive block)")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DatasetError(f"{shown}: not a readable tar file ({exc})") from None
    first.append(len(offset))
    return Shard(
        shown,
        source,
        np.array(first, dtype=np.int64),
        np.array(offset, dtype=np.int64),
        np.array(size, dtype=np.int64),
        np.array(ext, dtype=np.int16),
    )


def decoding(ext: str) -> tuple[bool, str]:
    """(gunzip first, the extension that picks the decoder) for a sample key, as
    ``.decode()``'s handlers see it: its ``gzfilter`` strips one ``.gz`` and decompresses,
    then the image handler and ``basichandlers`` look at the key's last extension only
    (``seg.json`` is JSON, ``npy.gz`` a gzipped npy, ``x.gz`` gunzipped bytes)."""
    key = "." + ext
    gz = key.endswith(".gz")
    if gz:
        key = key[:-3]
    return gz, key.rsplit(".", 1)[-1]


def refusal(ext: str) -> str | None:
    """Why a field's extension is refused (None: it is decoded, or kept as bytes)."""
    last = decoding(ext)[1]
    if last in REFUSED:
        return f"field extension {ext!r} is refused: {REFUSED[last]}"
    return None


def _gunzip(data: bytes) -> bytes:
    """``gzip.open(io.BytesIO(data)).read()`` (``gzfilter``), bounded by INFLATE_LIMIT."""
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
        out = f.read(INFLATE_LIMIT + 1)
    if len(out) > INFLATE_LIMIT:
        raise ValueError(f"decompresses to more than {INFLATE_LIMIT:,} bytes")
    return out


def _pickled(exc: ValueError) -> ValueError:
    if "allow_pickle" not in str(exc):
        return exc
    return ValueError(
        "an object array (dtype=object): numpy would unpickle it, which runs code from the "
        "shard inside the server, so pinfeed loads arrays with allow_pickle=False; store "
        "numeric or string arrays (npy/npz), or json"
    )


def _npy(data: bytes) -> np.ndarray[Any, Any]:
    """``webdataset.autodecode.npy_loads``: ``numpy.lib.format.read_array``."""
    try:
        return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise _pickled(exc) from None


def _npz(data: bytes) -> dict[str, Any]:
    """``npz_loads``: ``dict(np.load(stream))``, a plain dict of the archive's arrays by
    name, every array read (np.load alone would unpickle a file that is not a zip)."""
    if not data.startswith(_ZIP):
        raise ValueError("not an npz file (a zip archive of .npy arrays)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if sum(info.file_size for info in npz.zip.infolist()) > INFLATE_LIMIT:
                raise ValueError(f"its arrays take more than {INFLATE_LIMIT:,} bytes")
            return dict(npz)
    except ValueError as exc:
        raise _pickled(exc) from None


def _tenbin(data: bytes) -> list[np.ndarray[Any, Any]]:
    """``webdataset.tenbin.decode_buffer``: a list of read-only arrays over the data."""
    chunks: list[bytes] = []
    offset = 0
    while offset < len(data):
        if data[offset : offset + 8] != _TENBIN:
            raise ValueError("tenbin: magic bytes mismatch")
        (n,) = struct.unpack("@q", data[offset + 8 : offset + 16].ljust(8, b"\0"))
        if n < 0 or offset + 16 + n > len(data):
            raise ValueError(f"tenbin: a chunk of {n} bytes at byte {offset} runs past the end")
        chunks.append(data[offset + 16 : offset + 16 + n])
        offset += 16 + 64 * ((n + 63) // 64)
    arrays = []
    for header, body in zip(chunks[::2], chunks[1::2], strict=False):
        h = np.frombuffer(header, dtype="i8")
        code = struct.pack("@q", h[0]).decode("ascii").strip("\0")
        if code not in _TENBIN_DTYPES or len(h) < 3 or not 0 <= h[2] <= len(h) - 3:
            raise ValueError("tenbin: unsupported array type or bad header")
        shape = tuple(int(d) for d in h[3 : 3 + int(h[2])])
        count = math.prod(shape)
        arrays.append(np.frombuffer(body, dtype=_TENBIN_DTYPES[code], count=count).reshape(*shape))
    return arrays


def decode(ext: str, data: bytes, image_size: int | None) -> Any:
    """What ``.decode("torchrgb8")`` makes of a member with extension ``ext`` (``ext``
    not refused): see the module's table."""
    gz, last = decoding(ext)
    if gz:
        data = _gunzip(data)
    if last in IMAGES:
        with Image.open(io.BytesIO(data), formats=safe_formats()) as img:
            img.load()
            rgb = img.convert("RGB")
        if image_size is not None:
            rgb = fit(rgb, image_size)
        return torch.from_numpy(np.asarray(rgb).transpose(2, 0, 1).copy())
    if last in INTS:
        return int(data)
    if last in JSONS:
        return json.loads(data)
    if last in TEXTS:
        return data.decode("utf-8")
    if last == "npy":
        return _npy(data)
    if last == "npz":
        return _npz(data)
    if last in ("ten", "tb"):
        return _tenbin(data)
    if last in MSGPACK:
        return msgpack.unpackb(data)
    if last in REFUSED:  # refused at registration; never decoded
        raise ValueError(REFUSED[last])
    return data


class WebDatasetShards(torch.utils.data.IterableDataset[Any]):
    def __init__(self, shards: list[Shard], exts: dict[str, int], p: WebDatasetParams) -> None:
        self.shards = shards  # every rank's
        self._exts = [e for e, _ in sorted(exts.items(), key=lambda kv: kv[1])]
        if isinstance(p.fields, dict):
            self._keys: list[str] | None = list(p.fields)
            wanted = list(p.fields.values())
        else:
            self._keys, wanted = None, list(p.fields)
        self._fields = [[exts.get(e, -1) for e in alt.split(";")] for alt in wanted]
        self._wanted = wanted
        self.image_size, self.shuffle_buffer, self.seed = p.image_size, p.shuffle_buffer, p.seed
        self._rank = None if p.rank is None else (p.rank, p.world_size or 1)
        self.counts = np.array([sh.samples for sh in shards], dtype=np.int64)
        for shard in shards:
            self._check_fields(shard)

    def _check_fields(self, shard: Shard) -> None:
        for s in range(shard.samples):
            present = set(shard.ext[shard.first[s] : shard.first[s + 1]].tolist())
            for alts, spec in zip(self._fields, self._wanted, strict=True):
                if not present.intersection(alts):
                    raise DatasetError(f"{shard.shown}: sample {s} has no {spec!r} field")

    def _rank_shards(self) -> tuple[int, int]:
        """(rank, world_size) as WebDataset's ``pytorch_worker_info`` finds them."""
        if self._rank is not None:
            return self._rank
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return 0, 1

    def __len__(self) -> int:
        rank, world = self._rank_shards()
        return int(self.counts[rank::world].sum())

    def _sample(self, shard: Shard, mm: mmap.mmap, s: int) -> Any:
        members = range(int(shard.first[s]), int(shard.first[s + 1]))
        by_ext = {int(shard.ext[m]): m for m in members}
        out = []
        for alts in self._fields:
            m = next(by_ext[a] for a in alts if a in by_ext)
            start, n = int(shard.offset[m]), int(shard.size[m])
            ext = self._exts[int(shard.ext[m])]
            try:
                out.append(decode(ext, mm[start : start + n], self.image_size))
            except Exception as exc:  # any decoder's failure (Pillow, numpy, zip, gzip)
                raise DatasetError(f"{shard.shown}: sample {s} .{ext}: {exc}") from None
        return dict(zip(self._keys, out, strict=True)) if self._keys is not None else tuple(out)

    def __iter__(self) -> Iterator[Any]:
        rank, world = self._rank_shards()
        shards = self.shards[rank::world]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        refs: Iterator[tuple[Shard, int]] = ((sh, s) for sh in shards for s in range(sh.samples))
        if self.shuffle_buffer is not None:
            refs = _shuffle(refs, self.shuffle_buffer, random.Random(self.seed))
        maps: dict[str, mmap.mmap] = {}
        try:
            for shard, s in refs:
                mm = maps.get(shard.shown)
                if mm is None:
                    if self.shuffle_buffer is None:  # in order: a shard at a time
                        for old in maps.values():
                            old.close()
                        maps.clear()
                    mm = maps[shard.shown] = _map(shard.source)
                yield self._sample(shard, mm, s)
        finally:
            for mm in maps.values():
                mm.close()

    def __repr__(self) -> str:
        return f"WebDatasetShards({len(self.shards)} shards, {self.counts.sum()} samples)"


def _shuffle(data: Iterator[Any], bufsize: int, rng: random.Random) -> Iterator[Any]:
    """``webdataset.filters._shuffle`` with its default ``initial`` (100): the same
    buffer, the same ``rng.randint`` picks, so the same order for the same seed."""
    initial = min(100, bufsize)
    buf: list[Any] = []

    def pick() -> Any:
        k = rng.randint(0, len(buf) - 1)
        sample, buf[k] = buf[k], buf[-1]
        buf.pop()
        return sample

    for sample in data:
        buf.append(sample)
        if len(buf) < bufsize:
            with contextlib.suppress(StopIteration):
                buf.append(next(data))
        if len(buf) >= initial:
            yield pick()
    while buf:
        yield pick()


class ShardSpans:
    """Each sample's shard (one whole object), samples numbered across the shards."""

    def __init__(self, manifest: Manifest, counts: np.ndarray[Any, Any]) -> None:
        self.manifest = manifest
        self.starts = np.cumsum([0, *counts.tolist()], dtype=np.int64)

    def __call__(self, indices: NDArray[np.int64]) -> Spans:
        k = np.searchsorted(self.starts, indices, side="right") - 1
        return [self.manifest.objects_units(k.astype(np.int64))]


def _objects(names: list[str], ctx: DatasetContext) -> tuple[Manifest, Manifest]:
    """(the shards' manifest, the listing it came from): one listing of the folder the
    shards are in (LIST answers a thousand keys a request; a HEAD each would be one)."""
    urls = [S3Url.parse(n) for n in names]
    folders = {(u.bucket, u.key.rpartition("/")[0]) for u in urls}
    if len(folders) != 1:
        listed = ctx.manifest(names, blocks=False, single=True)
        return listed, listed
    bucket, folder = folders.pop()
    listed = ctx.manifest(str(S3Url(bucket, folder)), blocks=False)
    where = {o.key: k for k, o in enumerate(listed.objects)}
    missing = [str(u) for u in urls if u.key not in where]
    if missing:
        raise DatasetError(f"{missing[0]}: no such object in the store ({len(missing)} missing)")
    return listed.select([where[u.key] for u in urls]), listed


def build(p: WebDatasetParams, ctx: DatasetContext) -> Any:
    if (p.rank is None) != (p.world_size is None):
        raise DatasetError("rank and world_size go together")
    if p.rank is not None and p.world_size is not None and p.rank >= p.world_size:
        raise DatasetError(f"rank {p.rank} must be below world_size {p.world_size}")
    patterns = [p.shards] if isinstance(p.shards, str) else p.shards
    if math.prod(_braces(pattern) for pattern in patterns) > MAX_SHARDS:
        raise DatasetError(f"shards expand to more than {MAX_SHARDS:,} files")
    names = [name for pattern in patterns for name in braceexpand(pattern)]
    if not names:
        raise DatasetError("shards must name at least one tar file")
    if not p.fields:
        raise DatasetError("fields must name at least one extension")
    wanted = p.fields.values() if isinstance(p.fields, dict) else p.fields
    for ext in (e for alts in wanted for e in alts.split(";")):
        why = refusal(ext)
        if why is not None:
            raise DatasetError(why)
    exts: dict[str, int] = {}
    remote = [is_remote(name) for name in names]
    if not any(remote):
        return WebDatasetShards([scan(name, ctx.resolve(name), exts) for name in names], exts, p)
    if not all(remote):
        raise DatasetError("shards must be all s3:// URLs or all files under the data root")
    manifest, listed = _objects(names, ctx)
    sources = [RemoteObject(ctx.remote, manifest, k) for k in range(len(names))]  # type: ignore[arg-type]
    inner = WebDatasetShards(
        [scan(n, o, exts) for n, o in zip(names, sources, strict=True)], exts, p
    )
    spans = ShardSpans(manifest, inner.counts)
    return RemoteIterable(inner, manifest, spans, listed)


KIND = Kind("webdataset", WebDatasetParams, build, __doc__)
