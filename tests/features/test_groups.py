"""Consumer groups: one batch for many ranks (broadcast, one copy in memory) and
round-robin distinct batches (split)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from tests.conftest import REPO, Server
from tests.fixtures.trainer import command, digest, read_log
from tests.helpers import unique

PARAMS: dict[str, Any] = {
    "length": 45,
    "seed": 5,
    "fields": [{"shape": [8, 8], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 3}],
}


def _dataset(admin: Client) -> str:
    name = unique("grp")
    admin.create_dataset(name, "synthetic", PARAMS)
    return name


def _reference(root: Path, epochs: int) -> list[str]:
    ds = build_dataset("synthetic", PARAMS, DatasetContext(root))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    return [digest(b) for _ in range(epochs) for b in dl]


def _trainers(server: Server, name: str, tmp: Path, members: int, epochs: int) -> list[Path]:
    outs = [tmp / f"m{m}.jsonl" for m in range(members)]
    procs = [
        subprocess.Popen(
            command(server.socket, name, out, "--member", str(m), "--epochs", str(epochs)),
            cwd=REPO,
        )
        for m, out in enumerate(outs)
    ]
    for p in procs:
        assert p.wait(90) == 0
    return outs


@pytest.mark.slow
def test_broadcast_four_trainers_share_one_copy(
    admin: Client, server: Server, tmp_path: Path
) -> None:
    name = unique("bcast")
    loader = admin.create_loader(
        name,
        dataset=_dataset(admin),
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=2,
        group_size=4,
    )
    # One ring for the group: the prefetch depth plus three slots per member, not 4 rings.
    assert loader["slots"]["total"] == 2 * 2 + 3 * 4
    outs = _trainers(server, name, tmp_path, 4, 2)
    logs = [read_log(out) for out in outs]
    want = _reference(server.data_root, 2)
    for log in logs:
        assert [r["digest"] for r in log] == want
    # Every member read each batch from the same slot: one copy in shared memory.
    for i in range(len(want)):
        assert len({log[i]["slot"] for log in logs}) == 1
    status = admin.loader(name)
    assert not status["consumer_attached"]
    assert status["slots"]["leased"] == 0
    admin.delete_loader(name)


@pytest.mark.slow
def test_split_round_robin(admin: Client, server: Server, tmp_path: Path) -> None:
    name = unique("split")
    admin.create_loader(
        name,
        dataset=_dataset(admin),
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=2,
        group_size=3,
        group_mode="split",
    )
    outs = _trainers(server, name, tmp_path, 3, 2)
    want = _reference(server.data_root, 2)  # 12 batches per epoch
    per_epoch = len(want) // 2
    for m, out in enumerate(outs):
        got = [r["digest"] for r in read_log(out)]
        expect = [want[e * per_epoch + i] for e in range(2) for i in range(m, per_epoch, 3)]
        assert got == expect
    union = [r["digest"] for out in outs for r in read_log(out)]
    assert sorted(union) == sorted(want) and len(set(union)) == len(set(want))
    admin.delete_loader(name)


def test_group_waits_for_a_member_that_left(admin: Client, server: Server) -> None:
    """A broadcast group stalls (it never skips) while a member is away, and says so."""
    name = unique("wait")
    admin.create_loader(
        name, dataset=_dataset(admin), batch_size=4, group_size=2, group_timeout_s=0.5
    )
    from pinfeed import GroupMemberLost

    with Loader(name, socket=server.socket, member=0, timeout=30) as a:
        it = iter(a)
        got = []
        try:
            for _ in range(12):
                got.append(next(it)[1].clone())
        except GroupMemberLost as exc:
            assert "group members [1]" in str(exc)
        else:
            raise AssertionError("member 0 ran ahead of the absent member 1")
        status = admin.loader(name)
        assert [m["attached"] for m in status["members"]] == [True, False]
    admin.delete_loader(name)
