"""How a worker process reads units: from the node's cache directory when the file is
there, else by asking the server, which fetches it (once for every asker: single
flight) and answers with the path. All fetching, accounting and eviction happen in the
server; no worker holds a client or credentials of its own.

The server listens on a Unix socket (``multiprocessing.connection``, mode 0600, an
HMAC challenge with a key only its zygotes get) and answers each connection in a thread
of its own. A ``Remote`` pickled into a worker's zygote becomes a ``RemoteLink`` to it.
A zygote that builds a dataset over a store (a trainer's ``pinfeed.ServerDataset``)
asks the server for its listing too: the server answers with the one it made for the
same request, where it made one, so both read the same objects and ETags.
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
from pinfeed_server.remote.objects import Manifest, Unit

log = logging.getLogger("pinfeed.remote")

Fetch = Callable[[Unit, str], Path]
# urls, blocks, single -> the listing (``Remote.lent``)
Listing = Callable[[str | list[str], bool, bool], Manifest]


class LinkServer:
    def __init__(self, fetch: Fetch, listing: Listing) -> None:
        self._fetch = fetch
        self._listing = listing
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
                    what, *args = conn.recv()
                except (EOFError, OSError):
                    return
                reply: tuple[Any, ...]
                try:
                    if what == "unit":
                        reply = ("ok", str(self._fetch(*args)))
                    else:
                        reply = ("ok", self._listing(*args))
                except (RemoteError, ValueError) as exc:
                    reply = ("err", type(exc).__name__, str(exc))
                except Exception as exc:  # a bug must reach the batch, not hang it
                    log.exception("remote link: %s %s", what, args[0])
                    reply = ("err", "RemoteError", f"{args[0]}: {type(exc).__name__}")
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
        return Path(self._ask("unit", unit, dataset))

    def manifest(self, urls: str | list[str], *, blocks: bool, single: bool = False) -> Manifest:
        """The server's listing of ``urls`` (``Remote.manifest``'s, as it lent it)."""
        found: Manifest = self._ask("listing", urls, blocks, single)
        return found

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            if self._pid != os.getpid() or self._conn is None:
                self._conn = connection.Client(self._address, "AF_UNIX", authkey=self._authkey)
                self._pid = os.getpid()
            self._conn.send(request)
            reply = self._conn.recv()
        if reply[0] == "ok":
            return reply[1]
        cls = ValueError if reply[1] == "ValueError" else getattr(errors, reply[1], RemoteError)
        raise cls(reply[2])
