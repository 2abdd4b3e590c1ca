"""Generated blocks of a page: what lies between two marker comments is written by a
program, never by hand::

    <!-- PREFIX:NAME ARGS -->
    ... (generated: edits here are overwritten) ...
    <!-- /PREFIX:NAME -->

Two programs own such blocks, each under its prefix: ``python -m bench report``
(``bench:``, benchmark tables from ``docs/results/``) and ``python -m docs.gen``
(``gen:``, the reference from the code). Each renders a block from its ``NAME`` and
``ARGS`` alone, so a page either equals what its program makes or a test says which
block differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# A block's renderer: (its name, its arguments) -> its body.
Render = Callable[[str, list[str]], str]


def marker(prefix: str) -> re.Pattern[str]:
    """The blocks of one program: ``name``, ``args`` and ``body`` groups."""
    return re.compile(
        rf"(<!-- {prefix}:(?P<name>[\w-]+)(?P<args>[^>]*?) -->\n)(?P<body>.*?)"
        rf"(<!-- /{prefix}:(?P=name) -->)",
        re.S,
    )


def fill(text: str, pattern: re.Pattern[str], render: Render) -> str:
    """``text`` with every block of ``pattern`` rendered afresh."""

    def one(m: re.Match[str]) -> str:
        body = render(m.group("name"), m.group("args").split())
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(5)

    return pattern.sub(one, text)


def pages() -> list[Path]:
    """Every page a block may live in: README.md and the site's pages."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
