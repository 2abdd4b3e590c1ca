"""Data-plane errors as a trainer meets them: the typed ``pinfeed`` exception (the
server raises the same classes: tests/test_error_tree.py), ``except NotFound`` on
either plane, and ``ServerUnavailable`` for a failed HTTP connection too."""

from __future__ import annotations

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
