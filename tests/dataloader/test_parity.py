"""``pinfeed.DataLoader`` in place of torch's, in the same test code: every case builds
its loader from a class it is given, and runs once with ``torch.utils.data.DataLoader``
and once with ``pinfeed.DataLoader`` (the server's, on this test's objects), from the
same seeds; the epochs must be equal batch for batch (``torch.equal``, same structure
and dtypes), ``len()`` too, and the trainer's own RNGs must have moved alike."""

from __future__ import annotations

import collections
import itertools
import math
import random
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    TensorDataset,
    default_collate,
    get_worker_info,
)
from torch.utils.data import DataLoader as TorchDataLoader

import pinfeed
from tests.conftest import Server
from tests.helpers import assert_same

Pair = collections.namedtuple("Pair", ["left", "right"])


# -- the script's own objects: classes of this module, lambdas, closures -----------------
class Squares(Dataset[Any]):
    def __init__(self, n: int = 45) -> None:
        self.n = n
        self.table = np.arange(n, dtype=np.int64) ** 2  # an array the dataset holds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor(self.table[i]), i % 3


class Augmented(Dataset[Any]):
    """Draws from torch, random and numpy in every sample, as augmentations do."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return (
            torch.full((2,), float(i)) + torch.rand(2),
            random.random(),
            np.float32(np.random.rand()),
        )


class Mixed(Dataset[Any]):
    """Every default_collate case."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> Any:
        return {
            "image": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i,
            "arr": np.full((3,), i, dtype=np.int32),
            "label": i % 4,
            "weight": i / 7.0,
            "flag": bool(i % 2),
            "name": f"sample-{i}",
            "nested": (torch.tensor([i, -i]), [i * 2, {"deep": torch.ones(2) * i}, f"n{i}"]),
            "pair": Pair(torch.tensor(i), float(i)),
            "ordered": collections.OrderedDict(b=torch.tensor(i), a=f"{i}"),
        }


class Ragged(Dataset[Any]):
    def __len__(self) -> int:
        return 33

    def __getitem__(self, i: int) -> Any:
        return torch.arange(1 + i % 7, dtype=torch.int64)


class WhoMadeMe(Dataset[Any]):
    """Returns the worker that made each sample, and what its worker_init_fn set."""

    def __init__(self) -> None:
        self.tag = -1

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        worker = -1 if info is None else info.id
        count = 0 if info is None else info.num_workers
        return torch.tensor([i, worker, count, self.tag])


def tag_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.tag = 100 + worker_id


class Shards(IterableDataset[Any]):
    """Splits its range over workers with get_worker_info; draws a random number too."""

    def __init__(self, n: int = 26) -> None:
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([i]), torch.rand(1)


class Flaky(Dataset[Any]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        if i in (7, 13):
            raise ValueError(f"corrupt record {i}")
        return torch.tensor([i])


class EveryOther(Sampler[int]):
    """A custom sampler: the even indices, then the odd ones."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from range(0, self.n, 2)
        yield from range(1, self.n, 2)

    def __len__(self) -> int:
        return self.n


class Rotating(Sampler[int]):
    """A stateful sampler: each epoch starts one further on."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, self.start + 1
        for k in range(self.n):
            yield (start + k) % self.n

    def __len__(self) -> int:
        return self.n


class Buckets(Sampler[list[int]]):
    """A batch sampler with batches of different sizes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        i, size = 0, 1
        while i < self.n:
            yield list(range(i, min(self.n, i + size)))
            i, size = i + size, size % 5 + 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in samples)
    out = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, s in enumerate(samples):
        out[row, : len(s)] = s
    return out, torch.tensor([len(s) for s in samples])


# -- running a case under both ------------------------------------------------------------
Make = Callable[[type[TorchDataLoader[Any]], dict[str, Any]], TorchDataLoader[Any]]


def _clone(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_clone(x) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(x) for x in batch)
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    return batch


def _seed() -> None:
    torch.manual_seed(1234)
    random.seed(99)
    np.random.seed(7)


def _run(
    make: Make, cls: type[Any], extra: dict[str, Any], epochs: int, set_epoch: bool
) -> tuple[list[list[Any]], int | None, Any]:
    _seed()
    loader = make(cls, extra)
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    got: list[list[Any]] = []
    for epoch in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        got.append([])
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except Exception as exc:  # a sample raised: DataLoader raises it, then goes on
                got[-1].append(
                    ("raised", isinstance(exc, ValueError), "corrupt record" in str(exc))
                )
                continue
            got[-1].append(_clone(batch))
    after = (torch.rand(2), random.random(), np.random.rand())
    if isinstance(loader, pinfeed.DataLoader):
        loader.close()
    return got, length, after


def check(server: Server, make: Make, epochs: int = 3, set_epoch: bool = False) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        want, want_len, want_after = _run(make, TorchDataLoader, {}, epochs, set_epoch)
        got, got_len, got_after = _run(
            make, pinfeed.DataLoader, {"socket": server.socket}, epochs, set_epoch
        )
    assert got_len == want_len
    assert [len(e) for e in got] == [len(e) for e in want] and sum(map(len, want)) > 0
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (gb, wb) in enumerate(zip(g, w, strict=True)):
            assert_same(gb, wb, f"epoch {e} batch {i}")
    assert_same(got_after, want_after, "the trainer's RNGs afterwards")


@pytest.fixture(params=[0, 2], ids=["workers0", "workers2"])
def workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


# -- the cases ------------------------------------------------------------------------------
def _shuffled_squares(workers: int, drop_last: bool) -> Make:
    return lambda cls, x: cls(
        Squares(),
        batch_size=4,
        shuffle=True,
        drop_last=drop_last,
        num_workers=workers,
        generator=torch.Generator().manual_seed(5),
        **x,
    )


def test_batches_shuffle_with_a_generator_and_drop_last(server: Server, workers: int) -> None:
    for drop_last in (False, True):
        check(server, _shuffled_squares(workers, drop_last))


def test_index_batches_sent_many_at_a_time(
    server: Server, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch's own samplers the index batches go to the server a chunk at a time
    (FEEDS, ``FEEDS_INDICES`` indices each: here 3 batches of 4, so an epoch of 12
    ends exactly at a chunk's end, one of 11 inside one): the same batches, the same
    RNGs after, whether the sampler draws from a generator, from the global RNG, or a
    ``DistributedSampler`` with ``set_epoch``; where a batch is made on the trainer's
    RNGs (no workers, a dataset that draws), one FEED a batch, as before."""
    from pinfeed import _dataloader

    monkeypatch.setattr(_dataloader, "FEEDS_INDICES", 12)
    threads = torch.get_num_threads()
    made: list[Any] = []

    def chunked(loader: Any) -> Any:
        made.append(loader)
        return loader

    for drop_last in (False, True):
        make = _shuffled_squares(workers, drop_last)
        check(server, lambda cls, x, make=make: chunked(make(cls, x)))  # type: ignore[misc]
    check(
        server,
        lambda cls, x: chunked(
            cls(Squares(), batch_size=4, shuffle=True, num_workers=workers, **x)
        ),
    )
    check(
        server,
        lambda cls, x: chunked(
            cls(
                Augmented(),
                batch_size=4,
                sampler=DistributedSampler(Augmented(), num_replicas=2, rank=1, seed=3),
                num_workers=workers,
                **x,
            )
        ),
        set_epoch=True,
    )
    tensors = TensorDataset(torch.arange(45) * 3, torch.arange(45) % 2)
    check(
        server,
        lambda cls, x: chunked(cls(tensors, batch_size=4, shuffle=True, num_workers=workers, **x)),
    )
    owned = [d._owned for d in made if isinstance(d, pinfeed.DataLoader)]
    # Without workers only a TensorDataset (it draws nothing: rng.draws_nothing) is fed
    # ahead, so a chunk at a time; the script's own classes may draw.
    assert [o.feeding.chunk for o in owned] == ([3] * 5 if workers else [0, 0, 0, 0, 3])
    # The sampler ran on one intra-op thread (_one_thread); the trainer's own setting is back.
    assert torch.get_num_threads() == threads


def test_shuffle_from_the_global_rng(server: Server, workers: int) -> None:
    check(
        server, lambda cls, x: cls(Squares(), batch_size=6, shuffle=True, num_workers=workers, **x)
    )


def test_augmentations_across_workers_and_epochs(server: Server, workers: int) -> None:
    check(
        server,
        lambda cls, x: cls(Augmented(), batch_size=5, shuffle=True, num_workers=workers, **x),
    )


def test_persistent_workers_and_prefetch_factor(server: Server) -> None:
    check(
        server,
        lambda cls, x: cls(
            Augmented(),
            batch_size=3,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            prefetch_factor=4,
            **x,
        ),
    )


def test_a_tensordataset_gathered_a_batch_at_a_time(server: Server, workers: int) -> None:
    """torch's ``TensorDataset`` (its exact type) is gathered one ``index_select`` per
    tensor in the server (``datasets.base.batch_fetch``): the same batches as
    DataLoader's stack of rows, for every dtype and rank, a last short batch included;
    a subclass, which may override ``__getitem__``, goes one sample at a time."""
    from torch.utils.data import TensorDataset

    from pinfeed_server.datasets.base import batch_fetch

    class Shifted(TensorDataset):
        def __getitem__(self, i: int) -> Any:
            x, y = super().__getitem__(i)
            return x + 1, y

    g = torch.Generator().manual_seed(3)
    tensors = (
        torch.randn(45, 3, 4, generator=g),
        torch.randint(0, 255, (45, 2, 2), generator=g, dtype=torch.uint8),
        torch.arange(45, dtype=torch.int64),
        torch.rand(45, generator=g, dtype=torch.float64) > 0.5,
    )
    assert batch_fetch(TensorDataset(*tensors)) is not None
    assert batch_fetch(Shifted(tensors[0], tensors[2])) is None
    for ds in (TensorDataset(*tensors), Shifted(tensors[0], tensors[2])):
        check(
            server,
            lambda cls, x, ds=ds: cls(  # type: ignore[misc]
                ds, batch_size=7, shuffle=True, num_workers=workers, **x
            ),
            epochs=2,
        )

    # A training step that draws between batches (dropout): without workers the next
    # index batches go ahead, and the sampler still draws its seed in the first next().
    def steps(loader: Any) -> list[Any]:
        _seed()
        out = []
        for _ in range(2):
            torch.rand(1)  # between iter() and the first next()
            for batch in loader:
                out.append((_clone(batch), torch.rand(3)))
        return out

    _same_steps(
        server,
        lambda cls, x: cls(
            TensorDataset(*tensors), batch_size=4, shuffle=True, num_workers=workers, **x
        ),
        steps,
        2 * 12,
    )


def _same_steps(server: Server, make: Make, steps: Callable[[Any], list[Any]], count: int) -> None:
    """``steps(loader)`` (a loop that draws between batches) with torch's DataLoader and
    with pinfeed.DataLoader: the same ``count`` steps, batches and draws alike."""
    runs = []
    for cls, extra in ((TorchDataLoader, {}), (pinfeed.DataLoader, {"socket": server.socket})):
        loader = make(cls, extra)
        runs.append(steps(loader))
        if isinstance(loader, pinfeed.DataLoader):
            loader.close()
    assert len(runs[0]) == len(runs[1]) == count
    for i, (got, want) in enumerate(zip(runs[1], runs[0], strict=True)):
        assert_same(got, want, f"step {i}")


def _shift_by_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    ds = info.dataset
    ds.tensors = (ds.tensors[0] + 100 * (worker_id + 1), *ds.tensors[1:])  # type: ignore[attr-defined]


def test_indices_taken_a_slice_at_a_time_are_the_samplers_own() -> None:
    """``_take`` (the chunked feed's) against ``islice`` on the same sampler iterators:
    the same indices for every chunk size, the sampler's end in the same place, and
    the RNGs drawn alike, for each of torch's samplers, several permutations in one
    epoch included."""
    from torch.utils.data import (
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    from pinfeed._dataloader import _take

    samplers: list[Callable[[], Any]] = [
        lambda: RandomSampler(range(1000)),
        lambda: RandomSampler(range(100), num_samples=350, generator=torch.Generator()),
        lambda: RandomSampler(range(100), replacement=True, num_samples=333),
        lambda: SequentialSampler(range(77)),
        lambda: DistributedSampler(range(101), num_replicas=3, rank=1),
        lambda: WeightedRandomSampler([0.1, 0.5, 0.4] * 10, 123),
        lambda: SubsetRandomSampler([5, 3, 9, 1] * 7),
    ]

    def chunks(take: Callable[[Any, int], list[Any]], make: Callable[[], Any], n: int) -> Any:
        torch.manual_seed(3)
        it, out = iter(make()), []
        while len(out) < 10_000:
            out.append(take(it, n))
            if len(out[-1]) < n:
                return out, torch.get_rng_state()
        raise AssertionError("the sampler did not end")

    for make in samplers:
        for n in (1, 7, 32, 256, 10_000):
            want, want_rng = chunks(lambda it, k: list(itertools.islice(it, k)), make, n)
            got, got_rng = chunks(_take, make, n)
            assert got == want, (make(), n)
            assert torch.equal(got_rng, want_rng)


def test_which_shipped_objects_draw_nothing() -> None:
    """Only torch's own ``TensorDataset`` with ``default_collate`` and no
    ``worker_init_fn`` draws nothing: its loader keeps no RNG stream per worker (the
    trainer says so in its CREATE, ``draws``)."""
    from torch.utils.data import TensorDataset

    from pinfeed.rng import draws_nothing

    class Sub(TensorDataset):
        pass

    t = torch.arange(4)
    assert draws_nothing(TensorDataset(t), None)
    assert draws_nothing(TensorDataset(t), default_collate)
    for objects in (
        (Sub(t), None, None),
        (TensorDataset(t), lambda b: b, None),
        (TensorDataset(t), None, _shift_by_worker),
        (Squares(), None, None),
    ):
        assert not draws_nothing(*objects)


def test_a_worker_init_fn_that_changes_its_workers_dataset(server: Server) -> None:
    """A ``TensorDataset`` draws nothing, so any worker may make any of its batches
    (``datasets.shipped.params``), unless a ``worker_init_fn`` may change it per worker:
    here it rebinds the worker's tensors, so batch i must come from worker i % 2, as
    under DataLoader; and, without persistent workers, each epoch's workers start from
    the dataset as shipped, as DataLoader's new processes do (not the last epoch's)."""
    from torch.utils.data import TensorDataset

    ds = TensorDataset(torch.zeros(40, 2, dtype=torch.int64), torch.arange(40))
    for persistent in (False, True):
        check(
            server,
            lambda cls, x, p=persistent: cls(  # type: ignore[misc]
                ds,
                batch_size=4,
                shuffle=True,
                num_workers=2,
                worker_init_fn=_shift_by_worker,
                persistent_workers=p,
                **x,
            ),
            epochs=2,
        )


def test_a_sampler_drawing_from_the_scripts_generator_as_it_goes(server: Server) -> None:
    """Index batches go ahead of DataLoader's ``num_workers * prefetch_factor`` only
    where when they are taken cannot be seen. ``RandomSampler(replacement=True)`` on the
    script's generator draws 32 indices at a time from it as it is iterated: with the
    loop drawing from that generator too, every batch must still be DataLoader's."""
    from torch.utils.data import RandomSampler

    def make(cls: Any, extra: dict[str, Any]) -> Any:
        sampler = RandomSampler(range(200), replacement=True, generator=torch.Generator())
        sampler.generator.manual_seed(5)  # type: ignore[union-attr]
        return cls(Squares(200), batch_size=8, sampler=sampler, num_workers=2, **extra)

    def steps(loader: Any) -> list[Any]:
        g = loader.sampler.generator
        return [(_clone(b), torch.rand(1, generator=g)) for _ in range(2) for b in loader]

    _same_steps(server, make, steps, 2 * 25)


def test_default_collate_of_every_structure(server: Server, workers: int) -> None:
    check(server, lambda cls, x: cls(Mixed(), batch_size=4, num_workers=workers, **x), epochs=1)


def test_a_lambda_collate_fn_and_a_plain_function(server: Server, workers: int) -> None:
    check(
        server,
        lambda cls, x: cls(
            Ragged(), batch_size=5, shuffle=True, num_workers=workers, collate_fn=pad, **x
        ),
    )
    scale = 3  # a closure over a local
    check(
        server,
        lambda cls, x: cls(
            Squares(),
            batch_size=4,
            num_workers=workers,
            collate_fn=lambda samples: default_collate(samples)[0] * scale,
            **x,
        ),
        epochs=1,
    )


class InClassBody(Dataset[Any]):
    """Namedtuples made in a class body, as torch's test_dataloader_with_namedtuple's: no
    import finds them by name, so only num_workers=0 DataLoader can carry them (its
    workers' queue pickles by name)."""

    Batch = collections.namedtuple("Batch", ["data", "label", "random_tensor"])
    Data = collections.namedtuple("Data", ["positive", "negative"])

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.Batch(self.Data(i, -i), str(i), torch.arange(3) * i)


def test_namedtuples_made_in_a_class_body(server: Server) -> None:
    check(server, lambda cls, x: cls(InClassBody(), batch_size=2, **x), epochs=1)
    check(server, lambda cls, x: cls(InClassBody(), batch_size=None, **x), epochs=1)


class Encoding(collections.UserDict[str, Any]):
    """A mapping that is not a dict, as HF's BatchEncoding is."""


def encode(samples: list[Any]) -> Encoding:
    return Encoding(default_collate([{"x": x, "i": i} for x, i in samples]))


def test_a_collate_fns_mapping_and_namedtuple_classes(server: Server, workers: int) -> None:
    # The batch is of the collate_fn's classes, as DataLoader gives it.
    check(
        server,
        lambda cls, x: cls(Squares(), batch_size=4, num_workers=workers, collate_fn=encode, **x),
        epochs=1,
    )
    check(
        server,
        lambda cls, x: cls(
            Squares(),
            batch_size=4,
            num_workers=workers,
            collate_fn=lambda s: Pair(*default_collate(s)),
            **x,
        ),
        epochs=1,
    )


def test_a_module_of_the_scripts_own_goes_by_value(
    server: Server, workers: int, tmp_path: Path
) -> None:
    """A module beside the script (outside the Python installation, where the server
    cannot import it) is shipped by value, as ``__main__`` is."""
    (tmp_path / "labmod_pf.py").write_text(
        textwrap.dedent(
            """
            import torch
            class Cubes:
                def __len__(self): return 21
                def __getitem__(self, i): return torch.tensor([i ** 3]), i % 2
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import labmod_pf  # type: ignore[import-not-found]

        check(
            server,
            lambda cls, x: cls(labmod_pf.Cubes(), batch_size=4, num_workers=workers, **x),
            epochs=2,
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("labmod_pf", None)


def test_worker_init_fn_and_get_worker_info(server: Server, workers: int) -> None:
    check(
        server,
        lambda cls, x: cls(
            WhoMadeMe(), batch_size=3, num_workers=workers, worker_init_fn=tag_worker, **x
        ),
    )


def test_custom_and_stateful_samplers(server: Server, workers: int) -> None:
    check(
        server,
        lambda cls, x: cls(
            Squares(), batch_size=4, sampler=EveryOther(45), num_workers=workers, **x
        ),
    )
    # The sampler object advances per epoch as under DataLoader (it runs in the trainer).
    check(
        server,
        lambda cls, x: cls(
            Squares(20), batch_size=6, sampler=Rotating(20), num_workers=workers, **x
        ),
    )


def test_a_batch_sampler_of_varying_sizes(server: Server, workers: int) -> None:
    check(
        server,
        lambda cls, x: cls(
            Squares(),
            batch_sampler=Buckets(45),
            num_workers=workers,
            **({"max_batch_size": 5} | x if x else {}),
        ),
    )
    check(
        server,
        lambda cls, x: cls(
            Squares(),
            batch_sampler=BatchSampler(EveryOther(45), batch_size=7, drop_last=False),
            num_workers=workers,
            **x,
        ),
    )


def test_distributed_sampler_with_set_epoch_on_the_scripts_object(
    server: Server, workers: int
) -> None:
    for rank in (0, 1):
        check(
            server,
            lambda cls, x, rank=rank: cls(  # type: ignore[misc]
                Augmented(),
                batch_size=4,
                sampler=DistributedSampler(
                    Augmented(), num_replicas=2, rank=rank, shuffle=True, seed=3
                ),
                num_workers=workers,
                **x,
            ),
            set_epoch=True,
        )


def test_an_iterable_dataset_split_across_workers(server: Server, workers: int) -> None:
    check(server, lambda cls, x: cls(Shards(), batch_size=4, num_workers=workers, **x))
    check(
        server, lambda cls, x: cls(Shards(), batch_size=4, drop_last=True, num_workers=workers, **x)
    )


class ItemsAsTheyCome(Dataset[Any]):
    """Its ``__getitems__`` differs from its ``__getitem__``: DataLoader reads a batch
    through the first, and one sample without automatic batching through the second."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, 1]), torch.rand(1)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [(torch.tensor([i, 2]), torch.rand(1)) for i in indices]


class ReadsBatches(Dataset[Any]):
    """Reads a whole batch in one ``__getitem__(indices)``: DataLoader's tuned batched
    read, with a ``BatchSampler`` as ``sampler=`` and ``batch_size=None``."""

    def __init__(self) -> None:
        self.table = torch.arange(45) ** 2

    def __len__(self) -> int:
        return 45

    def __getitem__(self, indices: list[int]) -> Any:
        return {"x": self.table[indices], "noise": torch.rand(len(indices))}


class ListsThenInts(Sampler[Any]):
    """A plain sampler (no BatchSampler) yielding index lists, one of one index, an empty
    one and a bare index: DataLoader reads each item as it is, dataset[item]."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __iter__(self) -> Iterator[Any]:
        order = torch.randperm(self.n, generator=self.generator)
        yield from (x.tolist() for x in order[:-2].split(4))
        yield [int(order[-2])]
        yield []
        yield int(order[-1])

    def __len__(self) -> int:
        return math.ceil((self.n - 2) / 4) + 3


class TakesListsOrInts(ReadsBatches):
    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(key if isinstance(key, list) else [key, key])


def test_a_plain_sampler_yielding_index_lists(server: Server, workers: int) -> None:
    # torch's test_bulk_loading_nobatch: batch_size=None, a sampler of index lists
    check(
        server,
        lambda cls, x: cls(
            TakesListsOrInts(),
            batch_size=None,
            sampler=ListsThenInts(45, torch.Generator().manual_seed(4)),
            num_workers=workers,
            **x,
        ),
    )


def test_batch_size_none_without_automatic_batching(server: Server, workers: int) -> None:
    # Each item one sample, default_convert-ed (no batch dimension: shapes may differ;
    # ints, floats, strings and numpy scalars as they are), or the script's collate_fn
    # of it; the sampler's indices one at a time; an iterable's items as they come.
    for make in (
        lambda cls, x: cls(
            Mixed(), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(6), **x
        ),
        lambda cls, x: cls(Ragged(), batch_size=None, sampler=EveryOther(33), **x),
        lambda cls, x: cls(ItemsAsTheyCome(), batch_size=None, **x),
        lambda cls, x: cls(Shards(), batch_size=None, **x),
        lambda cls, x: cls(Squares(), batch_size=None, collate_fn=lambda s: s[0] * 2 + s[1], **x),
        lambda cls, x: cls(
            ReadsBatches(),
            batch_size=None,
            sampler=BatchSampler(
                RandomSampler(range(45), generator=torch.Generator().manual_seed(2)), 8, False
            ),
            **x,
        ),
    ):
        check(server, lambda cls, x, make=make: make(cls, {"num_workers": workers, **x}), epochs=2)
    # Augmentations on DataLoader's worker streams, as with batches.
    check(server, lambda cls, x: cls(Augmented(), batch_size=None, num_workers=workers, **x))


def test_exceptions_from_getitem_reach_the_loop(server: Server, workers: int) -> None:
    check(server, lambda cls, x: cls(Flaky(), batch_size=3, num_workers=workers, **x))


def test_len_and_dataloaders_attributes(server: Server) -> None:
    ds = Squares()
    loader = pinfeed.DataLoader(ds, batch_size=7, shuffle=True, num_workers=2, socket=server.socket)
    try:
        assert isinstance(loader, TorchDataLoader)
        assert len(loader) == math.ceil(45 / 7)
        assert loader.dataset is ds and loader.batch_size == 7 and loader.num_workers == 2
        assert loader.prefetch_factor == 2 and loader.drop_last is False
        assert type(loader.sampler).__name__ == "RandomSampler"
        with pytest.raises(ValueError, match="batch_size attribute should not be set"):
            loader.batch_size = 3
    finally:
        loader.close()


def test_dataloaders_argument_errors_word_for_word(server: Server) -> None:
    for kwargs in (
        {"shuffle": True, "sampler": EveryOther(45)},
        {"batch_sampler": Buckets(45), "batch_size": 4},
        {"num_workers": 0, "prefetch_factor": 2},
        {"num_workers": 0, "persistent_workers": True},
        {"num_workers": -1},
        {"batch_size": None, "drop_last": True},
    ):
        with pytest.raises(ValueError) as want:
            TorchDataLoader(Squares(), **kwargs)
        with pytest.raises(ValueError) as got:
            pinfeed.DataLoader(Squares(), socket=server.socket, **kwargs)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError) as want:
        TorchDataLoader(Shards(), shuffle=True)
    with pytest.raises(ValueError) as got:
        pinfeed.DataLoader(Shards(), shuffle=True, socket=server.socket)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize(
    ("workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["w0", "w2", "w2p"]
)
def test_a_datapipe_reshuffled_each_epoch(server: Server, workers: int, persistent: bool) -> None:
    """A datapipe graph's shufflers get DataLoader's shared seed every epoch: drawn by the
    trainer's iterator, applied by each worker (persistent ones too, as DataLoader's
    ``_ResumeIteration`` carries it), after the graph was sharded among the workers."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    def make(cls: Any, x: dict[str, Any]) -> Any:
        pipe = IterableWrapper(range(40)).shuffle().sharding_filter()
        return cls(
            pipe,
            batch_size=4,
            num_workers=workers,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(3),
            **x,
        )

    check(server, make, epochs=3)
