"""The one launcher of a real ``pinfeed serve`` (uvicorn, worker processes, SQLite), for
the tests (``tests/conftest.py``) and the benchmarks (``bench/``).

    with Server(tmp_path) as srv:          # a free port; state, socket and log under root
        Client(srv.url).create_dataset(...)
        Loader("name", socket=srv.socket)

``env`` adds or overrides ``PINFEED_*`` settings; ``data`` is the data root (default
``root/data``); ``command`` replaces ``python -m pinfeed_server serve`` (to run it under a wrapper
such as ``unshare``). The server gets this environment and not the caller's
``PINFEED_TOKEN``. ``start`` returns once ``/healthz`` answers; ``stop`` sends SIGTERM
(or ``sig``), kills after ``timeout`` and returns the exit code.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from pinfeed import Client

REPO = Path(__file__).resolve().parent.parent
SERVE = (sys.executable, "-m", "pinfeed_server", "serve")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (closed again at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A ``pinfeed serve`` process; ``url`` is HTTP, ``socket`` the data plane."""

    root: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    data: Path | None = None
    command: tuple[str, ...] = SERVE
    proc: subprocess.Popen[bytes] | None = None
    start_s: float = math.nan  # seconds from spawn to a healthy /healthz

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "pinfeed.sock"

    @property
    def data_root(self) -> Path:
        return self.data if self.data is not None else self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PINFEED_TOKEN"}
        return env | {
            "PINFEED_HOST": "127.0.0.1",
            "PINFEED_PORT": str(self.port),
            "PINFEED_SOCKET": str(self.socket),
            "PINFEED_STATE_DIR": str(self.root / "state"),
            "PINFEED_DATA_ROOT": str(self.data_root),
            "PINFEED_ALLOWED_PLUGINS": '["tests.fixtures"]',
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            **self.env,
        }

    def start(self, timeout: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                env=self.environment(),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pinfeed serve exited:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)  # the server offers nothing to wait on before it listens
        self.stop()
        raise TimeoutError(f"pinfeed serve not healthy within {timeout} s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Stop the server (idempotent); its exit code."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def client(self) -> Client:
        return Client(self.url)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
