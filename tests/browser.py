"""A headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, for the
page and docs tests and the README's screenshot.

Chromium runs as the machine docs say (``--headless --no-sandbox --disable-gpu``, the
background-networking flags off, a fresh ``--user-data-dir``) and cut off from any
host but this one: every URL goes through a proxy that does not exist
(``127.0.0.1:9``) except ``127.0.0.1`` itself, and host names resolve to nothing. The
``Network`` domain records every request the page makes (``requests``), so a test can
assert none left the machine.

    python -m tests.browser docs/page.png   # the README's screenshot, of a live node
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--remote-allow-origins=*",
    # cut off: everything but 127.0.0.1 goes to a proxy nobody listens on
    "--proxy-server=http://127.0.0.1:9",
    "--proxy-bypass-list=127.0.0.1",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


class Browser:
    def __init__(self, width: int = 1280, height: int = 860) -> None:
        if CHROMIUM is None:
            raise RuntimeError("no chromium: apt-get install chromium")
        self._dir = Path(tempfile.mkdtemp(prefix="pinfeed-chromium-"))
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={self._dir}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.requests: list[str] = []
        self.failed: list[str] = []
        self._id = 0
        self._ws: Any = None
        self._connect()

    def _connect(self) -> None:
        import websocket  # websocket-client, in the test extra

        port_file = self._dir / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages: list[dict[str, Any]] = []
        while not pages:
            pages = [
                t
                for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()
                if t["type"] == "page"
            ]
            if time.monotonic() > deadline:
                raise RuntimeError("chromium has no page target")
            time.sleep(0.1)
        self._ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
        )
        self.send("Network.enable")
        self.send("Page.enable")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events that arrive meanwhile are recorded."""
        self._id += 1
        me = self._id
        self._ws.send(json.dumps({"id": me, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == me:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Network.loadingFailed":
            self.failed.append(f"{params.get('errorText')} ({params.get('requestId')})")

    def evaluate(self, expression: str) -> Any:
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy (events keep being recorded)."""
        deadline = time.monotonic() + timeout
        error: Exception | None = None
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as exc:  # e.g. no document.body yet while it loads
                value, error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still falsy after {timeout} s ({error})")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._ws is not None:
                self._ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _screenshot(out: Path) -> int:
    """The README's picture: the page of a node running the node benchmark's three
    trainers under the arbiter, once it has made a few decisions."""
    from bench import node
    from pinfeed import Client

    args = node.parse_args(["--quick"])
    args.data_dir.mkdir(parents=True, exist_ok=True)
    with node._server(args, True) as srv, Client(srv.url, timeout=120) as c:
        node._loaders(c, node.JOBS, None, args.interval)
        trainers = node._start(srv, node.JOBS)
        try:
            deadline = time.monotonic() + 90
            while len(c.node()["decisions"]) < 8 and time.monotonic() < deadline:
                time.sleep(1)
            with Browser(1280, 760) as b:
                b.open(srv.url + "/")
                b.wait_for("Number(document.body.dataset.rendered || 0) >= 2")
                b.screenshot(out)
                outside = [u for u in b.requests if not u.startswith(srv.url)]
        finally:
            for t in trainers:
                t.stop()
    print(f"wrote {out}; requests off the machine: {outside}")
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(_screenshot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/page.png")))
