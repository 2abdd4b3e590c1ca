"""PATCH num_workers/prefetch_factor under live trainers, whatever the ring had: the
ring grows (a further memfd segment) and shrinks back; no batch is lost, repeated or
reordered, views held across the change stay valid, 0 <-> >0 workers swaps the
producer; only the memory budget refuses (507)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import Server
from tests.features.test_augment import INIT, _check, _copy, _loader, _reference
from tests.fixtures.trainer import digest
from tests.helpers import unique

PARAMS: dict[str, Any] = {"length": 96, "seed": 2, "fields": [{"shape": [4], "dtype": "float32"}]}
# The sequence: 1 -> 4 workers, then 2 with prefetch_factor 8, then 0.
CHANGES = [{"num_workers": 4}, {"num_workers": 2, "prefetch_factor": 8}, {"num_workers": 0}]


def _setup(admin: Client, server: Server, group_size: int = 1) -> tuple[str, list[str]]:
    ds = unique("patch")
    admin.create_dataset(ds, "synthetic", PARAMS)
    name = unique("patch")
    admin.create_loader(
        name, dataset=ds, batch_size=4, shuffle=True, seed=6, num_workers=1, group_size=group_size
    )
    ref = DataLoader(
        build_dataset("synthetic", PARAMS, DatasetContext(server.data_root)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(6),
    )
    return name, [digest(b) for _ in range(2) for b in ref]


def _patch(admin: Client, name: str, change: dict[str, int]) -> dict[str, Any]:
    out = admin.patch_loader(name, **change)  # raises unless 200
    for key, value in change.items():
        assert out[key] == value and admin.loader(name)[key] == value
    return out


def test_patch_1_to_4_to_2x8_to_0_keeps_every_batch(admin: Client, server: Server) -> None:
    name, want = _setup(admin, server)
    created = admin.loader(name)
    at = {3: CHANGES[0], 10: CHANGES[1], 30: CHANGES[2]}  # after that many batches
    rings: list[dict[str, Any]] = []
    got: list[str] = []
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            for batch in loader:
                got.append(digest(batch))
                if len(got) in at:
                    rings.append(_patch(admin, name, at[len(got)]))
    assert got == want
    # 1 x 2 + 3 slots as created; 4 x 2 + 3 and 2 x 8 + 3 grew it; at 0 it shrank back.
    assert created["slots"]["total"] == 5 and created["ring_segments"] == 1
    assert [r["slots"]["total"] for r in rings[:2]] == [11, 19]
    assert rings[1]["ring_segments"] == 3
    final = admin.loader(name)
    assert (final["slots"]["total"], final["ring_segments"]) == (5, 1)
    assert final["ring_bytes"] == created["ring_bytes"]
    admin.delete_loader(name)


def test_patch_under_a_broadcast_group_of_two(admin: Client, server: Server) -> None:
    name, want = _setup(admin, server, group_size=2)
    at = {3: CHANGES[0], 10: CHANGES[1], 30: CHANGES[2]}
    got: tuple[list[str], list[str]] = ([], [])
    with Loader(name, socket=server.socket) as a, Loader(name, socket=server.socket) as b:
        for _ in range(2):
            for batch_a, batch_b in zip(a, b, strict=True):
                got[0].append(digest(batch_a))
                got[1].append(digest(batch_b))
                if len(got[0]) in at:
                    _patch(admin, name, at[len(got[0])])
    assert got == (want, want)
    admin.delete_loader(name)


def test_a_view_held_across_the_change_stays_valid(admin: Client, server: Server) -> None:
    """A copy=False trainer keeps a view into a grown segment while the PATCH to 0
    retires it: the view still reads its batch (the segment stays mapped, and its slot
    is filled no more), and the view of the current batch reads right after each PATCH."""
    name, want = _setup(admin, server)
    got: list[str] = []
    held: tuple[int, Any] | None = None
    with Loader(name, socket=server.socket) as loader:
        assert loader.device is None and not loader.copy
        for _ in range(2):
            for batch in loader:
                i = len(got)
                got.append(digest(batch))
                if i == 2:
                    _patch(admin, name, CHANGES[0])
                    assert digest(batch) == want[i]  # the current view, after the growth
                if held is None and i > 2 and not loader._conn.ring.contains(batch[0]):  # type: ignore[union-attr]
                    assert loader.ring_contains(batch[0])  # in segment 1
                    held = (i, batch)
                    _patch(admin, name, CHANGES[2])
                    assert digest(batch) == want[i]
                if held is not None:
                    assert digest(held[1]) == want[held[0]]  # long after its release
    assert held is not None
    assert got == want
    assert admin.loader(name)["ring_segments"] == 1  # the held segment closed meanwhile
    admin.delete_loader(name)


@pytest.mark.parametrize(
    ("created", "steps", "workers", "kwargs"),
    [
        # Created with 3 workers: at 0 the server serves their 3 streams itself.
        (3, {(0, 2): 0, (1, 1): 2, (1, 5): 0}, 3, {}),
        # Created at 0 (DataLoader's one non-persistent worker): processes serve it.
        (0, {(0, 2): 2, (1, 3): 0}, 1, {"info": False}),
    ],
)
def test_switching_0_and_workers_keeps_augmentations(
    admin: Client,
    server: Server,
    created: int,
    steps: dict[tuple[int, int], int],
    workers: int,
    kwargs: dict[str, Any],
) -> None:
    """Random augmentations stay DataLoader(num_workers=<as created>)'s across PATCHes
    between 0 and >0 workers (the RNG streams are the created loader's)."""
    init = created > 0
    want = _reference(2, workers, init=init, **kwargs)
    extra: dict[str, Any] = {"worker_init_fn": INIT} if init else {}
    name = _loader(admin, created, kwargs=kwargs, **extra)
    got: list[list[Any]] = []
    with Loader(name, socket=server.socket) as loader:
        for epoch in range(2):
            got.append([])
            for index, batch in enumerate(loader):
                got[-1].append(_copy(batch))
                if (epoch, index) in steps:
                    _patch(admin, name, {"num_workers": steps[(epoch, index)]})
    _check(got, want)
    admin.delete_loader(name)
