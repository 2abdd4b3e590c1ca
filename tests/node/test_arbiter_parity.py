"""The node arbiter's moves under attached trainers lose, repeat or reorder nothing, and
leave the augmentations DataLoader's: live PATCH's parity test (tests/features/
test_patch.py) with the arbiter moving the workers every few batches instead of the
test. Two autotuned loaders over a dataset that draws from the global RNGs (random
crops, flips, noise) and costs some decode, on a node of 3 worker processes with
0.1 s rounds; their priorities swap every 12 batches, so the arbiter moves workers
from one to the other (down to 0, the server's own thread, for the lower one) while
both trainers read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.features.test_augment import _check, _copy, _loader, _reference

EPOCHS = 12  # of 8 batches
FLIP_EVERY = 12  # batches
MOVES = ("grow", "move", "shrink", "undo", "room")


@pytest.fixture()
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"PINFEED_MAX_WORKERS": "3", "PINFEED_ARBITER_INTERVAL_S": "0.1"}
    server = Server(tmp_path_factory.mktemp("node"), env=env)
    server.start()
    yield server
    server.stop()


def test_arbiter_moves_keep_every_batch_and_augmentation(node: Server) -> None:
    want = _reference(EPOCHS, 3, info=False)  # streams: autotune's max_workers
    with Client(node.url) as admin:
        auto = {"autotune": {"max_workers": 3, "interval_s": 0.2}}
        kwargs = {"info": False, "delay_s": 0.004}
        names = [_loader(admin, 1, kwargs=kwargs, **auto) for _ in range(2)]
        got: tuple[list[list[Any]], list[list[Any]]] = ([], [])
        seen_workers: list[dict[str, int]] = []
        batches = 0
        with Loader(names[0], socket=node.socket) as a, Loader(names[1], socket=node.socket) as b:
            for _ in range(EPOCHS):
                for out in got:
                    out.append([])
                for batch_a, batch_b in zip(a, b, strict=True):
                    got[0][-1].append(_copy(batch_a))
                    got[1][-1].append(_copy(batch_b))
                    batches += 1
                    if batches % FLIP_EVERY == 0:
                        high = names[(batches // FLIP_EVERY) % 2]
                        for name in names:
                            admin.patch_loader(name, priority=5 if name == high else 1)
                        node_now = admin.node()
                        seen_workers.append(
                            {lo["name"]: lo["workers"] for lo in node_now["loaders"]}
                        )
        decisions = admin.node()["decisions"]
        for name in names:
            admin.delete_loader(name)
    _check(got[0], want)
    _check(got[1], want)
    moves = [d for d in decisions if d["kind"] in MOVES]
    assert len(moves) >= 3, decisions  # the arbiter moved workers while both read
    assert len({tuple(sorted(w.items())) for w in seen_workers}) >= 2, seen_workers
