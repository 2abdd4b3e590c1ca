"""The data-plane Unix socket: attach, NEXT/BATCH, RELEASE, SKIP.

One ``SOCK_SEQPACKET`` listener; one thread per consumer connection. The per-batch
path is one ``recv_into`` of a preallocated buffer and one scatter ``sendmsg`` of
prebuilt parts: no pickling, no JSON, no HTTP. A connection's leased slots are
returned when it closes, however it closes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from pinfeed import _protocol as p
from pinfeed_server.engine.collate import describe
from pinfeed_server.engine.consumers import BatchItem, EndItem, ErrorItem, Item
from pinfeed_server.engine.errors import (
    DataPlaneError,
    LoaderFailed,
    LoaderNotFound,
    ProtocolError,
)
from pinfeed_server.engine.iterable import dataset_length, sampler_length
from pinfeed_server.engine.loader import LoaderEngine
from pinfeed_server.engine.resize import announce_segments

log = logging.getLogger("pinfeed.dataplane")

Lookup = Callable[[str], LoaderEngine | None]


def _peer_ids(conn: socket.socket) -> tuple[int, int]:
    """(uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    return int(uid), int(gid)


class DataPlaneServer:
    def __init__(
        self, path: Path, lookup: Lookup, attach_timeout_s: float = 60.0, group: int | None = None
    ) -> None:
        self.path = path
        self.group = group  # besides our own uid (and root), peers in this gid may attach
        self._lookup = lookup
        self._attach_timeout = attach_timeout_s
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._secure_dir(self.path.parent, self.group)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from a previous run
        sock = p.new_socket()
        old = os.umask(0o177)  # the socket is never, even briefly, wider than 0600
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(self.path, -1, self.group)
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        t = threading.Thread(target=self._accept_loop, name="pinfeed-dataplane", daemon=True)
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

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
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
            uid, gid = _peer_ids(conn)
            if uid not in (0, os.getuid()) and (self.group is None or gid != self.group):
                log.warning("refusing data-plane peer with uid %d gid %d", uid, gid)
                conn.close()
                continue
            t = threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name="pinfeed-consumer"
            )
            with self._lock:
                self._threads.add(t)
                self._conns.add(conn)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        session: _Session | None = None
        try:
            attached = self._attach(conn)
            if attached is not None:
                session = _Session(conn, *attached, self._stop)
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
            _close_gently(conn)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _attach(self, conn: socket.socket) -> tuple[LoaderEngine, int] | None:
        """Serve the ATTACH; None (after an ERROR, if the peer said anything) if refused."""
        conn.settimeout(10)  # a peer that connects and says nothing is dropped
        buf = bytearray(p.MAX_MESSAGE)
        n, fds = p.recv_message(conn, buf)
        for fd in fds:
            os.close(fd)  # clients never send fds
        if n == 0:
            return None
        try:
            try:
                request = p.Attach.decode(memoryview(buf)[:n])
            except ValueError as exc:
                raise ProtocolError(f"the first message must be an ATTACH: {exc}") from None
            engine = self._attachable(request)
            member = engine.attach(request.member)
        except DataPlaneError as exc:
            conn.send(exc.info().encode())
            return None
        assert engine.ring is not None
        cfg = engine.config
        epoch, index = engine.position(member)
        attached = p.Attached(
            loader=request.loader,
            member=member,
            ring_bytes=engine.nslots * engine.ring.slot_bytes,  # segment 0; SEGMENT the rest
            nslots=engine.nslots,
            slot_bytes=engine.ring.slot_bytes,
            layout=engine.layout,
            batches_per_epoch=engine.batches_per_epoch,
            group_size=cfg.group_size,
            group_mode=cfg.group_mode,
            epoch=epoch,
            position=index,
            # What the trainer reports as DataLoader's attributes (pinfeed._info).
            config=cfg.model_dump(),
            dataset_length=dataset_length(engine.sampler),
            sampler_length=sampler_length(engine.sampler),
            sample=describe(engine.layout),
        )
        try:
            conn.sendmsg(
                [attached.encode()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", engine.ring.fd))],
            )
        except BaseException:
            engine.detach(member, set())
            raise
        return engine, member

    def _attachable(self, request: p.Attach) -> LoaderEngine:
        """The started loader ``request`` names; a DataPlaneError saying why not."""
        if request.version != p.PROTOCOL_VERSION:
            raise ProtocolError(
                f"the client speaks data-plane protocol {request.version}, this server "
                f"{p.PROTOCOL_VERSION}: install the same pinfeed version on both sides"
            )
        engine = self._lookup(request.loader)
        if engine is None:
            raise LoaderNotFound(request.loader)
        try:
            engine.wait_started(self._attach_timeout)
        except TimeoutError as exc:
            raise LoaderFailed(str(exc)) from None
        if engine.failure is not None:
            raise LoaderFailed(engine.failure.detail)
        if engine.state != "ready" or engine.ring is None:
            raise LoaderFailed(f"loader {request.loader!r} is {engine.state}")
        return engine


class _Session:
    """One attached consumer: its socket, its loader and member index, and the slots it
    holds. ``run`` serves its messages until it leaves; the leases are returned by the
    caller whatever ends the session."""

    def __init__(
        self, conn: socket.socket, engine: LoaderEngine, member: int, stop: threading.Event
    ) -> None:
        self.conn = conn
        self.engine = engine
        self.member = member
        self.stop = stop
        self.leased: set[int] = set()
        self.buf = bytearray(p.MAX_MESSAGE)
        self.view = memoryview(self.buf)
        self.dims: dict[int, bytes] = {}  # packed leaf dims by batch length
        self.segments = {0}  # ring segments the trainer has (ATTACHED carried 0)
        self.generation = -1  # the ring's generation they are of
        self.poller = select.poll()
        self.poller.register(conn, select.POLLIN | select.POLLRDHUP)

    def error(self, exc: DataPlaneError) -> None:
        self.conn.send(exc.info().encode())

    def run(self) -> None:
        self.conn.settimeout(None)
        while not self.stop.is_set():
            n = self.conn.recv_into(self.buf)
            if n == 0:
                return  # the trainer closed (or died)
            kind = self.buf[0]
            item: Item | None
            if kind in (p.NEXT, p.RELEASE, p.SKIP):
                slots, wait_us = p.decode_release(self.view[:n])
                if wait_us is not None and kind == p.NEXT:
                    self.engine.stats.consumer_wait(wait_us / 1e6)
                if not self.release_ok(slots):
                    return
                if kind == p.NEXT:
                    # A ready batch goes out before the releases are applied: handing
                    # slots back wakes the producer, which should not delay this send.
                    item = self.engine.next_item(self.member, self.stop, timeout=0)
                    self.release(slots)
                    if item is None:
                        item = self.wait()
                else:
                    self.release(slots)
                    if kind == p.RELEASE:
                        continue
                    item = self.skip_epoch()
                if item is None:
                    return  # hung up, or broke the protocol, while waiting
            elif kind == p.SEEK and n == p.POSITION_BODY.size:
                epoch, index = p.decode_position(self.view[:n])
                try:
                    self.engine.seek(self.member, epoch, index)
                except DataPlaneError as exc:  # InvalidPosition: the connection goes on
                    self.error(exc)
                    continue
                epoch, index = self.engine.position(self.member)
                self.conn.send(p.encode_position(p.POSITION, epoch, index))
                continue
            elif kind == p.CUDA and n == 1:
                self.engine.cuda_registered.add(self.member)
                continue
            else:
                name = p.KIND_NAMES.get(kind, "unknown")
                self.error(ProtocolError(f"unexpected message kind {kind} {name} ({n} bytes)"))
                return
            if not self.send(item):
                return

    def send(self, item: Item) -> bool:
        """Send one item; False once the loader itself failed or closed."""
        ring = self.engine.ring
        if ring is not None and self.generation != ring.generation:  # before a batch in them
            self.generation, self.segments = announce_segments(self.conn, ring, self.segments)
        if isinstance(item, BatchItem):
            self.leased.add(item.slot)
            body = item.strings
            kind, dims = p.BATCH | p.FLAG_LAYOUT << 8, b""
            if body[:1] != b"\0":  # else a layout of its own (BATCH_LAYOUT_HEAD's mark)
                kind = p.BATCH
                dims = self.dims.get(item.rows) or b""
                if not dims:
                    dims = self.dims[item.rows] = p.pack_dims(self.engine.layout, item.rows)
            # BATCH, as p.batch_parts builds it, without the call on the per-batch path.
            head = p.BATCH_HEAD.pack(kind, item.slot, item.seq, item.epoch, item.index, len(body))
            self.conn.sendmsg([head, dims, body])
        elif isinstance(item, EndItem):
            self.conn.send(p.encode_end(item.epoch, item.seq))
        else:
            info = item.info if item.epoch < 0 else item.info.at(item.epoch, item.index)
            self.conn.send(info.encode())
            if info.fatal:
                return False
        return True

    def release_ok(self, slots: list[int]) -> bool:
        bad = [s for s in slots if s not in self.leased]
        if bad:
            self.error(ProtocolError(f"release of slots {bad} not leased"))
        return not bad

    def release(self, slots: list[int]) -> None:
        self.leased.difference_update(slots)
        self.engine.release(self.member, slots)

    def wait(self) -> Item | None:
        """Wait for the member's next item while watching its socket: a trainer hands
        slots back (RELEASE) while its NEXT waits, and one that hangs up is let go at
        once instead of wedging the loader. None: the connection is over."""
        while True:
            item = self.engine.next_item(self.member, self.stop, timeout=0.02)
            if item is not None:
                return item
            if not self.poller.poll(0):
                continue
            n = self.conn.recv_into(self.buf)
            if n == 0:
                return None
            if self.buf[0] != p.RELEASE:
                self.error(ProtocolError("only RELEASE while a NEXT waits"))
                return None
            slots, _ = p.decode_release(self.view[:n])
            if not self.release_ok(slots):
                return None
            self.release(slots)

    def skip_epoch(self) -> Item | None:
        """Drop the rest of the member's current epoch (a trainer broke out of its loop)."""
        end = self.engine.skip_epoch(self.member)
        if end is not None:
            return end
        while True:
            item = self.wait()
            if isinstance(item, BatchItem):
                self.engine.release(self.member, [item.slot])
                continue
            if isinstance(item, ErrorItem) and item.epoch >= 0:
                continue  # a failed batch of the epoch being dropped
            return item


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
