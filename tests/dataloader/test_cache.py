"""``pinfeed.DataLoader(pinfeed.Transformed(dataset, transform), cache=...)``: the node's
cache on the one-line path. The batches are DataLoader's on the same objects
(``torch.equal``, three epochs, ``num_workers`` 0 and 2, the W9 pipeline shrunk: JPEGs
decoded and resized by the script's own Dataset class, RandomResizedCrop + flip as the
transform); the dataset part is read once (misses == its length, every later read a
hit); loaders naming one cache share it, in one script or in two trainer processes;
another dataset under that name, a dataset that draws, a transform that writes into
its input and a cache over the budget are errors that say what to do; and the cache
goes with its last loader (nothing left in the server)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

import pinfeed
from pinfeed import InsufficientMemory, InvalidRequest, Transformed
from pinfeed_server.cache import record
from pinfeed_server.cache.region import Layout
from tests.cache.images import make_jpegs
from tests.conftest import Server
from tests.dataloader.test_parity import Augmented, check
from tests.fixtures.transforms import crop_flip, in_place
from tests.helpers import unique
from tests.reliability.procs import cache_holders, wait_for

SIZE = 32
BATCH = 5
SCRIPT = Path(__file__).with_name("cache_script.py")


class Jpegs(Dataset[Any]):
    """The script's own deterministic stage: decode, RGB, shorter side to 32, CHW uint8."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(str(p) for p in folder.rglob("*.jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = SIZE / min(w, h)
            im = im.resize((round(w * scale), round(h * scale)), Image.BILINEAR)
            x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous()
        return x, i % 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of this module's own, whose /metrics are rendered for every scrape (the
    tests read a cache's counts right after the reads they count)."""
    srv = Server(tmp_path_factory.mktemp("cached"), env={"PINFEED_METRICS_MAX_AGE_S": "0"})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    make_jpegs(root, "w9", n=40)
    return root / "w9"


def _metric(server: Server, series: str, key: str) -> int | None:
    with server.client() as c:
        text = c.metrics()
    m = re.search(
        rf'^pinfeed_dataset_cache_{series}\{{dataset="{re.escape(key)}"\}} (\S+)$', text, re.M
    )
    return None if m is None else int(float(m.group(1)))


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_dataloader_over_the_cache(
    server: Server, folder: Path, workers: int
) -> None:
    name = unique("w9")

    def make(cls: type[Any], extra: dict[str, Any]) -> Any:
        if cls is pinfeed.DataLoader:
            extra = extra | {"cache": name}
        return cls(
            Transformed(Jpegs(folder), crop_flip),
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(3),
            **extra,
        )

    check(server, make, epochs=3)
    wait_for(lambda: not cache_holders(server.pid, f"~{name}"), "the cache gone with its loader")


def test_read_once_and_shared_by_the_loaders_that_name_it(server: Server, folder: Path) -> None:
    name, key = unique("shared"), None
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "socket": server.socket}
    first = pinfeed.DataLoader(
        Transformed(Jpegs(folder), crop_flip), num_workers=2, cache=name, **kw
    )
    key = f"~{name}"
    with server.client() as c:  # which cache a trainer's loader reads, for operators
        (row,) = [r for r in c.loaders() if r["name"] == first.pinfeed_name]
    assert row["owner"]["cache"] == key
    for _ in range(2):
        assert sum(len(b[1]) for b in first) == 40
    assert _metric(server, "misses_total", key) == 40
    hits = _metric(server, "hits_total", key)  # epoch 2's, and the ring's sizing reads
    assert hits is not None and 40 <= hits <= 42, hits
    # A second loader over an equal (not the same) object joins the cache: no read.
    second = pinfeed.DataLoader(
        Transformed(Jpegs(folder), crop_flip), num_workers=0, cache=name, **kw
    )
    assert sum(len(b[1]) for b in second) == 40
    assert _metric(server, "misses_total", key) == 40
    first.close()
    assert cache_holders(server.pid, key)  # the second still reads it
    assert sum(len(b[1]) for b in second) == 40
    second.close()
    wait_for(lambda: not cache_holders(server.pid, key), "the cache gone with its last loader")
    assert _metric(server, "misses_total", key) is None
    # cache=True: a cache of the loader's own
    own = pinfeed.DataLoader(Transformed(Jpegs(folder), crop_flip), num_workers=1, cache=True, **kw)
    for _ in range(2):
        assert sum(len(b[1]) for b in own) == 40
    own_key = f"~own-{own.pinfeed_name}"
    assert _metric(server, "misses_total", own_key) == 40
    own.close()
    wait_for(lambda: not cache_holders(server.pid, own_key), "its own cache gone with it")


@pytest.mark.slow
def test_two_trainer_processes_read_each_sample_once(server: Server, folder: Path) -> None:
    """Two jobs on one cache: each sample read once over both; one SIGKILLed leaves the
    cache to the other, and the cache goes with the last."""
    name = unique("jobs")
    key = f"~{name}"
    env = dict(os.environ, PINFEED_AUTOSTART="0", PYTHONPATH=str(Path(__file__).parents[2]))
    cmd = [sys.executable, str(SCRIPT), str(server.socket), str(folder), name]
    procs = [
        subprocess.Popen(
            [*cmd, str(seed)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for seed in (0, 1)
    ]
    try:
        # each trainer reads an epoch, says so, and holds its loader until stdin closes
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "read"
        assert _metric(server, "misses_total", key) == 40
        hits = _metric(server, "hits_total", key)
        assert hits is not None and hits >= 40  # the other trainer's epoch
        procs[0].kill()
        procs[0].wait(10)
        with server.client() as c:
            wait_for(lambda: len(c.loaders()) == 1, "the killed trainer's loader gone")
        assert cache_holders(server.pid, key)  # the other one's
        out, _ = procs[1].communicate("", timeout=60)  # it reads one more epoch
        assert procs[1].returncode == 0, out
        wait_for(lambda: not cache_holders(server.pid, key), "the cache gone with its last trainer")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


def test_errors_say_what_to_do(server: Server, folder: Path) -> None:
    kw: dict[str, Any] = {"batch_size": BATCH, "socket": server.socket}
    with pytest.raises(InvalidRequest, match=r"moved torch's.*pinfeed\.Transformed"):
        pinfeed.DataLoader(Augmented(), cache=True, **kw)
    with pytest.raises(InvalidRequest, match="writes into the sample"):
        pinfeed.DataLoader(Transformed(Jpegs(folder), in_place), cache=True, **kw)
    name = unique("taken")
    holder = pinfeed.DataLoader(Jpegs(folder), cache=name, **kw)
    with pytest.raises(InvalidRequest, match="holds another dataset's samples"):
        pinfeed.DataLoader(_Shifted(Jpegs(folder)), cache=name, **kw)
    holder.close()
    with pytest.raises(InvalidRequest, match="a cache's name is letters"):
        pinfeed.DataLoader(Jpegs(folder), cache="no spaces", **kw)
    with pytest.raises(ValueError, match="cache_max_bytes= without cache="):
        pinfeed.DataLoader(Jpegs(folder), cache_max_bytes=10, **kw)
    with pytest.raises(InsufficientMemory, match="cache_max_bytes="):
        pinfeed.DataLoader(Huge(), cache=True, **kw)
    # smaller than the data: a fixed subset of 10 of the 40 samples, hit on those only
    overhead, record_size = Layout(40, 0).data_at, record.plan(Jpegs(folder)[0]).size
    small = pinfeed.DataLoader(
        Transformed(Jpegs(folder), crop_flip),
        cache=True,
        cache_max_bytes=overhead + 10 * record_size,
        shuffle=True,
        **kw,
    )
    key = f"~own-{small.pinfeed_name}"
    assert sum(len(b[1]) for b in small) == 40
    after_first = _metric(server, "hits_total", key)
    assert after_first is not None and _metric(server, "samples", key) == 10
    for _ in range(2):
        assert sum(len(b[1]) for b in small) == 40
    assert _metric(server, "hits_total", key) == after_first + 20  # 10 of 40, each epoch
    small.close()


class Huge(Dataset[Any]):
    """10,000 samples of 8 MiB: a cache of 80 GiB, more than a node's budget."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> Any:
        return torch.zeros(1 << 21)


class _Shifted(Dataset[Any]):
    """Another dataset of the same length: every image one brighter."""

    def __init__(self, base: Jpegs) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        x, y = self.base[i]
        return x + 1, y
