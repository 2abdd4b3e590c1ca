"""``GET /v1/node`` and the loader fields the node arbiter reads (``priority``,
``min_workers``): validated at creation, changed live by PATCH, shown per loader; a
loader that does not fit is given room from autotuned loaders above their floors, and
that decision is shown with its reason."""

from __future__ import annotations

import pytest

from pinfeed import Client, Conflict, InvalidRequest, WorkerLimit
from tests.api.conftest import MakeServer, synthetic


@pytest.mark.slow
def test_node_shows_the_budget_and_every_loader(make_server: MakeServer) -> None:
    server = make_server(PINFEED_MAX_WORKERS="3")
    with Client(server.url) as c:
        c.create_dataset("d", "synthetic", synthetic(32))
        c.create_loader(
            "auto", dataset="d", batch_size=4, num_workers=2, autotune={"max_workers": 3}
        )
        c.create_loader("fixed", dataset="d", batch_size=4, num_workers=1, priority=3)
        node = c.node()
        assert node["max_workers"] == 3 and node["workers_used"] == 3 and node["cpus"] >= 1
        assert node["arbiter"]["enabled"] is True and node["arbiter"]["interval_s"] == 2.0
        by = {lo["name"]: lo for lo in node["loaders"]}
        assert by["auto"]["fixed"] is False and by["auto"]["max_workers"] == 3
        assert by["fixed"]["fixed"] is True and by["fixed"]["priority"] == 3
        assert by["auto"]["trainers"] == 0 and by["auto"]["min_workers"] == 0

        # a third loader does not fit: the autotuned one, with no trainer, makes room
        c.create_loader("new", dataset="d", batch_size=4, num_workers=1, min_workers=1)
        node = c.node()
        workers = {lo["name"]: lo["workers"] for lo in node["loaders"]}
        assert workers == {"auto": 1, "fixed": 1, "new": 1}
        [room] = [d for d in node["decisions"] if d["kind"] == "room"]
        assert room["loader"] == "auto" and "room for loader 'new'" in room["reason"]
        assert room["workers"] == {"auto": 1}

        # the autotuned loader, with no trainer and min_workers 0, gives its last worker
        # (it makes its batches in the server's thread)
        c.create_loader("more", dataset="d", batch_size=4, num_workers=1)
        workers = {lo["name"]: lo["workers"] for lo in c.node()["loaders"]}
        assert workers == {"auto": 0, "fixed": 1, "new": 1, "more": 1}

        # nobody is above the floor any more: refused, with the reason
        with pytest.raises(WorkerLimit, match="worker"):
            c.create_loader("most", dataset="d", batch_size=4, num_workers=1)


def test_priority_and_min_workers_are_validated_and_live(make_server: MakeServer) -> None:
    server = make_server(PINFEED_MAX_WORKERS="8")
    with Client(server.url) as c:
        c.create_dataset("d", "synthetic", synthetic(32))
        with pytest.raises(InvalidRequest, match="min_workers"):
            c.create_loader("x", dataset="d", batch_size=4, num_workers=1, min_workers=2)
        with pytest.raises(InvalidRequest):
            c.create_loader("x", dataset="d", batch_size=4, priority=0)
        auto = {"max_workers": 2}
        c.create_loader("x", dataset="d", batch_size=4, num_workers=2, autotune=auto)
        out = c.patch_loader("x", priority=4, min_workers=1)
        assert (out["priority"], out["min_workers"], out["autotune"]) == (4, 1, out["autotune"])
        assert out["autotune"] is not None  # priority and min_workers leave autotune on
        assert {lo["name"]: lo["priority"] for lo in c.node()["loaders"]} == {"x": 4}
        with pytest.raises(Conflict, match="min_workers"):
            c.patch_loader("x", num_workers=0)  # below its guarantee
        with pytest.raises(Conflict, match="max_workers"):
            c.patch_loader("x", min_workers=3)
        assert c.loader("x")["num_workers"] == 2
