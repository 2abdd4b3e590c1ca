"""The elastic guarantee under torchrun (gloo, CPU): a 4-rank job checkpoints mid-epoch
(``state_dict()`` gathered over the process group, rank 0's file kept; and through
``torch.distributed.checkpoint``) and dies; the job resumed on 3 ranks, and on 6,
delivers every sample of that epoch once with what the 4 ranks had (beyond the stated
padding), as many batches on every rank, and then epoch 1 of DistributedSampler(3)
(of 6), batch for batch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pinfeed import Client
from tests.conftest import REPO, Server, free_port
from tests.features.test_elastic import BATCH, LENGTH, SEED, WORKERS, _dataset, _loaders
from tests.fixtures.elastic import check_resumed, distributed, indices, reference_epoch
from tests.helpers import assert_same

SCRIPT = REPO / "tests" / "features" / "elastic_ddp.py"
K = 4  # batches each rank trains before the checkpoint (of 8 per rank at 4 ranks)


def torchrun(nproc: int, *args: str, script: Path = SCRIPT) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(script),
            *args,
        ],
        cwd=REPO,
        timeout=240,
        check=True,
    )


@pytest.fixture(scope="module")
def checkpoint(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    with server.client() as admin:
        ds = _dataset(admin)
        names = _loaders(admin, ds, 4)
        out = tmp_path_factory.mktemp("ddp")
        torchrun(4, names[0].rsplit("-", 1)[0], str(server.socket), str(out), "first", str(K))
        yield ds, out
        for name in names:
            admin.delete_loader(name)


@pytest.mark.heavy  # torchrun: 4 ranks, then 3 or 6
@pytest.mark.parametrize(("new_world", "phase"), [(3, "resume"), (6, "resume"), (3, "resume-dcp")])
def test_torchrun_resumes_at_another_world_size(
    admin: Client,
    server: Server,
    checkpoint: tuple[str, Path],
    new_world: int,
    phase: str,
    tmp_path: Path,
) -> None:
    ds, first = checkpoint
    state = torch.load(first / "ckpt.pt", weights_only=True)
    assert state["ranks"] == [[0, K]] * 4  # rank 0's file has every rank's position
    before = [torch.load(first / f"first-rank{r}.pt") for r in range(4)]
    names = _loaders(admin, ds, new_world)
    (tmp_path / "ckpt.pt").write_bytes((first / "ckpt.pt").read_bytes())
    shutil.copytree(first / "dcp", tmp_path / "dcp")
    prefix = names[0].rsplit("-", 1)[0]
    torchrun(new_world, prefix, str(server.socket), str(tmp_path), phase, "0")
    rests = []
    for rank in range(new_world):
        rest, following = torch.load(tmp_path / f"resume-rank{rank}.pt")
        rests.append(rest)
        sampler = distributed(LENGTH, new_world, rank, SEED, False)
        workers = WORKERS[rank % 2]
        if rank < 2:  # augmentations and all
            want: list[Any] = reference_epoch(
                sampler, 1, batch_size=BATCH, num_workers=workers, seed=SEED, length=LENGTH
            )
            assert_same(following, want)
        else:
            sampler.set_epoch(1)
            assert indices(following) == list(sampler)
    check_resumed(before, rests, length=LENGTH, batch=BATCH)
    for name in names:
        admin.delete_loader(name)
