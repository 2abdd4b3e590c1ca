"""The control plane's pace: each client at most ``PINFEED_HTTP_MAX_RPS`` requests a
second, apart from the others.

HTTP handling and the data plane share the server's cores and its interpreter. A
client that polls as fast as it can (16 connections on ``/healthz`` serve ~400 a
second here) would otherwise take a whole core from the trainers, and refusing fast
does not help: a refused client asks again at once. So every request waits its turn,
without spinning, until its client's pace allows it (a generic cell rate algorithm:
one timestamp per client, O(1) per request, a burst of ``rps / 4`` passes unpaced). A
flooding client is slowed to the pace and every request of it is still answered;
another client's requests never queue behind it (each has its own timestamp).

A client is the peer's address and the ``x-pinfeed-client`` header (``pinfeed.Client``
sends its process id), in two lanes: probes (``/healthz``, ``/readyz``) and the rest,
so a client flooding the API does not delay its own probes, nor a prober's. At most
``MAX_CLIENTS`` are remembered: clients whose timestamp has passed are forgotten first
(they would start with a full burst anyway); past that, unknown clients share one.
Only a request that would wait longer than ``MAX_WAIT_S`` (hundreds of concurrent
requests from one client) is refused at once: 503 ``overloaded`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from starlette.types import ASGIApp, Receive, Scope, Send

from pinfeed.errors import Overloaded
from pinfeed.protocol import HTTP_CLIENT_HEADER
from pinfeed_server.api.problems import error_response

MAX_WAIT_S = 5.0
MAX_CLIENTS = 1024
PROBES = frozenset({"/healthz", "/readyz"})
_HEADER = HTTP_CLIENT_HEADER.encode()
_SHARED = ("*", "", "")  # the key of clients past MAX_CLIENTS


def client_key(scope: Scope) -> tuple[str, str, str]:
    """(address, x-pinfeed-client, lane) of a request."""
    peer = scope.get("client")
    host = str(peer[0]) if peer else "?"
    name = ""
    for key, value in scope.get("headers", ()):
        if key == _HEADER:
            name = value[:64].decode("latin-1")
            break
    return host, name, "probe" if scope.get("path") in PROBES else "api"


class Throttle:
    def __init__(self, app: ASGIApp, rps: float) -> None:
        self.app = app
        self.interval = 1.0 / rps if rps > 0 else 0.0
        self.burst_s = self.interval * max(1.0, rps / 4)
        # each client's theoretical arrival time of its next request, oldest use first
        self._tat: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def _key(self, scope: Scope, now: float) -> tuple[str, str, str]:
        key = client_key(scope)
        if key in self._tat:
            self._tat.move_to_end(key)
            return key
        while len(self._tat) >= MAX_CLIENTS:
            oldest, tat = next(iter(self._tat.items()))
            if tat > now:  # every remembered client is still paced: share one
                return _SHARED
            del self._tat[oldest]
        return key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.interval:
            await self.app(scope, receive, send)
            return
        now = time.monotonic()
        key = self._key(scope, now)
        tat = max(self._tat.get(key, 0.0), now)
        wait = tat - now - self.burst_s
        if wait > MAX_WAIT_S:
            exc = Overloaded(
                "this client is at PINFEED_HTTP_MAX_RPS and this request would wait "
                f"over {MAX_WAIT_S:.0f} s; retry later"
            )
            response = error_response(exc, str(scope["path"]), {"Retry-After": "1"})
            await response(scope, receive, send)
            return
        self._tat[key] = tat + self.interval
        if wait > 0:
            await asyncio.sleep(wait)
        await self.app(scope, receive, send)
