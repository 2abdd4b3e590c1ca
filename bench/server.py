"""A ``pinfeed serve`` subprocess for one benchmark section, in its own temp dirs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BenchServer:
    """``with BenchServer(data_root) as srv:`` a fresh server; ``srv.url``, ``srv.socket``."""

    def __init__(self, data_root: Path, *, log_level: str = "warning") -> None:
        self.data_root = data_root
        self.port = free_port()
        self._tmp = Path(tempfile.mkdtemp(prefix="pinfeed-bench-"))
        self.socket = self._tmp / "run" / "pinfeed.sock"
        self.log = self._tmp / "server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = float("nan")  # seconds from spawn to a healthy /healthz

    def start(self, timeout: float = 60.0) -> None:
        t0 = time.perf_counter()
        env = {
            **os.environ,
            "PINFEED_HOST": "127.0.0.1",
            "PINFEED_PORT": str(self.port),
            "PINFEED_SOCKET": str(self.socket),
            "PINFEED_STATE_DIR": str(self._tmp / "state"),
            "PINFEED_DATA_ROOT": str(self.data_root),
            "PINFEED_LOG_LEVEL": self._log_level,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("PINFEED_TOKEN", None)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "serve"],
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
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
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"pinfeed serve not healthy within {timeout} s:\n{self.tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
