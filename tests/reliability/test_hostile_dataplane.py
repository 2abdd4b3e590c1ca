"""A rogue data-plane client: garbage, truncated, oversize and out-of-order messages,
smuggled fds, SKIP storms, many stalled connections. The server stays up, a
well-behaved trainer on another loader keeps getting DataLoader's batches the whole
time, and the rogue never receives a ring it did not attach to."""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pinfeed import Client, Loader
from pinfeed import protocol as p
from tests.conftest import Server
from tests.helpers import unique
from tests.reliability.datasets import features
from tests.reliability.procs import fd_targets, reference_indices, wait_for

GOOD_LENGTH = 40
GOOD_SEED = 5


class Rogue:
    """A raw connection to the data plane that says whatever the test tells it to."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = p.new_socket()
        self.sock.connect(str(path))
        self.sock.settimeout(timeout)
        self.buf = bytearray(p.MAX_MESSAGE)
        self.fds: list[int] = []

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.sock.sendmsg([data], anc)

    def recv(self) -> bytes:
        """One message; b"" once the server has closed the connection."""
        try:
            n, fds = p.recv_message(self.sock, self.buf)
        except ConnectionResetError:
            return b""
        self.fds += fds
        return bytes(self.buf[:n])

    def attach(self, loader: str) -> bytes:
        self.send(p.Attach(loader).encode())
        return self.recv()

    def until_closed(self) -> list[bytes]:
        """Every message up to the server closing the connection (which it must)."""
        out = []
        while msg := self.recv():
            out.append(msg)
        return out

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.sock.close()


def _errors(messages: list[bytes]) -> list[dict[str, Any]]:
    """Every message must be a well-formed ERROR."""
    out = []
    for m in messages:
        assert m[:1] == bytes([p.ERROR]), f"unexpected reply {m[:80]!r}"
        info = json.loads(m[1:])
        assert isinstance(info.get("type"), str) and isinstance(info.get("detail"), str)
        out.append(info)
    return out


@dataclass
class Good:
    """A trainer thread on its own loader, checking every batch against DataLoader."""

    name: str
    count: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, path: Path) -> None:
        try:
            epochs = reference_indices(GOOD_LENGTH, 400, batch_size=4, shuffle=True, seed=GOOD_SEED)
            with Loader(self.name, socket=path, timeout=30) as loader:
                for e, want in enumerate(epochs):
                    n = 0
                    for k, (x, y) in enumerate(loader):
                        labels = y.tolist()
                        if labels != want[k] or not torch.equal(
                            x, torch.stack([features(i) for i in labels])
                        ):
                            self.errors.append(f"epoch {e} batch {k}: {labels} != {want[k]}")
                        n += 1
                        self.count += 1
                        if self.stop.wait(0.002):  # pacing, and the way out
                            return
                    if n != len(want):
                        self.errors.append(f"epoch {e}: {n} batches, want {len(want)}")
        except BaseException as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="module")
def synthetic(rserver: Server) -> str:
    name = unique("rel-syn")
    with rserver.client() as c:
        c.create_dataset(
            name, "synthetic", {"length": 64, "fields": [{"shape": [8], "dtype": "float32"}]}
        )
    return name


@pytest.fixture(scope="module")
def good(rserver: Server) -> Iterator[Good]:
    ds, name = unique("rel-good"), unique("good")
    with rserver.client() as c:
        c.create_dataset(
            ds,
            "python",
            {
                "factory": "tests.reliability.datasets:Slow",
                "kwargs": {"length": GOOD_LENGTH, "delay_s": 0},
            },
        )
        c.create_loader(name, dataset=ds, batch_size=4, shuffle=True, seed=GOOD_SEED, num_workers=1)
    g = Good(name)
    t = threading.Thread(target=g.run, args=(rserver.socket,), daemon=True)
    t.start()
    wait_for(lambda: g.count > 0 or g.errors, "the good trainer's first batch", 30)
    yield g
    g.stop.set()
    t.join(10)
    assert not g.errors


@pytest.fixture(autouse=True)
def keeps_serving(rserver: Server, good: Good) -> Iterator[None]:
    before = good.count
    yield
    wait_for(lambda: good.count >= before + 5 or good.errors, "the good trainer to go on", 10)
    assert not good.errors, good.errors
    assert rserver.proc is not None and rserver.proc.poll() is None, "the server died"
    assert httpx.get(rserver.url + "/healthz").status_code == 200


@pytest.fixture()
def rogue_loader(admin_r: Client, synthetic: str) -> Iterator[str]:
    name = unique("rogue")
    admin_r.create_loader(name, dataset=synthetic, batch_size=4)
    wait_for(lambda: admin_r.loader(name)["state"] == "ready", "rogue loader ready")
    yield name
    admin_r.delete_loader(name)


def _healthy(admin: Client, server: Server, name: str, within: float = 5.0) -> None:
    """No consumer left, every slot accounted for, and a real trainer gets a batch."""

    def detached() -> bool:
        d = admin.loader(name)
        s = d["slots"]
        return (
            not d["consumer_attached"]
            and s["leased"] == 0
            and s["free"] + s["filling"] + s["ready"] == s["total"]
        )

    wait_for(detached, f"loader {name} to have no consumer and no leased slot", within)
    with Loader(name, socket=server.socket, timeout=10) as loader:
        assert next(iter(loader))[0].shape == (4, 8)


NESTED = b"A" + b"[" * 100_000
BEFORE_ATTACH = {
    "garbage": b"\xff" * 64,
    "next": p.encode_release(p.NEXT, []),
    "release": p.encode_release(p.RELEASE, [0, 1]),
    "skip": p.encode_release(p.SKIP, []),
    "seek": p.POSITION_BODY.pack(p.SEEK, 0, 0),
    "attach-empty": b"A",
    "attach-truncated": b'A{"loader": "de',
    "attach-not-object": b"A[1, 2]",
    "attach-not-utf8": b"A\xff\xfe\xfd",
    "attach-nested": NESTED,
    "attach-number-name": b'A{"loader": 5}',
    "attach-bad-member": b'A{"loader": "demo", "member": "zero"}',
    "attach-long-name": p.Attach("x" * 100_000).encode(),
}


@pytest.mark.parametrize("message", list(BEFORE_ATTACH.values()), ids=list(BEFORE_ATTACH))
def test_bad_first_message(rserver: Server, message: bytes) -> None:
    rogue = Rogue(rserver.socket)
    try:
        rogue.send(message)
        _errors(rogue.until_closed())
        assert rogue.fds == [], "a ring fd went to a client that never attached"
    finally:
        rogue.close()


def test_oversize_messages(rserver: Server, rogue_loader: str, admin_r: Client) -> None:
    big = p.MAX_MESSAGE + 1024
    for attached in (False, True):
        rogue = Rogue(rserver.socket)
        try:
            rogue.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * big)
            if attached:
                assert rogue.attach(rogue_loader)[:1] == bytes([p.ATTACHED])
                payload = p.RELEASE_HEAD.pack(p.NEXT, 0) + b"\0" * big
            else:
                payload = b"A" + b" " * big
            try:
                rogue.send(payload)
            except OSError as exc:  # the kernel refused it: nothing reached the server
                assert exc.errno == 90  # EMSGSIZE
            _errors(rogue.until_closed())
        finally:
            rogue.close()
    _healthy(admin_r, rserver, rogue_loader)


def test_fds_smuggled_to_the_server_are_closed(
    rserver: Server, rogue_loader: str, admin_r: Client
) -> None:
    pid = rserver.proc.pid  # type: ignore[union-attr]
    before, devnulls = len(fd_targets(pid)), fd_targets(pid).count(os.devnull)
    mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]
    rogue = Rogue(rserver.socket)
    try:
        rogue.send(p.Attach(rogue_loader).encode(), fds=mine)
        assert rogue.recv()[:1] == bytes([p.ATTACHED])
        rogue.send(p.encode_release(p.NEXT, []), fds=mine)
        rogue.send(p.encode_release(p.RELEASE, []), fds=mine)
        assert rogue.recv()[:1] == bytes([p.BATCH])
    finally:
        rogue.close()
        for fd in mine:
            os.close(fd)
    _healthy(admin_r, rserver, rogue_loader)
    wait_for(lambda: len(fd_targets(pid)) <= before, "the server's fds to settle", 5)
    assert fd_targets(pid).count(os.devnull) == devnulls


def _next(rogue: Rogue, release: list[int]) -> int:
    rogue.send(p.encode_release(p.NEXT, release))
    msg = rogue.recv()
    assert msg[:1] == bytes([p.BATCH]), msg[:80]
    slot: int = p.BATCH_HEAD.unpack_from(msg)[1]
    return slot


def _release_twice(rogue: Rogue) -> None:
    slot = _next(rogue, [])
    rogue.send(p.encode_release(p.RELEASE, [slot]))
    rogue.send(p.encode_release(p.RELEASE, [slot]))


AFTER_ATTACH = {
    "release-never-leased": lambda r: r.send(p.encode_release(p.RELEASE, [0])),
    "next-release-out-of-range": lambda r: r.send(p.encode_release(p.NEXT, [999_999])),
    "next-huge-count": lambda r: r.send(p.RELEASE_HEAD.pack(p.NEXT, 65535)),
    "next-count-mismatch": lambda r: r.send(p.RELEASE_HEAD.pack(p.NEXT, 2) + p.SLOT.pack(0)),
    "next-truncated": lambda r: r.send(b"N"),
    "double-release": lambda r: _release_twice(r),
    "unknown-kind": lambda r: r.send(b"Z\0\0\0"),
    "seek-truncated": lambda r: r.send(bytes([p.SEEK, 0, 0])),
    "skip-count-mismatch": lambda r: r.send(p.RELEASE_HEAD.pack(p.SKIP, 3)),
    "second-attach": lambda r: r.send(p.Attach("demo").encode()),
    "server-message-kinds": lambda r: r.send(p.BATCH_HEAD.pack(p.BATCH, 0, 0, 0, 0, 0)),
}


@pytest.mark.parametrize("abuse", list(AFTER_ATTACH.values()), ids=list(AFTER_ATTACH))
def test_bad_messages_after_attach(
    rserver: Server, rogue_loader: str, admin_r: Client, abuse: Any
) -> None:
    rogue = Rogue(rserver.socket)
    try:
        assert rogue.attach(rogue_loader)[:1] == bytes([p.ATTACHED])
        assert len(rogue.fds) == 1
        assert os.readlink(f"/proc/self/fd/{rogue.fds[0]}").startswith(
            f"/memfd:pinfeed-{rogue_loader} "
        )
        abuse(rogue)
        _errors(rogue.until_closed())
        assert len(rogue.fds) == 1, "a second ring fd went out on one connection"
    finally:
        rogue.close()
    _healthy(admin_r, rserver, rogue_loader)


def test_seek_out_of_range_is_refused_and_the_connection_goes_on(
    rserver: Server, rogue_loader: str, admin_r: Client
) -> None:
    rogue = Rogue(rserver.socket)
    try:
        assert rogue.attach(rogue_loader)[:1] == bytes([p.ATTACHED])
        for epoch, index in ((0, 10**6), (2**32 - 1, 0)):
            rogue.send(p.POSITION_BODY.pack(p.SEEK, epoch, index))
            (info,) = _errors([rogue.recv()])
            assert info["type"] == "invalid-position"
        _next(rogue, [])
    finally:
        rogue.close()
    _healthy(admin_r, rserver, rogue_loader)


def test_skip_storm(rserver: Server, rogue_loader: str, admin_r: Client) -> None:
    rogue = Rogue(rserver.socket)
    try:
        assert rogue.attach(rogue_loader)[:1] == bytes([p.ATTACHED])
        for _ in range(100):
            rogue.send(p.encode_release(p.SKIP, []))
        epochs = []
        for _ in range(100):
            msg = rogue.recv()
            assert msg[:1] == bytes([p.END]), msg[:80]
            epochs.append(p.END_BODY.unpack_from(msg)[1])
        assert epochs == list(range(100))
        _next(rogue, [])
    finally:
        rogue.close()
    _healthy(admin_r, rserver, rogue_loader)


def test_rogue_cannot_take_a_loader_someone_is_using(rserver: Server, good: Good) -> None:
    rogue = Rogue(rserver.socket)
    try:
        (info,) = _errors([rogue.attach(good.name)])
        assert info["type"] == "loader-busy"
        assert rogue.until_closed() == []
        assert rogue.fds == [], "the rogue got the ring of a loader it could not attach to"
    finally:
        rogue.close()


def test_many_stalled_connections(rserver: Server, rogue_loader: str, admin_r: Client) -> None:
    pid = rserver.proc.pid  # type: ignore[union-attr]
    before = len(fd_targets(pid))
    stalled = [Rogue(rserver.socket) for _ in range(200)]
    try:
        # Connected, saying nothing: the server still accepts and serves others.
        with Loader(rogue_loader, socket=rserver.socket, timeout=10) as loader:
            assert next(iter(loader))[0].shape == (4, 8)
    finally:
        for r in stalled:
            r.close()
    wait_for(lambda: len(fd_targets(pid)) <= before, "the server's fds to settle", 10)
    _healthy(admin_r, rserver, rogue_loader)


def test_consumer_hanging_up_inside_next_is_detached(
    rserver: Server, rogue_loader: str, admin_r: Client
) -> None:
    rogue = Rogue(rserver.socket)
    try:
        assert rogue.attach(rogue_loader)[:1] == bytes([p.ATTACHED])
        total = admin_r.loader(rogue_loader)["slots"]["total"]
        for _ in range(total):  # take every slot, releasing none
            _next(rogue, [])
        rogue.send(p.encode_release(p.NEXT, []))  # cannot be served: it waits, then we hang up
        wait_for(
            lambda: admin_r.loader(rogue_loader)["slots"]["leased"] == total,
            "every slot leased to the rogue",
        )
    finally:
        rogue.close()
    _healthy(admin_r, rserver, rogue_loader, within=3)


def test_the_last_error_reaches_the_client(
    rserver: Server, admin_r: Client, synthetic: str
) -> None:
    name = unique("doomed")
    admin_r.create_loader(name, dataset=synthetic, batch_size=4)
    wait_for(lambda: admin_r.loader(name)["state"] == "ready", "loader ready")
    client = Rogue(rserver.socket)
    try:
        assert client.attach(name)[:1] == bytes([p.ATTACHED])
        total = admin_r.loader(name)["slots"]["total"]
        held = [_next(client, []) for _ in range(total)]
        client.send(p.encode_release(p.NEXT, []))  # waits: every slot is ours
        client.send(p.encode_release(p.RELEASE, held[:1]))  # unread while it waits
        admin_r.delete_loader(name)  # the wait ends with an ERROR, then the server hangs up
        errors = _errors(client.until_closed())
        assert errors, "the server hung up, and its ERROR was lost to a connection reset"
        assert errors[0]["type"] == "server-unavailable"
        info = errors[0]
        assert "deleted" in info["detail"]
    finally:
        client.close()
