"""Trainers killed with SIGKILL while holding slots or waiting inside NEXT: their slots
come back, the loader shows no consumer, a new trainer attaches and resumes from the
saved ``state_dict()``; cycles of this leak no fds, memfds or processes in the server."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import pytest

from pinfeed import Client, Loader
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.conftest import Server
from tests.helpers import assert_same, unique
from tests.reliability import trainers
from tests.reliability.datasets import Slow
from tests.reliability.procs import fd_targets, memfds, reference, wait_for

RAWCLIENT = Path(__file__).with_name("rawclient.py")
SEED = 11


def _loader(admin: Client, length: int, delay_s: float = 0.0, **config: Any) -> str:
    ds = unique("rel-ds")
    admin.create_dataset(
        ds,
        "python",
        {
            "factory": "tests.reliability.datasets:Slow",
            "kwargs": {"length": length, "delay_s": delay_s},
        },
    )
    name = unique("tkill")
    admin.create_loader(name, dataset=ds, batch_size=4, shuffle=True, seed=SEED, **config)
    wait_for(lambda: admin.loader(name)["state"] == "ready", f"loader {name} ready")
    return name


def _detached(admin: Client, name: str) -> dict[str, Any] | None:
    d = admin.loader(name)
    slots = d["slots"]
    free = slots["free"] + slots["filling"] + slots["ready"] == slots["total"]
    return d if not d["consumer_attached"] and slots["leased"] == 0 and free else None


def _labels(ref: list[list[Any]], epoch: int, index: int) -> list[int]:
    labels: list[int] = ref[epoch][index][1].tolist()
    return labels


def _take(conn: Any, ref: list[list[Any]], count: int, start: tuple[int, int]) -> dict[str, Any]:
    """Read ``count`` batch reports; check them against DataLoader from ``start``."""
    epoch, index = start
    state: dict[str, Any] = {}
    for _ in range(count):
        kind, labels, state = trainers.expect(conn)
        assert kind == "batch"
        assert labels == _labels(ref, epoch, index), f"epoch {epoch} batch {index}"
        epoch, index = (epoch, index + 1) if index + 1 < len(ref[epoch]) else (epoch + 1, 0)
        assert (state["epoch"], state["index"]) == (epoch, index)
    return state


def _resume(server: Server, name: str, state: dict[str, Any], ref: list[list[Any]]) -> None:
    """A new trainer loads ``state`` and gets the rest of that epoch and the next one."""
    with Loader(name, socket=server.socket) as loader:
        loader.load_state_dict(state)
        epoch, start = state["epoch"], state["index"]
        got = 0
        for index, batch in enumerate(loader, start=start):
            assert_same(batch, ref[epoch][index], f"resumed epoch {epoch} batch {index}")
            got += 1
        assert got == len(ref[epoch]) - start
        for index, batch in enumerate(loader):
            assert_same(batch, ref[epoch + 1][index], f"epoch {epoch + 1} batch {index}")


def test_trainer_killed_holding_a_batch(
    rserver: Server, admin_r: Client, trainer_ctx: ForkServerContext
) -> None:
    name = _loader(admin_r, 48)
    ref = reference(Slow(48, 0), 3, batch_size=4, shuffle=True, seed=SEED)
    proc, conn = trainers.start(trainer_ctx, str(rserver.socket), name, batches=5, then="hold")
    assert trainers.expect(conn) == ("attached", 0, 0)
    state = _take(conn, ref, 5, (0, 0))
    assert trainers.expect(conn) == ("hold",)
    live = admin_r.loader(name)
    # The held batch, and the next ones the client asked for ahead of time.
    assert live["consumer_attached"] and 1 <= live["slots"]["leased"] <= 1 + NEXTS_IN_FLIGHT

    proc.kill()
    proc.join(10)
    wait_for(lambda: _detached(admin_r, name), "the dead trainer's slots to come back", 5)
    # What was handed to the dead trainer counts as taken: a plain re-attach goes on
    # after it (at most once: nothing is handed out twice) ...
    after = admin_r.loader(name)
    assert after["epoch"] == 0 and 5 <= after["position"] <= 5 + NEXTS_IN_FLIGHT
    # ... and a trainer that saved its state resumes exactly there.
    _resume(rserver, name, state, ref)
    wait_for(lambda: _detached(admin_r, name), "the second trainer to detach", 5)
    admin_r.delete_loader(name)


def test_trainer_killed_inside_next_resumes_from_its_state(
    rserver: Server, admin_r: Client, trainer_ctx: ForkServerContext
) -> None:
    # 30 ms a sample: the server is still producing batch 3 when the trainer dies.
    name = _loader(admin_r, 24, delay_s=0.03, num_workers=1)
    ref = reference(Slow(24, 0), 3, batch_size=4, shuffle=True, seed=SEED)
    proc, conn = trainers.start(trainer_ctx, str(rserver.socket), name, batches=3, then="next")
    assert trainers.expect(conn) == ("attached", 0, 0)
    state = _take(conn, ref, 3, (0, 0))
    assert trainers.expect(conn) == ("next",)
    proc.kill()
    proc.join(10)
    wait_for(lambda: _detached(admin_r, name), "the dead trainer to be detached", 5)
    # The batch in flight when it died is not lost to a trainer that resumes its state.
    position = {k: state[k] for k in ("version", "loader", "epoch", "index")}
    assert position == {"version": 2, "loader": name, "epoch": 0, "index": 3}
    _resume(rserver, name, state, ref)
    admin_r.delete_loader(name)


def test_trainer_killed_at_an_epoch_boundary(
    rserver: Server, admin_r: Client, trainer_ctx: ForkServerContext
) -> None:
    name = _loader(admin_r, 16)
    ref = reference(Slow(16, 0), 2, batch_size=4, shuffle=True, seed=SEED)
    proc, conn = trainers.start(trainer_ctx, str(rserver.socket), name, batches=4, then="hold")
    trainers.expect(conn)
    _take(conn, ref, 4, (0, 0))  # all of epoch 0; its END not yet asked for
    assert trainers.expect(conn) == ("hold",)
    proc.kill()
    proc.join(10)
    wait_for(lambda: _detached(admin_r, name), "the dead trainer to be detached", 5)
    with Loader(name, socket=rserver.socket) as loader:
        got = [batch[1].tolist() for batch in loader]
    assert got == [b[1].tolist() for b in ref[1]], "the first loop after the restart"
    admin_r.delete_loader(name)


@pytest.mark.serial  # the server's fd and memfd counts, settled within a bound
def test_attach_kill_cycles_leak_nothing(rserver: Server, admin_r: Client) -> None:
    pid = rserver.proc.pid  # type: ignore[union-attr]
    fast = _loader(admin_r, 64)
    slow = _loader(admin_r, 64, delay_s=0.02)
    before_fds, before_memfds = len(fd_targets(pid)), memfds(pid)
    modes = [("attach", fast), ("hold", fast), ("wait", slow)] * 3
    for mode, name in modes:
        proc = subprocess.Popen(
            [sys.executable, str(RAWCLIENT), str(rserver.socket), name, mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline() == "ready\n", f"{mode}: rawclient failed"
            assert admin_r.loader(name)["consumer_attached"]
        finally:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
        wait_for(lambda n=name: _detached(admin_r, n), f"{mode}: the killed trainer detached", 5)
    wait_for(lambda: len(fd_targets(pid)) <= before_fds, "the server's fd count to settle", 5)
    assert memfds(pid) == before_memfds
    # Both loaders still serve, from where the killed trainers left them.
    for name in (fast, slow):
        with Loader(name, socket=rserver.socket) as loader:
            next(iter(loader))
        admin_r.delete_loader(name)
    assert memfds(pid) == [m for m in before_memfds if fast not in m and slow not in m]
