"""A real ``pinfeed serve`` (uvicorn, worker processes, SQLite) for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from pinfeed import Client

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running server; ``client`` talks HTTP, ``socket`` is the data plane."""

    root: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "pinfeed.sock"

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def start(self, timeout: float = 60.0) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PINFEED_PORT": str(self.port),
            "PINFEED_SOCKET": str(self.socket),
            "PINFEED_STATE_DIR": str(self.root / "state"),
            "PINFEED_DATA_ROOT": str(self.data_root),
            "PINFEED_ALLOWED_PLUGINS": '["tests.fixtures"]',
            "PYTHONPATH": str(REPO),
            **self.env,
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "serve"], env=env, cwd=REPO, stdout=out, stderr=out
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server did not become healthy: {self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def client(self) -> Client:
        return Client(self.url)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the session; tests use unique dataset and loader names."""
    srv = Server(tmp_path_factory.mktemp("pinfeed"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def admin(server: Server) -> Iterator[Client]:
    with server.client() as c:
        yield c


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
