"""A fault-injecting HTTP/1.1 proxy in front of the test S3 server, on loopback.

    with FaultProxy(s3.endpoint) as proxy:      # its own process (spawned), its own loop
        proxy.latency_s, proxy.bandwidth = 0.02, 100e6   # a cloud-like link
        proxy.inject("503", count=3)            # the next 3 GETs: 503 SlowDown
        proxy.inject("reset", count=1, path="/train/")   # RST halfway through a body
        proxy.inject("truncate")                # half the body, then a clean close
        proxy.down(); ...; proxy.up()           # connections refused, then served again
        proxy.counts.bytes, proxy.counts.requests        # what clients got

The proxy runs in a process of its own, driven over a pipe: a test process that forks
(a reference DataLoader's workers) must not fork its sockets, and the proxy's relaying
does not take the test's GIL. Each client connection gets its own upstream connection
(keep-alive passes through); request and response bodies are relayed by Content-Length
or chunked framing. A fault
applies to the next ``count`` GET requests whose path starts with ``path``. The byte
count is response body bytes delivered to clients: what a store would bill as egress.
``latency_s`` is added once per request before it is forwarded; ``bandwidth`` (bytes a
second, 0: none) is one token bucket for every connection together, as a node's link.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

Fault = Literal["503", "reset", "truncate"]
SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
CHUNK = 1 << 16


@dataclass
class Counts:
    requests: int = 0
    bytes: int = 0  # response body bytes delivered
    by_method: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests = self.bytes = 0
            self.by_method.clear()
            self.faults.clear()


@dataclass
class _Rule:
    fault: Fault
    count: int
    path: str


class _Proxy:
    def __init__(self, upstream: str, port: int = 0) -> None:
        u = urlsplit(upstream)
        assert u.hostname is not None and u.port is not None
        self._up = (u.hostname, u.port)
        self.port = port
        self.latency_s = 0.0
        self.bandwidth = 0.0
        self.counts = Counts()
        self._rules: list[_Rule] = []
        self._rules_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._call(self._listen())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def inject(self, fault: Fault, count: int = 1, path: str = "/") -> None:
        with self._rules_lock:
            self._rules.append(_Rule(fault, count, path))

    def clear(self) -> None:
        with self._rules_lock:
            self._rules.clear()

    def pending(self) -> int:
        """Faults injected and not yet applied."""
        with self._rules_lock:
            return sum(r.count for r in self._rules)

    def down(self) -> None:
        """Refuse connections (nothing listens on the port) and drop the open ones."""
        self._call(self._stop())

    def up(self) -> None:
        self._call(self._listen())

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    # -- the loop ------------------------------------------------------------------------
    async def _listen(self) -> None:
        if self._server is not None:
            return
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._serve, sock=sock)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            _rst(w)

    def _take(self, method: str, path: str) -> Fault | None:
        if method != "GET":
            return None
        with self._rules_lock:
            for rule in self._rules:
                if path.startswith(rule.path):
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                    return rule.fault
        return None

    async def _throttle(self, n: int) -> None:
        """Take ``n`` bytes from the link's bucket (10 ms of burst at most); a debt
        is slept off, so every connection together gets ``bandwidth``."""
        if self.bandwidth <= 0:
            return
        now = time.monotonic()
        burst = self.bandwidth * 0.01
        self._tokens = min(burst, self._tokens + (now - self._tokens_at) * self.bandwidth)
        self._tokens_at = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.bandwidth)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._writers.add(cw)
        uw: asyncio.StreamWriter | None = None
        try:
            ur, uw = await asyncio.open_connection(*self._up)
            while True:
                head = await _head(cr)
                if head is None:
                    return
                method, path = head[0].split(b" ")[:2]
                m, p = method.decode(), path.decode()
                uw.write(b"\r\n".join(head) + b"\r\n\r\n")
                await _relay_body(cr, uw, _headers(head), request=True)
                fault = self._take(m, p)
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                with self.counts.lock:
                    self.counts.requests += 1
                    self.counts.by_method[m] += 1
                    if fault:
                        self.counts.faults[fault] += 1
                rhead = await _head(ur)
                if rhead is None:
                    return
                if fault == "503":
                    # the upstream's answer is read and dropped: the client gets SlowDown
                    await _relay_body(ur, None, _headers(rhead), method=m, status=rhead[0])
                    cw.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(SLOWDOWN), SLOWDOWN)
                    )
                    await cw.drain()
                    continue
                cw.write(b"\r\n".join(rhead) + b"\r\n\r\n")
                cut = fault if fault in ("reset", "truncate") else None
                await _relay_body(
                    ur, cw, _headers(rhead), method=m, status=rhead[0], proxy=self, cut=cut
                )
                if cut == "reset":
                    _rst(cw)
                    return
                if cut == "truncate":
                    await cw.drain()
                    cw.close()
                    return
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            self._writers.discard(cw)
            for w in (cw, uw):
                if w is not None and not w.is_closing():
                    w.close()


def _run(upstream: str, conn: Connection) -> None:
    """The proxy process: serve, and answer the handle's commands until told to stop."""
    proxy = _Proxy(upstream)
    proxy.start()
    conn.send(proxy.port)
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "stop":
            break
        if cmd == "set":
            setattr(proxy, args[0], args[1])
            conn.send(None)
        elif cmd == "counts":
            c = proxy.counts
            with c.lock:
                conn.send((c.requests, c.bytes, dict(c.by_method), dict(c.faults)))
        elif cmd == "reset":
            proxy.counts.reset()
            conn.send(None)
        else:
            conn.send(getattr(proxy, cmd)(*args))
    proxy.close()


@dataclass(frozen=True)
class Seen:
    """What the proxy's clients got, as of when asked."""

    requests: int
    bytes: int
    by_method: dict[str, int]
    faults: dict[str, int]


class FaultProxy:
    """The handle of a proxy process (see the module docstring)."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._conn: Connection | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._lock = threading.Lock()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_run, args=(self._upstream, theirs), daemon=True)
        self._proc.start()
        theirs.close()
        self._conn = mine
        if not mine.poll(60):
            raise TimeoutError("the fault proxy did not start")
        self.port = mine.recv()

    def _ask(self, *cmd: object) -> object:
        assert self._conn is not None
        with self._lock:  # a test's timer thread may ask too (proxy.up later)
            self._conn.send(cmd)
            return self._conn.recv()

    def close(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError):
            assert self._conn is not None
            self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._proc = None

    @property
    def latency_s(self) -> float:
        raise AttributeError("write-only")

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self._ask("set", "latency_s", value)

    @property
    def bandwidth(self) -> float:
        raise AttributeError("write-only")

    @bandwidth.setter
    def bandwidth(self, value: float) -> None:
        self._ask("set", "bandwidth", value)

    @property
    def counts(self) -> Seen:
        requests, nbytes, by_method, faults = self._ask("counts")  # type: ignore[misc]
        return Seen(requests, nbytes, by_method, faults)

    def reset_counts(self) -> None:
        self._ask("reset")

    def inject(self, fault: Fault, count: int = 1, path: str = "/") -> None:
        self._ask("inject", fault, count, path)

    def clear(self) -> None:
        self._ask("clear")

    def pending(self) -> int:
        return int(self._ask("pending"))  # type: ignore[call-overload]

    def down(self) -> None:
        self._ask("down")

    def up(self) -> None:
        self._ask("up")

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _rst(w: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a connection reset by the network."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


async def _head(r: asyncio.StreamReader) -> list[bytes] | None:
    try:
        raw = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    return raw[:-4].split(b"\r\n")


def _headers(head: list[bytes]) -> dict[str, str]:
    out = {}
    for line in head[1:]:
        k, _, v = line.partition(b":")
        out[k.strip().lower().decode()] = v.strip().decode()
    return out


async def _relay_body(
    r: asyncio.StreamReader,
    w: asyncio.StreamWriter | None,
    headers: dict[str, str],
    *,
    request: bool = False,
    method: str = "GET",
    status: bytes = b"",
    proxy: _Proxy | None = None,
    cut: str | None = None,
) -> None:
    """Relay one message body from ``r`` to ``w`` (None: read and drop it). A response
    to HEAD, or a 204/304, has none whatever its headers say."""
    if not request:
        code = status.split(b" ")[1] if b" " in status else b""
        if method == "HEAD" or code in (b"204", b"304"):
            return
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await r.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            data = await r.readexactly(size + 2)
            if proxy is not None:  # counted before the client can have it
                await _count(proxy, size)
            if w is not None:
                w.write(line + data)
                await w.drain()
            if size == 0:
                return
    length = int(headers.get("content-length", "0"))
    limit = length // 2 if cut else length
    sent = 0
    while sent < length:
        n = min(CHUNK, length - sent)
        data = await r.readexactly(n)
        if cut and sent + n > limit:
            data = data[: max(0, limit - sent)]
        if proxy is not None:  # counted before the client can have it
            await proxy._throttle(len(data))
            await _count(proxy, len(data))
        if w is not None and data:
            w.write(data)
            await w.drain()
        sent += n
        if cut and sent >= limit:
            return


async def _count(proxy: _Proxy, n: int) -> None:
    with proxy.counts.lock:
        proxy.counts.bytes += n
