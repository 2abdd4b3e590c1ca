"""``sampler`` and ``batch_sampler`` loader fields: a user's Sampler, built in the server
by ``factory(dataset, **kwargs)`` (``tests/fixtures/samplers.py``), gives DataLoader's
batches batch for batch, epoch after epoch, across seeks and a resume in a new trainer
process; bad values are a 422 and the server carries on."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pinfeed import BatchTooLarge, Client, InvalidRequest, Loader, NotFound
from pinfeed_server.engine.custom_sampler import BatchSamplerSpec, SamplerSpec, custom_plan
from tests.conftest import REPO, Server
from tests.fixtures import samplers
from tests.fixtures.trainer import command, digest, read_log
from tests.helpers import assert_same, register_synthetic, unique

PARAMS: dict[str, Any] = {
    "length": 40,
    "seed": 3,
    "fields": [{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int64", "high": 100}],
}
BUCKETS = {"factory": "tests.fixtures.samplers:BucketBatchSampler", "kwargs": {"seed": 9}}


@pytest.fixture(scope="module")
def dataset(server: Server) -> tuple[str, Any]:
    return register_synthetic(server, PARAMS, "smp")


def _copy(batch: Any) -> Any:
    """A batch that outlives its slot (a pinfeed batch is a view of a ring slot, reused
    once the trainer asks for the next one)."""
    return [t.clone() for t in batch]


def _epochs(loader: Any, epochs: int) -> list[list[Any]]:
    return [[_copy(b) for b in loader] for _ in range(epochs)]


def _same_epochs(got: list[list[Any]], want: list[list[Any]]) -> None:
    assert [len(e) for e in got] == [len(e) for e in want]
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (gb, wb) in enumerate(zip(g, w, strict=True)):
            assert_same(gb, wb, f"epoch {e} batch {i}")


# -- the plan, in-process ------------------------------------------------------------------
def _plan(spec: SamplerSpec, ds: Any, **kw: Any) -> Any:
    return custom_plan(
        "batch_sampler" if isinstance(spec, BatchSamplerSpec) else "sampler",
        spec,
        ds,
        ("tests.fixtures",),
        batch_size=kw.get("batch_size", 1),
        drop_last=kw.get("drop_last", False),
    )


def test_plan_random_access_replays_the_samplers_epochs() -> None:
    ds = list(range(40))
    ref = samplers.BucketBatchSampler(ds, seed=9)
    want = [list(ref) for _ in range(5)]
    plan = _plan(BatchSamplerSpec.model_validate(BUCKETS), ds)
    assert len(plan) == len(ref) and plan.max_rows == 6 and plan.samples == 40
    assert [list(plan.batches(e)) for e in range(4)] == want[:4]
    assert list(plan.batches(3, 2)) == want[3][2:]  # kept: no replay
    assert list(plan.batches(0, 5)) == want[0][5:]  # replayed from a fresh instance
    assert list(plan.batches(4, 1)) == want[4][1:]  # forward again, past an epoch
    it = plan.batches(1)
    assert next(it) == want[1][0]  # abandoned mid-epoch: the next epoch is still right
    assert list(plan.batches(2)) == want[2]


def test_plan_of_an_unsized_sampler_counts_its_first_epoch() -> None:
    ds = list(range(11))
    plan = _plan(SamplerSpec(factory="tests.fixtures.samplers:Unsized"), ds, batch_size=4)
    want = [b.tolist() for b in DataLoader(ds, batch_size=4, sampler=samplers.Unsized(ds))]
    assert len(plan) == 2 and plan.samples == 6
    assert list(plan.batches(1)) == want


# -- against DataLoader through a real server ------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_bucketing_batch_sampler_equals_dataloader(
    admin: Client, server: Server, dataset: tuple[str, Any], num_workers: int
) -> None:
    name, ds = dataset
    loader_name = unique("bucket")
    admin.create_loader(
        loader_name, dataset=name, batch_sampler=BUCKETS, num_workers=num_workers, seed=1
    )
    ref = DataLoader(ds, batch_sampler=samplers.BucketBatchSampler(ds, seed=9))
    want = _epochs(ref, 3)
    assert {len(b[1]) for e in want for b in e} == {1, 2, 3, 4, 5, 6}  # variable sizes
    with Loader(loader_name, socket=server.socket) as loader:
        assert len(loader) == len(ref)
        assert len(loader.sampler) == len(ref.sampler) == len(ds)
        assert loader.batch_size is ref.batch_size is None
        got = _epochs(loader, 3)
    _same_epochs(got, want)
    public = admin.loader(loader_name)
    assert public["batch_sampler"]["factory"] == BUCKETS["factory"]
    assert public["batches_per_epoch"] == len(ref)


def test_weighted_random_sampler_equals_dataloader(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    name, ds = dataset
    kwargs = {"num_samples": 30, "seed": 4}
    loader_name = unique("weighted")
    admin.create_loader(
        loader_name,
        dataset=name,
        batch_size=4,
        drop_last=True,
        num_workers=2,
        sampler={"factory": "tests.fixtures.samplers:weighted", "kwargs": kwargs},
    )
    ref = DataLoader(ds, batch_size=4, drop_last=True, sampler=samplers.weighted(ds, **kwargs))
    want = _epochs(ref, 2)
    with Loader(loader_name, socket=server.socket) as loader:
        assert (len(loader), len(loader.sampler)) == (len(ref), 30)
        _same_epochs(_epochs(loader, 2), want)
    # Its generator advanced: the second epoch is another draw.
    assert [b[1].tolist() for b in want[0]] != [b[1].tolist() for b in want[1]]


def test_set_epoch_is_called_before_each_epoch(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    name, ds = dataset
    kwargs = {"num_replicas": 3, "rank": 1, "shuffle": True, "seed": 5}
    loader_name = unique("setepoch")
    admin.create_loader(
        loader_name,
        dataset=name,
        batch_size=3,
        sampler={"factory": "tests.fixtures.samplers:distributed", "kwargs": kwargs},
    )
    sampler = samplers.distributed(ds, **kwargs)
    ref = DataLoader(ds, batch_size=3, sampler=sampler)
    want = []
    for epoch in range(3):
        sampler.set_epoch(epoch)  # what the server does for its copy
        want.append(list(ref))
    with Loader(loader_name, socket=server.socket) as loader:
        _same_epochs(_epochs(loader, 3), want)
        loader.set_epoch(1)  # back to an epoch: the same batches again
        _same_epochs(_epochs(loader, 1), want[1:2])


@pytest.mark.slow
def test_resume_mid_epoch_in_a_new_trainer_process(
    admin: Client, server: Server, dataset: tuple[str, Any], tmp_path: Path
) -> None:
    name, ds = dataset
    loader_name = unique("bucket-resume")
    admin.create_loader(loader_name, dataset=name, batch_sampler=BUCKETS, num_workers=2)
    ref = DataLoader(ds, batch_sampler=samplers.BucketBatchSampler(ds, seed=9))
    per_epoch = len(ref)
    want = [digest(b) for _ in range(2) for b in ref]
    state, first, second = tmp_path / "state.json", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    at = per_epoch + 3  # 3 batches into the second epoch
    run = [
        *("--epochs", "2", "--state-at", str(at), "--state-file", str(state)),
        *("--die-after", "4"),
    ]
    code = subprocess.run(command(server.socket, loader_name, first, *run), cwd=REPO, timeout=60)
    assert code.returncode == -signal.SIGKILL
    again = command(server.socket, loader_name, second, "--resume", str(state), "--epochs", "1")
    assert subprocess.run(again, cwd=REPO, timeout=60).returncode == 0
    got = [r["digest"] for r in read_log(first)][:at] + [r["digest"] for r in read_log(second)]
    assert got == want


def test_a_batch_larger_than_the_slots_is_a_per_batch_error(
    admin: Client, server: Server, dataset: tuple[str, Any]
) -> None:
    name, ds = dataset
    loader_name, ok = unique("growing"), unique("growing-ok")
    try:
        admin.create_loader(
            loader_name,
            dataset=name,
            batch_sampler={"factory": "tests.fixtures.samplers:GrowingBatches"},
        )
        with Loader(loader_name, socket=server.socket) as loader:
            assert [len(b[1]) for b in loader] == [2] * 20  # the slots hold 2
            it = iter(loader)
            for _ in range(2):  # each batch of 3 fails on its own; the loader goes on
                with pytest.raises(BatchTooLarge, match="max_batch_size to at least 3"):
                    next(it)
        admin.create_loader(
            ok,
            dataset=name,
            batch_sampler={
                "factory": "tests.fixtures.samplers:GrowingBatches",
                "max_batch_size": 3,
            },
        )
        with Loader(ok, socket=server.socket) as loader:
            assert len(list(loader)) == 20
            second = [_copy(b) for b in loader]
        want = torch.stack([ds[i][1] for i in range(3)])
        assert [len(b[1]) for b in second] == [3] * 13 and torch.equal(second[0][1], want)
    finally:
        # Deleted, not left idle: from epoch 39 on GrowingBatches' epochs are empty, and
        # the server's producer, which runs ahead across epochs until the ring is full,
        # then loops through empty epochs that take no slot, a core for the rest of the
        # session (it slowed every later test on the shared server).
        for lo in (loader_name, ok):
            with contextlib.suppress(NotFound):
                admin.delete_loader(lo)


GOOD = {"factory": "tests.fixtures.samplers:Unsized"}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"sampler": {"factory": "os.path:join"}}, "sampler factory 'os.path:join'.*not allowed"),
        (
            {"sampler": {"factory": "tests.fixtures.nosuch:make"}},
            "sampler factory 'tests.fixtures.nosuch:make' cannot be imported",
        ),
        (
            {"batch_sampler": {"factory": "tests.fixtures.samplers:missing"}},
            "batch_sampler factory .* cannot be imported",
        ),
        (
            {"sampler": {"factory": "tests.fixtures.samplers:NOT_CALLABLE"}},
            "sampler factory .* is a int, not a callable",
        ),
        (
            {"sampler": {"factory": "tests.fixtures.samplers:raises"}},
            "sampler: its factory.* raised RuntimeError: no sampler today",
        ),
        (
            {"sampler": {"factory": "tests.fixtures.samplers:weighted", "kwargs": {"x": 1}}},
            "sampler: its factory.* raised TypeError",
        ),
        (
            {"batch_sampler": {"factory": "tests.fixtures.samplers:not_a_sampler"}},
            "batch_sampler: its factory returned a list, not a torch.utils.data.Sampler",
        ),
        (
            {"sampler": {"factory": "tests.fixtures.samplers:OutOfRange"}},
            "sampler yielded indices .* outside the dataset's 40 samples",
        ),
        (
            {
                "sampler": {"factory": "tests.fixtures.samplers:Unsized"},
                "batch_size": 2,
                "batch_sampler": BUCKETS,
            },
            "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
            "and drop_last .got batch_size=2, sampler=",
        ),
        ({"batch_sampler": BUCKETS, "drop_last": True}, "exclusive.*got drop_last=True"),
        ({"batch_sampler": BUCKETS, "shuffle": True}, "exclusive.*got shuffle=True"),
        ({"sampler": GOOD, "shuffle": True}, "sampler option is mutually exclusive with shuffle"),
        ({"sampler": GOOD, "world_size": 2}, "world_size shards .* a sampler shards itself"),
        (
            {"batch_sampler": {**BUCKETS, "max_batch_size": 4}},
            "a batch of 6 samples, over max_batch_size 4",
        ),
        ({"sampler": {"factory": "no colon"}}, "sampler.factory"),
    ],
)
def test_bad_samplers_are_422_and_the_server_carries_on(
    admin: Client, server: Server, dataset: tuple[str, Any], fields: dict[str, Any], needle: str
) -> None:
    name, _ = dataset
    good = unique("alongside")
    admin.create_loader(good, dataset=name, sampler=GOOD, batch_size=3)
    bad = unique("bad")
    with pytest.raises(InvalidRequest, match=needle):
        admin.create_loader(bad, dataset=name, **fields)
    assert bad not in {row["name"] for row in admin.loaders()}
    with Loader(good, socket=server.socket) as loader:
        assert [len(b[1]) for b in loader] == [3] * 6 + [2]
    admin.delete_loader(good)


@pytest.mark.slow
def test_resume_across_a_server_restart_replays_the_sampler(restartable: Server) -> None:
    srv = restartable
    name, ds = register_synthetic(srv, PARAMS, "smp")
    loader_name = unique("bucket-restart")
    with srv.client() as admin:
        admin.create_loader(loader_name, dataset=name, batch_sampler=BUCKETS)
    ref = DataLoader(ds, batch_sampler=samplers.BucketBatchSampler(ds, seed=9))
    want = _epochs(ref, 3)
    with Loader(loader_name, socket=srv.socket) as loader:
        got = _epochs(loader, 1)
        it = iter(loader)
        got.append([_copy(next(it)) for _ in range(4)])
        state = loader.state_dict()
    assert srv.stop() == 0
    srv.start()  # the loader comes back from the registry: its sampler is replayed
    with Loader(loader_name, socket=srv.socket) as loader:
        loader.load_state_dict(state)
        got[1] += _epochs(loader, 1)[0]
        got += _epochs(loader, 1)
    _same_epochs(got, want)
