"""The control plane's pace: at most ``PINFEED_HTTP_MAX_RPS`` requests a second.

HTTP handling and the data plane share the server's cores and its interpreter. A
client that polls as fast as it can (16 connections on ``/healthz`` serve ~400 a
second here) would otherwise take a whole core from the trainers, and refusing fast
does not help: a refused client asks again at once. So every request waits its turn,
without spinning, until the pace allows it (a generic cell rate algorithm: one
timestamp, O(1) per request, a burst of ``rps / 4`` passes unpaced). A flooding client
is slowed to the pace, every request is still answered, and probes behind a flood
wait at most ``connections / rps`` seconds. Only when a request would wait longer
than ``MAX_WAIT_S`` (hundreds of concurrent clients) is it refused at once: 503
``overloaded`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from pinfeed.errors import Overloaded
from pinfeed_server.api.problems import error_response

MAX_WAIT_S = 5.0


class Throttle:
    def __init__(self, app: ASGIApp, rps: float) -> None:
        self.app = app
        self.interval = 1.0 / rps if rps > 0 else 0.0
        self.burst_s = self.interval * max(1.0, rps / 4)
        self._tat = 0.0  # the theoretical arrival time of the next request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.interval:
            await self.app(scope, receive, send)
            return
        now = time.monotonic()
        tat = max(self._tat, now)
        wait = tat - now - self.burst_s
        if wait > MAX_WAIT_S:
            exc = Overloaded(
                "the control plane is at PINFEED_HTTP_MAX_RPS and this request would wait "
                f"over {MAX_WAIT_S:.0f} s; retry later"
            )
            response = error_response(exc, str(scope["path"]), {"Retry-After": "1"})
            await response(scope, receive, send)
            return
        self._tat = tat + self.interval
        if wait > 0:
            await asyncio.sleep(wait)
        await self.app(scope, receive, send)
