"""Consumer groups, in-process: broadcast and split delivery, slot release, seek reset."""

from __future__ import annotations

import threading

import pytest

from pinfeed.errors import InvalidPosition, SampleError
from pinfeed_server.engine.consumers import BatchItem, Consumers, EndItem, ErrorItem
from pinfeed_server.engine.ring import SlotState, SlotTable


def _group(size: int, mode: str, nslots: int = 8) -> tuple[Consumers, SlotTable]:
    slots = SlotTable(nslots)
    group = Consumers(size, mode, slots)
    for m in range(size):
        assert group.join(m) == m
    return group, slots


def _publish_batch(group: Consumers, slots: SlotTable, slot: int, index: int) -> BatchItem:
    assert slots.acquire_free(threading.Event()) == slot
    slots.move(slot, SlotState.FILLING, SlotState.READY)
    item = BatchItem(slot, index, 0, index, 4, b"")
    group.publish(item)
    return item


def test_broadcast_frees_a_slot_once_every_member_released_it() -> None:
    group, slots = _group(2, "broadcast")
    item = _publish_batch(group, slots, 0, 0)
    assert group.take(0) == item
    assert slots.states[0] is SlotState.LEASED
    group.release(0, [0])
    assert slots.states[0] is SlotState.LEASED  # member 1 has not had it yet
    assert group.take(1) == item
    group.release(1, [0])
    assert slots.states[0] is SlotState.FREE


def test_split_deals_batches_round_robin_and_end_to_everyone() -> None:
    group, slots = _group(2, "split")
    items = [_publish_batch(group, slots, i, i) for i in range(4)]
    group.publish(EndItem(0, 3))
    assert [group.take(0), group.take(0), group.take(0)] == [items[0], items[2], EndItem(0, 3)]
    assert [group.take(1), group.take(1), group.take(1)] == [items[1], items[3], EndItem(0, 3)]
    assert group.take(0) is None


def test_errors_reach_their_member_and_take_no_slot() -> None:
    group, _ = _group(1, "broadcast")
    error = ErrorItem(0, 0, 0, SampleError("boom").info())
    group.publish(error)
    assert group.take(0) == error


def test_position_is_the_next_item_or_the_head() -> None:
    group, slots = _group(1, "broadcast")
    assert group.position(0, (3, 1)) == (3, 1)
    _publish_batch(group, slots, 0, 5)
    assert group.position(0, (9, 9)) == (0, 5)
    group.take(0)
    group.publish(EndItem(0, 5))
    assert group.position(0, (9, 9)) == (1, 0)


def test_reset_drops_untaken_items_and_frees_their_slots() -> None:
    group, slots = _group(1, "broadcast")
    first = _publish_batch(group, slots, 0, 0)
    _publish_batch(group, slots, 1, 1)
    assert group.take(0) == first
    group.reset()
    assert group.take(0) is None
    assert slots.states[:2] == [SlotState.LEASED, SlotState.FREE]  # a held slot stays held
    group.release(0, [0])
    assert slots.states[0] is SlotState.FREE


def test_join_refuses_a_second_trainer_and_a_member_outside_the_group() -> None:
    group, _ = _group(1, "broadcast")
    with pytest.raises(LookupError, match="already has a consumer"):
        group.join(None)
    group.leave(0, set())
    assert group.join(None) == 0
    with pytest.raises(InvalidPosition, match="outside"):
        Consumers(2, "broadcast", SlotTable(2)).join(2)


def test_a_member_gone_too_long_is_reported_lost() -> None:
    group, _ = _group(2, "broadcast")
    group.leave(1, set())
    assert group.lost(3600.0) == []
    assert group.lost(0.0) == [1]
