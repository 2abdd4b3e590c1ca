"""Small versions of the benchmarks' workloads (``bench/data.py``), written under a
local folder and uploaded to the test store under the same relative keys: W2's
``.npy`` pair, W1's ``.pt``, W3's JPEG folder, W6's token file, W7's ``save_to_disk``
folder and its table as Parquet, W8's tar shards. Each workload names its kind, its
params over the local files and over the store, and the Dataset DataLoader reads for
the same files (``bench.references``)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import references
from bench.data import _jpeg, _jpeg_folder
from tests.remote.s3server import S3Server

BUCKET = "pinfeed"


@dataclass(frozen=True)
class Workload:
    key: str
    kind: str
    local: dict[str, Any]  # params over the files under the data root
    remote: dict[str, Any]  # the same over the store (s3:// URLs)
    reference: Callable[[], Any]  # DataLoader's Dataset over the local files
    shuffle: bool = True


def _url(rel: str) -> str:
    return f"s3://{BUCKET}/{rel}"


def _jpeg_bytes(rng: np.random.Generator, w: int, h: int) -> bytes:
    buf = io.BytesIO()
    _jpeg(rng, w, h).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make(root: Path, prefix: str, s3: S3Server) -> dict[str, Workload]:
    """Every workload's files under ``root/prefix``, uploaded to ``s3://pinfeed/prefix``."""
    base = root / prefix
    base.mkdir(parents=True)
    rng = np.random.default_rng(45)
    out: dict[str, Workload] = {}

    # W2: float32 rows of 3x16x16 (3 KB: a 64 KB block holds ~20) and int64 labels
    x, y = f"{prefix}/w2-x.npy", f"{prefix}/w2-y.npy"
    np.save(root / x, rng.random((120, 3, 16, 16), dtype=np.float32))
    np.save(root / y, rng.integers(0, 1000, 120, dtype=np.int64))
    out["W2"] = Workload(
        "W2",
        "npy",
        {"paths": [x, y]},
        {"paths": [_url(x), _url(y)]},
        lambda: references.memmap(root, {"paths": [x, y]}),
    )

    # W1: a .pt of uint8 images and int64 labels
    pt = f"{prefix}/w1.pt"
    tensors = (
        torch.from_numpy(rng.integers(0, 256, (90, 3, 8, 8), dtype=np.uint8)),
        torch.from_numpy(rng.integers(0, 10, 90, dtype=np.int64)),
    )
    torch.save(tensors, root / pt)
    out["W1"] = Workload(
        "W1",
        "tensors",
        {"path": pt},
        {"path": _url(pt)},
        lambda: references.tensordataset(root, {"path": pt}),
    )

    # W3: JPEGs in class folders (a spec.json beside them, which ImageFolder skips)
    images = f"{prefix}/w3"
    _jpeg_folder(root / images, {"n": 44, "classes": 4, "source": [64, 48], "seed": 3})
    out["W3"] = Workload(
        "W3",
        "images",
        {"path": images, "size": 32},
        {"path": _url(images), "size": 32},
        lambda: references.imagefolder(root, {"path": images, "size": 32}),
    )

    # W6: a flat uint16 token file
    tokens = f"{prefix}/w6.bin"
    rng.integers(0, 50257, 60_001, dtype=np.uint16).tofile(root / tokens)
    out["W6"] = Workload(
        "W6",
        "tokens",
        {"path": tokens, "seq_len": 512},
        {"path": _url(tokens), "seq_len": 512},
        lambda: references.tokens(root, {"path": tokens, "dtype": "uint16", "seq_len": 512}),
    )

    # W7: a save_to_disk folder of JPEGs and a ClassLabel, and the same table as Parquet
    import datasets as hd

    hd.disable_progress_bars()
    names = [f"class{k:02d}" for k in range(4)]
    features = hd.Features({"image": hd.Image(), "label": hd.ClassLabel(names=names)})
    table = hd.Dataset.from_dict(
        {
            "image": [{"bytes": _jpeg_bytes(rng, 40, 30), "path": None} for _ in range(50)],
            "label": rng.integers(0, 4, 50).tolist(),
        },
        features=features,
    )
    hf = f"{prefix}/w7"
    table.save_to_disk(str(root / hf), num_shards=2)
    out["W7"] = Workload(
        "W7",
        "hf",
        {"path": hf},
        {"path": _url(hf)},
        lambda: hd.load_from_disk(str(root / hf)).with_format("torch"),
    )
    parts = [f"{prefix}/w7pq/part-{k}.parquet" for k in range(2)]
    (root / prefix / "w7pq").mkdir()
    for k, part in enumerate(parts):  # row groups of 8: several a file
        table.shard(2, k, contiguous=True).to_parquet(str(root / part), batch_size=8)
    cache = root / prefix / "hf-cache"
    out["W7-parquet"] = Workload(
        "W7-parquet",
        "parquet",
        {"paths": parts},
        {"paths": _url(f"{prefix}/w7pq/part-*.parquet")},
        lambda: hd.load_dataset(
            "parquet",
            data_files=[str(root / p) for p in parts],
            split="train",
            cache_dir=str(cache),
        ).with_format("torch"),
    )

    # W8: tar shards of JPEGs and their class
    shards = base / "w8"
    shards.mkdir()
    for k in range(3):
        with tarfile.open(shards / f"shard-{k:06d}.tar", "w") as tar:
            for i in range(k * 16, (k + 1) * 16):
                for ext, data in (("jpg", _jpeg_bytes(rng, 40, 30)), ("cls", b"%d" % (i % 8))):
                    info = tarfile.TarInfo(f"sample{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    pattern = f"{prefix}/w8/shard-{{000000..000002}}.tar"
    fields = ["jpg", "cls"]
    out["W8"] = Workload(
        "W8",
        "webdataset",
        {"shards": pattern, "fields": fields},
        {"shards": _url(pattern), "fields": fields},
        lambda: references.webdataset(root, {"shards": pattern, "fields": fields}),
        shuffle=False,
    )

    s3.upload(BUCKET, prefix, base)
    return out
