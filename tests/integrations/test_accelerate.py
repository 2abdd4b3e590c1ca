"""Accelerate: ``save_state`` mid-epoch in one process, ``load_state`` in a new one, and
the new one continues with the next batch (DataLoader's epoch, batch for batch); a
4-process job's ``save_state`` resumed by 3 processes with each sample of the epoch
once (Accelerate keeps the main process's loader state alone: it has every rank's); a
2-process job's ``prepare`` warns of a loader nothing shards."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import REPO, Server
from tests.helpers import unique

PARAMS: dict[str, Any] = {
    "length": 32,
    "seed": 9,
    "fields": [{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 5}],
}
SCRIPT = REPO / "tests" / "integrations" / "accelerate_train.py"


def _run(server: Server, name: str, ckpt: Path, out: Path, route: str, *extra: str) -> None:
    cmd = [sys.executable, str(SCRIPT), name, str(server.socket), str(ckpt), str(out), route]
    subprocess.run([*cmd, *extra], cwd=REPO, timeout=120, check=True)


def _shuffled(admin: Client, server: Server) -> tuple[str, list[list[torch.Tensor]]]:
    """A new shuffled loader (8 batches, one worker) and DataLoader's epoch 0 of it."""
    ds_name, name = unique("acc"), unique("acc")
    admin.create_dataset(ds_name, "synthetic", PARAMS)
    admin.create_loader(name, dataset=ds_name, batch_size=4, shuffle=True, seed=3, num_workers=1)
    ds = build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))
    gen = torch.Generator().manual_seed(3)
    return name, [list(b) for b in DataLoader(ds, batch_size=4, shuffle=True, generator=gen)]


def _same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


@pytest.mark.slow
def test_save_state_mid_epoch_then_load_state_in_a_new_process(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    """``register_for_checkpointing(loader)``, the route for a loader ``prepare`` returns."""
    name, want = _shuffled(admin, server)
    ckpt = tmp_path / "ckpt"
    _run(server, name, ckpt, tmp_path / "a.pt", "register")
    _run(server, name, ckpt, tmp_path / "b.pt", "register", "--resume")
    first, second = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert len(first) == 5  # batches 3 and 4 came after the checkpoint: they come again
    _same(first[:3] + second, want)
    admin.delete_loader(name)


def test_prepare_data_loader_tracks_the_loader_for_save_and_load_state(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    """``accelerator.prepare_data_loader(loader)`` hands the Loader back and tracks it
    as a stateful loader: ``save_state`` stores its position, ``load_state`` restores
    it into a new Loader (here in the same process; the script above shows a new one)."""
    from accelerate import Accelerator

    name, want = _shuffled(admin, server)
    accelerator = Accelerator(cpu=True)
    with Loader(name, socket=server.socket, copy=True) as loader:
        assert accelerator.prepare_data_loader(loader) is loader
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        accelerator.save_state(tmp_path / "ckpt")
        next(it)  # consumed after the checkpoint: comes again
    accelerator = Accelerator(cpu=True)
    with Loader(name, socket=server.socket, copy=True) as loader:
        assert accelerator.prepare_data_loader(loader) is loader
        accelerator.load_state(tmp_path / "ckpt")
        got += list(loader)
    _same(got, want)
    admin.delete_loader(name)


def test_skip_first_batches_says_what_to_do_instead(admin: Client, server: Server) -> None:
    """``accelerate.skip_first_batches`` rebuilds a local DataLoader over the loader's
    dataset, which lives in the server: iterating it says how to start at batch n."""
    from accelerate import skip_first_batches

    ds_name, name = unique("acc"), unique("acc")
    admin.create_dataset(ds_name, "synthetic", PARAMS)
    admin.create_loader(name, dataset=ds_name, batch_size=4)
    want = list(DataLoader(build_dataset("synthetic", PARAMS, DatasetContext(server.data_root)), 4))
    # timeout=None: DataLoader without workers refuses a timeout before it gets there.
    with Loader(name, socket=server.socket, timeout=None, copy=True) as loader:
        skipped = skip_first_batches(loader, 2)
        assert len(skipped) == len(loader) - 2
        with pytest.raises(TypeError, match="load_state_dict"):
            next(iter(skipped))
        loader.load_state_dict({"epoch": 0, "index": 2})  # what it says to do
        got = list(loader)
    assert len(got) == len(want) - 2
    for g, w in zip(got, want[2:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    admin.delete_loader(name)


def test_prepare_and_save_load_state_of_a_pinfeed_dataloader(
    server: Server, tmp_path: Path
) -> None:
    """The one-line switch under Accelerate: ``prepare`` hands a ``pinfeed.DataLoader``
    back as it is and tracks it as stateful; ``load_state`` in a new loader continues
    after the checkpointed batch, equal to torch's DataLoader's epoch."""
    from accelerate import Accelerator

    import pinfeed

    ds = build_dataset("synthetic", PARAMS, DatasetContext(server.data_root))

    def make(cls: Any, **extra: Any) -> Any:
        gen = torch.Generator().manual_seed(3)
        return cls(ds, batch_size=4, shuffle=True, num_workers=1, generator=gen, **extra)

    want = [list(b) for b in make(DataLoader)]
    accelerator = Accelerator(cpu=True)
    loader = make(pinfeed.DataLoader, socket=server.socket, copy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: nothing to shard, no warning
        assert accelerator.prepare_data_loader(loader) is loader
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    accelerator.save_state(tmp_path / "ckpt")
    next(it)  # consumed after the checkpoint: comes again
    del it
    loader.close()
    accelerator = Accelerator(cpu=True)
    loader = make(pinfeed.DataLoader, socket=server.socket, copy=True)
    assert accelerator.prepare_data_loader(loader) is loader
    accelerator.load_state(tmp_path / "ckpt")
    got += list(loader)
    loader.close()
    _same(got, want)


@pytest.mark.heavy  # torchrun: 4 Accelerate processes, then 3
def test_a_4_process_save_state_resumed_by_3(admin: Client, server: Server, tmp_path: Path) -> None:
    from tests.features.test_elastic import BATCH, LENGTH, SEED, WORKERS, _dataset, _loaders
    from tests.features.test_elastic_ddp import torchrun
    from tests.fixtures.elastic import check_resumed, distributed, reference_epoch
    from tests.helpers import assert_same

    script = REPO / "tests" / "integrations" / "accelerate_elastic.py"
    ds = _dataset(admin)
    old, new = _loaders(admin, ds, 4), _loaders(admin, ds, 3)
    for names, phase in ((old, "first"), (new, "resume")):
        prefix = names[0].rsplit("-", 1)[0]
        torchrun(len(names), prefix, str(server.socket), str(tmp_path), phase, "4", script=script)
    before = [torch.load(tmp_path / f"first-rank{r}.pt") for r in range(4)]
    rests = []
    for rank in range(3):
        rest, following = torch.load(tmp_path / f"resume-rank{rank}.pt")
        rests.append(rest)
        want = reference_epoch(
            distributed(LENGTH, 3, rank, SEED, False),
            1,
            batch_size=BATCH,
            num_workers=WORKERS[rank % 2],
            seed=SEED,
            length=LENGTH,
        )
        assert_same(following, want)
    check_resumed(before, rests, length=LENGTH, batch=BATCH)
    for name in old + new:
        admin.delete_loader(name)


@pytest.mark.heavy  # torchrun: 2 Accelerate processes
def test_prepare_under_2_processes_warns_of_a_loader_nothing_shards(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    """Accelerate shards a DataLoader it prepares, not a pinfeed loader it hands back:
    ``prepare`` warns, once a loader, where nothing else shards it (a pinfeed.DataLoader
    without a ``DistributedSampler``, a named loader without ``world_size`` or a split
    group), naming the
    fix; the fix (``DistributedSampler`` with ``set_epoch``) gives each rank torch's
    DataLoader's batches of the same objects, over 2 epochs."""
    from tests.features.test_elastic_ddp import torchrun

    ds_name, name = unique("acc"), unique("acc")
    admin.create_dataset(ds_name, "synthetic", PARAMS)
    for rank in range(2):
        admin.create_loader(f"{name}-{rank}", dataset=ds_name, batch_size=4)
    admin.create_loader(
        f"{name}-group", dataset=ds_name, batch_size=4, group_size=2, group_mode="split"
    )
    script = REPO / "tests" / "integrations" / "accelerate_shards.py"
    torchrun(2, str(server.socket), name, str(tmp_path), script=script)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["processes"] == 2
        (unsharded,) = got["unsharded"]
        assert "each of the 2 processes would iterate the whole dataset" in unsharded
        assert "DistributedSampler(dataset, num_replicas=accelerator.num_processes" in unsharded
        assert got["again"] == []
        assert got["distributed"] == got["tuned"] == []
        (named,) = got["named"]
        assert "world_size=accelerator.num_processes" in named
        assert got["group"] == []
        for mine, torchs in got["epochs"]:
            assert len(mine) == len(torchs) == 3
            for g, w in zip(mine, torchs, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    for suffix in ("0", "1", "group"):
        admin.delete_loader(f"{name}-{suffix}")


@pytest.mark.slow
def test_a_streaming_dataset_moves_on_each_epoch_as_under_accelerate(
    server: Server, tmp_path: Path
) -> None:
    """Accelerate's prepared DataLoader calls the dataset's ``set_epoch`` as each epoch
    begins (a Hugging Face ``IterableDataset``: a new shard order and shuffle buffer);
    ``prepare`` hands a pinfeed.DataLoader back as it is, which then does the same: the
    3 epochs are DataLoader's under Accelerate, batch for batch, and differ."""
    script = REPO / "tests" / "integrations" / "accelerate_epochs.py"
    got = {}
    for which in ("torch", "pinfeed"):
        out = tmp_path / f"{which}.pt"
        cmd = [sys.executable, str(script), which, str(server.socket), str(out)]
        subprocess.run(cmd, cwd=REPO, timeout=180, check=True)
        got[which] = torch.load(out)
    theirs, ours = got["torch"], got["pinfeed"]
    assert [len(e) for e in theirs] == [len(e) for e in ours] == [12, 12, 12]
    for a, b in zip(theirs, ours, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(torch.cat(theirs[0]), torch.cat(theirs[1]))
