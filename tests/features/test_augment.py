"""Random augmentations equal DataLoader's: a dataset that draws from the global
``torch``, ``random`` and numpy RNGs inside ``__getitem__`` gives the same samples,
bit for bit, as ``DataLoader(num_workers=N, generator=Generator().manual_seed(seed),
persistent_workers=P, worker_init_fn=...)``, epoch after epoch; at ``num_workers=0``
as DataLoader's one non-persistent worker, undisturbed by other loaders; and across
what DataLoader cannot survive (a worker SIGKILLed, a resume in a new trainer process,
a server restart)."""

from __future__ import annotations

import functools
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, InvalidRequest, Loader
from tests.conftest import REPO, Server
from tests.fixtures.datasets import Augmented, set_offset
from tests.fixtures.trainer import command, digest, read_log
from tests.helpers import (
    across_restart,
    assert_epochs_same,
    epochs_with,
    sigkill_worker,
    unique,
)

FACTORY = "tests.fixtures.datasets:Augmented"
INIT = "tests.fixtures.datasets:set_offset"
BATCH = 3  # 22 samples: 8 batches per epoch, the last one short
SEED = 11


def _reference(
    epochs: int, num_workers: int, *, persistent: bool = False, init: bool = False, **kw: Any
) -> list[list[Any]]:
    with warnings.catch_warnings():
        # 3 workers on a 2-core machine: DataLoader's advice, not a problem here.
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        dl = DataLoader(
            Augmented(**kw),
            batch_size=BATCH,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(SEED),
            persistent_workers=persistent,
            worker_init_fn=set_offset if init else None,
        )
        return [list(dl) for _ in range(epochs)]


def _loader(admin: Client, num_workers: int, **kw: Any) -> str:
    ds = unique("aug")
    admin.create_dataset(ds, "python", {"factory": FACTORY, "kwargs": kw.pop("kwargs", {})})
    name = unique("aug")
    admin.create_loader(
        name, dataset=ds, batch_size=BATCH, shuffle=True, seed=SEED, num_workers=num_workers, **kw
    )
    return name


def _copy(batch: Any) -> Any:
    """A batch that outlives its ring slot (a Loader's views are valid until released)."""
    return [t.clone() for t in batch]


def _epoch(loader: Loader) -> list[Any]:
    return [_copy(b) for b in loader]


_check = assert_epochs_same


@pytest.mark.parametrize(
    ("num_workers", "persistent", "init"),
    [
        (1, False, False),
        (2, False, False),
        (3, False, True),
        (1, True, False),
        (2, True, True),
        (3, True, False),
    ],
)
def test_augmentations_equal_dataloader(
    admin: Client, server: Server, num_workers: int, persistent: bool, init: bool
) -> None:
    want = _reference(3, num_workers, persistent=persistent, init=init)
    extra: dict[str, Any] = {"persistent_workers": persistent}
    if init:
        extra["worker_init_fn"] = INIT
    name = _loader(admin, num_workers, **extra)
    with Loader(name, socket=server.socket) as loader:
        got = [_epoch(loader) for _ in range(3)]
    _check(got, want)
    admin.delete_loader(name)


def test_num_workers_0_is_one_dataloader_worker_and_undisturbed(
    admin: Client, server: Server
) -> None:
    """Two inline loaders with the same seed, iterated in lockstep in one server, each
    give DataLoader's batches at ``num_workers=1, persistent_workers=False``."""
    want = _reference(2, 1, info=False)
    names = [_loader(admin, 0, kwargs={"info": False}) for _ in range(2)]
    with Loader(names[0], socket=server.socket) as a, Loader(names[1], socket=server.socket) as b:
        got_a: list[list[Any]] = []
        got_b: list[list[Any]] = []
        for _ in range(2):
            got_a.append([])
            got_b.append([])
            for x, y in zip(a, b, strict=True):
                got_a[-1].append(_copy(x))
                got_b[-1].append(_copy(y))
    _check(got_a, want)
    _check(got_b, want)
    for name in names:
        admin.delete_loader(name)


def test_num_workers_0_keeps_its_stream_while_the_server_draws_between_batches(
    admin: Client, server: Server
) -> None:
    """An inline loader's RNG states stay in the process's globals between its batches
    (``global_rng.GlobalRngs``); the server's own code that draws there (registering a
    dataset reads its first sample, which draws) gets the server's states back first,
    so the loader's stream does not move: its batches stay DataLoader's."""
    want = _reference(2, 1, info=False)
    name = _loader(admin, 0, kwargs={"info": False})
    got: list[list[Any]] = []
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            got.append([])
            for batch in loader:
                got[-1].append(_copy(batch))
                noisy = unique("noisy")
                admin.create_dataset(noisy, "python", {"factory": "tests.fixtures.datasets:Noisy"})
                admin.delete_dataset(noisy)
    _check(got, want)
    admin.delete_loader(name)


@pytest.mark.parametrize("persistent", [False, True])
def test_sigkilled_worker_keeps_dataloaders_sequence(
    admin: Client, server: Server, persistent: bool
) -> None:
    want = _reference(2, 2, persistent=persistent)
    name = _loader(admin, 2, persistent_workers=persistent)
    # The second kill is late in an epoch of batches made in microseconds: the worker's
    # last RNG snapshot is batches back (seeding.SnapshotCadence), the replay re-makes them.
    kill = {
        (0, 2): lambda: sigkill_worker(admin, server, name, 2, 1),
        (1, 6): lambda: sigkill_worker(admin, server, name, 2, 0),
    }
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, 2, _copy, kill)
    _check(got, want)
    admin.delete_loader(name)


@pytest.mark.slow
def test_a_collate_fn_that_draws_is_replayed_too(restartable: Server) -> None:
    """A stream resumed on a new server (no RNG snapshot to restore) replays its earlier
    batches through the ``collate_fn`` as well (DataLoader's fetcher collates in the
    worker): a collate_fn drawing from the global RNG keeps DataLoader's sequence."""
    from tests.fixtures.collate import jitter_collate

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        dl = DataLoader(
            Augmented(info=False),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(SEED),
            collate_fn=jitter_collate,
        )
        want = [list(dl) for _ in range(2)]
    create = functools.partial(
        _loader, num_workers=2, collate_fn="tests.fixtures.collate:jitter_collate",
        kwargs={"info": False},
    )  # fmt: skip
    _check(across_restart(restartable, create, _dict_copy), want)


def _dict_copy(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in batch.items()}


def test_patch_num_workers_changes_no_batch(admin: Client, server: Server) -> None:
    """The RNG streams stay the 3 workers the loader was created with: fewer or more
    processes after a PATCH make the same batches as DataLoader(num_workers=3)."""
    want = _reference(2, 3, init=True)
    name = _loader(admin, 3, worker_init_fn=INIT)
    changes: dict[tuple[int, int], dict[str, int]] = {
        (0, 1): {"num_workers": 1},
        (0, 4): {"num_workers": 2},
        (1, 2): {"num_workers": 4, "prefetch_factor": 1},  # more processes than streams
    }
    at = {place: functools.partial(admin.patch_loader, name, **c) for place, c in changes.items()}
    with Loader(name, socket=server.socket) as loader:
        got = epochs_with(loader, 2, _copy, at)
    _check(got, want)
    admin.delete_loader(name)


def _run_trainer(server: Server, name: str, out: Path, *extra: str) -> int:
    return subprocess.run(
        command(server.socket, name, out, *extra), cwd=REPO, timeout=60
    ).returncode


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_resume_in_a_new_trainer_process(
    admin: Client, server: Server, tmp_path: Path, persistent: bool
) -> None:
    want = [digest(b) for epoch in _reference(2, 2, persistent=persistent) for b in epoch]
    name = _loader(admin, 2, persistent_workers=persistent)
    state, first, second = tmp_path / "state.json", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    code = _run_trainer(
        server, name, first, "--epochs", "2", "--state-at", "10", "--state-file", str(state),
        "--die-after", "3",
    )  # fmt: skip
    assert code == -signal.SIGKILL
    # The resumed trainer's one epoch is the rest of epoch 1.
    assert _run_trainer(server, name, second, "--resume", str(state), "--epochs", "1") == 0
    # Batches 10..12 were consumed after the checkpoint: the server seeks back to 10.
    got = [r["digest"] for r in read_log(first)][:10] + [r["digest"] for r in read_log(second)]
    assert got == want
    admin.delete_loader(name)


@pytest.mark.slow
def test_resume_across_server_restart(restartable: Server) -> None:
    want = _reference(2, 2, persistent=True, init=True)
    got = across_restart(
        restartable,
        lambda admin: _loader(admin, 2, persistent_workers=True, worker_init_fn=INIT),
        _copy,
    )
    _check(got, want)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"worker_init_fn": "tests.fixtures.nope:f"}, "worker_init_fn .* cannot be imported"),
        ({"worker_init_fn": "os:getcwd"}, "worker_init_fn .* not allowed"),
        ({"worker_init_fn": "tests.fixtures.datasets:NOT_CALLABLE"}, "not a callable"),
        ({"worker_init_fn": "no colon"}, "worker_init_fn"),
        ({"persistent_workers": True, "num_workers": 0}, "persistent_workers option needs"),
    ],
)
def test_bad_fields_are_422(admin: Client, fields: dict[str, Any], needle: str) -> None:
    ds = unique("aug")
    admin.create_dataset(ds, "python", {"factory": FACTORY})
    with pytest.raises(InvalidRequest, match=needle):
        admin.create_loader(
            unique("aug"), dataset=ds, batch_size=BATCH, **{"num_workers": 1, **fields}
        )
    admin.delete_dataset(ds)  # nothing was created that uses it
