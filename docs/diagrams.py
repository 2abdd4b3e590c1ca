"""``python -m docs.diagrams``: the site's diagrams, SVG files rendered from their Mermaid
text (``docs/**/*.mmd``) by Mermaid itself in the headless Chromium the tests drive.

Why not mkdocs-material's own Mermaid: it loads ``mermaid.min.js`` from unpkg.com in the
reader's browser, and served from the site instead it is 3.5 MB of script on every
page of a site that must render on an offline node. So the diagram is drawn once, here,
from the npm registry's ``mermaid`` (pinned below, fetched into ``.cache/``), and the SVG
is committed: pages show it as an image (no script), GitHub too. Each SVG names the
digest of the text it was drawn from; tests/docs/test_site.py fails when a ``.mmd``
changed without its SVG (``check``).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from docs import blocks

MERMAID = "mermaid@11.17.2"
CACHE = blocks.REPO / ".cache" / "mermaid"
CONFIG = "{startOnLoad: false, theme: 'neutral', htmlLabels: false, flowchart: {htmlLabels: false}}"


def sources() -> list[Path]:
    return sorted(blocks.DOCS.rglob("*.mmd"))


def stamp(source: Path) -> str:
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    return f"<!-- drawn from {source.name} sha256:{digest} by {MERMAID} -->"


def check() -> list[str]:
    """One line per diagram whose SVG is missing or was drawn from other text."""
    problems = []
    for src in sources():
        svg = src.with_suffix(".svg")
        if not svg.exists() or stamp(src) not in svg.read_text():
            problems.append(f"{svg.relative_to(blocks.REPO)}: not drawn from {src.name}")
    return problems


def mermaid_js() -> Path:
    """``mermaid.min.js`` of the pinned version, from the npm registry, kept in .cache."""
    js = CACHE / MERMAID / "mermaid.min.js"
    if not js.exists():
        js.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", MERMAID, "--silent"], cwd=tmp, check=True)
            (tgz,) = Path(tmp).glob("mermaid-*.tgz")
            with tarfile.open(tgz) as tar:
                member = tar.extractfile("package/dist/mermaid.min.js")
                assert member is not None
                js.write_bytes(member.read())
    return js


def draw(text: str) -> str:
    from tests.browser import Browser

    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "draw.html"
        script = f'<script src="{mermaid_js().as_uri()}"></script>'
        page.write_text(f"<html><body>{script}</body></html>")
        with Browser() as b:
            b.open(page.as_uri())
            b.wait_for("typeof mermaid !== 'undefined'")
            b.evaluate(
                f"mermaid.initialize({CONFIG}); mermaid.render('d', {text!r})"
                ".then(r => {{ window.svg = r.svg; }}, e => {{ window.svg = 'ERROR ' + e; }})"
            )
            svg: str = b.wait_for("window.svg")
    if svg.startswith("ERROR"):
        raise ValueError(svg)
    return svg


def main() -> int:
    for src in sources():
        svg = src.with_suffix(".svg")
        svg.write_text(stamp(src) + "\n" + draw(src.read_text()) + "\n")
        print(f"wrote {svg.relative_to(blocks.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
