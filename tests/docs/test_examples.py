"""Every Python example of README.md and the site runs: each ```` ```python ```` block is
a script, run in a fresh process in an empty folder beside a real ``pinfeed serve`` that
holds what the docs assume a node has (``make run``'s ``demo`` loader, and ``pinned``,
the getting-started page's ``pin_memory`` loader over it). A block that cannot run here
says so right above its fence, with the reason::

    <!-- not-run: needs CUDA (device="cuda"); tests/gpu runs the same -->

An example that raises, or exits with another status than 0, fails its test, named by
page and line. The README's one-line example also has a test of its own, which runs it
with torch's DataLoader too and compares the losses (tests/dataloader/test_example.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from docs import blocks
from tests.conftest import Server

FENCE = re.compile(
    r"^(?:<!-- not-run: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)^```", re.M | re.S
)


class Example(NamedTuple):
    page: str
    line: int
    code: str
    why_not: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def examples(text: str, page: str) -> list[Example]:
    return [
        Example(page, text.count("\n", 0, m.start("code")), m.group("code"), m.group("why"))
        for m in FENCE.finditer(text)
    ]


ALL = [
    ex
    for path in blocks.pages()
    for ex in examples(path.read_text(), str(path.relative_to(blocks.REPO)))
]
RUN = [ex for ex in ALL if ex.why_not is None]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The node the examples assume: ``pinfeed serve --demo``, and ``pinned``."""
    srv = Server(tmp_path_factory.mktemp("examples"), env={"PINFEED_DEMO": "1"})
    srv.start()
    try:
        with srv.client() as c:
            c.create_loader("pinned", dataset="demo", batch_size=10, pin_memory=True)
        yield srv
    finally:
        srv.stop()


def run(code: str, cwd: Path, server: Server) -> subprocess.CompletedProcess[str]:
    script = cwd / "example.py"
    script.write_text(code)
    env = dict(
        os.environ,
        PINFEED_SOCKET=str(server.socket),
        PINFEED_URL=server.url,
        PINFEED_AUTOSTART="0",
    )
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("example", RUN, ids=[ex.id for ex in RUN])
def test_the_example_runs(example: Example, node: Server, tmp_path: Path) -> None:
    done = run(example.code, tmp_path, node)
    assert done.returncode == 0, f"{example.id} failed:\n{done.stderr[-3000:]}"


def test_every_example_runs_or_says_why_not() -> None:
    assert RUN, "no runnable example found"
    for ex in ALL:
        assert ex.why_not is None or len(ex.why_not.strip()) >= 10, f"{ex.id}: say why not"


def test_a_broken_example_fails(node: Server, tmp_path: Path) -> None:
    """What the test of each example checks, on one broken on purpose: a loader name
    mistyped in the README's named-loader example."""
    named = next(ex for ex in RUN if 'Loader("demo")' in ex.code)
    assert run(named.code, tmp_path, node).returncode == 0
    broken = named.code.replace('Loader("demo")', 'Loader("dmeo")')
    done = run(broken, tmp_path, node)
    assert done.returncode != 0 and "LoaderNotFound" in done.stderr


def test_the_collector_sees_markers() -> None:
    text = "a\n<!-- not-run: needs CUDA, not here -->\n```python\nx = 1\n```\n```python\ny\n```\n"
    found = examples(text, "page.md")
    assert [(ex.code, ex.why_not, ex.line) for ex in found] == [
        ("x = 1\n", "needs CUDA, not here", 3),
        ("y\n", None, 6),
    ]
