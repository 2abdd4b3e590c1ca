"""Autotune on a live loader: decisions logged with their reasons in GET .../stats and
``pinfeed status``, never past max_workers, batches unchanged; an explicit PATCH turns
it off, a PATCH with ``autotune`` turns it on."""

from __future__ import annotations

import time
from typing import Any

from pinfeed import Client, Loader
from tests.cli.test_cli import ok
from tests.conftest import Server
from tests.helpers import unique

SLOW = "tests.fixtures.datasets:Slow"


def test_autotune_decides_reports_and_turns_off(admin: Client, server: Server) -> None:
    ds = unique("tune")
    admin.create_dataset(ds, "python", {"factory": SLOW, "kwargs": {"length": 40, "seconds": 0.01}})
    name = unique("tune")
    spec = {"max_workers": 2, "interval_s": 0.3}
    created = admin.create_loader(name, dataset=ds, batch_size=4, num_workers=1, autotune=spec)
    assert created["autotune"]["max_workers"] == 2
    got: list[int] = []
    seen: list[int] = []
    report: dict[str, Any] | None = None
    deadline = time.monotonic() + 60
    with Loader(name, socket=server.socket) as loader:
        while time.monotonic() < deadline:
            for batch in loader:
                got.extend(int(x) for x in batch)
                seen.append(admin.loader(name)["num_workers"])
            report = admin.loader_stats(name)["autotune"]
            if report and report["decisions"]:
                break
    assert report is not None and report["decisions"], "no decision within 60 s"
    assert all(d["reason"] for d in report["decisions"])
    # A trainer reading as fast as it can from one busy worker: the first decision is the
    # one the rule must make, a second worker (not fewer, not a deeper prefetch).
    first = report["decisions"][0]
    assert first["num_workers"] == 2 and "one more worker" in first["reason"], first
    assert max(seen) <= 2 and all(d["num_workers"] <= 2 for d in report["decisions"])
    assert got == list(range(40)) * (len(got) // 40)  # in order, none lost or repeated
    assert "arbiter" in ok(server, "status")  # the node line: what the arbiter is doing

    out = admin.patch_loader(name, num_workers=1)  # explicit values: autotune off
    assert out["autotune"] is None and admin.loader_stats(name)["autotune"] is None
    out = admin.patch_loader(name, autotune=spec)  # on again
    assert out["autotune"]["interval_s"] == 0.3
    assert admin.loader_stats(name)["autotune"]["enabled"]
    admin.delete_loader(name)
