"""Memory: workers map the dataset; they never copy it per worker as DataLoader's
workers copy a dataset held in Python objects. 4 workers over a 1 GiB npy file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import smaps_rollup, unique

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
