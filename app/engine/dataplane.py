"""The data-plane Unix socket: attach, NEXT/BATCH, RELEASE, SKIP.

One ``SOCK_SEQPACKET`` listener; one thread per consumer connection. The per-batch
path is one ``recv_into`` of a preallocated buffer and one scatter ``sendmsg`` of
prebuilt parts: no pickling, no JSON, no HTTP. A connection's leased slots are
returned when it closes, however it closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.engine.consumers import BatchItem, EndItem, ErrorItem, Item
from app.engine.loader import LoaderBusyError, LoaderEngine, dims_message
from client import _protocol as p

log = logging.getLogger("pinfeed.dataplane")

Lookup = Callable[[str], LoaderEngine | None]


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class DataPlaneServer:
    def __init__(self, path: Path, lookup: Lookup, attach_timeout_s: float = 60.0) -> None:
        self.path = path
        self._lookup = lookup
        self._attach_timeout = attach_timeout_s
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from a previous run
        sock = p.new_socket()
        sock.bind(str(self.path))
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        t = threading.Thread(target=self._accept_loop, name="pinfeed-dataplane", daemon=True)
        t.start()
        self._accept_thread = t

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
            except OSError:
                if self._stop.is_set():
                    return
                raise
            uid = _peer_uid(conn)
            if uid not in (0, os.getuid()):
                log.warning("refusing data-plane peer with uid %d", uid)
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
        attached: tuple[LoaderEngine, int] | None = None
        leased: set[int] = set()
        try:
            attached = self._attach(conn)
            if attached is not None:
                self._loop(conn, *attached, leased)
        except (OSError, ValueError) as exc:
            log.debug("consumer connection ended: %s", exc)
        except Exception:
            log.exception("data-plane connection failed")
        finally:
            if attached is not None:
                attached[0].detach(attached[1], leased)
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _send_error(self, conn: socket.socket, info: dict[str, Any]) -> None:
        conn.send(p.encode_json(p.ERROR, info))

    def _attach(self, conn: socket.socket) -> tuple[LoaderEngine, int] | None:
        conn.settimeout(10)  # a peer that connects and says nothing is dropped
        buf = bytearray(p.MAX_MESSAGE)
        n, fds = p.recv_message(conn, buf)
        for fd in fds:
            os.close(fd)  # clients never send fds
        if n == 0:
            return None
        if buf[0] != p.ATTACH:
            self._send_error(conn, {"type": "data-plane", "detail": "expected ATTACH first"})
            return None
        request = p.decode_json(memoryview(buf)[:n])
        name = str(request.get("loader", ""))
        member = request.get("member")
        if member is not None and not isinstance(member, int):
            self._send_error(conn, {"type": "data-plane", "detail": "member must be an int"})
            return None
        engine = self._lookup(name)
        if engine is None:
            self._send_error(
                conn,
                {
                    "type": "not-found",
                    "detail": f"no loader named {name!r}; create it with POST /v1/loaders",
                },
            )
            return None
        try:
            engine.wait_started(self._attach_timeout)
        except TimeoutError as exc:
            self._send_error(conn, {"type": "loader-failed", "detail": str(exc)})
            return None
        if engine.state != "ready" or engine.ring is None:
            self._send_error(
                conn,
                engine.failure
                or {"type": "loader-failed", "detail": f"loader {name!r} is {engine.state}"},
            )
            return None
        try:
            member = engine.attach(member)
        except (LoaderBusyError, ValueError) as exc:
            self._send_error(conn, {"type": "loader-busy", "detail": str(exc)})
            return None
        cfg = engine.config
        epoch, index = engine.position(member)
        meta = {
            "loader": name,
            "version": p.PROTOCOL_VERSION,
            "ring_bytes": engine.ring.size,
            "nslots": engine.nslots,
            "slot_bytes": engine.ring.slot_bytes,
            "layout": engine.layout.to_json(),
            "batches_per_epoch": engine.batches_per_epoch,
            "pin_memory": cfg.pin_memory,
            "batch_size": cfg.batch_size,
            "member": member,
            "group_size": cfg.group_size,
            "group_mode": cfg.group_mode,
            "epoch": epoch,
            "position": index,
        }
        try:
            conn.sendmsg(
                [p.encode_json(p.ATTACHED, meta)],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", engine.ring.fd))],
            )
        except BaseException:
            engine.detach(member, set())
            raise
        return engine, member

    def _loop(
        self, conn: socket.socket, engine: LoaderEngine, member: int, leased: set[int]
    ) -> None:
        conn.settimeout(None)
        buf = bytearray(p.MAX_MESSAGE)
        view = memoryview(buf)
        dims_cache: dict[int, bytes] = {}
        while not self._stop.is_set():
            n = conn.recv_into(buf)
            if n == 0:
                return  # the trainer closed (or died): leases are returned in _serve
            kind = buf[0]
            item: Item
            if kind in (p.NEXT, p.RELEASE, p.SKIP):
                slots, wait_us = p.decode_release(view[:n])
                if wait_us is not None and kind == p.NEXT:
                    engine.stats.consumer_wait(wait_us / 1e6)
                bad = [s for s in slots if s not in leased]
                if bad:
                    self._send_error(
                        conn, {"type": "data-plane", "detail": f"release of slots {bad} not leased"}
                    )
                    return
                leased.difference_update(slots)
                engine.release(member, slots)
                if kind == p.RELEASE:
                    continue
                if kind == p.SKIP:
                    item = self._skip_epoch(engine, member)
                else:
                    item = engine.next_item(member, self._stop)
            elif kind == p.SEEK and n == p.POSITION_BODY.size:
                _, epoch, index = p.POSITION_BODY.unpack_from(buf)
                try:
                    engine.seek(member, epoch, index)
                except ValueError as exc:
                    self._send_error(conn, {"type": "invalid-request", "detail": str(exc)})
                    continue
                epoch, index = engine.position(member)
                conn.send(p.POSITION_BODY.pack(p.POSITION, epoch, index))
                continue
            elif kind == p.CUDA and n == 1:
                engine.cuda_registered.add(member)
                continue
            else:
                self._send_error(
                    conn,
                    {"type": "data-plane", "detail": f"unexpected message kind {kind} ({n} bytes)"},
                )
                return
            if isinstance(item, BatchItem):
                leased.add(item.slot)
                dims = dims_cache.get(item.rows)
                if dims is None:
                    dims = dims_cache[item.rows] = dims_message(engine.layout, item.rows)
                head = p.BATCH_HEAD.pack(
                    p.BATCH, item.slot, item.seq, item.epoch, item.index, len(item.strings)
                )
                conn.sendmsg([head, dims, item.strings])
            elif isinstance(item, EndItem):
                conn.send(p.END_BODY.pack(p.END, item.epoch, item.seq))
            else:
                info = dict(item.info)
                if item.epoch >= 0:
                    info.update(epoch=item.epoch, batch_index=item.index)
                self._send_error(conn, info)
                if item.seq == -1:
                    return  # the loader itself failed or closed

    def _skip_epoch(self, engine: LoaderEngine, member: int) -> Item:
        """Drop the rest of the member's current epoch (a trainer broke out of its loop)."""
        while True:
            item = engine.next_item(member, self._stop)
            if isinstance(item, BatchItem):
                engine.release(member, [item.slot])
                continue
            if isinstance(item, ErrorItem) and item.seq >= 0:
                continue
            return item
