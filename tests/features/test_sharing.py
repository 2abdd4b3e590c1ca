"""Memory: workers map the dataset; they never copy it per worker as DataLoader's
workers copy a dataset held in Python objects. 4 workers over a 1 GiB npy file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import pinfeed
import pinfeed._dataloader
from pinfeed import Client, Loader
from tests.conftest import Server
from tests.dataloader.test_parity import check
from tests.helpers import smaps_rollup, unique
from tests.reliability.procs import wait_for

GIB = 1 << 30


def _tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            pass
    return out


def _memory(pid: int) -> dict[str, int]:
    """Summed over the process tree: anonymous (private) memory, RSS, and PSS."""
    total = {"anon": 0, "rss": 0, "pss": 0, "procs": 0}
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            pss = smaps_rollup(p)["Pss"]
        except FileNotFoundError:
            continue
        total["anon"] += int(fields["RssAnon"].split()[0]) * 1024
        total["rss"] += int(fields["VmRSS"].split()[0]) * 1024
        total["pss"] += pss
        total["procs"] += 1
    return total


@pytest.mark.slow
@pytest.mark.serial  # the PSS and anonymous memory of a process tree
def test_four_workers_over_a_1gib_npy_share_it(admin: Client, server: Server) -> None:
    shape = (GIB // (3 * 224 * 224 * 4), 3, 224, 224)
    path = server.data_root / "big_x.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
    for i in range(0, shape[0], 256):
        x[i : i + 256] = i
    x.flush()
    del x
    np.save(server.data_root / "big_y.npy", np.arange(shape[0]))
    ds = unique("big")
    admin.create_dataset(ds, "npy", {"paths": ["big_x.npy", "big_y.npy"]})
    name = unique("big")
    info = admin.create_loader(name, dataset=ds, batch_size=16, shuffle=True, seed=0, num_workers=4)
    assert server.proc is not None
    with Loader(name, socket=server.socket) as loader:
        next(iter(loader))  # workers are up, ring mapped
        before = _memory(server.proc.pid)
        seen = 0
        for _images, labels in loader:  # the rest of the epoch: all 1 GiB goes through
            seen += len(labels)
        after = _memory(server.proc.pid)
    grow = {k: after[k] - before[k] for k in ("anon", "rss", "pss")}
    report = (
        f"1 GiB npy, 4 workers, ring {info['ring_bytes'] / 2**20:.0f} MiB: growth over "
        f"an epoch: anon {grow['anon'] / 2**20:.0f} MiB, RSS {grow['rss'] / 2**20:.0f} MiB, "
        f"PSS {grow['pss'] / 2**20:.0f} MiB over {after['procs']} processes"
    )
    print(report)
    (Path(os.environ.get("PINFEED_REPORT_DIR", server.root)) / "sharing.txt").write_text(report)
    assert seen >= shape[0] - 32
    # DataLoader-style per-worker copies would add 4 GiB of private memory.
    assert grow["anon"] < 256 << 20, report
    # Mapped file pages are shared page cache: even counted per process they stay ~1 GiB.
    assert grow["pss"] < int(1.5 * GIB), report
    admin.delete_loader(name)
    admin.delete_dataset(ds)
    path.unlink()


def _maps(pid: int, path: Path) -> bool:
    """Whether ``pid`` or a process under it maps ``path``."""
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/maps") as f:
                if any(line.rstrip().endswith(str(path)) for line in f):
                    return True
        except FileNotFoundError:
            continue
    return False


@pytest.mark.parametrize("workers", [0, 2])
def test_a_memory_mapped_tensor_is_shipped_as_its_file(
    server: Server, tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.load(mmap=True)``'s tensors go to the server as their file, which the
    server (or its zygote) maps again: no copy into the payload; the batches are
    DataLoader's. A tensor written in the trainer goes as its bytes (the file does not
    hold what the trainer reads): the server's batches have the write."""
    path = tmp_path / "x.pt"
    torch.save((torch.arange(4096 * 1024, dtype=torch.int32).reshape(4096, 1024),), path)
    (x,) = torch.load(path, mmap=True, weights_only=True)
    labels = torch.arange(4096) % 7  # 32 KiB: copied
    sizes: list[int] = []

    def ship(self: Any, objects: Any, real: Any = pinfeed._shipping.Shipper.ship) -> Any:
        fd = real(self, objects)
        if fd is not None:
            sizes.append(os.fstat(fd).st_size)
        return fd

    monkeypatch.setattr(pinfeed._shipping.Shipper, "ship", ship)

    def make(cls: type[Any], extra: dict[str, Any]) -> Any:
        ds = TensorDataset(x, labels)
        return cls(ds, batch_size=64, shuffle=True, num_workers=workers, **extra)

    check(server, make, epochs=2)
    assert sizes and max(sizes) < 1 << 20, sizes  # the 16 MiB tensor is not in it
    loader = pinfeed.DataLoader(
        TensorDataset(x, labels), batch_size=64, num_workers=workers, socket=server.socket
    )
    next(iter(loader))
    assert _maps(server.pid, path)
    loader.close()
    x[3] = -1  # a written page: this tensor is not the file's any more
    check(server, make, epochs=1)
    assert sizes[-1] > 16 << 20, sizes  # shipped as its bytes


def _payload_rss(pid: int, size: int) -> int:
    """The most RSS of a ``pinfeed-payload`` mapping of at least ``size`` bytes in ``pid``."""
    best, current = 0, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and not line.endswith("kB\n"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                current = "pinfeed-payload" in line and hi - lo >= size
            elif current and line.startswith("Rss:"):
                best = max(best, int(line.split()[1]) * 1024)
    return best


def test_a_loader_without_workers_maps_its_objects_before_its_first_epoch(
    server: Server,
) -> None:
    """Its server reads the shipped tensors itself: their pages are mapped at its start
    (in a thread), not faulted in one by one through its first epoch."""
    size = 64 << 20
    ds = TensorDataset(torch.ones(size // 1024, 1024, dtype=torch.uint8))
    with pinfeed.DataLoader(ds, batch_size=1024, socket=server.socket):  # not iterated
        wait_for(lambda: _payload_rss(server.pid, size) >= size, "the payload's pages mapped")
