"""Data-plane errors: every slug the server can send is one server class and one
``pinfeed`` exception; a failed HTTP connection is ``ServerUnavailable`` too."""

from __future__ import annotations

import pytest

import pinfeed
from pinfeed import protocol as p
from pinfeed.errors import DATA_PLANE_ERRORS, error_from_info
from pinfeed_server.engine import errors as server
from tests.helpers import unique
from tests.launcher import Server, free_port


def test_every_server_slug_maps_to_one_client_exception() -> None:
    server_slugs = {cls.slug for cls in server.DATA_PLANE_ERRORS}
    assert server_slugs == set(p.ERROR_KINDS) == set(DATA_PLANE_ERRORS)
    assert len(server_slugs) == len(server.DATA_PLANE_ERRORS), "two server classes, one slug"
    for cls in DATA_PLANE_ERRORS.values():
        assert getattr(pinfeed, cls.__name__) is cls, f"{cls.__name__} is not exported"


@pytest.mark.parametrize("cls", server.DATA_PLANE_ERRORS, ids=lambda c: c.__name__)
def test_a_server_error_arrives_as_its_client_exception(cls: type[server.DataPlaneError]) -> None:
    if cls is server.LoaderNotFound:
        exc: server.DataPlaneError = cls("nope")
    elif issubclass(cls, server.SampleError):
        exc = cls("sample 3 raised", index=3, error_type="KeyError")
    else:
        exc = cls("detail")
    info = p.ErrorInfo.decode(exc.info().at(1, 2).encode())
    assert info.fatal is p.ERROR_KINDS[cls.slug]
    error = error_from_info(info)
    assert type(error) is DATA_PLANE_ERRORS[cls.slug]
    assert error.detail == exc.detail
    assert error.extra["epoch"] == 1 and error.extra["batch_index"] == 2
    if isinstance(error, pinfeed.SampleError):
        assert (error.index, error.error_type) == (3, "KeyError")


def test_data_plane_not_found_and_invalid_request_are_data_plane_errors() -> None:
    for slug, http in (
        ("loader-not-found", pinfeed.NotFound),
        ("invalid-position", pinfeed.InvalidRequest),
    ):
        error = error_from_info(p.ErrorInfo.of(slug, "d"))
        assert isinstance(error, pinfeed.DataPlaneError), slug
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
