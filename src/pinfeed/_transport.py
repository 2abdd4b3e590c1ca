"""The socket under a ``Loader``'s ``Connection`` (``pinfeed._connection``): one Unix
socket to the server's data plane.

``Transport`` is the seam: ``Loader(name, transport=...)`` takes any object with these
methods, so the loader's connection and state machine run in tests against an
in-process fake (as httpx clients take a mock transport). Every reply lands in
``buf``; a method returns its length.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pinfeed import protocol as p
from pinfeed.errors import ServerUnavailable


class Transport(Protocol):
    buf: bytearray  # the last reply; p.MAX_MESSAGE bytes

    def attach(self, request: bytes, fds: Sequence[int] = ()) -> tuple[int, list[int]]:
        """Connect (again, after ``close``), send ``request`` (an ATTACH, or a CREATE and
        its payload's fd), and wait for the reply: (length, fds it carried)."""

    def send(self, message: bytes) -> None: ...

    def send_fds(self, message: bytes, fds: Sequence[int]) -> None:
        """Send ``message`` with ``fds`` (SCM_RIGHTS): a pinfeed.DataLoader's OBJECTS."""

    def recv(self) -> int:
        """Wait, up to the loader's timeout, for one reply."""

    def try_recv(self) -> int | None:
        """A reply if one is already here, else None (never waits)."""

    def take_fds(self) -> list[int]:
        """The fds the last reply carried (a SEGMENT's memfd); the caller owns them."""

    def close(self) -> None: ...


def lost(reason: str | None) -> ServerUnavailable:
    """The one error for a data-plane connection that broke, however it broke."""
    return ServerUnavailable(
        f"lost the pinfeed server ({reason or 'connection lost'}): it restarted or "
        "stopped; create a new Loader, or use Loader(reconnect=True)"
    )


_ANCILLARY = socket.CMSG_SPACE(4 * struct.calcsize("i"))


class SocketTransport:
    """A ``SOCK_SEQPACKET`` connection to the server's data-plane socket.

    The socket is blocking without a Python timeout (which would add a poll before
    every recv and send): a reply already here takes one non-blocking recv; else
    ``recv`` polls with the loader's timeout, then receives.
    """

    def __init__(
        self, path: Path, timeout: float | None, loader: str, *, attach_timeout: bool = True
    ) -> None:
        """``timeout``: the most a reply is waited for (None: no bound); with
        ``attach_timeout`` false, the first reply (ATTACHED) is waited for unbounded
        (a pinfeed.DataLoader: DataLoader's timeout is its batches')."""
        self.path = path
        self.buf = bytearray(p.MAX_MESSAGE)
        self._loader = loader
        self._timeout = timeout
        self._timeout_ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
        self._attach_ms = self._timeout_ms if attach_timeout else -1
        self._sock: socket.socket | None = None
        self._readable = select.poll()
        self._fds: list[int] = []

    def attach(self, request: bytes, fds: Sequence[int] = ()) -> tuple[int, list[int]]:
        self.close()
        sock = self._sock = p.new_socket()
        try:
            sock.connect(str(self.path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise ServerUnavailable(
                f"no pinfeed server at {self.path} ({exc.strerror}); start one with "
                "`pinfeed serve` or set PINFEED_SOCKET"
            ) from None
        sock.settimeout(None)
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        try:
            if fds:
                self.send_fds(request, fds)
            else:
                self.send(request)
            self._wait(self._attach_ms)
            n, fds = p.recv_message(sock, self.buf)
        except OSError as exc:
            sock.close()
            raise lost(exc.strerror) from None
        except BaseException:
            sock.close()
            raise
        return self._check_eof(n), fds

    def send(self, message: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(message)
        except OSError as exc:
            self._send_failed(exc)

    def send_fds(self, message: bytes, fds: Sequence[int]) -> None:
        assert self._sock is not None
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))
        try:
            self._sock.sendmsg([message], [rights])
        except OSError as exc:
            self._send_failed(exc)

    def _send_failed(self, exc: OSError) -> None:
        """A send the server's hang-up refused. Where it said something before it hung
        up (batches already made, then the ERROR that says why: a failed loader), that
        is not lost: the next receive reads it, and the EOF after it is the loss. Only a
        hang-up with nothing left to read is lost here."""
        assert self._sock is not None
        if exc.errno in (errno.EPIPE, errno.ECONNRESET):
            try:
                if self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return
            except OSError:
                pass
        raise lost(exc.strerror) from None

    def recv(self) -> int:
        self._wait()
        return self._recv(0)

    def try_recv(self) -> int | None:
        try:
            return self._recv(socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    def _recv(self, flags: int) -> int:
        # recvmsg, not recv: a SEGMENT brings a memfd (the ring grew), and the kernel
        # would drop it for a plain recv. No slower per batch (measured).
        assert self._sock is not None
        try:
            n, ancdata, _, _ = self._sock.recvmsg_into([self.buf], _ANCILLARY, flags)
        except BlockingIOError:
            raise
        except OSError as exc:
            raise lost(exc.strerror) from None
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % 4
                self._fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
        return self._check_eof(n)

    def take_fds(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    def close(self) -> None:
        close_fds(self.take_fds())
        if self._sock is not None:
            self._sock.close()

    def _wait(self, timeout_ms: int | None = None) -> None:
        try:
            ready = self._readable.poll(self._timeout_ms if timeout_ms is None else timeout_ms)
        except OSError as exc:
            raise lost(exc.strerror) from None
        if not ready:
            raise TimeoutError(
                f"no batch from loader {self._loader!r} within {self._timeout} s; check "
                "its stats (GET /v1/loaders/{name}/stats) or raise Loader(timeout=...)"
            )

    @staticmethod
    def _check_eof(n: int) -> int:
        if n == 0:
            raise lost("it closed the connection")
        return n


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
