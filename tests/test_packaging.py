"""What ``pip install .`` installs: the folders under ``src/`` are the import names, and
the trainer library alone needs no server dependency."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.launcher import REPO

SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "pydantic_settings", "starlette", "typer")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(REPO)],
        check=True,
    )  # fmt: skip
    (built,) = out.glob("pinfeed-*.whl")
    return built


def test_the_wheel_holds_every_module_under_its_import_name(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for top in ("pinfeed", "pinfeed_server"):
        for module in (REPO / "src" / top).rglob("*.py"):
            assert module.relative_to(REPO / "src").as_posix() in names, module
    assert not any(n.startswith(("app/", "client/", "tests/", "bench/")) for n in names)


def test_the_trainer_library_requires_only_torch_numpy_httpx_cloudpickle(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    required = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    plain = sorted(r.name for r in required if r.marker is None)
    assert plain == ["cloudpickle", "httpx", "numpy", "torch"]


def test_pinfeed_imports_without_any_server_package() -> None:
    """``import pinfeed`` with the server's dependencies made unimportable."""
    code = (
        "import sys\n"
        f"blocked = {SERVER_ONLY!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked: raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pinfeed, pinfeed.protocol, pinfeed.errors\n"
        "assert 'pinfeed_server' not in sys.modules\n"
        "print(pinfeed.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert Path(out.stdout.strip()).parent == REPO / "src" / "pinfeed"
