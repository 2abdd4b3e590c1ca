"""The Loader's epoch state machine over an in-process fake server (no sockets, no
server process): what it sends, when, and in which state it is."""

from __future__ import annotations

import gc
import weakref

import pytest

from pinfeed import Loader, SampleError, ServerUnavailable
from tests.client.fake_server import FakeServer, first, labels


def _loader(fake: FakeServer) -> Loader:
    return Loader("fake", transport=fake)


def test_iter_sends_nothing_and_an_epoch_starts_at_the_first_next() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    assert loader.state == "idle"
    it = iter(loader)
    iter(loader)  # a probe, never consumed
    assert fake.sent == ["ATTACH"] and loader.state == "idle"
    assert list(it) == []  # older than the probe: ended, without a message
    assert fake.sent == ["ATTACH"]
    got = [labels(b)[0] for b in loader]
    assert got == [first(0, i) for i in range(3)]
    assert loader.state == "idle" and loader.state_dict()["epoch"] == 1


def test_one_send_and_one_recv_per_batch_with_two_nexts_ahead() -> None:
    fake = FakeServer(batches=5)
    loader = _loader(fake)
    it = iter(loader)
    next(it)
    assert loader.state == "ahead"  # the next two were asked for as this one arrived
    assert fake.sent == ["ATTACH", "NEXT", "NEXT", "NEXT"]
    for _ in it:
        pass
    # 5 batches and the END: one NEXT each, no other message.
    assert fake.sent == ["ATTACH"] + ["NEXT"] * 6
    assert loader.state == "idle"


def test_a_late_batch_hands_back_the_held_slot_before_waiting() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    it = iter(loader)
    next(it)
    fake.late = True
    assert labels(next(it))[0] == first(0, 1)
    assert fake.sent == ["ATTACH", "NEXT", "NEXT", "NEXT", "RELEASE", "NEXT"]


def test_breaking_out_skips_the_rest_when_the_next_epoch_starts() -> None:
    fake = FakeServer(batches=4)
    loader = _loader(fake)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert loader.state == "ahead"
    fake.sent.clear()
    it = iter(loader)
    assert fake.sent == []  # nothing until the first next()
    assert labels(next(it))[0] == first(1, 0)
    # The replies to the NEXTs in flight (batches 2 and 3) are read and handed back;
    # then SKIP.
    assert fake.sent == ["SKIP", "NEXT", "NEXT", "NEXT"]


def test_set_epoch_seeks_only_when_the_loader_is_elsewhere() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    loader.set_epoch(0)  # already there: free
    it = iter(loader)
    loader.set_epoch(2)  # after iter(), before next(): applies to it
    assert labels(next(it))[0] == first(2, 0)
    assert fake.sent == ["ATTACH", "SEEK", "NEXT", "NEXT", "NEXT"]
    list(it)
    fake.sent.clear()
    loader.sampler.set_epoch(3)  # the next epoch anyway: no SEEK
    assert loader.sampler.epoch == 3
    assert [labels(b)[0] for b in loader] == [first(3, i) for i in range(3)]
    assert "SEEK" not in fake.sent


def test_load_state_dict_then_set_epoch_of_that_epoch_keeps_the_position() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    loader.load_state_dict({"epoch": 1, "index": 2})
    assert loader.state == "idle"
    it = iter(loader)
    loader.set_epoch(1)
    assert [labels(b)[0] for b in it] == [first(1, 2)]
    assert fake.sent.count("SEEK") == 1


def test_a_failed_batch_counts_as_consumed_and_the_epoch_goes_on() -> None:
    fake = FakeServer(batches=3, fail_at={(0, 1)})
    loader = _loader(fake)
    it = iter(loader)
    assert labels(next(it))[0] == first(0, 0)
    with pytest.raises(SampleError):
        next(it)
    assert loader.state_dict()["index"] == 2
    assert labels(next(it))[0] == first(0, 2)
    assert list(it) == []


def test_close_hands_back_every_slot_and_is_idempotent() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    next(iter(loader))
    loader.close()
    loader.close()
    assert loader.state == "closed"
    assert fake.sent[-1] == "RELEASE"
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_copy_releases_each_slot_with_the_next_message() -> None:
    fake = FakeServer(batches=6, nslots=3)
    loader = Loader("fake", transport=fake, copy=True)
    kept = list(loader)  # owned tensors: they outlive their slots
    assert [labels(b)[0] for b in kept] == [first(0, i) for i in range(6)]


def test_reconnect_re_attaches_and_seeks_to_where_the_loader_was() -> None:
    fake = FakeServer(batches=4)
    loader = Loader("fake", transport=fake, reconnect=True, reconnect_timeout=5)
    sampler = loader.sampler
    it = iter(loader)
    got = [labels(next(it))[0], labels(next(it))[0]]
    fake.pos = (7, 0)  # the restarted server forgot this member's position
    fake.crash = True
    got += [labels(b)[0] for b in it]
    assert got == [first(0, i) for i in range(4)]
    assert fake.attaches == 2 and fake.sent.count("SEEK") == 1
    assert loader.sampler is sampler  # what a tool holds stays the loader's sampler
    assert loader.state == "idle" and loader.state_dict()["epoch"] == 1


def test_without_reconnect_a_lost_server_is_an_error() -> None:
    fake = FakeServer()
    loader = _loader(fake)
    it = iter(loader)
    next(it)
    fake.crash = True
    with pytest.raises(ServerUnavailable, match="restarted or stopped"):
        next(it)


def test_an_iterator_outlives_its_loader_and_the_last_one_gone_detaches() -> None:
    fake = FakeServer(batches=4)
    loader = Loader("fake", transport=fake)
    gone = weakref.ref(loader)
    it = iter(loader)
    del loader  # as in ``for batch in Loader(name):``
    gc.collect()
    assert gone() is None
    assert [labels(b)[0] for b in it] == [first(0, i) for i in range(4)]
    assert "RELEASE" not in fake.sent and fake.leased
    del it
    gc.collect()
    assert fake.sent[-1] == "RELEASE" and not fake.leased  # closed: every slot handed back
