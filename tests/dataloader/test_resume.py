"""``pinfeed.DataLoader.state_dict()``/``load_state_dict()``, as StatefulDataLoader means
them: a new loader that loads the state of one stopped after k batches yields batch k
onward of that epoch, augmentations and all, then the epochs after, batch for batch as
an uninterrupted torch DataLoader; shuffled from a generator or from the global RNG,
with a stateful sampler, without automatic batching, at 0 and 2 workers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import pinfeed
from tests.conftest import Server
from tests.dataloader.test_parity import Augmented, Rotating, Squares, _clone
from tests.helpers import assert_same


def _seed() -> None:
    torch.manual_seed(21)
    random.seed(3)
    np.random.seed(4)


def _make(
    cls: type[Any], extra: dict[str, Any], case: str, workers: int, dataset: type[Any]
) -> Any:
    kwargs: dict[str, Any] = {"batch_size": 3, "num_workers": workers, **extra}
    if case == "generator":
        kwargs |= {"shuffle": True, "generator": torch.Generator().manual_seed(8)}
    elif case == "global":
        kwargs |= {"shuffle": True}
    elif case == "unbatched":  # batch_size=None: each item one sample's
        kwargs |= {
            "batch_size": None,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(8),
        }
    else:
        kwargs |= {"sampler": Rotating(len(dataset()))}
    return cls(dataset(), **kwargs)


@pytest.mark.parametrize("case", ["generator", "global", "stateful", "unbatched"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_in_a_new_loader(server: Server, case: str, workers: int) -> None:
    # Without workers the batches are made on the trainer's global RNGs, as under
    # DataLoader: a resumed run's are its new process's, so only their order resumes
    # (a dataset that draws nothing: Squares, below); with workers, everything does.
    dataset = Augmented if workers else Squares
    _seed()
    reference = _make(TorchDataLoader, {}, case, workers, dataset)
    want = [[_clone(b) for b in reference] for _ in range(2)]
    extra = {"socket": server.socket}
    _seed()
    first = _make(pinfeed.DataLoader, extra, case, workers, dataset)
    it = iter(first)
    seen = [_clone(next(it)) for _ in range(5)]
    state = first.state_dict()
    assert (state["epoch"], state["index"]) == (0, 5)
    del it
    first.close()
    second = _make(pinfeed.DataLoader, extra, case, workers, dataset)
    if case == "stateful":  # the sampler object went with the old loader: a new one
        second.sampler.start = 0
    second.load_state_dict(state)
    rest = [_clone(b) for b in second]
    then = [_clone(b) for b in second]
    second.close()
    got = [seen + rest, then]
    assert [len(e) for e in got] == [len(e) for e in want]
    assert len(want[0]) == len(dataset()) if case == "unbatched" else -(-len(dataset()) // 3)
    for e in range(2):
        for i, (g, w) in enumerate(zip(got[e], want[e], strict=True)):
            assert_same(g, w, f"epoch {e} batch {i}")


def test_state_between_epochs_is_the_next_epochs_start(server: Server) -> None:
    loader = pinfeed.DataLoader(Augmented(), batch_size=8, socket=server.socket)
    assert loader.state_dict() == {"version": 1, "epoch": 0, "index": 0}
    list(loader)
    assert loader.state_dict() == {"version": 1, "epoch": 1, "index": 0}
    with pytest.raises(ValueError, match=r"not a pinfeed\.DataLoader state"):
        loader.load_state_dict({"epoch": 0})
    loader.close()


@pytest.mark.slow
@pytest.mark.parametrize("answered", [False, True], ids=["killed", "killed-after-answering"])
def test_reconnect_after_a_server_restart_mid_epoch(restartable: Server, answered: bool) -> None:
    """``reconnect=True``: the server is SIGKILLed after 4 batches and started again;
    the loader ships its objects to the new one, sends the epoch's batches again and
    goes on: the epochs equal an uninterrupted torch DataLoader's. ``answered``: the
    server is killed only once it has answered the NEXT kept in flight, so the fifth
    batch comes from the dead server's socket and the sends after it meet no server."""
    import signal
    import time

    srv = restartable
    _seed()
    reference = _make(TorchDataLoader, {}, "generator", 2, Augmented)
    want = [[_clone(b) for b in reference] for _ in range(2)]
    _seed()
    extra = {"socket": srv.socket, "reconnect": True}
    loader = _make(pinfeed.DataLoader, extra, "generator", 2, Augmented)
    got: list[list[Any]] = [[], []]
    for epoch in range(2):
        for batch in loader:
            got[epoch].append(_clone(batch))
            if epoch == 0 and len(got[0]) == 4:
                if answered:
                    time.sleep(1.5)  # the fifth batch is made and sent meanwhile
                srv.stop(signal.SIGKILL)
                srv.start()
    loader.close()
    for e in range(2):
        assert len(got[e]) == len(want[e])
        for i, (g, w) in enumerate(zip(got[e], want[e], strict=True)):
            assert_same(g, w, f"epoch {e} batch {i}")
