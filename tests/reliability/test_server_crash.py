"""``pinfeed serve`` killed with SIGKILL while trainers are attached, workers run and
the registry is being written, then restarted on the same state directory."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pinfeed import Client, Loader, ServerUnavailable
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.conftest import Server
from tests.helpers import assert_same
from tests.reliability.datasets import Slow
from tests.reliability.procs import (
    descendants,
    gone,
    reference,
    unix_socket_paths,
    wait_for,
)

LOADERS = {
    # seed None: the server draws one; it must survive the crash with the rest.
    "crash-a": {"batch_size": 4, "shuffle": True, "seed": None, "num_workers": 2},
    "crash-b": {"batch_size": 4, "shuffle": True, "seed": 3, "num_workers": 0},
}
KEYS = (
    "dataset",
    "batch_size",
    "shuffle",
    "seed",
    "drop_last",
    "num_workers",
    "pin_memory",
    "prefetch_factor",
)


@dataclass
class Crash:
    server: Server
    loaders: dict[str, dict[str, Any]]
    datasets: list[str]
    acked: list[str]
    old_pids: list[int]
    rings: set[int]  # inodes of crash-a's ring memfds, which its trainer had mapped
    temp_dirs: set[Path] = field(default_factory=set)
    plain_error: BaseException | None = None
    plain_delivered: int = 0  # batches the plain trainer got after the kill
    reconnecting: Loader | None = None
    reconnecting_epoch: Iterator[Any] | None = None  # its epoch, 3 batches in
    refs: dict[str, list[list[Any]]] = field(default_factory=dict)


def _writer(url: str, acked: list[str], stop: threading.Event) -> None:
    """Register datasets back to back until the server dies; remember the acknowledged."""
    with httpx.Client(base_url=url, timeout=5) as http:
        for i in range(10_000):
            if stop.is_set():
                return
            name = f"acked-{i}"
            try:
                r = http.post(
                    "/v1/datasets",
                    json={
                        "name": name,
                        "kind": "synthetic",
                        "params": {"length": 4, "fields": [{"shape": [2]}]},
                    },
                )
            except httpx.TransportError:
                return
            if r.status_code == 201:
                acked.append(name)


# The module's tests read one crash of a server with loaders and trainers: slow to set up.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def crash(make_server: Callable[..., Server]) -> Iterator[Crash]:
    srv = make_server()
    srv.start()
    admin = Client(srv.url)
    admin.create_dataset(
        "slow",
        "python",
        {"factory": "tests.reliability.datasets:Slow", "kwargs": {"length": 40, "delay_s": 0.001}},
    )
    for name, config in LOADERS.items():
        admin.create_loader(name, dataset="slow", **config)
    for name in LOADERS:
        wait_for(lambda n=name: admin.loader(n)["state"] == "ready", f"{name} ready", 30)
    c = Crash(
        server=srv,
        loaders={lo["name"]: {k: lo[k] for k in KEYS} for lo in admin.loaders()},
        datasets=[d["name"] for d in admin.datasets()],
        acked=[],
        old_pids=[srv.proc.pid, *(p.pid for p in descendants(srv.proc.pid))],  # type: ignore[union-attr]
        rings=set(),
    )
    for name, lo in c.loaders.items():
        c.refs[name] = reference(Slow(40, 0), 2, batch_size=4, shuffle=True, seed=lo["seed"])
    plain = Loader("crash-a", socket=srv.socket)
    c.reconnecting = Loader("crash-b", socket=srv.socket, reconnect=True, reconnect_timeout=30)
    plain_it, resumed_it = iter(plain), iter(c.reconnecting)
    c.reconnecting_epoch = resumed_it
    for index in range(3):
        assert_same(next(plain_it), c.refs["crash-a"][0][index])
        assert_same(next(resumed_it), c.refs["crash-b"][0][index])

    stop = threading.Event()
    writer = threading.Thread(target=_writer, args=(srv.url, c.acked, stop), daemon=True)
    writer.start()
    wait_for(lambda: len(c.acked) >= 3, "the registry writer to get going")
    c.temp_dirs = {Path(a).parent for a in unix_socket_paths(c.old_pids) if "/pymp-" in a}
    c.rings = _memfds(["self"], "pinfeed-crash-a")
    srv.proc.kill()  # type: ignore[union-attr]
    srv.proc.wait(10)  # type: ignore[union-attr]
    stop.set()
    writer.join(10)
    # The batches the server sent before it died are the trainer's (their slots are
    # mapped here); each is delivered, checked as it comes, then the loss is raised.
    for index in range(3, len(c.refs["crash-a"][0])):
        try:
            batch = next(plain_it)
        except BaseException as exc:
            c.plain_error = exc
            break
        assert_same(batch, c.refs["crash-a"][0][index], f"batch {index}, sent before the kill")
        del batch  # its views map the ring, which test_nothing_left_behind sees unmapped
        c.plain_delivered += 1
    plain.close()
    wait_for(lambda: gone(c.old_pids), "every process of the killed server to exit", 10)
    srv.start()
    yield c
    c.reconnecting.close()
    admin.close()


def test_registry_survives(crash: Crash) -> None:
    with crash.server.client() as admin:
        after = {lo["name"]: {k: lo[k] for k in KEYS} for lo in admin.loaders()}
        assert after == crash.loaders
        datasets = {d["name"] for d in admin.datasets()}
    assert set(crash.datasets) <= datasets
    missing = [n for n in crash.acked if n not in datasets]
    assert not missing, f"acknowledged before the kill, gone after it: {missing}"


def _memfds(pids: list[str], prefix: str) -> set[int]:
    """Inodes of the memfds named ``prefix``.. that these processes map or hold open."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(f"/memfd:{prefix}"):
                        found.add(int(parts[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith(f"/memfd:{prefix}"):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:  # gone, or not ours
            continue
    return found


def test_nothing_left_behind(crash: Crash) -> None:
    """The killed server's processes are gone, and its ring's memory with them: once
    the trainer that mapped it closed, no process maps or holds it (a memfd lives while
    anything does)."""
    assert gone(crash.old_pids)
    assert crash.rings, "the trainer had mapped no ring of crash-a before the kill"
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    held = _memfds(pids, "pinfeed-crash-a") & crash.rings
    assert not held, f"the killed server's ring is still held: inodes {held}"


def test_no_temp_dirs_left_behind(crash: Crash) -> None:
    assert crash.temp_dirs, "found no forkserver listener of the killed server"
    stale = [str(d) for d in crash.temp_dirs if d.exists()]
    assert not stale, f"left behind by the killed server: {stale}"


def test_loaders_serve_after_restart(crash: Crash) -> None:
    with crash.server.client() as admin:
        for name in LOADERS:
            wait_for(lambda n=name: admin.loader(n)["state"] == "ready", f"{name} ready", 30)
    with Loader("crash-a", socket=crash.server.socket) as loader:
        epoch, start = loader.meta.epoch, loader.meta.position
        want = crash.refs["crash-a"][epoch]
        seen = 0
        for index, batch in enumerate(loader, start=start):
            assert_same(batch, want[index], f"batch {index}")
            seen += 1
    # The rest of the epoch, every batch of it: a loader that yields nothing fails here.
    assert 0 < seen == len(want) - start, (seen, start, len(want))


def test_attached_trainer_is_told_the_server_went_away(crash: Crash) -> None:
    assert isinstance(crash.plain_error, ServerUnavailable), repr(crash.plain_error)
    # Told as soon as the batches already in its socket are read: no more of them than
    # NEXTs it had in flight, never the rest of the epoch.
    assert crash.plain_delivered <= NEXTS_IN_FLIGHT, crash.plain_delivered
    assert "restarted or stopped" in str(crash.plain_error)


def test_reconnecting_trainer_continues_where_it_was(crash: Crash) -> None:
    assert crash.reconnecting_epoch is not None
    ref = crash.refs["crash-b"][0]
    # The same epoch goes on (a new ``for`` loop would start a new epoch); views are
    # only valid until the next batch, so each is checked as it comes.
    index = 3
    while True:
        try:
            batch = next(crash.reconnecting_epoch)
        except StopIteration:
            break
        assert_same(batch, ref[index], f"batch {index} after the restart")
        index += 1
    assert index == len(ref)
