"""A dataset is built once per server, when it is registered: every loader and worker
uses that build (forked from the dataset's zygote), and the ``images`` index lives in
shared memory that every process maps, never in a list per process."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from bench.references import PilImageFolder
from pinfeed import Client, Loader
from pinfeed_server.datasets.shared import SharedArrays, StringTable, string_arrays
from tests.conftest import Server
from tests.datasets.test_images import SIZE, _own, make_tree
from tests.fixtures.datasets import MappedRows, PathList
from tests.helpers import assert_same, unique


def _assert_epoch(name: str, server: Server, want: list[Any]) -> None:
    """The loader's first epoch is ``want`` (batches are ring views: owned copies kept)."""
    with Loader(name, socket=server.socket) as loader:
        got = [_own(batch) for batch in loader]
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{name} batch {j}")


def test_workers_use_the_registered_build_not_a_rescan(admin: Client, server: Server) -> None:
    """A file added after registration is in no loader's batches: the workers of both
    loaders read the index built at registration, they do not walk the folder again."""
    rel = unique("built-once")
    folder = make_tree(server.data_root / rel)
    name = unique("imgs")
    admin.create_dataset(name, "images", {"path": rel, "size": SIZE})
    ref = PilImageFolder(folder, SIZE)
    # Sorts first in the first class: a rescan would make it sample 0.
    shutil.copy(folder / "apple" / "c.jpg", folder / "apple" / "0-new.jpg")
    loaders = [unique("imgs-l"), unique("imgs-l")]
    try:
        for loader in loaders:
            admin.create_loader(loader, dataset=name, batch_size=4, num_workers=2)
        want = list(DataLoader(ref, batch_size=4))  # type: ignore[arg-type]
        for loader in loaders:
            _assert_epoch(loader, server, want)
        assert admin.dataset(name)["length"] == len(ref)
    finally:
        for loader in loaders:
            admin.delete_loader(loader)
        admin.delete_dataset(name)


def test_a_python_dataset_is_built_once_for_every_loader_and_worker(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    log = tmp_path / "builds.log"
    name = unique("paths")
    kwargs = {"length": 300, "log": str(log)}
    admin.create_dataset(
        name, "python", {"factory": "tests.fixtures.datasets:PathList", "kwargs": kwargs}
    )
    loaders = [unique("paths-l") for _ in range(2)]
    try:
        for loader in loaders:
            admin.create_loader(loader, dataset=name, batch_size=16, num_workers=3)
        want = list(DataLoader(PathList(300), batch_size=16))  # type: ignore[arg-type]
        for loader in loaders:
            _assert_epoch(loader, server, want)
        assert server.proc is not None
        # One build, in the server; its zygote got it pickled, the workers forked.
        assert log.read_text().split() == [str(server.proc.pid)]
    finally:
        for loader in loaders:
            admin.delete_loader(loader)
        admin.delete_dataset(name)


def test_the_images_index_is_one_memfd_mapped_by_the_workers(admin: Client, server: Server) -> None:
    rel = unique("mapped")
    make_tree(server.data_root / rel)
    name = unique("imgs")
    admin.create_dataset(name, "images", {"path": rel, "size": SIZE})
    loader = unique("imgs-l")
    try:
        admin.create_loader(loader, dataset=name, batch_size=4, num_workers=2)
        with Loader(loader, socket=server.socket) as trainer:
            next(iter(trainer))
        assert server.proc is not None
        tree = [server.proc.pid, *(p.pid for p in psutil.Process(server.proc.pid).children(True))]
        holders = _holders(tree, lambda line: f"memfd:pinfeed-images-{rel}" in line)
        # the server, the zygote and its two workers map the same pages
        assert len(holders) >= 4, holders
    finally:
        admin.delete_loader(loader)
        admin.delete_dataset(name)


def test_a_python_datasets_memory_mapped_file_is_mapped_by_its_zygote_not_copied(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    """The zygote gets the server's build pickled; an ``np.load(mmap_mode="r")`` array in
    it goes as its file and is mapped again there (the workers inherit that mapping),
    not as its 32 MiB of contents copied into the zygote's heap."""
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(32 * 2**20 // 8, dtype=np.int64).reshape(-1, 512))
    name = unique("mapped-rows")
    factory = "tests.fixtures.datasets:MappedRows"
    admin.create_dataset(name, "python", {"factory": factory, "kwargs": {"path": str(path)}})
    loader = unique("mapped-rows-l")
    try:
        admin.create_loader(loader, dataset=name, batch_size=64, num_workers=2)
        want = list(DataLoader(MappedRows(str(path)), batch_size=64))  # type: ignore[arg-type]
        _assert_epoch(loader, server, want)
        assert server.proc is not None
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        holders = _holders([p.pid for p in tree], lambda line: line.rstrip().endswith(str(path)))
        # the zygote and its two workers map the file (a copy would map nothing)
        assert len(holders) >= 3, holders
    finally:
        admin.delete_loader(loader)
        admin.delete_dataset(name)


def _holders(pids: list[int], mapping: Callable[[str], bool]) -> list[int]:
    """The ``pids`` with a line of ``/proc/PID/maps`` that ``mapping`` accepts."""
    held = []
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            if any(mapping(line) for line in f):
                held.append(pid)
    return held


def test_a_large_folder_is_described_in_a_few_bytes(admin: Client, server: Server) -> None:
    rel = unique("large")
    folder = make_tree(server.data_root / rel)
    source = folder / "mango" / "y.jpg"
    for c in range(20):
        d = folder / f"extra{c:02d}"
        d.mkdir()
        for j in range(1000):
            os.link(source, d / f"{j:05d}.jpg")
    name = unique("large")
    try:
        described = admin.create_dataset(name, "images", {"path": rel, "size": SIZE})
        assert described["length"] == 20_011
        assert len(str(admin.dataset(name))) < 2000
        assert len(str(admin.datasets())) < 2000 * len(admin.datasets())
    finally:
        admin.delete_dataset(name)
        shutil.rmtree(folder)


def test_shared_arrays_pickle_only_to_a_starting_process() -> None:
    blob, offsets = string_arrays([b"a", b"", "é/ü".encode(), b"xyz"])
    shared = SharedArrays("t", {"blob": blob, "offsets": offsets, "n": np.arange(5)})
    table = StringTable(shared["blob"], shared["offsets"])
    assert [table[i] for i in range(len(table))] == ["a", "", "é/ü", "xyz"]
    assert not shared["n"].flags.writeable
    with pytest.raises(TypeError, match="only to a process"):
        pickle.dumps(shared)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(shared, child))
    proc.start()
    child.close()
    assert parent.recv() == ([0, 1, 2, 3, 4], ["a", "", "é/ü", "xyz"], True)
    proc.join(30)
    assert proc.exitcode == 0


def _echo(shared: SharedArrays, conn: Any) -> None:
    table = StringTable(shared["blob"], shared["offsets"])
    mapped = bool(_holders([os.getpid()], lambda line: "memfd:pinfeed-t" in line))
    conn.send((shared["n"].tolist(), [table[i] for i in range(len(table))], mapped))


def test_images_samples_view_matches_imagefolder(tmp_path: Path) -> None:
    from pinfeed_server.datasets import DatasetContext, build_dataset

    make_tree(tmp_path / "data")
    ds = build_dataset("images", {"path": "data", "size": SIZE}, DatasetContext(tmp_path))
    ref = PilImageFolder(tmp_path / "data", SIZE)
    assert list(ds.samples) == [(os.path.realpath(p), lbl) for p, lbl in ref.samples]
    assert ds.samples[-1] == ds.samples[len(ref) - 1]
    assert ds.samples[1:3] == [ds.samples[1], ds.samples[2]]
    with pytest.raises(IndexError):
        ds.samples[len(ref)]
    assert isinstance(ds[0][0], torch.Tensor)


def test_a_python_dataset_that_will_not_pickle_is_built_by_its_zygote(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    log = tmp_path / "builds.log"
    name = unique("unpicklable")
    factory = "tests.fixtures.datasets:UnpicklablePaths"
    admin.create_dataset(
        name, "python", {"factory": factory, "kwargs": {"length": 100, "log": str(log)}}
    )
    loader = unique("unpicklable-l")
    try:
        admin.create_loader(loader, dataset=name, batch_size=16, num_workers=2)
        _assert_epoch(loader, server, list(DataLoader(PathList(100), batch_size=16)))  # type: ignore[arg-type]
        builds = log.read_text().split()
        # the server's, and its zygote's (not the workers')
        assert len(builds) == 2 and builds[0] == str(server.proc and server.proc.pid)
    finally:
        admin.delete_loader(loader)
        admin.delete_dataset(name)
