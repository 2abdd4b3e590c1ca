"""Worker processes killed mid-epoch (SIGKILL, or a segfault in native code): the
batches they held are produced again, the consumer sees DataLoader's sequence with no
gap and no duplicate, and ``worker_restarts`` counts every replacement."""

from __future__ import annotations

import signal
from pathlib import Path

from pinfeed import Client, Loader, SampleError
from tests.conftest import Server
from tests.helpers import assert_same, unique
from tests.reliability.datasets import Slow
from tests.reliability.procs import gone, reference, wait_for, workers_of

SLOW = "tests.reliability.datasets:Slow"


def _python_dataset(admin: Client, factory: str, **kwargs: object) -> str:
    name = unique("rel-ds")
    admin.create_dataset(
        name, "python", {"factory": f"tests.reliability.datasets:{factory}", "kwargs": kwargs}
    )
    return name


def _restarts(admin: Client, name: str, n: int) -> bool:
    return bool(admin.loader(name)["worker_restarts"] == n)


def test_sigkill_workers_mid_epoch_loses_and_repeats_nothing(rserver: Server) -> None:
    pid = rserver.proc.pid  # type: ignore[union-attr]
    with rserver.client() as admin:
        # 3 ms a sample, 12 ms a batch: the consumer outruns two workers, so both
        # are always mid-batch when one is killed.
        ds = _python_dataset(admin, "Slow", length=96, delay_s=0.003)
        name = unique("wkill")
        admin.create_loader(name, dataset=ds, batch_size=4, shuffle=True, seed=7, num_workers=2)
        want = reference(Slow(length=96, delay_s=0), 2, batch_size=4, shuffle=True, seed=7)
        killed: list[int] = []
        with Loader(name, socket=rserver.socket) as loader:
            first = wait_for(lambda: len(w := workers_of(pid, name)) == 2 and w, "2 workers")
            kills = {(0, 3): first[0], (1, 10): first[1]}
            for epoch in range(2):
                n = 0
                for index, batch in enumerate(loader):
                    assert_same(batch, want[epoch][index], f"epoch {epoch} batch {index}")
                    victim = kills.get((epoch, index))
                    if victim is not None:
                        victim.send_signal(signal.SIGKILL)
                        killed.append(victim.pid)
                    n += 1
                assert n == len(want[epoch]), f"epoch {epoch}: {n} batches"
            wait_for(lambda: gone(killed), "the killed workers to be reaped")
            wait_for(lambda: _restarts(admin, name, 2), "worker_restarts == 2")
            # Replacements map the same ring and keep serving.
            assert len(workers_of(pid, name)) == 2
            assert not {p.pid for p in workers_of(pid, name)} & set(killed)
        admin.delete_loader(name)


def test_worker_segfault_in_native_code_is_replaced(rserver: Server, tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    with rserver.client() as admin:
        ds = _python_dataset(
            admin, "CrashOnce", marker=str(marker), at=22, length=48, delay_s=0.001
        )
        name = unique("segv")
        admin.create_loader(name, dataset=ds, batch_size=4, num_workers=2)
        want = reference(Slow(length=48, delay_s=0), 1, batch_size=4, shuffle=False, seed=0)[0]
        with Loader(name, socket=rserver.socket) as loader:
            got = 0
            for index, batch in enumerate(loader):
                assert_same(batch, want[index], f"batch {index}")
                got += 1
            assert got == len(want)
        assert marker.exists(), "the worker never reached the crashing sample"
        wait_for(lambda: _restarts(admin, name, 1), "worker_restarts == 1")
        admin.delete_loader(name)


def test_poison_sample_fails_only_its_own_batch(rserver: Server) -> None:
    with rserver.client() as admin:
        ds = _python_dataset(admin, "Poison", at=13, length=40, delay_s=0.002)
        name = unique("poison")
        # One worker with a deep queue: the batches after the poison one wait in the
        # same worker's pipe when it dies.
        admin.create_loader(name, dataset=ds, batch_size=4, num_workers=1, prefetch_factor=4)
        want = reference(Slow(length=40, delay_s=0), 1, batch_size=4, shuffle=False, seed=0)[0]
        failed = []
        with Loader(name, socket=rserver.socket) as loader:
            it = iter(loader)
            for index in range(len(want)):
                try:
                    batch = next(it)
                except SampleError as exc:
                    failed.append(index)
                    assert exc.extra.get("reason") == "worker-died", exc.extra
                    assert isinstance(exc, RuntimeError)  # what DataLoader raises
                    assert "is killed by signal" in str(exc) or "exited" in str(exc)
                    continue
                assert_same(batch, want[index], f"batch {index}")
        assert failed == [3], f"batches {failed} failed; only batch 3 holds sample 13"
        assert admin.loader(name)["worker_restarts"] == 3
        admin.delete_loader(name)


def test_only_worker_killed_while_batches_are_submitted(rserver: Server) -> None:
    pid = rserver.proc.pid  # type: ignore[union-attr]
    with rserver.client() as admin:
        # Half a second to build the dataset: the replacement worker is that long coming.
        ds = _python_dataset(admin, "SlowStart", init_s=0.5, length=40, delay_s=0.002)
        name = unique("lone")
        admin.create_loader(name, dataset=ds, batch_size=4, num_workers=1, prefetch_factor=4)
        want = reference(Slow(length=40, delay_s=0), 1, batch_size=4, shuffle=False, seed=0)[0]
        with Loader(name, socket=rserver.socket) as loader:
            for index, batch in enumerate(loader):
                assert_same(batch, want[index], f"batch {index}")
                if index == 1:
                    # Ready batches in the ring: taking them frees slots while the
                    # replacement starts, so the producer submits in that window.
                    wait_for(lambda: admin.loader(name)["slots"]["ready"] >= 2, "a full ring")
                    (worker,) = workers_of(pid, name)
                    worker.send_signal(signal.SIGKILL)
                    # Counted when the dead worker leaves the pool, before the
                    # replacement starts: the batches taken now free slots in that gap.
                    wait_for(lambda: _restarts(admin, name, 1), "the dead worker to be dropped")
        assert admin.loader(name)["state"] == "ready"
        admin.delete_loader(name)
