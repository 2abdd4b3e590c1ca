"""The request guard: bearer token and body size, checked before routing and parsing.

An ASGI middleware rather than a route dependency so that the order is fixed for
every request, routed or not: a mutating request without the token gets 401 even
when its body is malformed or its route unknown, and no body larger than the limit
is ever read into memory.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pinfeed.errors import PayloadTooLarge, ProblemError, Unauthorized
from pinfeed_server.api.problems import error_response
from pinfeed_server.settings import Settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.token = settings.token
        self.max_body = settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.token is not None and not self._authorized(headers):
            await self._refuse(
                Unauthorized("this request needs 'Authorization: Bearer <PINFEED_TOKEN>'"),
                scope,
                receive,
                send,
            )
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            await self._refuse(self._too_large(), scope, receive, send)
            return
        # Chunked bodies have no length: read at most the limit, then replay what was read.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._refuse(self._too_large(), scope, receive, send)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: Headers) -> bool:
        assert self.token is not None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            given.strip().encode(), self.token.encode()
        )

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the body is larger than PINFEED_MAX_BODY_BYTES={self.max_body} bytes"
        )

    @staticmethod
    async def _refuse(exc: ProblemError, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(exc, str(scope["path"]))(scope, receive, send)
