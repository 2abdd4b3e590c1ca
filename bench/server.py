"""A ``pinfeed serve`` for one benchmark section: ``tests.launcher.Server`` (the one
launcher, shared with the tests) in a temp dir of its own, removed when it stops."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from pathlib import Path

from tests.launcher import REPO, Server

__all__ = ["REPO", "BenchServer"]


class BenchServer(Server):
    """``with BenchServer(data_root) as srv:`` a fresh server; ``srv.url``, ``srv.socket``,
    ``srv.pid``, ``srv.start_s`` (seconds to a healthy /healthz)."""

    def __init__(
        self, data_root: Path, *, log_level: str = "warning", env: dict[str, str] | None = None
    ) -> None:
        """``env``: more ``PINFEED_*`` settings."""
        root = Path(tempfile.mkdtemp(prefix="pinfeed-bench-"))
        from bench.data import PLUGINS

        base = {"PINFEED_LOG_LEVEL": log_level, "PINFEED_ALLOWED_PLUGINS": json.dumps(PLUGINS)}
        super().__init__(root, env=base | (env or {}), data=data_root)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        try:
            return super().stop(sig, timeout) if self.proc is not None else 0
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
