"""``python -m bench control``: the control-plane benchmark runs end to end.

A smoke run (``--quick``'s 1 s phases and small W1, at 3 loaders only): it checks the
table is complete and that every request was answered or refused cleanly, never how
fast anything was. ``--quick`` also runs every phase at 1 loader, the same code with no
idle loaders, which doubled this test's time (the slowest in ``make test``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.heavy  # the control benchmark: floods and load processes
# About half a minute alone; the machine's other work can triple that.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_control_quick(tmp_path: Path) -> None:
    quick = ["--seconds", "1", "--loaders", "3", "--scale", "0.05"]
    args = [*quick, "--request-timeout", "60", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "bench", "control", *args, "--data-dir", str(tmp_path / "data")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "flood 16 /metrics" in out.stdout and "wrote" in out.stdout
    result = json.loads((tmp_path / "control.json").read_text())
    rows = result["rows"]
    assert {r["loaders"] for r in rows} == {3}
    # alone, 3 scrape rates, 3 floods, probes, another client alone and flooded, fresh scrapes
    assert len(rows) == 11
    for r in rows:
        assert r["samples_per_s"] > 0, r["traffic"]
        for path, h in r.get("http", {}).items():
            assert h["requests"] > 0, (r["traffic"], path)
            assert h["errors_5xx"] == h["hangs"] == h["conn_errors"] == 0, (r["traffic"], h)
    assert {t["target"].split(":")[0] for t in result["targets"]} >= {
        "/metrics 10/s, 3 loaders",
        "/healthz p99 under full load, 3 loaders (ms)",
    }
