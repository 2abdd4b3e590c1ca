"""``collate_fn`` and variable shapes, against DataLoader: a padding collate_fn (shapes
change batch to batch) and a detection collate_fn (lists of differently shaped tensors,
numbers, strings, numpy scalars) give DataLoader's batches, batch for batch, at
``num_workers`` 0 and 2 over several epochs; ragged samples under default collate fail
with DataLoader's own error; ``max_batch_bytes`` bounds a batch, and a batch over it is
a per-batch error that leaves the loader and the server going; bad ``collate_fn``
values are a 422 naming them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from pinfeed import BatchTooLarge, Client, InvalidRequest, Loader, SampleError
from tests.conftest import Server
from tests.fixtures.collate import Detection, Lengths, Tokens, detection_collate, pad_collate
from tests.fixtures.datasets import Growing
from tests.helpers import assert_same, unique

SEED = 7
EPOCHS = 3


def _dataset(admin: Client, factory: str, **kwargs: Any) -> str:
    name = unique("col")
    admin.create_dataset(name, "python", {"factory": f"tests.fixtures.{factory}", "kwargs": kwargs})
    return name


def _clone(batch: Any) -> Any:
    """A batch that outlives its ring slot (views are valid until the next batch)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*map(_clone, batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map(_clone, batch))
    return batch


def _check(got: list[list[Any]], want: list[list[Any]]) -> None:
    assert [len(e) for e in got] == [len(e) for e in want]
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (gb, wb) in enumerate(zip(g, w, strict=True)):
            assert_same(gb, wb, f"epoch {e} batch {i}")


CASES = {
    "padding": ("collate:Tokens", {"length": 45}, pad_collate, Tokens(length=45), 6),
    "detection": ("collate:Detection", {}, detection_collate, Detection(), 4),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_collate_fn_batches_equal_dataloader(
    admin: Client, server: Server, case: str, num_workers: int
) -> None:
    factory, kwargs, collate, reference, batch_size = CASES[case]
    dl = DataLoader(
        reference,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(SEED),
    )
    want = [list(dl) for _ in range(EPOCHS)]
    name = unique("col")
    admin.create_loader(
        name,
        dataset=_dataset(admin, factory, **kwargs),
        batch_size=batch_size,
        shuffle=True,
        seed=SEED,
        num_workers=num_workers,
        collate_fn=f"tests.fixtures.collate:{collate.__name__}",
    )
    with Loader(name, socket=server.socket) as loader:
        got = []
        for _ in range(EPOCHS):
            got.append([])
            for batch in loader:
                views = [t for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.numel()]
                assert views and all(loader.ring_contains(t) for t in views), "zero-copy views"
                got[-1].append(_clone(batch))
    _check(got, want)
    if case == "padding":  # the shapes really change from batch to batch
        assert len({b["input_ids"].shape for e in got for b in e}) > 3
    admin.delete_loader(name)


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in _leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in _leaves(v)]
    return [batch]


def test_copies_and_the_batch_structure_are_dataloaders(admin: Client, server: Server) -> None:
    """``copy=True`` gives owned tensors and arrays; GET shows the first batch."""
    name = unique("col")
    info = admin.create_loader(
        name,
        dataset=_dataset(admin, "collate:Tokens", length=12),
        batch_size=4,
        collate_fn="tests.fixtures.collate:pad_collate",
    )
    assert info["batch"]["n"] == {"kind": "int"}
    assert info["batch"]["labels"] == {"dtype": "int64", "shape": [4]}
    assert info["slot_bytes"] >= 1 << 20  # without max_batch_bytes: 4x the first, >= 1 MiB
    want = list(DataLoader(Tokens(length=12), batch_size=4, collate_fn=pad_collate))
    with Loader(name, socket=server.socket, copy=True) as loader:
        got = list(loader)
        assert not any(
            loader.ring_contains(t) for b in got for t in _leaves(b) if torch.is_tensor(t)
        )
    _check([got], [want])
    assert not np.shares_memory(got[0]["packed"].input_ids, got[1]["packed"].input_ids)
    admin.delete_loader(name)


def test_default_collate_on_ragged_samples_is_dataloaders_error(
    admin: Client, server: Server
) -> None:
    """``Growing``: sample 0 has 4 values, the others 64. Batch [0, 1] is ragged: the
    trainer hears DataLoader's own words. Later batches are equal within themselves but
    larger than the slots sized from sample 0: a per-batch error naming max_batch_bytes,
    and with max_batch_bytes they come as DataLoader's."""
    with pytest.raises(RuntimeError) as dl_error:
        next(iter(DataLoader(Growing(), batch_size=2)))
    ds = _dataset(admin, "datasets:Growing")
    for num_workers in (0, 2):
        name = unique("rag")
        admin.create_loader(name, dataset=ds, batch_size=2, num_workers=num_workers)
        with Loader(name, socket=server.socket) as loader:
            it = iter(loader)
            with pytest.raises(SampleError) as ours:
                next(it)
            assert str(dl_error.value) in str(ours.value)
            assert "stack expects each tensor to be equal size" in str(ours.value)
            with pytest.raises(BatchTooLarge, match=r"max_batch_bytes >= 5\d\d") as big:
                next(it)  # the loader goes on: the next batch, its own error
            assert "default_collate" in str(big.value)
        admin.delete_loader(name)
    name = unique("rag")
    admin.create_loader(name, dataset=ds, batch_size=2, drop_last=True, max_batch_bytes=4096)
    want = [default_collate([Growing()[i] for i in (k, k + 1)]) for k in range(2, 10, 2)]
    with Loader(name, socket=server.socket) as loader:
        it = iter(loader)
        with pytest.raises(SampleError, match="stack expects"):
            next(it)
        got = [_clone(b) for b in it]
    _check([got], [want])
    admin.delete_loader(name)


LENGTHS = [3, 3, 3, 3, 200, 3, 3, 3, 3, 3]  # batch 2 of 5 (batch_size 2) is 200 wide


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_batch_over_max_batch_bytes_is_its_own_error(
    admin: Client, server: Server, on_error: str
) -> None:
    ds = _dataset(admin, "collate:Lengths", lengths=LENGTHS)
    name = unique("cap")
    admin.create_loader(
        name,
        dataset=ds,
        batch_size=2,
        num_workers=2,
        collate_fn="tests.fixtures.collate:pad_collate",
        max_batch_bytes=2048,
        on_error=on_error,
    )
    assert admin.loader(name)["slot_bytes"] == 2048
    want = list(DataLoader(Lengths(LENGTHS), batch_size=2, collate_fn=pad_collate))
    del want[2]
    got: list[Any] = []
    errors: list[BatchTooLarge] = []
    with Loader(name, socket=server.socket) as loader:
        for _ in range(2):
            it = iter(loader)
            while True:
                try:
                    got.append(_clone(next(it)))
                except StopIteration:
                    break
                except BatchTooLarge as exc:
                    errors.append(exc)
    _check([got], [want + want])
    if on_error == "raise":
        assert len(errors) == 2
        need = 2 * 200 * 8  # the padded ids alone
        assert "max_batch_bytes" in str(errors[0])
        size = int(str(errors[0]).split("max_batch_bytes >= ")[1].split()[0])
        assert size > need
        assert errors[0].extra["batch_index"] == 2
    else:
        assert not errors
        # two epochs consumed, two skipped; the warm queue may already have produced
        # (and so skipped) the third epoch's batch 2 ahead of any trainer asking for it
        assert admin.loader_stats(name)["skipped"] in (2, 3)
    assert admin.loader(name)["state"] == "ready"
    admin.delete_loader(name)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tests.fixtures.nope:pad", "cannot be imported"),
        ("tests.fixtures.collate:missing", "cannot be imported"),
        ("os.path:join", "not allowed"),
        ("tests.fixtures.collate:NOT_CALLABLE", "not a callable"),
        ("not a spec", "collate_fn"),
        ("tests.fixtures.collate:failing_collate", "always fails"),
        ("tests.fixtures.collate:opaque_collate", "Opaque"),
    ],
)
def test_bad_collate_fn_is_a_422_naming_it(
    admin: Client, server: Server, spec: str, says: str
) -> None:
    ds = _dataset(admin, "collate:Tokens", length=8)
    name = unique("bad")
    with pytest.raises(InvalidRequest, match=says) as exc:
        admin.create_loader(name, dataset=ds, batch_size=2, num_workers=1, collate_fn=spec)
    assert "collate_fn" in str(exc.value)
    with pytest.raises(InvalidRequest, match="max_batch_bytes"):
        admin.create_loader(name, dataset=ds, batch_size=2, max_batch_bytes=0)
    # The server and its other loaders carry on.
    admin.create_loader(
        name, dataset=ds, batch_size=2, collate_fn="tests.fixtures.collate:pad_collate"
    )
    with Loader(name, socket=server.socket) as loader:
        assert len(list(loader)) == 4
    admin.delete_loader(name)
