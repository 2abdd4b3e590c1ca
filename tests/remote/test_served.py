"""``pinfeed.ServerDataset``: a script names a dataset in the store and passes it to
``pinfeed.DataLoader``; the server builds and reads it with its own credentials (the
trainer has none), and the batches are torch's DataLoader's over the local files."""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import default_collate

import pinfeed
from pinfeed import InvalidRequest, ServerDataset, Unshippable
from pinfeed_server.remote.errors import SECRET_VARIABLES
from tests.helpers import assert_same
from tests.launcher import Server
from tests.remote.data import Workload
from tests.remote.s3server import ACCESS_KEY, SECRET_KEY


def _epochs(loader: Any, n: int = 2) -> list[list[Any]]:
    out = [[[t.clone() if isinstance(t, torch.Tensor) else t for t in b] for b in loader]]
    for _ in range(n - 1):
        out.append([[t.clone() if isinstance(t, torch.Tensor) else t for t in b] for b in loader])
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "key",
    [
        "W2",
        "W3",
        # webdataset's gopen leaves shard files for the garbage collector to close
        pytest.param("W8", marks=pytest.mark.filterwarnings("ignore::ResourceWarning")),
    ],
)
def test_a_script_reads_the_store_through_the_server(
    remote_server: Server, workloads: dict[str, Workload], key: str, num_workers: int
) -> None:
    assert not any(os.environ.get(k) for k in SECRET_VARIABLES)  # the trainer has no key
    w = workloads[key]
    dataset = ServerDataset(w.kind, socket=remote_server.socket, **w.remote)
    reference = w.reference()
    assert isinstance(dataset, torch.utils.data.IterableDataset) == (key == "W8")
    if key != "W8":
        assert len(dataset) == len(reference)
    shipped = pickle.dumps(dataset)
    assert ACCESS_KEY.encode() not in shipped and SECRET_KEY.encode() not in shipped

    def make(cls: Any, ds: Any, **kw: Any) -> Any:
        return cls(
            ds,
            batch_size=7,
            shuffle=w.shuffle,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(5) if w.shuffle else None,
            **kw,
        )

    theirs = _epochs(make(TorchDataLoader, reference))
    loader = make(pinfeed.DataLoader, dataset, socket=remote_server.socket, strict=True)
    with loader:
        assert loader.pinfeed_name is not None
        ours = _epochs(loader)
    assert [len(e) for e in ours] == [len(e) for e in theirs]
    assert_same(ours, theirs)


def test_it_cannot_be_read_in_the_trainer_nor_fall_back(
    remote_server: Server, workloads: dict[str, Workload]
) -> None:
    """A sample read here says who reads it; where pinfeed.DataLoader would fall back
    to torch's own DataLoader (an object that does not pickle), it raises instead."""
    w = workloads["W2"]
    dataset = ServerDataset(w.kind, socket=remote_server.socket, **w.remote)
    with pytest.raises(RuntimeError, match="read by the pinfeed server"):
        dataset[0]
    lock = threading.Lock()

    def collate(batch: list[Any]) -> Any:
        with lock:  # a lock does not pickle: pinfeed.DataLoader cannot ship it
            return default_collate(batch)

    with pytest.raises(Unshippable):
        pinfeed.DataLoader(dataset, batch_size=4, collate_fn=collate, socket=remote_server.socket)


def test_params_the_server_refuses_are_said_at_once(remote_server: Server) -> None:
    with pytest.raises(InvalidRequest, match="PINFEED_REMOTE_ALLOW"):
        ServerDataset("tokens", path="s3://other/t.bin", seq_len=8, socket=remote_server.socket)
    with pytest.raises(InvalidRequest, match="no such object"):
        ServerDataset(
            "tokens", path="s3://pinfeed/no/t.bin", seq_len=8, socket=remote_server.socket
        )
