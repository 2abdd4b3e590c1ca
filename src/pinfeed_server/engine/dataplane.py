"""The data-plane Unix socket: attach, NEXT/BATCH, RELEASE, SKIP.

One ``SOCK_SEQPACKET`` listener; one thread per consumer connection. The per-batch
path is one ``recv_into`` of a preallocated buffer and one scatter ``sendmsg`` of
prebuilt parts: no pickling, no JSON, no HTTP. A connection's leased slots are
returned when it closes, however it closes. One attached trainer's messages are
``session.py``. A connection that opens with a REPLAY is served one batch made again
(``replay.py``) in a ring of its own, and closed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pinfeed import protocol as p
from pinfeed._autostart import answers
from pinfeed.errors import (
    InvalidRequest,
    LoaderFailed,
    LoaderNotFound,
    PinfeedError,
    ProtocolError,
)
from pinfeed_server.engine.collate import describe
from pinfeed_server.engine.config import LoaderConfig
from pinfeed_server.engine.iterable import dataset_length, sampler_length
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.mixture import mixture_of
from pinfeed_server.engine.replay import replay
from pinfeed_server.engine.session import Session
from pinfeed_server.errors import DomainError

log = logging.getLogger("pinfeed.dataplane")

Lookup = Callable[[str], LoaderEngine | None]


def _attached_config(config: LoaderConfig) -> p.AttachedConfig:
    """What a trainer is told of its loader's config (a sampler or batch sampler by its
    factory): named field by field, so that mypy sees a field renamed on either side."""
    return p.AttachedConfig(
        dataset=config.dataset,
        batch_size=config.batch_size,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=config.drop_last,
        num_workers=config.num_workers,
        prefetch_factor=config.prefetch_factor,
        pin_memory=config.pin_memory,
        persistent_workers=config.persistent_workers,
        rank=config.rank,
        world_size=config.world_size,
        group_size=config.group_size,
        group_mode=config.group_mode,
        collate_fn=config.collate_fn,
        sampler=config.sampler.factory if config.sampler is not None else None,
        batch_sampler=config.batch_sampler.factory if config.batch_sampler is not None else None,
        shard_size=config.shard_size,
    )


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, from the kernel (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, conn: socket.socket) -> Peer:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        return cls(int(pid), int(uid), int(gid))


# A trainer's CREATE (its options, its payload's fd, who sent it): the service makes the
# loader of its own or raises the pinfeed error that says why not (``service.py``).
# a trainer's CREATE, its payload's fd, the shared memory fds its objects map, the peer
Create = Callable[[p.Create, int, list[int], Peer], LoaderEngine]
_First = TypeVar("_First", p.Replay, p.Describe)
# The connection that owned loader ``name`` ended (its trainer left, however it left).
OwnerGone = Callable[[str], None]
# A DESCRIBE (pinfeed.ServerDataset): what the kind builds from the params, or the
# pinfeed error (InvalidRequest) that says why it cannot
Describe = Callable[[str, dict[str, Any]], p.Described]


class DataPlaneServer:
    def __init__(
        self,
        path: Path,
        lookup: Lookup,
        attach_timeout_s: float = 60.0,
        group: int | None = None,
        create: Create | None = None,
        owner_gone: OwnerGone | None = None,
        describe: Describe | None = None,
    ) -> None:
        """``create``: how a trainer's CREATE becomes a loader; None: objects are not
        accepted (PINFEED_ACCEPT_OBJECTS=false): a CREATE gets an error saying so.
        ``describe``: how a DESCRIBE is answered (None: refused)."""
        self.path = path
        self.group = group  # besides our own uid (and root), peers in this gid may attach
        self._lookup = lookup
        self._create = create
        self._owner_gone = owner_gone
        self._describe = describe
        self._attach_timeout = attach_timeout_s
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._idle_since = time.monotonic()  # when the last connection closed
        self._bound: tuple[int, int] | None = None  # the socket file's (st_dev, st_ino)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._secure_dir(self.path.parent, self.group)
        if self.path.exists() or self.path.is_symlink():
            if answers(self.path):
                # Another server (a script's, started while none ran): new trainers
                # connect here; the other keeps its trainers, and its close leaves this
                # socket alone (``close``).
                log.warning("a server answers on %s: this one takes the path over", self.path)
            self.path.unlink()  # else a stale socket from a previous run
        sock = p.new_socket()
        old = os.umask(0o177)  # the socket is never, even briefly, wider than 0600
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        st = os.lstat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        if self.group is not None:
            os.chown(self.path, -1, self.group)
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        t = threading.Thread(target=self._accept_loop, name="pinfeed-dataplane", daemon=True)
        self._idle_since = time.monotonic()
        t.start()
        self._accept_thread = t

    @staticmethod
    def _secure_dir(run_dir: Path, group: int | None) -> None:
        """The socket's directory must be ours; a private one is made 0700 (0750 in the
        socket group). A shared sticky directory (like /tmp) is left alone: the socket's
        own mode guards it."""
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        link = os.lstat(run_dir)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.getuid()):
            raise RuntimeError(
                f"socket directory {run_dir} is a symlink made by uid {link.st_uid}; "
                "refusing to use it"
            )
        st = os.stat(run_dir)  # the directory itself, through our own (or root's) link
        if st.st_mode & stat.S_ISVTX:
            return
        if st.st_uid != os.getuid():
            raise RuntimeError(
                f"socket directory {run_dir} belongs to uid {st.st_uid}, not {os.getuid()}; "
                "give pinfeed a directory of its own (PINFEED_RUN_DIR or PINFEED_SOCKET)"
            )
        if group is not None:
            os.chown(run_dir, -1, group)
            if stat.S_IMODE(st.st_mode) != 0o750:
                os.chmod(run_dir, 0o750)
        elif stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(run_dir, 0o700)

    def idle_s(self) -> float | None:
        """Seconds since the last trainer's connection closed (or since the start, if
        none came); None while one is connected."""
        with self._lock:
            return None if self._conns else time.monotonic() - self._idle_since

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() at once
            self._accept_thread.join(5)
            self._sock.close()
            self._sock = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for t in list(self._threads):
            t.join(5)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:  # not another server's, made since
                self.path.unlink()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of fds or memory (a connection flood): back off, keep serving.
                    log.warning("data plane: accept failed (%s); retrying", exc.strerror)
                    self._stop.wait(0.1)
                    continue
                raise
            peer = Peer.of(conn)
            uid, gid = peer.uid, peer.gid
            if uid not in (0, os.getuid()) and (self.group is None or gid != self.group):
                log.warning("refusing data-plane peer with uid %d gid %d", uid, gid)
                conn.close()
                continue
            t = threading.Thread(
                target=self._serve, args=(conn, peer), daemon=True, name="pinfeed-consumer"
            )
            with self._lock:
                self._threads.add(t)
                self._conns.add(conn)
            t.start()

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        session: Session | None = None
        owned: str | None = None
        try:
            attached = self._attach(conn, peer)
            if attached is not None:
                owned = attached[2]
                session = Session(conn, attached[0], attached[1], self._stop, attached[3])
                session.run()
        except ValueError as exc:  # a malformed message: say so, then hang up
            log.debug("consumer broke the protocol: %s", exc)
            with contextlib.suppress(OSError):
                conn.send(ProtocolError(str(exc)).info().encode())
        except OSError as exc:
            log.debug("consumer connection ended: %s", exc)
        except Exception:
            log.exception("data-plane connection failed")
        finally:
            if session is not None:
                session.engine.detach(session.member, session.leased)
            # This frame lets go of the loader before its owner is gone: the collection
            # there frees the trainer's objects (reference cycles) only if nothing holds
            # them; else they stayed mapped in an idle server until some later collection.
            session = attached = None
            if owned is not None and self._owner_gone is not None:
                self._owner_gone(owned)
            _close_gently(conn)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
                if not self._conns:
                    self._idle_since = time.monotonic()

    def _attach(
        self, conn: socket.socket, peer: Peer
    ) -> tuple[LoaderEngine, int, str | None, bool] | None:
        """Serve the first message: an ATTACH of a loader, or a trainer's CREATE of one
        of its own (then its name, which goes when the connection does); None (after an
        ERROR, if the peer said anything) if refused. Last: whether ATTACHED carried
        the ring (a loader sized from its first batches may have none yet)."""
        conn.settimeout(10)  # a peer that connects and says nothing is dropped
        buf = bytearray(p.MAX_MESSAGE)
        n, fds = p.recv_message(conn, buf)
        if n == 0 or buf[0] != p.CREATE:
            for fd in fds:
                os.close(fd)  # only a CREATE brings one
        if n == 0:
            return None
        if buf[0] == p.REPLAY:
            self._replay(conn, memoryview(buf)[:n])
            return None
        if buf[0] == p.DESCRIBE:
            self._described(conn, memoryview(buf)[:n])
            return None
        owned: str | None = None
        engine: LoaderEngine | None = None
        try:
            if buf[0] == p.CREATE:
                engine = self._created(memoryview(buf)[:n], fds, peer)
                owned = engine.config.name
            else:
                try:
                    request = p.Attach.decode(memoryview(buf)[:n])
                except ValueError as exc:
                    raise ProtocolError(f"the first message must be an ATTACH: {exc}") from None
                self._check_version(request.version)
                engine = self._lookup(request.loader)
                if engine is None:
                    raise LoaderNotFound(
                        f"no loader named {request.loader!r}; create it with POST /v1/loaders"
                    )
            self._wait_ready(engine)
            member = engine.attach(None if owned else request.member, drives=True)
        except (PinfeedError, DomainError) as exc:  # a CREATE refused where it arose, too
            error = exc.as_problem() if isinstance(exc, DomainError) else exc
            conn.send(error.info().encode())
            engine = None  # as in _serve: nothing here holds the loader while it goes
            if owned is not None and self._owner_gone is not None:
                self._owner_gone(owned)
            return None
        # A loader sized from its first batches may have no ring yet: a RING brings it.
        ring, layout = engine.ring, engine.layout
        slot_bytes = 0 if ring is None else ring.slot_bytes
        epoch, index = engine.position(member)
        attached = p.Attached(
            loader=engine.config.name,
            member=member,
            ring_bytes=engine.nslots * slot_bytes,  # segment 0; SEGMENT the rest
            nslots=engine.nslots,
            slot_bytes=slot_bytes,
            layout=layout if ring is not None else None,
            batches_per_epoch=engine.batches_per_epoch,
            epoch=epoch,
            position=index,
            config=_attached_config(engine.config),
            dataset_length=dataset_length(engine.sampler),
            sampler_length=sampler_length(engine.sampler),
            sample=None if layout is None else describe(layout),
            elastic=engine.elastic_epoch(),
            mixture=mixture_of(engine.sampler),
        )
        try:
            rights = (
                []
                if ring is None
                else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", ring.fd))]
            )
            conn.sendmsg([attached.encode()], rights)
        except BaseException:
            engine.detach(member, set())
            del engine  # as in _serve: nothing here holds the loader while it goes
            if owned is not None and self._owner_gone is not None:
                self._owner_gone(owned)
            raise
        return engine, member, owned, ring is not None

    def _request(self, cls: type[_First], message: memoryview) -> _First:
        """A connection's first message of its own (REPLAY, DESCRIBE), decoded, of this
        protocol version (a ProtocolError if not)."""
        try:
            request = cls.decode(message)
        except ValueError as exc:
            raise ProtocolError(f"a malformed {cls.__name__.upper()}: {exc}") from None
        self._check_version(request.version)
        return request

    def _described(self, conn: socket.socket, message: memoryview) -> None:
        """A DESCRIBE: DESCRIBED, or the ERROR that says why the dataset cannot be built."""
        try:
            request = self._request(p.Describe, message)
            if self._describe is None:
                raise ProtocolError("this server does not describe datasets")
            conn.settimeout(None)  # a kind's build may list a store, read its headers
            reply = self._describe(request.kind, request.params)
        except (PinfeedError, DomainError) as exc:
            error = exc.as_problem() if isinstance(exc, DomainError) else exc
            conn.send(error.info().encode())
            return
        conn.send(reply.encode())

    def _replay(self, conn: socket.socket, message: memoryview) -> None:
        """A REPLAY: REPLAYED with the ring of one slot the batch was made into, then
        its BATCH (or its ERROR); an ERROR alone if there is no such batch."""
        try:
            request = self._request(p.Replay, message)
            engine = self._lookup(request.loader)
            if engine is None:
                raise LoaderNotFound(f"no loader named {request.loader!r}")
            self._wait_ready(engine)
            conn.settimeout(None)
            made = replay(engine, request.epoch, request.index)
        except PinfeedError as exc:
            conn.send(exc.info().encode())
            return
        ring, layout = made.ring, engine.layout
        assert layout is not None  # a batch was made: the loader has its ring
        try:
            reply = p.Replayed(
                engine.config.name,
                made.epoch,
                made.index,
                made.indices,
                made.worker,
                engine.config.rank,
                ring.size,
                layout,
            )
            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", ring.fd))
            conn.sendmsg([reply.encode()], [rights])
            result = made.result
            if result.error is not None:
                conn.send(result.error.at(made.epoch, made.index).encode())
                return
            body = result.strings
            rows = len(made.indices) if result.rows is None else result.rows
            if body[:1] == b"\0":  # a layout of its own (BATCH_LAYOUT_HEAD's mark)
                parts = p.batch_parts(0, 0, made.epoch, made.index, b"", body, p.FLAG_LAYOUT)
            else:
                dims = p.pack_dims(layout, rows)
                parts = p.batch_parts(0, 0, made.epoch, made.index, dims, body)
            conn.sendmsg(parts)
        finally:
            ring.close()  # the trainer's mapping keeps the memory while it needs it

    @staticmethod
    def _check_version(version: int) -> None:
        if version != p.PROTOCOL_VERSION:
            raise ProtocolError(
                f"the client speaks data-plane protocol {version}, this server "
                f"{p.PROTOCOL_VERSION}: install the same pinfeed version on both sides"
            )

    def _created(self, message: memoryview, fds: list[int], peer: Peer) -> LoaderEngine:
        """A trainer's CREATE: its options, and its objects' payload (the one fd). Only a
        peer of the server's own uid may send objects: loading them runs its code here."""
        try:
            request = p.Create.decode(message)
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"a malformed CREATE: {exc}") from None
        try:
            self._check_version(request.version)
            if not fds:
                raise ProtocolError("a CREATE brings its payload's fd")
            if self._create is None:
                raise InvalidRequest(
                    "this pinfeed server does not accept a trainer's objects "
                    "(PINFEED_ACCEPT_OBJECTS=false): register the dataset and loader over "
                    "HTTP and use pinfeed.Loader(name), or ask the operator to allow them"
                )
            if peer.uid != os.getuid():
                raise InvalidRequest(
                    f"only a trainer running as the server's own uid {os.getuid()} may send "
                    f"objects (pinfeed.DataLoader), not uid {peer.uid}: loading them runs "
                    "its code in the server. Run the trainer as that user, or start a "
                    "server of your own (pinfeed serve)"
                )
            return self._create(request, fds[0], fds[1:], peer)
        finally:
            for fd in fds:
                os.close(fd)  # the service dup()s what it keeps

    def _wait_ready(self, engine: LoaderEngine) -> None:
        """A started loader to attach to; a DataPlaneError saying why not."""
        try:
            engine.wait_started(self._attach_timeout)
        except TimeoutError as exc:
            raise LoaderFailed(str(exc)) from None
        if engine.failure is not None:
            raise LoaderFailed(engine.failure.detail)
        if engine.state != "ready" or (engine.ring is None and engine.sizing is None):
            raise LoaderFailed(f"loader {engine.config.name!r} is {engine.state}")


def _close_gently(conn: socket.socket) -> None:
    """Close without a reset: read what the peer already sent (its pipelined NEXT), so
    the kernel delivers our last message (an ERROR) instead of ECONNRESET."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        for _ in range(64):
            if not conn.recv(p.MAX_MESSAGE):
                break
    except OSError:
        pass
    conn.close()
