"""Bad input to ``pinfeed.DataLoader`` with ``strict=True`` (else it runs torch's own
DataLoader, with a warning: test_fallback.py): each error is clear and names what to
do, and the server and its other loaders go on: an object that cannot be shipped (the
attribute path named, in the trainer), a module the server cannot import, a
``collate_fn`` that raises on the first batch, a trainer of another uid, a server that
refuses objects."""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import pinfeed
from pinfeed import InvalidRequest, Unshippable
from tests.conftest import Server
from tests.dataloader.test_parity import Squares

NOBODY = 65534


class HoldsAFile(Dataset[Any]):
    def __init__(self, path: Path) -> None:
        self.meta = {"fh": open(path, "rb")}  # noqa: SIM115 (what the error is about)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return i


class HoldsAGenerator(Dataset[Any]):
    def __init__(self) -> None:
        self.rows = (i for i in range(4))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return i


class HoldsADeviceTensor(Dataset[Any]):
    """A tensor off the CPU: on a GPU node a CUDA one; here the meta device stands in
    (it cannot be shipped for the same reason: its data is not in this process's RAM)."""

    def __init__(self) -> None:
        device = "cuda" if torch.cuda.is_available() else "meta"
        self.weights = torch.zeros(3, device=device)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return i


def _alive(server: Server) -> None:
    """The server and a loader of another trainer still work."""
    loader = pinfeed.DataLoader(Squares(), batch_size=9, socket=server.socket)
    assert [len(b[0]) for b in loader] == [9] * 5
    loader.close()


def test_an_open_file_is_named_with_its_attribute_path(server: Server, tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x")
    ds = HoldsAFile(tmp_path / "data.bin")
    with pytest.raises(Unshippable) as info:
        pinfeed.DataLoader(ds, batch_size=2, socket=server.socket, strict=True)
    assert info.value.path == "dataset.meta['fh']"
    assert "open files in __getitem__ or in worker_init_fn" in str(info.value)
    assert isinstance(info.value, TypeError)  # what pickling it raises under DataLoader
    ds.meta["fh"].close()
    _alive(server)


def test_a_generator_and_a_device_tensor_are_named(server: Server) -> None:
    with pytest.raises(Unshippable, match=r"dataset\.rows .*create the iterator in __iter__"):
        pinfeed.DataLoader(HoldsAGenerator(), socket=server.socket, strict=True)
    with pytest.raises(
        Unshippable, match=r"dataset\.weights .*keep the dataset's tensors on the CPU"
    ):
        pinfeed.DataLoader(HoldsADeviceTensor(), socket=server.socket, strict=True)
    lock = threading.Lock()  # a lambda's default that cannot be pickled
    with pytest.raises(Unshippable, match=r"cannot ship collate_fn \(a function\)"):
        pinfeed.DataLoader(
            Squares(), collate_fn=lambda s, lock=lock: s, socket=server.socket, strict=True
        )


@pytest.fixture()
def installed_elsewhere(tmp_path: Path) -> Iterator[Any]:
    """A module the trainer imports from an installed package that the server's
    environment does not have (a folder named site-packages is pickled by reference)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "labdata_pf.py").write_text(
        textwrap.dedent(
            """
            import torch
            class Scans:
                def __len__(self): return 8
                def __getitem__(self, i): return torch.tensor([i])
            """
        )
    )
    sys.path.insert(0, str(site))
    try:
        import labdata_pf  # type: ignore[import-not-found]

        yield labdata_pf
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("labdata_pf", None)


def test_a_module_the_server_cannot_import(server: Server, installed_elsewhere: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        pinfeed.DataLoader(
            installed_elsewhere.Scans(), batch_size=2, socket=server.socket, strict=True
        )
    message = str(info.value)
    assert "cannot import module 'labdata_pf'" in message
    assert "install it in the server's Python environment" in message
    _alive(server)


def test_a_collate_fn_that_raises_on_the_first_batch(server: Server) -> None:
    """DataLoader calls ``collate_fn`` in the loop: the loader is made, and its first
    batch raises the function's own exception type there (a SampleError too)."""

    def broken(samples: list[Any]) -> Any:
        raise KeyError("label")

    for workers in (0, 2):
        loader = pinfeed.DataLoader(
            Squares(), batch_size=4, collate_fn=broken, num_workers=workers, socket=server.socket
        )
        with pytest.raises(KeyError) as info:
            next(iter(loader))
        assert isinstance(info.value, pinfeed.SampleError) and "'label'" in str(info.value)
        loader.close()
    _alive(server)


def test_a_sampler_of_keys_without_automatic_batching(server: Server) -> None:
    # DataLoader indexes with whatever the sampler yields; the server reads by integer
    # index or index list: a key is an error saying what to do.
    for sampler, says in (
        (["a", "b"], "map them to keys"),
        ([[0, "b"], [2, 3]], "map them to keys"),
    ):
        loader = pinfeed.DataLoader(
            Squares(), batch_size=None, sampler=sampler, socket=server.socket
        )
        with pytest.raises(TypeError, match=says):
            next(iter(loader))
        loader.close()
    _alive(server)


@pytest.mark.slow
def test_a_trainer_of_another_uid_may_not_ship_objects(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root, to run a trainer as another uid")
    srv = Server(tmp_path_factory.mktemp("uid"), env={"PINFEED_SOCKET_GROUP": str(NOBODY)})
    with srv:
        for folder in (srv.root, *srv.root.parents):  # let nobody reach the socket's folder
            if folder == Path(tempfile.gettempdir()):
                break
            os.chmod(folder, os.stat(folder).st_mode | 0o011)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child, as nobody in the socket's group
            code = 3
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                try:
                    pinfeed.DataLoader(Squares(), batch_size=2, socket=srv.socket, strict=True)
                    code = 1
                except InvalidRequest as exc:
                    os.write(write, str(exc).encode())
                    code = 0
            except BaseException as exc:
                os.write(write, f"{type(exc).__name__}: {exc}".encode())
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            message = f.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, message
        assert f"only a trainer running as the server's own uid {os.getuid()}" in message
        assert f"not uid {NOBODY}" in message
        _alive(srv)


@pytest.mark.slow
def test_a_server_that_accepts_no_objects(tmp_path_factory: pytest.TempPathFactory) -> None:
    env = {"PINFEED_ACCEPT_OBJECTS": "false"}
    with (
        Server(tmp_path_factory.mktemp("noobj"), env=env) as srv,
        pytest.raises(InvalidRequest, match="PINFEED_ACCEPT_OBJECTS=false"),
    ):
        pinfeed.DataLoader(Squares(), socket=srv.socket, strict=True)
