"""How a worker process reads units: from the node's cache directory when the file is
there, else by asking the server, which fetches it (once for every asker: single
flight) and answers with the path. All fetching, accounting and eviction happen in the
server; no worker holds a client or credentials of its own.

The server listens on a Unix socket (``multiprocessing.connection``, mode 0600, an
HMAC challenge with a key only its zygotes get) and answers each connection in a thread
of its own. A ``Remote`` pickled into a worker's zygote becomes a ``RemoteLink`` to it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing import connection
from pathlib import Path
from typing import Any

from pinfeed_server.remote import errors
from pinfeed_server.remote.errors import RemoteError
from pinfeed_server.remote.objects import Unit

log = logging.getLogger("pinfeed.remote")

Fetch = Callable[[Unit, str], Path]


class LinkServer:
    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self.authkey = os.urandom(32)
        self.address: str = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        self._listener = connection.Listener(self.address, "AF_UNIX", authkey=self.authkey)
        os.chmod(self.address, 0o600)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="pinfeed-remote-link", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError):
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: connection.Connection) -> None:
        with conn:
            while True:
                try:
                    unit, dataset = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply: tuple[str, ...] = ("ok", str(self._fetch(unit, dataset)))
                except RemoteError as exc:
                    reply = ("err", type(exc).__name__, str(exc))
                except Exception as exc:  # a bug must reach the batch, not hang it
                    log.exception("remote link: fetching %s", unit)
                    reply = ("err", "RemoteError", f"{unit}: {type(exc).__name__}")
                try:
                    conn.send(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()


class RemoteLink:
    """A worker's side: ``local(unit, dataset)`` as the server's ``Remote.local``."""

    def __init__(self, root: Path, address: str, authkey: bytes) -> None:
        self.root, self._address, self._authkey = root, address, authkey
        self._conn: connection.Connection | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteLink, (self.root, self._address, self._authkey))

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def local(self, unit: Unit, dataset: str) -> Path:
        path = self.path(unit.digest)
        if path.exists():
            return path
        with self._lock:
            if self._pid != os.getpid() or self._conn is None:
                self._conn = connection.Client(self._address, "AF_UNIX", authkey=self._authkey)
                self._pid = os.getpid()
            self._conn.send((unit, dataset))
            reply = self._conn.recv()
        if reply[0] == "ok":
            return Path(reply[1])
        cls = getattr(errors, reply[1], RemoteError)
        raise cls(reply[2])
