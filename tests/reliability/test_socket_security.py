"""The data-plane socket: restrictive permissions, peer credentials checked, and an
accept loop that outlives a flood of connections."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from pinfeed import Client, Loader
from pinfeed import protocol as p
from tests.conftest import Server
from tests.helpers import unique
from tests.reliability.procs import wait_for

NOBODY = 65534


def test_socket_and_run_dir_permissions(rserver: Server) -> None:
    sock, run = os.stat(rserver.socket), os.stat(rserver.socket.parent)
    assert stat.S_ISSOCK(sock.st_mode)
    assert stat.S_IMODE(sock.st_mode) & ~0o660 == 0, oct(sock.st_mode)
    assert stat.S_IMODE(run.st_mode) & 0o077 == 0, oct(run.st_mode)
    assert sock.st_uid == run.st_uid == os.getuid()


def _attach_as(uid: int, path: str, loader: str, gid: int | None = None) -> int:
    """Fork; as ``uid``, try to attach to ``loader``. Exit code: 0 the server hung up
    without a word, 1 got a ring, 2 the filesystem said no (EACCES), 3 anything else,
    4 the server answered (so it served a peer it should have refused)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            s = p.new_socket()
            s.settimeout(5)
            try:
                s.connect(path)
            except PermissionError:
                os._exit(2)
            buf = bytearray(p.MAX_MESSAGE)
            try:  # the server may hang up before or after our ATTACH
                s.send(p.Attach(loader).encode())
                n, fds = p.recv_message(s, buf)
                code = 1 if fds or (n and buf[0] == p.ATTACHED) else 4 if n else 0
            except (BrokenPipeError, ConnectionResetError):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_peer_with_another_uid_is_refused(rserver: Server, admin_r: Client) -> None:
    ds, name = unique("rel-syn"), unique("peer")
    admin_r.create_dataset(ds, "synthetic", {"length": 8, "fields": [{"shape": [2]}]})
    admin_r.create_loader(name, dataset=ds, batch_size=4)
    assert _attach_as(os.getuid(), str(rserver.socket), name) == 1, "the probe itself works"
    # A hard link in a directory that uid 65534 can reach: the same socket, so the
    # only gates left are the socket's mode and the server's peer-credential check.
    reach = Path(tempfile.mkdtemp(prefix="pinfeed-peer-"))
    mode = stat.S_IMODE(os.stat(rserver.socket).st_mode)
    try:
        os.chmod(reach, 0o711)
        link = reach / "s.sock"
        os.link(rserver.socket, link)
        assert _attach_as(NOBODY, str(link), name) == 2, "mode 0660 must keep other users out"
        os.chmod(link, 0o666)
        assert _attach_as(NOBODY, str(link), name) == 0, "the server must refuse another uid"
    finally:
        os.chmod(rserver.socket, mode)
        shutil.rmtree(reach)
        admin_r.delete_loader(name)


@pytest.mark.slow
def test_existing_loose_run_dir_is_tightened_or_refused(
    make_server: Callable[..., Server],
) -> None:
    srv = make_server()
    run = srv.socket.parent
    run.mkdir(parents=True)
    os.chmod(run, 0o777)
    try:
        srv.start()
    except RuntimeError:
        return  # refused to start: as good as tightening
    assert stat.S_IMODE(os.stat(run).st_mode) & 0o077 == 0, oct(os.stat(run).st_mode)


@pytest.mark.serial  # counts the server's fds against a limit set from that count
def test_accept_loop_survives_running_out_of_fds(make_server: Callable[..., Server]) -> None:
    srv = make_server()
    srv.start()
    with Client(srv.url) as admin:
        ds, name = unique("rel-syn"), unique("flood")
        admin.create_dataset(ds, "synthetic", {"length": 8, "fields": [{"shape": [2]}]})
        admin.create_loader(name, dataset=ds, batch_size=4)
        wait_for(lambda: admin.loader(name)["state"] == "ready", "loader ready")
    server = psutil.Process(srv.proc.pid)  # type: ignore[union-attr]
    limit = server.num_fds() + 32
    server.rlimit(psutil.RLIMIT_NOFILE, (limit, limit))
    flood = []
    try:
        for _ in range(64):  # more connections than the server has fds left
            s = p.new_socket()
            s.connect(str(srv.socket))
            flood.append(s)
        wait_for(lambda: server.num_fds() >= limit - 2, "the server to run out of fds")
    finally:
        for s in flood:
            s.close()
    with Loader(name, socket=srv.socket, timeout=3) as loader:
        assert len(next(iter(loader))[0]) == 4


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_socket_group_lets_its_members_attach(make_server: Callable[..., Server]) -> None:
    """PINFEED_SOCKET_GROUP: a trainer running as another uid but in that group attaches;
    one outside it is still refused."""
    group = 4242
    srv = make_server(PINFEED_SOCKET_GROUP=str(group))
    srv.start()
    sock, run = os.stat(srv.socket), os.stat(srv.socket.parent)
    assert (sock.st_gid, run.st_gid) == (group, group)
    assert stat.S_IMODE(sock.st_mode) == 0o660 and stat.S_IMODE(run.st_mode) == 0o750
    with Client(srv.url) as admin:
        ds, name = unique("rel-syn"), unique("grp")
        admin.create_dataset(ds, "synthetic", {"length": 8, "fields": [{"shape": [2]}]})
        admin.create_loader(name, dataset=ds, batch_size=4)
    reach = Path(tempfile.mkdtemp(prefix="pinfeed-grp-"))
    try:
        os.chmod(reach, 0o711)
        link = reach / "s.sock"
        os.link(srv.socket, link)  # same socket, reachable past pytest's private tmp dirs
        assert _attach_as(NOBODY, str(link), name, gid=group) == 1, "a group member attaches"
        os.chmod(link, 0o666)
        assert _attach_as(NOBODY, str(link), name) == 0, "outside the group: refused"
    finally:
        shutil.rmtree(reach)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another uid's symlink")
def test_run_dir_symlinked_by_another_uid_is_refused(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    """Another user pre-creates the socket directory as a link to a directory of theirs:
    the server refuses to start rather than put its socket there. A link of our own (a
    volume layout, say) is fine, as the compose tests show."""
    srv = make_server()
    target = tmp_path / "theirs"
    target.mkdir()
    srv.socket.parent.parent.mkdir(parents=True, exist_ok=True)
    srv.socket.parent.symlink_to(target)
    os.lchown(srv.socket.parent, NOBODY, NOBODY)
    with pytest.raises(RuntimeError, match="symlink made by uid"):
        srv.start()  # it exits at start-up; a loaded machine imports slowly
