"""The array kinds against the real thing a trainer uses today, batch for batch through a
real server: ``tensors`` against ``torch.utils.data.TensorDataset`` over the same
tensors loaded from the same ``.pt`` and ``.safetensors`` files, ``npy`` against a user's
``np.memmap`` Dataset (``bench.references.MemmapArrays``), ``synthetic`` against its own
class; two shuffled epochs at ``num_workers`` 0 and 2. These references are also the
benchmark's (``bench/references.py``), and so are the tuned DataLoaders checked here
against them: the same batches, read a batch at a time.
"""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from bench import data, references
from pinfeed import Client
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.dataloader.test_parity import check
from tests.datasets.parity import check_parity
from tests.helpers import assert_same, unique

# webdataset's gopen (W8's reference) leaves shard files for the garbage collector to close.
# The benchmarks' own objects, checked against the kinds and torch's DataLoader: heavy
# (make test-heavy), as the benchmarks' smoke runs are.
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"), pytest.mark.heavy]

LENGTH = 45  # 6 batches of 7 and one of 3
BATCH = 7


@pytest.fixture(scope="module")
def files(server: Server) -> Path:
    root = server.data_root
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (LENGTH, 3, 5, 4), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (LENGTH,), generator=g)
    torch.save((x, y), root / "ref-pair.pt")
    save_file({"label": y, "image": x.float()}, str(root / "ref-pair.safetensors"))
    np.save(root / "ref-x.npy", x.numpy().astype(np.float32))
    np.save(root / "ref-y.npy", y.numpy())
    return root


def _register(admin: Client, names: list[str], kind: str, params: dict[str, Any]) -> str:
    name = unique(f"ref-{kind}")
    admin.create_dataset(name, kind, params)
    names.append(name)
    return name


WORKERS = [pytest.param(0, id="nw0"), pytest.param(2, id="nw2")]


@pytest.mark.parametrize("num_workers", WORKERS)
def test_tensors_pt_equals_tensordataset(
    admin: Client, server: Server, files: Path, registered: list[str], num_workers: int
) -> None:
    ref = references.tensordataset(files, {"path": "ref-pair.pt"})
    assert type(ref) is torch.utils.data.TensorDataset
    name = _register(admin, registered, "tensors", {"path": "ref-pair.pt"})
    seen = check_parity(
        admin,
        server,
        name,
        ref,
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        # TensorDataset gives tuples; a .pt of a tuple gives tuples too
    )
    assert seen == 2 * 7


@pytest.mark.parametrize("num_workers", WORKERS)
def test_tensors_safetensors_equals_tensordataset(
    admin: Client, server: Server, files: Path, registered: list[str], num_workers: int
) -> None:
    tensors, keys = references.load_tensors(files / "ref-pair.safetensors")
    assert keys == ["label", "image"]
    ref = torch.utils.data.TensorDataset(*tensors)
    name = _register(admin, registered, "tensors", {"path": "ref-pair.safetensors"})
    seen = check_parity(
        admin,
        server,
        name,
        ref,
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        # a dict file gives dict samples; TensorDataset gives its tensors in file order
        convert=lambda b: dict(zip(keys, b, strict=True)),
    )
    assert seen == 2 * 7


@pytest.mark.parametrize("num_workers", WORKERS)
def test_npy_equals_a_users_memmap_dataset(
    admin: Client, server: Server, files: Path, registered: list[str], num_workers: int
) -> None:
    paths = ["ref-x.npy", "ref-y.npy"]
    ref = references.memmap(files, {"paths": paths})
    assert all(isinstance(a, np.memmap) for a in ref.arrays)
    name = _register(admin, registered, "npy", {"paths": paths})
    seen = check_parity(
        admin, server, name, ref, batch_size=BATCH, shuffle=True, num_workers=num_workers
    )
    assert seen == 2 * 7


@pytest.mark.parametrize("num_workers", WORKERS)
def test_synthetic_equals_its_own_class(
    admin: Client, server: Server, registered: list[str], num_workers: int
) -> None:
    params = {
        "length": LENGTH,
        "seed": 4,
        "fields": [{"shape": [2, 3], "dtype": "float32"}, {"shape": [], "dtype": "int64"}],
    }
    # synthetic has no outside reference: the kind's class, built here, under DataLoader
    ref = build_dataset("synthetic", params, DatasetContext(server.data_root))
    name = _register(admin, registered, "synthetic", params)
    seen = check_parity(
        admin, server, name, ref, batch_size=BATCH, shuffle=True, num_workers=num_workers
    )
    assert seen == 2 * 7


# --- the tuned DataLoaders give the plain references' batches ----------------------------


def _epochs(loader: DataLoader[Any], epochs: int = 2) -> list[list[Any]]:
    return [list(loader) for _ in range(epochs)]


def _same(got: list[list[Any]], want: list[list[Any]]) -> int:
    assert [len(e) for e in got] == [len(e) for e in want] and want[0]
    for e, (ge, we) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(ge, we, strict=True)):
            assert_same(g, w, f"epoch {e} batch {i}")
    return sum(len(e) for e in got)


def _plain(
    w: data.Workload, root: Path, num_workers: int = 0, cls: Any = DataLoader, **extra: Any
) -> DataLoader[Any]:
    """The ``dataloader`` system's DataLoader; ``cls=pinfeed.DataLoader``: the
    ``pinfeed-dataloader`` system's (the same call on the same Dataset object)."""
    from bench.trainer import _collate_fn, _dataset, _reference

    spec = {"kind": w.kind, "params": w.params, "data_root": str(root)}
    spec |= {"reference": w.reference, "collate_fn": w.collate_fn}
    ds = _reference(spec) if w.reference else _dataset(spec)
    loader: DataLoader[Any] = cls(
        ds,
        batch_size=w.batch_size,
        shuffle=w.shuffle,
        collate_fn=_collate_fn(spec),
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )
    return loader


def _tuned(
    w: data.Workload, root: Path, num_workers: int = 0, cls: Any = DataLoader, **extra: Any
) -> DataLoader[Any]:
    """The ``dataloader-tuned`` system's DataLoader (``pinfeed-dataloader-tuned``'s with
    ``cls=pinfeed.DataLoader``)."""
    assert w.tuned is not None
    return references.tuned_loader(
        w.tuned,
        root,
        w.params,
        batch_size=w.batch_size,
        shuffle=w.shuffle,
        generator=torch.Generator().manual_seed(0),
        num_workers=num_workers,
        cls=cls,
        **extra,
    )


@pytest.fixture(scope="module")
def bench_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-data")


# The workloads with a batched read, at their smallest size (each maker has a floor).
TUNED = [pytest.param(k, id=k) for k in ("W1", "W4", "W6", "W7", "W8")]


@pytest.mark.parametrize("key", TUNED)
def test_tuned_dataloader_gives_the_plain_batches(bench_root: Path, key: str) -> None:
    w = data.MAKERS[key](bench_root, 0.0)
    assert w.tuned is not None and "dataloader-tuned" in w.systems
    seen = _same(_epochs(_tuned(w, bench_root)), _epochs(_plain(w, bench_root)))
    assert seen == 2 * -(-w.samples // w.batch_size)


def test_tuned_memmap_gives_the_plain_batches(tmp_path: Path) -> None:
    """W2's read (its files are too large for a test: the same Dataset classes over
    small files)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.random((50, 3, 4, 4), dtype=np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 9, 50))
    params = {"paths": ["x.npy", "y.npy"]}
    plain = DataLoader(
        references.memmap(tmp_path, params),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    tuned = references.tuned_loader(
        "memmap",
        tmp_path,
        params,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert _same(_epochs(tuned), _epochs(plain)) == 2 * 8


def test_tuned_with_workers_keeps_the_order(bench_root: Path) -> None:
    w = data.make_w1(bench_root, 0.0)
    tuned = _tuned(w, bench_root, num_workers=2)
    assert _same(_epochs(tuned), _epochs(_plain(w, bench_root))) == 2 * 4


# --- the one-line switch: the same objects through pinfeed.DataLoader --------------------

# Workloads whose pinfeed-dataloader and pinfeed-dataloader-tuned systems are checked here
# (W1 and W2's Datasets are checked in tests/dataloader).
SWITCHED = [pytest.param(k, id=k) for k in ("W4", "W6")]


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("key", SWITCHED)
def test_pinfeed_dataloader_gives_dataloaders_batches(
    server: Server, bench_root: Path, key: str, num_workers: int
) -> None:
    """The suite's ``pinfeed-dataloader`` (``pinfeed-dataloader-tuned``) system: the
    ``dataloader`` (``dataloader-tuned``) system's call on the same objects with
    ``pinfeed.DataLoader``; two epochs equal batch for batch, the RNGs alike after."""
    w = data.MAKERS[key](bench_root, 0.0)
    assert {"pinfeed-dataloader", "pinfeed-dataloader-tuned"} <= set(w.systems)
    for make in (_plain, _tuned):
        check(server, partial(_made, make, w, bench_root, num_workers), epochs=2)


def _made(make: Any, w: data.Workload, root: Path, nw: int, cls: Any, extra: Any) -> Any:
    return make(w, root, nw, cls, **extra)


# --- W9's tuned DataLoader: decoded once, by whichever process reads a sample first -------


def _w9(w: data.Workload, root: Path, system: str, num_workers: int) -> DataLoader[Any]:
    from bench.w9_trainer import loader

    spec = {"system": system, "data_root": str(root), "params": w.params, "seed": 0}
    spec |= {"transform": w.transform, "batch_size": w.batch_size, "num_workers": num_workers}
    dl: DataLoader[Any] = loader(spec)
    return dl


@pytest.mark.parametrize("num_workers", WORKERS)
def test_w9_caching_dataloader_gives_the_plain_batches(bench_root: Path, num_workers: int) -> None:
    """W9's ``dataloader-cached`` against ``dataloader``, two epochs from the same seed:
    the same batches (the transform's draws alike); after epoch 1 every sample is in
    the cache, as this process sees it (with workers: written by them), and a copy of
    the Dataset (as a worker started afresh gets it) maps the same samples."""
    w = data.make_w9(bench_root, 0.0)
    torch.manual_seed(3)  # the transform's RNG without workers: the trainer's
    want = _epochs(_w9(w, bench_root, "dataloader", num_workers))
    torch.manual_seed(3)
    cached = _w9(w, bench_root, "dataloader-cached", num_workers)
    ds = cached.dataset.dataset  # type: ignore[attr-defined]
    assert isinstance(ds, references.SharedDecoded) and not ds.filled.any()
    got = [list(cached)]
    assert ds.filled.all()
    got.append(list(cached))
    assert _same(got, want) == 2 * -(-w.samples // w.batch_size)
    copy = pickle.loads(pickle.dumps(ds))
    for i in (0, 3, len(ds) - 1):  # every fourth image portrait: shapes differ
        image, label = copy[i]
        assert_same((image, label), ds.dataset[i], f"sample {i}")
    del copy, ds, cached
