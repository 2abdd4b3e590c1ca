"""Mid-epoch resume with StatefulDataLoader's meaning: after k batches, a new trainer
that loads the state gets batch k onward; prefetched batches are neither lost nor
skipped. In-process, across a SIGKILLed trainer, across a server restart, and with
``reconnect=True`` across a server crash under a live trainer."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader, ServerUnavailable
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import REPO, Server
from tests.fixtures.trainer import command, digest, read_log
from tests.helpers import across_restart, unique

PARAMS: dict[str, Any] = {
    "length": 60,
    "seed": 8,
    "fields": [{"shape": [3, 4], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 9}],
}
BATCH = 4  # 15 batches per epoch


def _reference(root: Path, epochs: int, seed: int) -> list[str]:
    ds = build_dataset("synthetic", PARAMS, DatasetContext(root))
    dl = DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return [digest(b) for _ in range(epochs) for b in dl]


def _new_loader(admin: Client, **kw: Any) -> str:
    ds = unique("res")
    admin.create_dataset(ds, "synthetic", PARAMS)
    name = unique("res")
    admin.create_loader(name, dataset=ds, batch_size=BATCH, shuffle=True, seed=21, **kw)
    return name


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_process(admin: Client, server: Server, num_workers: int) -> None:
    want = _reference(server.data_root, 2, 21)
    name = _new_loader(admin, num_workers=num_workers, prefetch_factor=3)
    got: list[str] = []
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        for _ in range(20):  # epoch 0, then 5 batches into epoch 1
            try:
                got.append(digest(next(it)))
            except StopIteration:
                it = iter(loader)
                got.append(digest(next(it)))
        state = loader.state_dict()
        for _ in range(4):  # consumed but not checkpointed: must come again
            next(it)
    assert state["epoch"] == 1 and state["index"] == 5
    with Loader(name, socket=server.socket) as loader:
        loader.load_state_dict(state)
        got += [digest(b) for b in loader]  # the rest of epoch 1
    assert got == want


def _run_trainer(server: Server, name: str, out: Path, *extra: str) -> int:
    return subprocess.run(
        command(server.socket, name, out, *extra), cwd=REPO, timeout=60
    ).returncode


def _lines(path: Path) -> list[str]:
    return [r["digest"] for r in read_log(path)]


@pytest.mark.slow
def test_resume_after_trainer_sigkill(admin: Client, server: Server, tmp_path: Path) -> None:
    want = _reference(server.data_root, 2, 21)
    name = _new_loader(admin, num_workers=2)
    state, first, second = tmp_path / "state.json", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    code = _run_trainer(
        server,
        name,
        first,
        "--epochs",
        "2",
        "--state-at",
        "7",
        "--state-file",
        str(state),
        "--die-after",
        "5",
    )
    assert code == -signal.SIGKILL
    assert len(_lines(first)) == 12
    assert _run_trainer(server, name, second, "--resume", str(state), "--epochs", "2") == 0
    # Batches 7..11 were consumed by the dead trainer after its checkpoint: they come again.
    assert _lines(first)[:7] + _lines(second) == want


@pytest.mark.slow
def test_resume_across_server_restart(restartable: Server) -> None:
    srv = restartable
    epochs = across_restart(srv, lambda admin: _new_loader(admin, num_workers=1), digest, 9)
    assert epochs[0] + epochs[1] == _reference(srv.data_root, 2, 21)


@pytest.mark.slow
def test_reconnect_after_server_crash(restartable: Server) -> None:
    srv = restartable  # left SIGKILLed: the fixture starts it again
    with srv.client() as admin:
        name = _new_loader(admin, num_workers=2)
    got: list[str] = []
    with Loader(name, socket=srv.socket, reconnect=True, reconnect_timeout=60) as loader:
        for epoch in range(2):
            for i, batch in enumerate(loader):
                got.append(digest(batch))
                if epoch == 0 and i == 6:
                    assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
                    srv.start()
    with Loader(name, socket=srv.socket) as plain:
        next(iter(plain))
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
        with pytest.raises(ServerUnavailable, match="restarted or stopped"):
            next(iter(plain))
    assert got == _reference(srv.data_root, 2, 21)
