"""The service's rules, in-process: a real ``Service`` over a real SQLite registry and
real ``synthetic`` / ``npy`` datasets, with loaders whose batches are made in the
service's own threads (``num_workers=0``, or ``executor: "thread"`` for worker counts),
so no process is forked and no trainer is needed. What HTTP adds (status codes, the
problem+json bodies) is tested over a real server in tests/api.

Names unique; a dataset in use stays; admission (the worker cap and the memory budget,
a live change admitted against the other loaders); loaders that cannot start after a
restart listed as failed; PATCH semantics; the registry after a live change.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from pinfeed import errors
from pinfeed_server import schemas
from pinfeed_server.engine import config
from pinfeed_server.engine.config import LiveChange
from pinfeed_server.schemas import DatasetCreate, LoaderCreate, LoaderPatch
from pinfeed_server.service import Service
from pinfeed_server.settings import Settings
from tests.reliability.procs import wait_for

MiB = 1 << 20
SAMPLE_BYTES = 64 * 1024 * 4  # one float32 field of 64 Ki elements: 256 KiB a sample
AUTOTUNE = {"max_workers": 3, "max_prefetch_factor": 4, "interval_s": 5.0}

MakeService = Callable[..., Service]


def synthetic(length: int = 32, elements: int = 64 * 1024) -> dict[str, Any]:
    return {"length": length, "seed": 1, "fields": [{"shape": [elements], "dtype": "float32"}]}


@pytest.fixture()
def make_service(tmp_path: Path) -> Iterator[MakeService]:
    """Services over one state dir (so a second one is the first restarted); each is
    closed at teardown, also when the test fails."""
    made: list[Service] = []

    def make(**settings: Any) -> Service:
        values = {
            "state_dir": tmp_path / "state",
            "data_root": tmp_path / "data",
            "socket": tmp_path / "run" / "s.sock",
            "max_workers": 8,
            "max_shm_bytes": 256 * MiB,
        }
        (tmp_path / "data").mkdir(exist_ok=True)
        service = Service(Settings.model_validate(values | settings))
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


def restart(old: Service, make: MakeService, **settings: Any) -> Service:
    """``old`` closed, and a new service over its registry started from it."""
    old.close()
    new = make(**settings)
    new.restore()
    return new


def dataset(service: Service, name: str = "d", **params: Any) -> dict[str, Any]:
    body = DatasetCreate.model_validate(
        {"name": name, "kind": "synthetic", "params": synthetic(**params)}
    )
    return service.create_dataset(body)


def loader(service: Service, name: str, ds: str = "d", **fields: Any) -> dict[str, Any]:
    return service.create_loader(
        LoaderCreate.model_validate({"name": name, "dataset": ds, **fields})
    )


def patch(service: Service, name: str, **fields: Any) -> dict[str, Any]:
    return service.patch_loader(name, LoaderPatch.model_validate(fields))


def registered(service: Service, name: str) -> dict[str, Any]:
    """Loader ``name``'s config as the registry holds it."""
    return next(r.config for r in service.registry.loaders() if r.name == name)


# -- names ------------------------------------------------------------------------------
def test_dataset_and_loader_names_are_unique(make_service: MakeService) -> None:
    service = make_service()
    assert dataset(service)["length"] == 32
    with pytest.raises(errors.Conflict, match="dataset 'd' exists"):
        dataset(service, length=8)
    assert service.describe_dataset("d")["params"]["length"] == 32  # the first one stays
    loader(service, "a", batch_size=4)
    with pytest.raises(errors.Conflict, match="loader 'a' exists"):
        loader(service, "a", batch_size=8)
    assert [lo["batch_size"] for lo in service.list_loaders()] == [4]
    # a dataset may share a loader's name: they are different resources
    dataset(service, "a")
    assert {d["name"] for d in service.list_datasets()} == {"a", "d"}


def test_a_name_held_by_a_loader_that_failed_to_start_stays_taken(
    make_service: MakeService,
) -> None:
    service = make_service()
    dataset(service)
    loader(service, "a", batch_size=4)
    service = restart(service, make_service, max_shm_bytes=1)  # nothing fits
    assert service.describe_loader("a")["state"] == "failed"
    with pytest.raises(errors.Conflict, match="loader 'a' exists"):
        loader(service, "a", batch_size=1)


def test_unknown_names_are_not_found(make_service: MakeService) -> None:
    service = make_service()
    for call in (
        lambda: service.describe_dataset("nope"),
        lambda: service.delete_dataset("nope"),
        lambda: service.describe_loader("nope"),
        lambda: service.delete_loader("nope"),
        lambda: service.loader_stats("nope"),
        lambda: patch(service, "nope", num_workers=1),
        lambda: loader(service, "a", "nope", batch_size=1),
    ):
        with pytest.raises(errors.NotFound):
            call()


# -- datasets in use ----------------------------------------------------------------------
def test_a_dataset_in_use_cannot_be_deleted(make_service: MakeService) -> None:
    service = make_service()
    dataset(service)
    loader(service, "b", batch_size=4)
    loader(service, "a", batch_size=4)
    with pytest.raises(errors.Conflict, match=r"used by loaders \['a', 'b'\]"):
        service.delete_dataset("d")
    service.delete_loader("a")
    with pytest.raises(errors.Conflict, match=r"used by loaders \['b'\]"):
        service.delete_dataset("d")
    service.delete_loader("b")
    service.delete_dataset("d")
    assert service.list_datasets() == [] and service.registry.datasets() == []
    dataset(service, length=8)  # the name is free again, with the new params
    assert service.describe_dataset("d")["length"] == 8


def test_a_loader_that_failed_to_start_still_holds_its_dataset(
    make_service: MakeService,
) -> None:
    service = make_service()
    dataset(service)
    loader(service, "a", batch_size=4)
    service = restart(service, make_service, max_shm_bytes=1)
    with pytest.raises(errors.Conflict, match=r"used by loaders \['a'\]"):
        service.delete_dataset("d")
    service.delete_loader("a")
    service.delete_dataset("d")


# -- admission: the worker cap -----------------------------------------------------------
def test_worker_cap_counts_every_loaders_workers(make_service: MakeService) -> None:
    service = make_service(max_workers=3)
    dataset(service)
    loader(service, "two", batch_size=4, num_workers=2, executor="thread")
    with pytest.raises(errors.WorkerLimit) as info:
        loader(service, "more", batch_size=4, num_workers=2, executor="thread")
    assert (info.value.max_workers, info.value.free_workers) == (3, 1)
    assert isinstance(info.value, errors.Conflict)  # a 409, for callers that catch that
    assert "more" not in service.loaders and "more" not in {
        r.name for r in service.registry.loaders()
    }
    loader(service, "one", batch_size=4, num_workers=1, executor="thread")  # the bound
    loader(service, "inline", batch_size=4)  # num_workers=0 takes no worker
    assert service.workers_used() == 3
    service.delete_loader("one")
    loader(service, "again", batch_size=4, num_workers=1, executor="thread")


def test_a_live_change_is_admitted_against_the_other_loaders(
    make_service: MakeService,
) -> None:
    service = make_service(max_workers=4)
    dataset(service)
    loader(service, "a", batch_size=4, num_workers=2, executor="thread")
    loader(service, "b", batch_size=4, num_workers=1, executor="thread")
    # a's own two workers are not counted against it: 3 of 4 free for a
    assert patch(service, "a", num_workers=3)["num_workers"] == 3
    with pytest.raises(errors.WorkerLimit) as info:
        patch(service, "a", num_workers=4)
    assert info.value.free_workers == 3
    # refused: nothing changed, in the engine or in the registry
    assert service.describe_loader("a")["num_workers"] == 3
    assert registered(service, "a")["num_workers"] == 3
    assert patch(service, "a", num_workers=1)["num_workers"] == 1  # fewer: always
    assert patch(service, "b", num_workers=3)["num_workers"] == 3  # a's freed workers


# -- admission: the memory budget --------------------------------------------------------
def test_rings_over_the_memory_budget_are_refused_with_need_and_free(
    make_service: MakeService,
) -> None:
    # batch 4 of 256 KiB samples: 1 MiB slots; num_workers=0 rings have 4 slots (1 made
    # ahead, 3 a trainer's)
    service = make_service(max_shm_bytes=5 * MiB)
    dataset(service)
    first = loader(service, "a", batch_size=4)
    used = first["ring_bytes"]
    assert first["slots"]["total"] == 4 and used >= 4 * 4 * SAMPLE_BYTES
    assert service.shm_used() == used
    with pytest.raises(errors.InsufficientMemory) as info:
        loader(service, "b", batch_size=4)
    assert info.value.free_bytes == 5 * MiB - used
    assert info.value.need_bytes is not None and info.value.need_bytes > 5 * MiB - used
    assert "b" not in service.loaders and len(service.registry.loaders()) == 1
    service.delete_loader("a")  # its ring goes back to the budget
    assert service.shm_used() == 0
    loader(service, "b", batch_size=4)


def test_a_live_change_whose_ring_outgrows_the_budget_is_refused(
    make_service: MakeService,
) -> None:
    service = make_service(max_shm_bytes=8 * MiB)
    dataset(service)
    slot = loader(service, "a", batch_size=4, num_workers=1, executor="thread")["slot_bytes"]
    with pytest.raises(errors.InsufficientMemory) as info:
        patch(service, "a", num_workers=4)  # 4 x 2 ahead + 3 for the trainer
    assert info.value.need_bytes == (4 * 2 + 3) * slot
    assert info.value.free_bytes == 8 * MiB  # the loader's own ring counts as free
    with pytest.raises(errors.InsufficientMemory):
        patch(service, "a", prefetch_factor=8)
    assert service.describe_loader("a")["num_workers"] == 1
    assert registered(service, "a")["num_workers"] == 1
    grown = patch(service, "a", num_workers=2)
    assert grown["slots"]["total"] == 2 * 2 + 3
    assert service.shm_used() == (2 * 2 + 3) * slot


# -- loaders that cannot start after a restart ----------------------------------------------
def test_loaders_that_cannot_start_after_a_restart_are_listed_as_failed(
    make_service: MakeService, tmp_path: Path
) -> None:
    service = make_service()
    np.save(tmp_path / "data" / "x.npy", np.arange(64, dtype=np.float32).reshape(16, 4))
    service.create_dataset(
        DatasetCreate.model_validate(
            {"name": "file", "kind": "npy", "params": {"paths": ["x.npy"]}}
        )
    )
    dataset(service)
    loader(service, "ok", batch_size=2)
    loader(service, "gone", "file", batch_size=2)
    loader(service, "big", batch_size=16)  # a 12 MiB ring
    (tmp_path / "data" / "x.npy").unlink()

    service = restart(service, make_service, max_shm_bytes=8 * MiB)
    states = {lo["name"]: lo["state"] for lo in service.list_loaders()}
    assert states == {"big": "failed", "gone": "failed", "ok": states["ok"]}
    assert states["ok"] in ("starting", "ready")
    big, gone = service.describe_loader("big"), service.describe_loader("gone")
    assert "PINFEED_MAX_SHM_BYTES" in big["failure"]["detail"]
    assert "x.npy" in gone["failure"]["detail"]
    # still the loader it was: its config, its dataset, no batch layout, zero stats
    assert (big["batch_size"], big["dataset"], big["batch"]) == (16, "d", None)
    stats = service.loader_stats("big")
    assert (stats.batches_produced, stats.batches_consumed, stats.samples_per_s) == (0, 0, 0)
    assert [cfg["name"] for cfg, _, _ in service.unstarted()] == ["big", "gone"]
    with pytest.raises(errors.Conflict, match="failed to start"):
        patch(service, "big", num_workers=1)
    # deleted like any loader, from the registry too
    service.delete_loader("big")
    assert {r.name for r in service.registry.loaders()} == {"gone", "ok"}
    assert "big" not in {lo["name"] for lo in service.list_loaders()}


# -- PATCH semantics ----------------------------------------------------------------------------
def test_explicit_values_turn_autotune_off(make_service: MakeService) -> None:
    service = make_service()
    dataset(service)
    loader(service, "a", batch_size=4, num_workers=1, executor="thread", autotune=AUTOTUNE)
    assert service.describe_loader("a")["autotune"]["max_workers"] == 3
    off = patch(service, "a", num_workers=2)
    assert (off["num_workers"], off["autotune"]) == (2, None)
    assert service.loaders["a"].tuner is None

    patch(service, "a", autotune=AUTOTUNE)
    off = patch(service, "a", prefetch_factor=3)  # prefetch_factor alone, too
    assert (off["num_workers"], off["prefetch_factor"], off["autotune"]) == (2, 3, None)


def test_autotune_alone_turns_it_on_and_null_turns_it_off(make_service: MakeService) -> None:
    service = make_service()
    dataset(service)
    loader(service, "a", batch_size=4, num_workers=1, executor="thread")
    on = patch(service, "a", autotune=AUTOTUNE)
    assert on["autotune"] == AUTOTUNE and (on["num_workers"], on["prefetch_factor"]) == (1, 2)
    assert service.loaders["a"].tuner is not None
    kept = patch(service, "a")  # an empty PATCH changes nothing
    assert kept["autotune"] == AUTOTUNE
    off = patch(service, "a", autotune=None)
    assert off["autotune"] is None and off["num_workers"] == 1
    assert service.loaders["a"].tuner is None
    # values with autotune given as well: both apply
    both = patch(service, "a", num_workers=2, autotune=AUTOTUNE)
    assert (both["num_workers"], both["autotune"]) == (2, AUTOTUNE)


# -- the registry after a live change -------------------------------------------------------------
def test_a_live_change_is_in_the_registry_and_survives_a_restart(
    make_service: MakeService,
) -> None:
    service = make_service()
    dataset(service)
    loader(service, "a", batch_size=4, num_workers=1, executor="thread", seed=5)
    before = registered(service, "a")
    patch(service, "a", num_workers=2, prefetch_factor=3)
    row = registered(service, "a")
    assert (row["num_workers"], row["prefetch_factor"], row["autotune"]) == (2, 3, None)
    live = {"num_workers", "prefetch_factor", "autotune"}
    assert {k: v for k, v in row.items() if k not in live} == {
        k: v for k, v in before.items() if k not in live
    }
    patch(service, "a", autotune=AUTOTUNE)
    assert registered(service, "a")["autotune"] == AUTOTUNE

    service = restart(service, make_service)
    back = service.describe_loader("a")
    assert (back["num_workers"], back["prefetch_factor"], back["autotune"]) == (2, 3, AUTOTUNE)
    assert (back["seed"], back["executor"]) == (5, "thread")


# -- a script's server ------------------------------------------------------------------
def test_a_scripts_server_keeps_a_registry_of_its_own(make_service: MakeService) -> None:
    """What ``pinfeed serve`` registered is not restored by a server a script started
    (PINFEED_STARTED_BY=script), and what is made on that one stays out of the file."""
    serve = make_service()
    dataset(serve)
    loader(serve, "theirs", batch_size=4)
    script = restart(serve, make_service, started_by="script")
    assert script.list_loaders() == [] and script.list_datasets() == []
    assert script.node().lifetime.started_by == "script"
    dataset(script, "mine")
    loader(script, "mine", "mine", batch_size=4)
    serve = restart(script, make_service)
    assert [lo["name"] for lo in serve.list_loaders()] == ["theirs"]
    assert [d["name"] for d in serve.list_datasets()] == ["d"]
    assert serve.node().lifetime.started_by == "serve"


def test_only_a_trainer_holds_off_the_idle_exit(make_service: MakeService) -> None:
    """PINFEED_IDLE_EXIT_S counts from the last trainer's connection: a loader with no
    trainer does not hold it off; GET /v1/node says how long is left."""
    service = make_service(idle_exit_s=30)
    dataset(service)
    loader(service, "idle", batch_size=4)
    service.dataplane.start()
    life = service.node().lifetime
    assert (life.started_by, life.idle_exit_s) == ("serve", 30)
    assert life.exits_in_s is not None and 29 < life.exits_in_s <= 30
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as trainer:
        trainer.connect(str(service.settings.socket_path))
        wait_for(lambda: service.node().lifetime.exits_in_s is None, "the trainer counted")
        time.sleep(0.3)  # the clock restarts when it leaves, not when it came
    left = wait_for(lambda: service.node().lifetime.exits_in_s, "the trainer gone")
    assert 29 < left <= 30
    assert make_service().node().lifetime.exits_in_s is None  # no PINFEED_IDLE_EXIT_S


# -- a live field, declared once -----------------------------------------------------------------
@pytest.fixture()
def live_group_timeout(monkeypatch: pytest.MonkeyPatch) -> type[BaseModel]:
    """``group_timeout_s`` made live as any new live field is: one line of ``LIVE`` (and
    no apply step: the engine reads it at each use). Returns the PATCH body derived."""
    monkeypatch.setitem(config.LIVE, "group_timeout_s", "how long a group waits (live)")
    return schemas.live_patch()


def test_a_new_live_field_is_one_line_seen_by_patch_autotune_and_the_arbiter(
    make_service: MakeService, live_group_timeout: type[BaseModel]
) -> None:
    service = make_service(max_workers=3)
    dataset(service)
    loader(service, "a", batch_size=4, num_workers=2, executor="thread", autotune=AUTOTUNE)
    with pytest.raises(ValidationError):  # LoaderFields' bounds
        live_group_timeout.model_validate({"group_timeout_s": 0})
    body = live_group_timeout.model_validate({"group_timeout_s": 7.5})
    out = service.patch_loader("a", body)
    assert (out["group_timeout_s"], out["num_workers"], out["autotune"]) == (7.5, 2, AUTOTUNE)
    assert registered(service, "a")["group_timeout_s"] == 7.5
    # autotune's decision, applied as the arbiter applies it (node/arbiter.py _tune_alone)
    service.reconfigure("a", LiveChange(num_workers=3, prefetch_factor=4))
    # the arbiter makes room for a new loader: a worker of "a", which has no trainer
    loader(service, "b", batch_size=4, num_workers=1, executor="thread")
    a = service.describe_loader("a")
    assert (a["group_timeout_s"], a["num_workers"], a["prefetch_factor"]) == (7.5, 2, 4)
    row = registered(service, "a")
    assert (row["group_timeout_s"], row["num_workers"], row["prefetch_factor"]) == (7.5, 2, 4)
    service = restart(service, make_service, max_workers=3)
    back = service.describe_loader("a")
    assert (back["group_timeout_s"], back["num_workers"], back["autotune"]) == (7.5, 2, AUTOTUNE)
