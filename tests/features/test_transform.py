"""A loader's ``transform`` over a dataset, cached or not, gives DataLoader's batches:
``DataLoader(Transformed(dataset, transform))`` with the same seed, batch for batch
(``torch.equal``), at ``num_workers`` 0 and 2, persistent or not, over three epochs;
and under what the engine already guarantees augmentations: a worker SIGKILLed, a
resume in a new trainer process, a server restart (with the cache persisted), a live
PATCH of num_workers. The pipeline is W9's, shrunk: JPEGs decoded and resized
(shorter side 32, aspect kept) by the ``images`` kind, the deterministic stage the
cache keeps, and RandomResizedCrop(24) + flip as the transform. Four loaders with
different seeds over one cached dataset read each sample from the files once."""

from __future__ import annotations

import functools
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader, Transformed
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.cache.images import make_jpegs
from tests.conftest import REPO, Server
from tests.fixtures.trainer import command, digest, read_log
from tests.fixtures.transforms import crop_flip
from tests.helpers import assert_epochs_same, epochs_with, sigkill_worker, unique

TRANSFORM = "tests.fixtures.transforms:crop_flip"
BATCH = 5  # 40 images: 8 batches an epoch
SEED = 7
EPOCHS = 3


@pytest.fixture(scope="module")
def images(server: Server) -> dict[str, Any]:
    return make_jpegs(server.data_root, unique("w9"))


def _reference(
    data_root: Path, params: dict[str, Any], num_workers: int, persistent: bool, seed: int = SEED
) -> list[list[Any]]:
    """DataLoader(Transformed(images, crop_flip)); pinfeed's num_workers=0 is DataLoader's
    one non-persistent worker (the engine's rule for augmentations at 0)."""
    base = build_dataset("images", params, DatasetContext(data_root))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        dl = DataLoader(
            Transformed(base, crop_flip),
            batch_size=BATCH,
            shuffle=True,
            num_workers=max(1, num_workers),
            persistent_workers=persistent and num_workers > 0,
            generator=torch.Generator().manual_seed(seed),
        )
        return [list(dl) for _ in range(EPOCHS)]


def _copy(batch: Any) -> Any:
    return [t.clone() for t in batch]


def _dataset(admin: Client, params: dict[str, Any], cache: dict[str, Any] | None) -> str:
    name = unique("w9ds")
    admin.create_dataset(name, "images", params, cache=cache)
    return name


def _loader(admin: Client, dataset: str, num_workers: int, **kw: Any) -> str:
    name = unique("w9")
    kw.setdefault("seed", SEED)
    admin.create_loader(
        name,
        dataset=dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        transform=TRANSFORM,
        **kw,
    )
    return name


@pytest.mark.parametrize(
    ("num_workers", "cached", "persistent"),
    [(0, False, False), (0, True, False), (2, False, True), (2, True, True), (2, True, False)],
)
def test_batches_equal_dataloader_over_transformed(
    admin: Client,
    server: Server,
    images: dict[str, Any],
    num_workers: int,
    cached: bool,
    persistent: bool,
) -> None:
    want = _reference(server.data_root, images, num_workers, persistent)
    ds = _dataset(admin, images, {} if cached else None)
    extra = {"persistent_workers": True} if persistent else {}
    name = _loader(admin, ds, num_workers, **extra)
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, EPOCHS, _copy)
    assert_epochs_same(got, want)
    admin.delete_loader(name)
    stats = admin.dataset(ds)["cache"]
    if cached:  # every sample read from its file once; every later read a hit
        assert (stats["samples"], stats["misses"]) == (40, 40)
        assert stats["hits"] >= 40 * (EPOCHS - 1)
    else:
        assert stats is None
    admin.delete_dataset(ds)


def test_a_sigkilled_worker_keeps_the_sequence(
    admin: Client, server: Server, images: dict[str, Any]
) -> None:
    want = _reference(server.data_root, images, 2, True)
    ds = _dataset(admin, images, {})
    name = _loader(admin, ds, 2, persistent_workers=True)
    kill = {(0, 3): lambda: sigkill_worker(admin, server, name, 2, 0)}
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, EPOCHS, _copy, kill)
    assert_epochs_same(got, want)
    admin.delete_loader(name)
    assert admin.dataset(ds)["cache"]["corrupt"] == 0
    admin.delete_dataset(ds)


def test_a_live_patch_changes_no_batch(
    admin: Client, server: Server, images: dict[str, Any]
) -> None:
    want = _reference(server.data_root, images, 2, False)
    ds = _dataset(admin, images, {})
    name = _loader(admin, ds, 2)
    changes = {(0, 2): {"num_workers": 1}, (1, 1): {"num_workers": 3}, (2, 4): {"num_workers": 0}}
    at = {place: functools.partial(admin.patch_loader, name, **c) for place, c in changes.items()}
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, EPOCHS, _copy, at)
    assert_epochs_same(got, want)
    admin.delete_loader(name)
    admin.delete_dataset(ds)


@pytest.mark.slow
def test_resume_in_a_new_trainer_process(
    admin: Client, server: Server, images: dict[str, Any], tmp_path: Path
) -> None:
    want = [digest(b) for epoch in _reference(server.data_root, images, 2, True) for b in epoch]
    ds = _dataset(admin, images, {})
    name = _loader(admin, ds, 2, persistent_workers=True)
    state, first, second = tmp_path / "state.json", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run = functools.partial(subprocess.run, cwd=REPO, timeout=120)
    died = run(
        command(server.socket, name, first, "--epochs", "3", "--state-at", "11",
                "--state-file", str(state), "--die-after", "2"),
    )  # fmt: skip
    assert died.returncode == -9
    assert (
        run(
            command(server.socket, name, second, "--resume", str(state), "--epochs", "2")
        ).returncode
        == 0
    )
    got = [r["digest"] for r in read_log(first)][:11] + [r["digest"] for r in read_log(second)]
    assert got == want
    admin.delete_loader(name)
    admin.delete_dataset(ds)


@pytest.mark.slow
def test_a_server_restart_serves_the_persisted_cache(restartable: Server) -> None:
    """A checkpoint after 6 batches, a server restart, a resume: the batches are
    DataLoader's, and the new server reads from the files only what the old one had not
    stored (its entries come from the file, each checksum checked on its first read)."""
    srv = restartable
    params = make_jpegs(srv.data_root, "w9")
    want = _reference(srv.data_root, params, 2, True)[:2]
    with srv.client() as admin:
        admin.create_dataset("w9", "images", params, cache={"persist": True})
        name = _loader(admin, "w9", 2, persistent_workers=True)
        with Loader(name, socket=srv.socket) as loader:
            it = iter(loader)
            got = [_copy(next(it)) for _ in range(6)]
            state = loader.state_dict()
        stored = admin.dataset("w9")["cache"]["samples"]
    assert srv.stop() == 0
    srv.start()
    with srv.client() as admin:
        reopened = admin.dataset("w9")["cache"]
        assert reopened["persisted"] and reopened["rebuilt"] == 0
        # the old server's workers went on filling its warm queue after the GET
        assert reopened["samples"] >= stored >= 30
        with Loader(name, socket=srv.socket) as loader:
            loader.load_state_dict(state)
            got += [_copy(b) for b in loader]
            epochs = [got, [_copy(b) for b in loader]]
        stats = admin.dataset("w9")["cache"]
    assert_epochs_same(epochs, want)
    assert stats["misses"] == 40 - reopened["samples"] and stats["samples"] == 40
    assert stats["corrupt"] == 0 and stats["hits"] > 0


def test_four_jobs_read_each_sample_once(
    admin: Client, server: Server, images: dict[str, Any]
) -> None:
    ds = _dataset(admin, images, {})
    seeds = [1, 2, 3, 4]
    names = [_loader(admin, ds, 1, seed=s, persistent_workers=True) for s in seeds]
    got: dict[int, list[list[Any]]] = {}

    def job(seed: int, name: str) -> None:
        with Loader(name, socket=server.socket) as loader:
            got[seed] = epochs_with(loader, EPOCHS, _copy)

    threads = [threading.Thread(target=job, args=(s, n)) for s, n in zip(seeds, names, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for seed in seeds:
        assert_epochs_same(got[seed], _reference(server.data_root, images, 1, True, seed))
    for name in names:
        admin.delete_loader(name)
    stats = admin.dataset(ds)["cache"]
    assert stats["misses"] == 40  # over all four loaders: once per node
    admin.delete_dataset(ds)
