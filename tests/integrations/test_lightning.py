"""PyTorch Lightning's ``Trainer.fit`` on pinfeed loaders, checked batch for batch
against DataLoader: Lightning's ``iter()`` probe and its ``sampler.set_epoch`` calls
shift no epoch; validation sees DataLoader's validation batches every time; DDP on two
CPU processes trains on DistributedSampler's shards; a mid-epoch checkpoint resumes
with the rest of that epoch; one of 4 DDP ranks resumes on 3 and on 6 with each
sample of the epoch once (the elastic guarantee through Lightning's own checkpoint,
which keeps rank 0's loader state only)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from pinfeed import Client, Loader
from tests.conftest import REPO, Server
from tests.fixtures.elastic import check_resumed, distributed, reference_epoch
from tests.helpers import assert_same, register_synthetic, unique
from tests.integrations.lightning_module import Recorder, Validating, trainer

PARAMS: dict[str, Any] = {
    "length": 24,
    "seed": 2,
    "fields": [{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 7}],
}
SEED = 4
BATCH = 4  # 6 batches per epoch

# Lightning 2.6 itself calls a torch pytree API that torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
)


@pytest.fixture(scope="module")
def dataset(server: Server) -> tuple[str, Any]:
    return register_synthetic(server, PARAMS, "pl")


def _epochs(ds: Any, n: int) -> list[list[list[torch.Tensor]]]:
    """DataLoader's epochs 0..n-1, shuffled with the loaders' seed."""
    dl = DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    return [[list(b) for b in dl] for _ in range(n)]


def _check(
    seen: list[tuple[int, list[torch.Tensor]]], want: list[list[list[torch.Tensor]]]
) -> None:
    """``seen``'s batches of epoch e are ``want[e]``, in order, every one of them."""
    by_epoch: dict[int, list[list[torch.Tensor]]] = {}
    for epoch, batch in seen:
        by_epoch.setdefault(epoch, []).append(batch)
    assert sorted(by_epoch) == list(range(len(want)))
    for epoch, batches in by_epoch.items():
        assert len(batches) == len(want[epoch]), f"epoch {epoch}"
        for i, (g, w) in enumerate(zip(batches, want[epoch], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), f"{epoch}/{i}"


def _loader(admin: Client, dataset: str, **kw: Any) -> str:
    name = unique("pl")
    admin.create_loader(name, dataset=dataset, batch_size=BATCH, seed=SEED, **kw)
    return name


class Hidden:
    """An iterable that shows Lightning only ``__iter__`` and ``__len__``: no sampler,
    so Lightning calls no ``set_epoch`` (as with a user's own wrapper)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_fit_two_epochs_with_validation_is_dataloaders(
    admin: Client, server: Server, dataset: tuple[str, Any], set_epoch: bool
) -> None:
    name, ds = dataset
    train = _loader(admin, name, shuffle=True)
    val = _loader(admin, name)
    model = Validating()
    with (
        Loader(train, socket=server.socket) as train_loader,
        Loader(val, socket=server.socket) as val_loader,
    ):
        loaders: tuple[Any, Any] = (train_loader, val_loader)
        if not set_epoch:
            loaders = (Hidden(train_loader), Hidden(val_loader))
        # Validation: a 2-batch sanity check first, then a full pass after each epoch.
        trainer(max_epochs=2, num_sanity_val_steps=2).fit(model, *loaders)
    _check(model.train_seen, _epochs(ds, 2))
    val_want = [list(b) for b in DataLoader(ds, batch_size=BATCH)]
    assert len(model.val_seen) == 2 + 2 * len(val_want)
    # An unshuffled loader: every validation epoch is the same. With set_epoch, the
    # first full run restarts epoch 0 after the sanity check broke it off; without, it
    # is the next epoch.
    _check(model.val_seen[:2], [val_want[:2]])
    _check(model.val_seen[2:], [val_want, val_want])
    admin.delete_loader(train)
    admin.delete_loader(val)


class _SaveAt(pl.Callback):
    """Save a checkpoint after training batch ``index`` of epoch 0."""

    def __init__(self, path: Path, index: int) -> None:
        self.path, self.index = path, index

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        if trainer.current_epoch == 0 and i == self.index:
            trainer.save_checkpoint(self.path)


def test_resume_from_a_mid_epoch_checkpoint(
    admin: Client, server: Server, dataset: tuple[str, Any], tmp_path: Path
) -> None:
    name, ds = dataset
    want = _epochs(ds, 2)
    train = _loader(admin, name, shuffle=True, num_workers=1)
    ckpt = tmp_path / "mid.ckpt"
    first = Recorder()
    with Loader(train, socket=server.socket) as loader:
        trainer(max_epochs=2, callbacks=[_SaveAt(ckpt, 2)]).fit(first, loader)
    _check(first.train_seen, want)  # the run goes on past its checkpoint
    [saved] = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"
    ]
    position = {k: saved[k] for k in ("version", "loader", "epoch", "index")}
    assert position == {"version": 2, "loader": train, "epoch": 0, "index": 3}
    assert saved["elastic"] == {"epoch": None, "start": 0, "stages": []}  # no resize yet
    resumed = Recorder()
    with Loader(train, socket=server.socket) as loader:  # a new trainer, a new Loader
        trainer(max_epochs=2).fit(resumed, loader, ckpt_path=ckpt)
    # Batches 0-2 were trained before the checkpoint: the resumed run has the rest.
    assert [e for e, _ in resumed.train_seen] == [0] * 3 + [1] * 6
    _check([(0, b) for _, b in first.train_seen[:3]] + resumed.train_seen, want)
    admin.delete_loader(train)


@pytest.mark.heavy  # Lightning DDP: 2 ranks
@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_on_distributed_shards(
    admin: Client, server: Server, dataset: tuple[str, Any], tmp_path: Path
) -> None:
    name, ds = dataset
    prefix = unique("pl-ddp")
    for rank in range(2):
        admin.create_loader(
            f"{prefix}-{rank}",
            dataset=name,
            batch_size=BATCH,
            shuffle=True,
            seed=SEED,
            rank=rank,
            world_size=2,
            num_workers=rank,
        )
    script = REPO / "tests" / "integrations" / "lightning_ddp.py"
    subprocess.run(
        [sys.executable, str(script), prefix, str(server.socket), str(tmp_path)],
        cwd=REPO,
        timeout=180,
        check=True,
    )
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
        ref = DataLoader(ds, batch_size=BATCH, sampler=sampler)
        want = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want.append([list(b) for b in ref])
        _check(torch.load(tmp_path / f"rank{rank}.pt"), want)
        admin.delete_loader(f"{prefix}-{rank}")


# -- pinfeed.DataLoader: the one-line switch under Lightning --------------------------------
class _Made(Recorder):
    """Trains on the DataLoader its ``make`` gives (Lightning asks for it itself)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def train_dataloader(self) -> Any:
        return self.make()


def test_fit_on_a_pinfeed_dataloader_is_fit_on_torchs(server: Server, dataset: Any) -> None:
    import pinfeed

    _, ds = dataset
    seen = []
    for cls, extra in ((DataLoader, {}), (pinfeed.DataLoader, {"socket": server.socket})):
        torch.manual_seed(0)
        model = _Made(lambda cls=cls, extra=extra: cls(ds, batch_size=BATCH, shuffle=True, **extra))
        trainer(max_epochs=2).fit(model)
        seen.append(model.train_seen)
    assert len(seen[1]) == len(seen[0]) == 12
    for (e0, b0), (e1, b1) in zip(seen[0], seen[1], strict=True):
        assert e0 == e1 and all(torch.equal(x, y) for x, y in zip(b0, b1, strict=True))


@pytest.mark.heavy  # Lightning DDP: 2 ranks, twice
def test_ddp_puts_a_distributed_sampler_into_a_pinfeed_dataloader(
    server: Server, tmp_path: Path
) -> None:
    script = REPO / "tests" / "integrations" / "lightning_dataloader.py"
    env = {**__import__("os").environ, "PINFEED_SOCKET": str(server.socket)}
    for kind in ("torch", "pinfeed"):
        subprocess.run(
            [sys.executable, str(script), kind, str(tmp_path)],
            cwd=REPO,
            timeout=240,
            check=True,
            env=env,
        )
    for rank in range(2):
        want = torch.load(tmp_path / f"torch-rank{rank}.pt")
        got = torch.load(tmp_path / f"pinfeed-rank{rank}.pt")
        assert len(got) == len(want) == 2 * 5  # 40 samples, 2 ranks, batches of 4
        for (e0, b0), (e1, b1) in zip(want, got, strict=True):
            assert e0 == e1 and all(torch.equal(x, y) for x, y in zip(b0, b1, strict=True))
    ranks = [
        {int(i) for _, b in torch.load(tmp_path / f"pinfeed-rank{r}.pt") for i in b[1]}
        for r in range(2)
    ]
    assert ranks  # both ranks trained


@pytest.fixture(scope="module")
def elastic_checkpoint(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    with server.client() as admin:
        ds = _elastic_dataset(admin)
        names = _elastic_loaders(admin, ds, 4)
        out = tmp_path_factory.mktemp("pl-elastic")
        _lightning(names, server, out, "first", 4)
        yield ds, out
        for name in names:
            admin.delete_loader(name)


def _lightning(names: list[str], server: Server, out: Path, phase: str, devices: int) -> None:
    script = REPO / "tests" / "integrations" / "lightning_elastic.py"
    prefix = names[0].rsplit("-", 1)[0]
    args = [prefix, str(server.socket), str(out), phase, str(devices), str(ELASTIC_K)]
    subprocess.run([sys.executable, str(script), *args], cwd=REPO, timeout=300, check=True)


ELASTIC_K = 4  # batches trained before the checkpoint, of 8 per rank at 4 ranks


@pytest.mark.heavy  # Lightning DDP: 4 ranks, then 3 or 6
@pytest.mark.parametrize("new_world", [3, 6])
def test_ddp_resumes_a_4_rank_checkpoint_on_another_world_size(
    admin: Client,
    server: Server,
    elastic_checkpoint: tuple[str, Path],
    new_world: int,
    tmp_path: Path,
) -> None:
    ds, first = elastic_checkpoint
    ckpt = torch.load(first / "mid.ckpt", weights_only=False)
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["ranks"] == [[0, ELASTIC_K]] * 4  # rank 0's file: every rank's position
    before = [torch.load(first / f"first-rank{r}.pt") for r in range(4)]
    names = _elastic_loaders(admin, ds, new_world)
    (tmp_path / "mid.ckpt").write_bytes((first / "mid.ckpt").read_bytes())
    _lightning(names, server, tmp_path, "resume", new_world)
    rests = []
    for rank in range(new_world):
        seen = torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=False)
        rest = [b for e, b in seen if e == 0]
        following = [b for e, b in seen if e == 1]
        rests.append(rest)
        sampler = distributed(ELASTIC_LENGTH, new_world, rank, SEED, False)
        want = reference_epoch(
            sampler, 1, batch_size=BATCH, num_workers=rank % 2, seed=SEED, length=ELASTIC_LENGTH
        )
        assert_same(following, want)  # epoch 1: DistributedSampler(new_world)'s
    check_resumed(before, rests, length=ELASTIC_LENGTH, batch=BATCH)
    for name in names:
        admin.delete_loader(name)


ELASTIC_LENGTH = 120  # 30 samples, 8 batches per rank at 4 ranks


def _elastic_dataset(admin: Client) -> str:
    name = unique("pl-el")
    params = {
        "factory": "tests.fixtures.datasets:Augmented",
        "kwargs": {"length": ELASTIC_LENGTH, "info": False},
    }
    admin.create_dataset(name, "python", params)
    return name


def _elastic_loaders(admin: Client, dataset: str, world: int) -> list[str]:
    from tests.features.test_elastic import _loaders

    return _loaders(admin, dataset, world, batch=BATCH, seed=SEED, workers=(0, 1), prefix="pl-el")
