"""The workloads: their files (generated once, cached) and their dataset specs.

W1  in-memory tensors: a ``.pt`` of uint8 [N, 3, 64, 64] images + int64 labels
    (``tensors`` kind; the file is memory-mapped, so it lives in the page cache).
W2  memory-mapped ``.npy``: float32 [N, 3, 224, 224] + int64 labels (``npy`` kind),
    read from the page cache (the files are read once before the runs).
W3  decode-bound: JPEG files in class folders (``images`` kind, ``size`` 224),
    decoded with Pillow, shorter side resized to 224 and center-cropped.
W4  variable-length token sequences: int64 ids, 16-512 per sample, from one flat
    memory-mapped token file (``python`` kind, ``bench.tokens``), padded per batch by a
    ``collate_fn`` (``bench.tokens.pad_collate``), batch 64.
W5  W3's JPEGs with random crop and flip (``python`` kind, ``bench.augment:w5``):
    resized to 256, a random 224x224 window, flipped with probability 0.5.
W6  a flat uint16 token file (``tokens`` kind, nanoGPT's ``train.bin``), seq_len 1024,
    batch 32, against nanoGPT-style ``np.memmap`` windows (``bench.references``).
W7  an ``hf`` save_to_disk folder with a fixed-size Image column (W3-like JPEGs,
    400x300) and a ClassLabel, batch 64, against ``load_from_disk(...).with_format("torch")``.
W8  WebDataset tar shards of JPEGs (W3-like, 400x300) + cls, 64 samples a shard,
    batch 64 (an IterableDataset: no shuffle), against the webdataset library's
    ``WebDataset(...).decode("torchrgb8").to_tuple("jpg", "cls")``.
W9  ImageNet-like JPEGs (500x375) with the node's sample cache (issue 25): ``images``
    uncropped (decode, RGB, shorter side 256) cached, RandomResizedCrop(224) + flip the
    loader's ``transform`` (``bench.transforms:w9``), batch 32; DataLoader reads
    ``Transformed(the same dataset, the same transform)``. Measured by its own driver
    (``bench.w9``: per epoch, four jobs, a restart), which writes the suite's cells too.

Each workload names what plain DataLoader reads (``reference``: a ``bench.references``
Dataset, the one a trainer uses today for the same files; none: the very object the
server builds, for ``python`` datasets) and its tuned variant (``tuned``: a batched read,
where the dataset has one). Adding a workload: a ``make_wN`` returning a ``Workload``, in
``MAKERS``; a system beside pinfeed and DataLoader (e.g. ``pinfeed.DataLoader``) is an
entry of ``bench.trainer.SYSTEMS`` and a name in the workload's ``extra_systems``.

``--scale`` multiplies every sample count.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Where generated workload files are cached (every bench subcommand's --data-dir).
DATA_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pinfeed-bench"

# Full-size sample counts (scale 1.0): sized for a few minutes on 2 cores.
W1_SAMPLES = 50_000
W2_SAMPLES = 1_024
W3_SAMPLES = 384
W3_CLASSES = 8
W3_SOURCE = (400, 300)  # width, height of the generated JPEGs (landscape, like ImageNet)
W4_SAMPLES = 32_768
W6_SAMPLES = 16_384
W7_SAMPLES = 384
W8_SAMPLES = 384
W8_SHARD = 64
W6_SEQ_LEN = 1024


@dataclass
class Workload:
    key: str
    title: str
    kind: str
    params: dict[str, Any]
    samples: int
    batch_size: int
    shuffle: bool
    epochs: int  # epochs iterated per run; the timed window is all but the first batch
    sample_shape: list[int]
    dtype: str
    files: list[str] = field(default_factory=list)
    notes: str = ""
    collate_fn: str | None = None  # the loader's, and DataLoader's (resolved)
    # A bench.references name: the Dataset plain DataLoader reads (None: the very same
    # object the server builds, as for a ``python`` dataset).
    reference: str | None = None
    # A bench.references.TUNED name: the tuned DataLoader's batched read (None: the
    # dataset has none, e.g. a per-file decode; then tuned = plain DataLoader at its best).
    tuned: str | None = None
    extra_systems: tuple[str, ...] = ()  # e.g. "pinfeed-dataloader" (issue 24)
    # A bench.references name: the Dataset with a batched ``__getitems__`` that
    # ``pinfeed-dataloader-getitems`` reads (None: the workload has none).
    getitems: str | None = None
    # The node's sample cache (issue 25): the dataset's ``cache`` ({} : the whole
    # dataset), and the loaders' ``transform``, which DataLoader applies as
    # ``pinfeed.Transformed(dataset, transform)``.
    cache: dict[str, Any] | None = None
    transform: str | None = None
    # A module that measures the workload itself (its result file the suite's too): the
    # suite leaves it to it.
    driver: str | None = None

    @property
    def systems(self) -> tuple[str, ...]:
        """The systems measured on this workload (``bench.trainer.SYSTEMS``)."""
        tuned = ("dataloader-tuned",) if self.tuned else ()
        return ("pinfeed", "dataloader", *tuned, *self.extra_systems)

    @property
    def sample_bytes(self) -> int:
        itemsize = {"uint8": 1, "float32": 4, "int64": 8}[self.dtype]
        return int(np.prod(self.sample_shape)) * itemsize

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["sample_bytes"] = self.sample_bytes
        d["systems"] = list(self.systems)
        d["batches_per_epoch"] = -(-self.samples // self.batch_size)
        return d


def _count(n: int, scale: float, minimum: int) -> int:
    return max(minimum, round(n * scale))


def _stamp_ok(path: Path, spec: dict[str, Any]) -> bool:
    stamp = path.with_suffix(path.suffix + ".json")
    return path.exists() and stamp.exists() and json.loads(stamp.read_text()) == spec


def _stamp(path: Path, spec: dict[str, Any]) -> None:
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(spec))


def make_w1(root: Path, scale: float) -> Workload:
    import torch

    n = _count(W1_SAMPLES, scale, 1024)
    path = root / f"w1-{n}.pt"
    spec = {"n": n, "shape": [3, 64, 64], "seed": 1}
    if not _stamp_ok(path, spec):
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 1000, (n,), dtype=torch.int64, generator=g)
        torch.save((x, y), path)
        _stamp(path, spec)
    return Workload(
        "W1",
        "in-memory tensors, uint8 3x64x64, batch 256",
        "tensors",
        {"path": path.name},
        n,
        256,
        True,
        6,  # epochs: DataLoader as usually written needs ~6 s of them at full size
        [3, 64, 64],
        "uint8",
        [path.name],
        "tensors kind: .pt loaded with mmap=True (page cache), TensorDataset semantics; "
        "DataLoader over torch's TensorDataset of the same file's tensors",
        reference="tensordataset",
        tuned="tensordataset",
        extra_systems=("pinfeed-dataloader", "pinfeed-dataloader-tuned", "pinfeed-python"),
    )


def make_w2(root: Path, scale: float) -> Workload:
    n = _count(W2_SAMPLES, scale, 256)
    x_path, y_path = root / f"w2-{n}-x.npy", root / f"w2-{n}-y.npy"
    spec = {"n": n, "shape": [3, 224, 224], "seed": 2}
    if not (_stamp_ok(x_path, spec) and y_path.exists()):
        rng = np.random.default_rng(2)
        x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32, shape=(n, 3, 224, 224))
        for start in range(0, n, 256):
            stop = min(n, start + 256)
            x[start:stop] = rng.random((stop - start, 3, 224, 224), dtype=np.float32)
        x.flush()
        del x
        np.save(y_path, rng.integers(0, 1000, n, dtype=np.int64))
        _stamp(x_path, spec)
    return Workload(
        "W2",
        "memory-mapped npy, float32 3x224x224, batch 64",
        "npy",
        {"paths": [x_path.name, y_path.name]},
        n,
        64,
        True,
        6,
        [3, 224, 224],
        "float32",
        [x_path.name, y_path.name],
        "npy kind: np.load(mmap_mode='r'), files pre-read into the page cache; DataLoader "
        "over a user's np.memmap Dataset (bench.references.MemmapArrays)",
        reference="memmap",
        tuned="memmap",
        extra_systems=("pinfeed-dataloader", "pinfeed-dataloader-tuned", "pinfeed-python"),
    )


def _jpeg(rng: np.random.Generator, w: int, h: int) -> Any:
    """A photo-like image: smooth colour fields, edges and mild noise (not pure noise,
    which no camera produces and which decodes unusually slowly)."""
    from PIL import Image

    small = rng.integers(0, 256, (h // 25 + 2, w // 25 + 2, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _jpeg_folder(folder: Path, spec: dict[str, Any]) -> int:
    """An image folder of ``spec["n"]`` JPEGs (q90) of ``spec["source"]`` (width,
    height) in ``spec["classes"]`` class folders, drawn from ``spec["seed"]``; made
    again only when ``folder/spec.json`` differs. Returns their total bytes."""
    stamp = folder / "spec.json"
    n, classes = spec["n"], spec["classes"]
    w, h = spec["source"]
    if not (stamp.exists() and json.loads(stamp.read_text()) == spec):
        rng = np.random.default_rng(spec["seed"])
        for i in range(n):
            cls = folder / f"class{i % classes:02d}"
            cls.mkdir(parents=True, exist_ok=True)
            # Some portrait images, as in real data sets.
            size = (w, h) if i % 4 else (h, w)
            _jpeg(rng, *size).save(cls / f"img{i:06d}.jpg", format="JPEG", quality=90)
        stamp.write_text(json.dumps(spec))
    return sum(p.stat().st_size for p in folder.rglob("*.jpg"))


def make_w3(root: Path, scale: float) -> Workload:
    n = _count(W3_SAMPLES, scale, 128)
    folder = root / f"w3-{n}"
    spec = {"n": n, "classes": W3_CLASSES, "source": list(W3_SOURCE), "seed": 3}
    w, h = W3_SOURCE
    jpeg_bytes = _jpeg_folder(folder, spec)
    return Workload(
        "W3",
        "decode-bound JPEG (Pillow) to 3x224x224, batch 64",
        "images",
        {"path": folder.name, "size": 224},
        n,
        64,
        True,
        6,
        [3, 224, 224],
        "uint8",
        [folder.name],
        f"images kind: {n} JPEGs of {w}x{h} (q90, mean "
        f"{jpeg_bytes // max(1, n) // 1024} KiB) in {W3_CLASSES} class folders; DataLoader "
        "over bench.references.PilImageFolder (torchvision's ImageFolder + Resize + "
        "CenterCrop in Pillow: torchvision does not import beside this torch)",
        reference="imagefolder",
        extra_systems=("pinfeed-dataloader", "pinfeed-python"),
    )


def make_w4(root: Path, scale: float) -> Workload:
    from bench import tokens

    n = _count(W4_SAMPLES, scale, 1024)
    tok_path, off_path = root / f"w4-{n}-tokens.npy", root / f"w4-{n}-offsets.npy"
    spec = {"n": n, "lengths": [tokens.LO, tokens.HI], "seed": 4}
    if not (_stamp_ok(tok_path, spec) and off_path.exists()):
        tokens.generate(tok_path, off_path, n, seed=4)
        _stamp(tok_path, spec)
    return Workload(
        "W4",
        "variable-length int64 tokens (16-512), padding collate_fn, batch 64",
        "python",
        # python-kind factories get their paths as given: absolute, under the data root.
        {
            "factory": "bench.tokens:TokenSequences",
            "kwargs": {"tokens": str(tok_path), "offsets": str(off_path)},
        },
        n,
        64,
        True,
        6,
        [(tokens.LO + tokens.HI) // 2],
        "int64",
        [tok_path.name, off_path.name],
        "python kind: a flat memory-mapped int64 token file + offsets, one sequence per "
        "sample; collate_fn bench.tokens:pad_collate pads to the batch's longest (ids, "
        "attention mask, lengths); sample_shape is the mean length",
        collate_fn="bench.tokens:pad_collate",
        tuned="sequences",
        extra_systems=("pinfeed-dataloader", "pinfeed-dataloader-tuned"),
    )


def make_w5(root: Path, scale: float) -> Workload:
    from bench.augment import CROP, RESIZE

    w3 = make_w3(root, scale)
    return Workload(
        "W5",
        f"W3's JPEGs, resize {RESIZE} + random crop {CROP} + random flip, batch 64",
        "python",
        {"factory": "bench.augment:w5", "kwargs": {"path": w3.files[0], "data_root": str(root)}},
        w3.samples,
        w3.batch_size,
        True,
        w3.epochs,
        [3, CROP, CROP],
        "uint8",
        w3.files,
        "python kind: bench/augment.py over the images kind; the same object, seeded "
        "alike (seed 0, persistent workers), in both systems",
    )


def make_w6(root: Path, scale: float) -> Workload:
    n = _count(W6_SAMPLES, scale, 512)
    path = root / f"w6-{n}.bin"
    count = n * W6_SEQ_LEN + 1
    spec = {"tokens": count, "dtype": "uint16", "seed": 6}
    if not _stamp_ok(path, spec):
        rng = np.random.default_rng(6)
        rng.integers(0, 50257, count, dtype=np.uint16).tofile(path)  # GPT-2's vocabulary
        _stamp(path, spec)
    return Workload(
        "W6",
        f"flat uint16 tokens, seq_len {W6_SEQ_LEN} (x, y int64), batch 32",
        "tokens",
        {"path": path.name, "dtype": "uint16", "seq_len": W6_SEQ_LEN},
        n,
        32,
        True,
        2,  # epochs: DataLoader as usually written needs ~10 s of them at full size
        [2, W6_SEQ_LEN],
        "int64",
        [path.name],
        f"tokens kind: {count:,} uint16 tokens ({count * 2 / 2**20:.0f} MiB), np.memmap; "
        "DataLoader over nanoGPT-style np.memmap windows",
        reference="tokens",
        tuned="tokens",
        extra_systems=("pinfeed-dataloader", "pinfeed-dataloader-tuned"),
    )


def make_w7(root: Path, scale: float) -> Workload:
    import io

    n = _count(W7_SAMPLES, scale, 128)
    folder = root / f"w7-{n}"
    w, h = W3_SOURCE
    spec = {"n": n, "source": [w, h], "seed": 7}
    stamp = root / f"w7-{n}.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == spec):
        import datasets as hd

        rng = np.random.default_rng(7)
        images = []
        for _ in range(n):
            buf = io.BytesIO()
            _jpeg(rng, w, h).save(buf, format="JPEG", quality=90)
            images.append({"bytes": buf.getvalue(), "path": None})
        labels = rng.integers(0, W3_CLASSES, n).tolist()
        names = [f"class{k:02d}" for k in range(W3_CLASSES)]
        features = hd.Features({"image": hd.Image(), "label": hd.ClassLabel(names=names)})
        ds = hd.Dataset.from_dict({"image": images, "label": labels}, features=features)
        ds.save_to_disk(str(folder))
        stamp.write_text(json.dumps(spec))
    return Workload(
        "W7",
        f"hf save_to_disk, Image column (JPEG {w}x{h}) + ClassLabel, batch 64",
        "hf",
        {"path": folder.name},
        n,
        64,
        True,
        2,  # epochs: ~10 s of DataLoader at full size
        [3, h, w],
        "uint8",
        [folder.name],
        f"hf kind: {n} JPEGs of {w}x{h} (q90) embedded in Arrow; DataLoader over "
        "datasets.load_from_disk(...).with_format('torch')",
        reference="hf",
        tuned="hf",
    )


def make_w8(root: Path, scale: float) -> Workload:
    import io
    import tarfile

    n = _count(W8_SAMPLES, scale, 128)
    shards = -(-n // W8_SHARD)
    folder = root / f"w8-{n}"
    w, h = W3_SOURCE
    spec = {"n": n, "shard": W8_SHARD, "source": [w, h], "seed": 8}
    stamp = folder / "spec.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == spec):
        rng = np.random.default_rng(8)
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(shards):
            with tarfile.open(folder / f"shard-{k:06d}.tar", "w") as tar:
                for i in range(k * W8_SHARD, min(n, (k + 1) * W8_SHARD)):
                    buf = io.BytesIO()
                    _jpeg(rng, w, h).save(buf, format="JPEG", quality=90)
                    for ext, data in (("jpg", buf.getvalue()), ("cls", b"%d" % (i % 8))):
                        info = tarfile.TarInfo(f"sample{i:06d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        stamp.write_text(json.dumps(spec))
    pattern = f"{folder.name}/shard-{{000000..{shards - 1:06d}}}.tar"
    return Workload(
        "W8",
        f"WebDataset shards, JPEG {w}x{h} + cls, batch 64",
        "webdataset",
        {"shards": pattern, "fields": ["jpg", "cls"]},
        n,
        64,
        False,
        2,  # epochs: ~10 s of DataLoader at full size
        [3, h, w],
        "uint8",
        [folder.name],
        f"webdataset kind: {n} JPEGs (q90) in {shards} tar shards; DataLoader over "
        "webdataset.WebDataset(...).decode('torchrgb8').to_tuple('jpg', 'cls')",
        reference="webdataset",
        tuned="webdataset",
    )


W9_SOURCE = (500, 375)  # width, height: ImageNet's typical landscape photo
W9_RESIZE = 256


def make_w9(root: Path, scale: float) -> Workload:
    n = _count(3000, scale, 160)
    folder = root / f"w9-{n}"
    spec = {"n": n, "classes": 10, "source": list(W9_SOURCE), "quality": 90, "seed": 9}
    w, h = W9_SOURCE
    jpeg_bytes = _jpeg_folder(folder, spec)
    return Workload(
        "W9",
        "ImageNet-like JPEGs, decode + resize 256 cached once per node, RandomResizedCrop "
        "224 + flip as the loader's transform, batch 32",
        "images",
        {"path": folder.name, "size": W9_RESIZE, "crop": False},
        n,
        32,
        True,
        3,
        [3, 224, 224],
        "uint8",
        [folder.name],
        f"images kind uncropped: {n} JPEGs of {w}x{h} (every fourth portrait, q90, mean "
        f"{jpeg_bytes // max(1, n) // 1024} KiB) in 10 class folders",
        cache={},
        transform="bench.transforms:w9",
        driver="bench.w9",
    )


NULL_SAMPLES = 20_000


def make_null(root: Path, scale: float) -> Workload:
    """The null workload (``python -m bench null``): batches of one sample of one uint8,
    so a batch's making is next to nothing and what a path costs per batch is its fixed
    cost: messages, wake-ups, views."""
    import torch

    n = _count(NULL_SAMPLES, scale, 2048)
    path = root / f"null-{n}.pt"
    spec = {"n": n, "shape": [1]}
    if not _stamp_ok(path, spec):
        torch.save(
            (torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)[:, None],), path
        )
        _stamp(path, spec)
    return Workload(
        "null",
        "null: batches of one uint8 sample",
        "tensors",
        {"path": path.name},
        n,
        1,
        True,
        1,
        [1],
        "uint8",
        [path.name],
        "tensors kind over a .pt of one uint8 [N, 1] tensor, batch 1; DataLoader and "
        "pinfeed.DataLoader over torch's TensorDataset of it",
        reference="tensordataset",
        tuned="tensordataset",
        getitems="getitems",
        extra_systems=(
            "pinfeed-dataloader",
            "pinfeed-dataloader-getitems",
            "pinfeed-dataloader-tuned",
        ),
    )


MAKERS = {
    "W1": make_w1,
    "W2": make_w2,
    "W3": make_w3,
    "W4": make_w4,
    "W5": make_w5,
    "W6": make_w6,
    "W7": make_w7,
    "W8": make_w8,
    "W9": make_w9,
}
# Why pinfeed wins, ties or loses on each workload: the mechanism, fixed text. The verdict
# beside it (and its ratio) is the numbers' (bench.cells).
WHY = {
    "W1": "A batch is one gather per field in pinfeed (`index_select` into the slot) and "
    "in the tuned DataLoader (TensorDataset indexed with the batch's index list); "
    "against it what differs is the handoff: pinfeed announces a slot, DataLoader's "
    "workers move each batch's storages through shared memory (none at num_workers "
    "0). Plain DataLoader pays 256 `__getitem__` calls and `default_collate`'s stack. "
    "Without workers the tuned DataLoader gathers with torch's intra-op threads (2 "
    "here), pinfeed's server with one (`PINFEED_TORCH_THREADS`, default 1: the cores "
    "are the trainers'), and each batch then crosses to the trainer's process, a fixed "
    "cost a batch (`python -m bench null`); how fast the gather runs depends on how the "
    "file's pages sit in the page cache.",
    "W2": "Rows of 588 KiB: the gather is memory bandwidth. pinfeed gathers a batch into "
    "the slot, its only host copy; the tuned DataLoader does one fancy index per "
    "field, then its workers copy the batch into shared memory; plain DataLoader "
    "copies row by row and stacks.",
    "W3": "Decode-bound: both systems run the same Pillow decode and resize per file, and "
    "a file cannot be read a batch at a time (tuned = DataLoader at its best): at equal "
    "cores the only work pinfeed saves is the handoff of a 9.6 MB batch (no pickling "
    "into shared memory, no storages rebuilt in the trainer).",
    "W4": "Python-bound: 64 `__getitem__` calls and the padding `collate_fn` per batch, "
    "in pinfeed's workers as in DataLoader's; pinfeed saves the pickling into shared "
    "memory and the unpickling in the trainer (`python -m bench w4-profile`). The "
    "tuned DataLoader pads a batch straight into one array.",
    "W5": "W3 plus a random crop and flip drawn from torch's RNG: decode-bound as W3, the "
    "same object in both systems, no batched read (tuned = DataLoader at its best).",
    "W6": "Windows of 1,024 uint16 tokens widened to int64: pinfeed reads a batch's "
    "windows straight into the slot; the tuned DataLoader does one 2-D fancy index a "
    "batch; plain DataLoader makes two small tensors a sample and stacks them.",
    "W7": "JPEG decode from Arrow dominates. Plain DataLoader already reads a batch at "
    "once through HF's `__getitems__` (then splits it into samples and restacks); "
    "the tuned one keeps the batch as read; pinfeed decodes into the slot.",
    "W8": "An IterableDataset of tar shards, split by worker alike in both systems; JPEG "
    "decode dominates. The tuned DataLoader batches in the pipeline (`.batched`); "
    "pinfeed decodes into the slot.",
    "W9": "Decode-bound, decoded once per node: pinfeed stores each sample's decode and "
    "resize in the node's cache in epoch 1 (the same work as DataLoader's, plus a copy "
    "into the cache) and from epoch 2 runs only the transform; DataLoader decodes every "
    "epoch. The tuned DataLoader, where measured, keeps its own decoded samples in shared "
    "memory from epoch 1 (one copy per job, not per node) and from epoch 2 transforms only.",
}

# ``python -m bench training``: the workloads a training loop is measured on, with the
# step (ms of GPU time per batch) each stands with.
STEP_MS = {"W1": 5.0, "W3": 20.0, "W9": 20.0}

# Workloads another change brings (its maker goes into MAKERS then); until their result
# files exist, the report shows their rows as not yet measured.
PLANNED: dict[str, str] = {}
PLUGINS = ("bench", "tests.fixtures")  # what the bench's python datasets and collate_fns import


def warm_page_cache(root: Path, workload: Workload) -> None:
    """Read the workload's files once so the runs read from the page cache."""
    for name in workload.files:
        path = root / name
        paths = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for p in paths:
            with p.open("rb") as f:
                while f.read(1 << 24):
                    pass
