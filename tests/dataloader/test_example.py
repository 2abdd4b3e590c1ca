"""The README's first trainer example, run as a script twice: with torch's DataLoader,
and changed only in its import to ``pinfeed.DataLoader``: the same losses, printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Server
from tests.launcher import REPO

IMPORT = "from pinfeed import DataLoader  # was: from torch.utils.data import DataLoader"


def _example() -> str:
    readme = (REPO / "README.md").read_text()
    block = re.search(
        r"<!-- example:one-line -->\n```python\n(.*?)```\n<!-- /example:one-line -->", readme, re.S
    )
    assert block is not None, "the README's one-line example"
    code = block.group(1)
    assert IMPORT in code
    return code


def _run(code: str, tmp: Path, server: Server) -> list[str]:
    script = tmp / "train.py"
    script.write_text(code)
    env = dict(os.environ, PINFEED_SOCKET=str(server.socket), PINFEED_AUTOSTART="0")
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.slow
def test_the_one_line_switch_gives_the_same_losses(server: Server, tmp_path: Path) -> None:
    code = _example()
    torch_code = code.replace(IMPORT, "from torch.utils.data import DataLoader")
    assert code.count("\n") == torch_code.count("\n")  # one line changed, no more
    (tmp_path / "torch").mkdir()
    (tmp_path / "pinfeed").mkdir()
    want = _run(torch_code, tmp_path / "torch", server)
    got = _run(code, tmp_path / "pinfeed", server)
    assert len(want) == 2 and want[0].startswith("0 ")
    assert got == want
