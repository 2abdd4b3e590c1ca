"""What a ``pinfeed.DataLoader`` sends its server, message by message: the data-plane
requests of a matrix of configurations (0 and 2 workers, persistent workers, torch's own
``BatchSampler`` whose moments cannot be seen against a sampler of the script's, a
dataset that draws from the RNGs against one that draws nothing, an iterable, no
automatic batching, a resume, an epoch left early, a failed batch, objects that change)
held against ``messages.json``. The ways of feeding the server (index batches one a
batch or a chunk at a time, ahead of the batches asked for or of the trainer's RNG
states) are the trainer's side of the protocol: a change to one shows here as the
configuration and the message where the sequence first differs.

The record is each message's kind and fields: a FEED's epoch, index, indices (a digest
where there are many), whether RNG states came with it (their digest), and its flags;
a FEEDS's batches; an EPOCH's base seed; a SEEK's position. What depends on timing is
left out: the slots a NEXT hands back, the wait it reports, and a RELEASE (sent where a
batch had not come yet when the trainer asked, or before a SEEK or EPOCH).
``PINFEED_WRITE_MESSAGES=1`` writes the file anew from the code as it is (then read
the diff: every changed line is a message the server now gets differently)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    get_worker_info,
)

import pinfeed
from pinfeed import protocol as p
from pinfeed._transport import SocketTransport
from tests.conftest import Server

GOLDEN = Path(__file__).with_name("messages.json")
N = 24  # samples; batches of 4: six an epoch


class Drawing(Dataset[Any]):
    """Draws from torch, random and numpy in every sample (an augmentation); sample
    ``bad`` raises. ``scale``: an attribute a script may change between epochs."""

    def __init__(self, n: int = N, bad: int | None = None) -> None:
        self.n = n
        self.bad = bad
        self.scale = 1.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise ValueError(f"sample {i} is bad")
        return torch.full((2,), float(i) * self.scale) + torch.rand(2), random.random()


class Backwards(Sampler[int]):
    """A sampler of the script's own: when it is iterated can be seen (it may draw)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Stream(IterableDataset[Any]):
    """An iterable split among workers, drawing as it goes."""

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, 18, step):
            yield torch.tensor([i]), random.random()


def _tensors(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n) * 10, torch.arange(n) % 3)


def _seed() -> None:
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)


# -- what the trainer does with each loader --------------------------------------------
def _epochs(
    loader: Any,
    epochs: int = 2,
    stop_after: int | None = None,
    draw_at: frozenset[tuple[int, int]] = frozenset(),
    change: Callable[[Any, int], None] | None = None,
) -> None:
    """``epochs`` epochs, each left after ``stop_after`` batches where given; a failed
    batch is passed over as a loop that catches it would; the trainer draws from its
    RNGs after the batches in ``draw_at`` ((epoch, index)); ``change(loader, epoch)``
    before each epoch."""
    for epoch in range(epochs):
        if change is not None:
            change(loader, epoch)
        it = iter(loader)
        index = 0
        while stop_after is None or index < stop_after:
            try:
                next(it)
            except StopIteration:
                break
            except ValueError:
                pass
            if (epoch, index) in draw_at:
                torch.rand(3), random.random()
            index += 1


def _resumed(make: Callable[..., Any], socket: Path) -> None:
    """Three batches, a state_dict, then a new loader that loads it: two epochs."""
    first = make(socket=socket)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    del it
    first.close()
    second = make(socket=socket)
    second.load_state_dict(state)
    _epochs(second)
    second.close()


def _scaled(loader: Any, epoch: int) -> None:
    loader.dataset.scale = float(epoch + 1)  # the objects change: OBJECTS at iter()


Case = Callable[[Path], None]


def _plain(make: Callable[..., Any], **script: Any) -> Case:
    def run(socket: Path) -> None:
        loader = make(socket=socket)
        _epochs(loader, **script)
        loader.close()

    return run


def _loader(dataset: Callable[[], Any], **kwargs: Any) -> Callable[..., Any]:
    def make(**extra: Any) -> Any:
        return pinfeed.DataLoader(dataset(), **{"batch_size": 4, **kwargs, **extra})

    return make


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(3)


def _cases() -> dict[str, Case]:
    g = _generator
    cases: dict[str, Case] = {}
    for nw in (0, 2):
        w = {"num_workers": nw}
        cases |= {
            # torch's BatchSampler over its own samplers, a dataset that draws nothing
            f"nw{nw}-tensors-shuffled": _plain(_loader(_tensors, shuffle=True, generator=g(), **w)),
            # ... over a RandomSampler whose epoch is two permutations (drawn mid-epoch)
            f"nw{nw}-tensors-two-permutations": _plain(
                _loader(
                    _tensors,
                    sampler=RandomSampler(range(N), num_samples=2 * N, generator=g()),
                    **w,
                )
            ),
            # a sampler of the script's own
            f"nw{nw}-tensors-own-sampler": _plain(_loader(_tensors, sampler=Backwards(N), **w)),
            # a dataset that draws, under torch's samplers and the script's
            f"nw{nw}-drawing-shuffled": _plain(
                _loader(Drawing, shuffle=True, generator=g(), **w), epochs=3
            ),
            f"nw{nw}-drawing-trainer-draws": _plain(
                _loader(Drawing, shuffle=True, **w), draw_at=frozenset({(0, 3), (1, 1)})
            ),
            f"nw{nw}-drawing-own-sampler": _plain(_loader(Drawing, sampler=Backwards(N), **w)),
            f"nw{nw}-drawing-batch-sampler": _plain(
                _loader(
                    Drawing,
                    batch_size=1,
                    batch_sampler=[[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10]],
                    **w,
                )
            ),
            # an epoch left early, then the next
            f"nw{nw}-drawing-left-early": _plain(
                _loader(Drawing, shuffle=True, generator=g(), **w), stop_after=2, epochs=3
            ),
            f"nw{nw}-tensors-left-early": _plain(
                _loader(_tensors, shuffle=True, generator=g(), **w), stop_after=2, epochs=3
            ),
            # a failed batch, under torch's samplers and the script's
            f"nw{nw}-failing-sequential": _plain(_loader(lambda: Drawing(bad=6), **w)),
            f"nw{nw}-failing-own-sampler": _plain(
                _loader(lambda: Drawing(bad=6), sampler=Backwards(N), **w)
            ),
            # the objects change between epochs
            f"nw{nw}-drawing-changed": _plain(
                _loader(Drawing, shuffle=True, generator=g(), **w), change=_scaled
            ),
            # no automatic batching: one index a batch; a BatchSampler's lists
            f"nw{nw}-unbatched": _plain(_loader(Drawing, batch_size=None, **w)),
            f"nw{nw}-unbatched-batch-sampler": _plain(
                _loader(
                    _tensors,
                    batch_size=None,
                    sampler=BatchSampler(SequentialSampler(range(N)), 5, False),
                    **w,
                )
            ),
            # an iterable: its turns
            f"nw{nw}-iterable": _plain(_loader(Stream, **w)),
            # resumed mid-epoch in a new loader
            f"nw{nw}-resumed-shuffled": lambda s, w=w: _resumed(
                _loader(Drawing, shuffle=True, generator=g(), **w), s
            ),
            f"nw{nw}-resumed-own-sampler": lambda s, w=w: _resumed(
                _loader(_tensors, sampler=Backwards(N), **w), s
            ),
        }
    persistent = {"num_workers": 2, "persistent_workers": True}
    cases |= {
        "nw2-persistent-shuffled": _plain(
            _loader(Drawing, shuffle=True, generator=g(), **persistent), epochs=3
        ),
        "nw2-persistent-own-sampler": _plain(
            _loader(Drawing, sampler=Backwards(N), **persistent), epochs=3, change=_scaled
        ),
        "nw2-persistent-left-early": _plain(
            _loader(_tensors, shuffle=True, generator=g(), **persistent), stop_after=3, epochs=3
        ),
        # batches larger than one FEEDS chunk, and than one FEED message (FEED_PART)
        "nw0-tensors-large-batches": _plain(
            _loader(lambda: _tensors(50_000), batch_size=20_000), epochs=1
        ),
        "nw2-drawing-large-batches": _plain(
            _loader(
                lambda: Drawing(40_000), batch_size=20_000, sampler=Backwards(40_000), num_workers=2
            ),
            epochs=1,
        ),
    }
    return cases


# -- recording what the trainer sends ----------------------------------------------------
def _digest(data: bytes | list[Any]) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return hashlib.sha256(raw).hexdigest()[:10]


def _indices(indices: list[int]) -> str:
    return str(indices) if len(indices) <= 8 else f"{len(indices)} indices {_digest(indices)}"


def describe(message: bytes) -> str | None:
    """One message the trainer sent, in words; None for what depends on timing."""
    kind = message[0]
    if kind == p.RELEASE:
        return None
    if kind in (p.NEXT, p.SKIP):
        return p.KIND_NAMES[kind]
    if kind == p.CREATE:
        c = p.Create.decode(message)
        return (
            f"CREATE rows={c.max_rows} workers={c.num_workers} prefetch={c.prefetch_factor} "
            f"persistent={c.persistent_workers} iterable={c.iterable} length={c.length} "
            f"batches={c.batches_per_epoch} samples={c.samples} drop_last={c.drop_last} "
            f"draws={c.draws}"
        )
    if kind == p.EPOCH:
        return "EPOCH {} seed={}".format(*p.decode_epoch(message))
    if kind == p.OBJECTS:
        return f"OBJECTS {p.decode_objects(message)}"
    if kind == p.SEEK:
        _, epoch, index = p.POSITION_BODY.unpack_from(message)
        return f"SEEK {epoch}/{index}"
    if kind == p.FEEDS:
        epoch, index, batches, ended = p.decode_feeds(message)
        shown = str(batches) if len(batches) <= 2 else f"{len(batches)} batches {_digest(batches)}"
        return f"FEEDS {epoch}/{index} {shown}{' end' if ended else ''}"
    if kind == p.FEED:
        part = p.decode_feed_part(message)
        if part is not None:
            return f"FEED_PART {part[0]}/{part[1]} {_indices(part[2])}"
        epoch, index, indices, states, ahead, then = p.decode_feed(message)
        words = [f"FEED {epoch}/{index}", "end" if indices is None else _indices(indices)]
        if states:
            words.append(f"rng={_digest(states)}")
        if ahead:
            words.append("ahead")
        if then is not None:
            words.append(f"+{p.KIND_NAMES[then[0]]}")
        return " ".join(words)
    return p.KIND_NAMES.get(kind, f"kind {kind}")


@pytest.fixture()
def sent(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every message this process's data-plane connections send, in order (an attach's
    CREATE too: ``attach`` sends it with these)."""
    out: list[bytes] = []
    send, send_fds = SocketTransport.send, SocketTransport.send_fds

    def on_send(self: SocketTransport, message: bytes) -> None:
        out.append(bytes(message))
        send(self, message)

    def on_send_fds(self: SocketTransport, message: bytes, fds: Any) -> None:
        out.append(bytes(message))
        send_fds(self, message, fds)

    monkeypatch.setattr(SocketTransport, "send", on_send)
    monkeypatch.setattr(SocketTransport, "send_fds", on_send_fds)
    return out


def record(server: Server, sent: list[bytes]) -> dict[str, list[str]]:
    """Each case's messages, in words."""
    got = {}
    for name, case in _cases().items():
        sent.clear()
        _seed()
        case(server.socket)
        got[name] = [d for d in map(describe, sent) if d is not None]
    return got


@pytest.mark.slow
def test_the_messages_each_configuration_sends(server: Server, sent: list[bytes]) -> None:
    got = record(server, sent)
    if os.environ.get("PINFEED_WRITE_MESSAGES") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want), "the cases differ from messages.json's"
    changed = [name for name in want if got[name] != want[name]]
    diffs = [
        "\n".join(difflib.unified_diff(want[n], got[n], f"{n} (messages.json)", n, lineterm=""))
        for n in changed
    ]
    assert not changed, f"{len(changed)} configurations send other messages:\n" + "\n".join(diffs)
