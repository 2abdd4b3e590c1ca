"""A ``pinfeed.DataLoader``'s loader belongs to its trainer: listed with its owner while
the trainer lives, gone with it however it ends (close, exit, SIGKILL mid-epoch) with
nothing left in the server (fds, memfds, processes, memory); create/close cycles leak
nothing; ``name=`` keeps it warm for the next trainer with an equal config, and refuses
another config with the reason."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import TensorDataset

import pinfeed
from pinfeed import Conflict
from tests.conftest import Server
from tests.dataloader.test_parity import Squares
from tests.helpers import smaps_rollup
from tests.reliability.procs import descendants, fd_targets, memfds, wait_for

SCRIPT = Path(__file__).with_name("script.py")

# A server's fds, memfds, processes and PSS counted: alone, after the parallel pass.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of this module's own: its fds, memfds and processes are counted."""
    srv = Server(tmp_path_factory.mktemp("owned"))
    srv.start()
    yield srv
    srv.stop()


def _state(srv: Server) -> tuple[list[str], list[str], int]:
    """The server's open fds (sockets and pipes by kind only: their inodes change),
    its memfds, and how many processes it has (workers, zygotes, forkserver)."""
    fds = sorted(
        t.split(":")[0] if t.startswith(("socket:", "pipe:")) else t for t in fd_targets(srv.pid)
    )
    return fds, memfds(srv.pid), len(descendants(srv.pid))


def _settle(srv: Server, before: tuple[list[str], list[str], int], timeout: float = 30) -> None:
    """Wait until the server holds nothing it did not hold before: no more fds of any
    kind (an HTTP keep-alive socket of before may have closed since), the same memfds,
    no more processes; on timeout, say what is left over."""
    left: dict[str, Any] = {}

    def settled() -> bool:
        fds, mems, procs = _state(srv)
        left.clear()
        grown = collections.Counter(fds) - collections.Counter(before[0])
        if grown:
            left["fds"] = dict(grown)
        if mems != before[1]:
            left["memfds"] = {"before": before[1], "now": mems}
        if procs > before[2]:
            left["processes"] = {"before": before[2], "now": procs}
        return not left

    try:
        wait_for(settled, "the server back to its state before", timeout)
    except AssertionError:
        raise AssertionError(f"the server still holds, after {timeout} s: {left}") from None


def _trainer(srv: Server, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PINFEED_AUTOSTART="0", PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(srv.socket), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _lines(proc: subprocess.Popen[str], until: str) -> list[str]:
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line.strip())
        if line.strip() == until:
            return out
    raise AssertionError(
        f"the trainer ended before {until!r}: {proc.stderr.read() if proc.stderr else ''}"
    )


def _warm(srv: Server) -> tuple[list[str], list[str], int]:
    """The server's state once a first owned loader came and went (the forkserver and
    the first imports are the server's, not a loader's), and its processes are gone."""
    processes = len(descendants(srv.pid))
    loader = pinfeed.DataLoader(Squares(), batch_size=4, num_workers=2, socket=srv.socket)
    list(loader)
    loader.close()
    for _ in range(2):  # a script's objects (pickled by value, a lambda): first imports
        proc = _trainer(srv, "--workers", "2", "--batches", "3")
        try:
            _lines(proc, "done")
        finally:
            _reap(proc)
    with srv.client() as c:
        wait_for(lambda: not c.loaders(), "no loader left")
    wait_for(lambda: len(descendants(srv.pid)) <= processes, "its processes gone")
    return _state(srv)


def test_a_trainer_killed_mid_epoch_leaves_nothing(own: Server) -> None:
    before = _warm(own)
    pss = smaps_rollup(own.pid)["Pss"]
    proc = _trainer(own, "--workers", "2", "--batches", "3", "--hang")
    try:
        head = _lines(proc, "holding")
        name = json.loads(head[0])["loader"]
        assert len(head) == 1 + 3 + 1  # the name, three batches, holding
        with own.client() as c:
            (row,) = [r for r in c.loaders() if r["name"] == name]
            assert row["owner"]["pid"] == proc.pid and row["owner"]["uid"] == os.getuid()
            assert row["num_workers"] == 2 and row["consumer_attached"]
        assert len(descendants(own.pid)) > before[2]  # its workers and its zygote
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with own.client() as c:
            wait_for(lambda: not c.loaders(), "the killed trainer's loader to go")
        _settle(own, before)
    finally:
        _reap(proc)
    assert smaps_rollup(own.pid)["Pss"] - pss < 16 * 2**20


@pytest.mark.heavy
def test_fifty_create_and_close_cycles_leak_nothing(own: Server) -> None:
    before = _warm(own)
    pss = smaps_rollup(own.pid)["Pss"]
    for i in range(50):
        loader = pinfeed.DataLoader(
            Squares(), batch_size=8, shuffle=True, num_workers=i % 3, socket=own.socket
        )
        assert sum(1 for _ in loader) == 6
        if i % 2:
            loader.close()
        del loader  # the other half: let go by garbage, as a script that just drops it
    with own.client() as c:
        wait_for(lambda: not c.loaders(), "every loader gone", 20)
    _settle(own, before)
    assert smaps_rollup(own.pid)["Pss"] - pss < 24 * 2**20


@pytest.mark.parametrize("workers", [0, 2])
def test_a_closed_loaders_objects_leave_the_server_at_once(own: Server, workers: int) -> None:
    # Its shipped dataset is gone when it closes, not when a later loader's collection
    # happens to find its reference cycles (64 MiB of tensors, mapped from its payload).
    before = _warm(own)
    pss = smaps_rollup(own.pid)["Pss"]
    big = TensorDataset(torch.ones(1 << 16, 1024, dtype=torch.uint8))
    loader = pinfeed.DataLoader(big, batch_size=1024, num_workers=workers, socket=own.socket)
    next(iter(loader))
    loader.close()
    with own.client() as c:
        wait_for(lambda: not c.loaders(), "the loader gone")
    _settle(own, before)

    # (an idle server collects its oldest generation rarely: a cycle left to it stays)
    def unmapped() -> bool:
        with open(f"/proc/{own.pid}/maps") as f:
            return "pinfeed-payload" not in f.read()

    wait_for(unmapped, "the closed loader's payload unmapped", 5)
    grown = smaps_rollup(own.pid)["Pss"] - pss
    assert grown < 16 * 2**20, f"the server kept {grown / 2**20:.0f} MiB of a closed loader"


@pytest.mark.heavy
def test_exits_of_trainer_processes_leave_nothing(own: Server) -> None:
    before = _warm(own)
    for _ in range(3):
        proc = _trainer(own, "--workers", "1", "--epochs", "1")
        try:
            out = _lines(proc, "done")
            assert len(out) == 1 + 16 + 1
            assert proc.wait(20) == 0
        finally:
            _reap(proc)
    with own.client() as c:
        wait_for(lambda: not c.loaders(), "every loader gone")
    _settle(own, before)


def _zygotes(pid: int) -> set[int]:
    """The processes two levels below ``pid`` (the server): its children's children."""
    try:
        direct = {p.pid for p in psutil.Process(pid).children()}
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for p in descendants(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.ppid() in direct:
                out.add(p.pid)
    return out


def test_a_named_loader_stays_warm_for_the_next_trainer(own: Server) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}

    def epoch(loader: torch.utils.data.DataLoader[Any]) -> list[Any]:
        return [b[0].clone() for b in loader]

    torch.manual_seed(3)
    want = epoch(torch.utils.data.DataLoader(Squares(), **kwargs))
    torch.manual_seed(3)
    first = pinfeed.DataLoader(Squares(), name="warm-squares", socket=own.socket, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(epoch(first), want, strict=True))
    first.close()
    with own.client() as c:
        (row,) = c.loaders()
        assert row["name"] == "warm-squares" and row["owner"]["keep"]
        assert not row["owner"]["attached"]
        # The loader's zygote: a child of the server's forkserver (the server's one
        # child that lives as long as it does); its workers, forked from the zygote
        # one level further down, go with the first trainer (perhaps not yet gone).
        zygotes_before = _zygotes(own.pid)
        assert zygotes_before, "the warm loader kept no zygote"
        torch.manual_seed(3)
        second = pinfeed.DataLoader(Squares(), name="warm-squares", socket=own.socket, **kwargs)
        got = epoch(second)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and got
        # Warm: its objects and their zygote stayed; only workers were forked anew.
        gone = zygotes_before - _zygotes(own.pid)
        assert not gone, f"the warm loader's zygote {sorted(gone)} was started again"
        with pytest.raises(Conflict, match="in use by the trainer pid"):
            pinfeed.DataLoader(Squares(), name="warm-squares", socket=own.socket, **kwargs)
        second.close()
        with pytest.raises(Conflict, match="runs another configuration"):
            pinfeed.DataLoader(
                Squares(), name="warm-squares", socket=own.socket, **(kwargs | {"batch_size": 5})
            )
        c.delete_loader("warm-squares")
        assert not c.loaders()


def test_several_loaders_in_one_script(own: Server) -> None:
    train = pinfeed.DataLoader(
        Squares(), batch_size=4, shuffle=True, num_workers=1, socket=own.socket
    )
    val = pinfeed.DataLoader(Squares(20), batch_size=5, num_workers=0, socket=own.socket)
    try:
        with own.client() as c:
            names = {r["name"] for r in c.loaders()}
        assert {train.pinfeed_name, val.pinfeed_name} <= names
        for _ in range(2):
            assert sum(len(b[0]) for b in train) == 45
            assert [b[1].tolist() for b in val] == [
                [i % 3 for i in range(j, j + 5)] for j in range(0, 20, 5)
            ]
    finally:
        train.close()
        val.close()
