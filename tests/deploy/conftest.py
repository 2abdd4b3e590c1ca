"""The deploy tests' shared fixture: a short root for a compose project's services."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    """A directory right under the temp dir: a service's socket path is its root plus
    the container path (``/run/pinfeed/pinfeed.sock``), and pytest's own ``tmp_path``
    (longer still under an xdist worker, ``popen-gw1/...``) takes it past the 107 bytes
    of a Unix socket path."""
    path = Path(tempfile.mkdtemp(prefix="pf-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
