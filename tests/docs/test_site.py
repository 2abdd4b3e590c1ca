"""The documentation site builds with ``mkdocs build --strict`` (no broken link or anchor)
and every page renders in a real headless Chromium cut off from every host but this one:
no request leaves 127.0.0.1, none fails, every image loads, search answers. The home
page's screenshot is left in ``build/site-home.png`` to look at. Skipped, with the reason,
where no Chromium is installed (``.ci/run`` installs Debian's)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.browser import CHROMIUM, Browser
from tests.conftest import REPO

SCREENSHOT = REPO / "build" / "site-home.png"
IMAGES = """
JSON.stringify([...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
  .map(i => i.getAttribute('src')))
"""


def build(out: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]


class Site(NamedTuple):
    url: str
    root: Path

    def pages(self) -> list[str]:
        """Every page of the built site (404.html is no page)."""
        paths = sorted(p.relative_to(self.root) for p in self.root.rglob("*.html"))
        return [self.url + str(p) for p in paths if str(p) != "404.html"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The built site, served on 127.0.0.1 by Python's own HTTP server."""
    root = tmp_path_factory.mktemp("site")
    build(root)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Site(f"http://127.0.0.1:{httpd.server_address[1]}/", root)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)"
)


@chromium
@pytest.mark.slow
def test_every_page_renders_offline(site: Site) -> None:
    urls = site.pages()
    assert len(urls) >= 10, urls
    with Browser(1280, 860) as b:
        for url in urls:
            b.open(url)
            b.wait_for("document.readyState === 'complete' && !!document.querySelector('h1')")
            missing = b.evaluate(IMAGES)
            assert missing == "[]", f"{url}: images that did not load: {missing}"
        outside = [u for u in b.requests if not u.startswith((site.url, "data:"))]
        assert outside == [], outside
        assert not b.failed, b.failed
        b.open(site.url)
        b.wait_for("document.readyState === 'complete'")
        SCREENSHOT.parent.mkdir(exist_ok=True)
        b.screenshot(SCREENSHOT)
    assert SCREENSHOT.stat().st_size > 10_000


@chromium
def test_search_answers_offline(site: Site) -> None:
    with Browser() as b:
        b.open(site.url)
        b.wait_for("document.readyState === 'complete'")
        b.evaluate(
            "(() => { const q = document.querySelector('input.md-search__input');"
            " q.focus(); q.value = 'arbiter'; q.dispatchEvent(new Event('input')); })()"
        )
        hits = b.wait_for("document.querySelectorAll('.md-search-result__item').length")
        assert hits > 0
        assert [u for u in b.requests if not u.startswith((site.url, "data:"))] == []


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_links_to_what_exists() -> None:
    """README.md is no page of the site (mkdocs checks those): its relative links and
    images are checked here, anchors into itself too."""
    text = (REPO / "README.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (REPO / path).exists(), f"README.md links to {path}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"README.md links to #{anchor}, no such heading"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_diagram_is_drawn_from_its_text() -> None:
    """A diagram's SVG names the digest of its Mermaid text: one changed without the
    other fails (python -m docs.diagrams draws them again)."""
    from docs import diagrams

    assert diagrams.sources(), "no diagram found"
    assert diagrams.check() == [], "run `make docs-diagrams` and commit the SVG"
