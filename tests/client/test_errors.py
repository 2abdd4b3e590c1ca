"""Data-plane errors as a trainer meets them: the typed ``pinfeed`` exception (the
server raises the same classes: tests/test_error_tree.py), ``except NotFound`` on
either plane, and ``ServerUnavailable`` for a failed HTTP connection too."""

from __future__ import annotations

import select
import time

import pytest

import pinfeed
from pinfeed import protocol as p
from pinfeed.errors import InvalidPosition, LoaderNotFound, error_from_info
from tests.helpers import unique
from tests.launcher import Server, free_port


def test_data_plane_not_found_and_invalid_request_are_data_plane_errors() -> None:
    for cls, http in (
        (LoaderNotFound, pinfeed.NotFound),
        (InvalidPosition, pinfeed.InvalidRequest),
    ):
        error = error_from_info(p.ErrorInfo.decode(cls("d").info().encode()))
        assert isinstance(error, pinfeed.DataPlaneError), cls
        assert isinstance(error, http), f"except {http.__name__} catches it on either plane"


def test_an_unknown_slug_is_a_data_plane_error() -> None:
    error = error_from_info(p.ErrorInfo("from-the-future", "d", fatal=True))
    assert type(error) is pinfeed.DataPlaneError


def test_client_against_a_closed_port_is_server_unavailable_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pinfeed.Client(url, timeout=5) as c, pytest.raises(pinfeed.ServerUnavailable) as info:
        c.health()
    assert url in str(info.value)
    assert "cannot reach the pinfeed server" in str(info.value)


def test_attaching_to_no_such_loader_is_a_data_plane_not_found(server: Server) -> None:
    with pytest.raises(pinfeed.LoaderNotFound, match="no loader named") as info:
        pinfeed.Loader(unique("absent"), socket=server.socket)
    assert isinstance(info.value, pinfeed.DataPlaneError)
    assert isinstance(info.value, pinfeed.NotFound)


def test_another_protocol_version_is_refused_by_name(server: Server) -> None:
    sock = p.new_socket()
    try:
        sock.connect(str(server.socket))
        sock.send(p.Attach("demo", version=p.PROTOCOL_VERSION + 1).encode())
        buf = bytearray(p.MAX_MESSAGE)
        n, fds = p.recv_message(sock, buf)
        assert fds == []
        info = p.ErrorInfo.decode(memoryview(buf)[:n])
        assert (info.slug, info.fatal) == ("protocol-error", True)
        assert f"protocol {p.PROTOCOL_VERSION + 1}" in info.detail
        assert sock.recv(16) == b"", "the server hangs up after a fatal error"
    finally:
        sock.close()


def test_a_loader_ended_with_nexts_in_flight_delivers_what_came_then_says_why(
    server: Server,
) -> None:
    """The server sends batch 1, then (the loader deleted while batch 2 is being made)
    the ERROR that answers the other NEXT, and hangs up. The trainer takes batch 1 and
    asks for more on a socket the server closed (EPIPE): batch 1 is still delivered,
    and the next batch raises what the server said, not 'lost the server (Broken
    pipe)' (which a Ray loader's trainer met when its cluster went)."""
    with server.client() as admin:
        ds = unique("slow")
        admin.create_dataset(
            ds, "python", {"factory": "tests.fixtures.datasets:Slow", "kwargs": {"seconds": 0.3}}
        )
        name = unique("ended")
        admin.create_loader(name, dataset=ds, batch_size=2, num_workers=1)
        with pinfeed.Loader(name, socket=server.socket, copy=True) as loader:
            it = iter(loader)
            assert next(it).tolist() == [0, 1]  # NEXTs for batches 1 and 2 are in flight
            deadline = time.monotonic() + 30
            while admin.loader(name)["slots"]["leased"] < 2:  # batch 1 sent, 2 being made
                assert time.monotonic() < deadline, "batch 1 never sent"
                time.sleep(0.01)
            admin.delete_loader(name)
            hangup = select.poll()
            hangup.register(loader._conn._t._sock, select.POLLHUP)  # type: ignore[attr-defined]
            assert hangup.poll(30_000), "the server did not hang up"
            assert next(it).tolist() == [2, 3]
            with pytest.raises(pinfeed.ServerUnavailable, match="was deleted or is stopping"):
                next(it)
        admin.delete_dataset(ds)
