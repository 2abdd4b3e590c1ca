"""The slot table, in-process: states, the prefetch limit, a bounded wait."""

from __future__ import annotations

import threading
import time

from pinfeed_server.engine.ring import SlotState, SlotTable


def test_acquire_takes_free_slots_up_to_the_limit() -> None:
    table = SlotTable(4)
    table.set_limit(2)
    stop = threading.Event()
    assert table.acquire_free(stop) == 0
    assert table.acquire_free(stop) == 1
    assert table.counts() == {"free": 2, "filling": 2, "ready": 0, "leased": 0}
    stop.set()  # at the limit: waits, and gives up once stopped
    assert table.acquire_free(stop, poll_s=0.01) is None


def test_ready_counts_against_the_limit_leased_does_not() -> None:
    table = SlotTable(3)
    table.set_limit(1)
    stop = threading.Event()
    slot = table.acquire_free(stop)
    assert slot == 0
    assert table.move(0, SlotState.FILLING, SlotState.READY)
    assert table.move(0, SlotState.READY, SlotState.LEASED)
    assert table.acquire_free(stop) == 1  # a leased slot is the trainer's, not prefetch


def test_move_checks_the_expected_state() -> None:
    table = SlotTable(2)
    assert not table.move(0, SlotState.READY, SlotState.FREE)
    assert table.states[0] is SlotState.FREE


def test_limit_may_exceed_the_slots_a_ring_has_now() -> None:
    """A live PATCH sets the depth before the ring's new segment exists
    (``LoaderEngine.reconfigure``); acquire is bounded by the slots there are either way."""
    table = SlotTable(3)
    table.set_limit(10)
    assert table.limit == 10
    table.set_limit(0)
    assert table.limit == 1


def test_a_waiting_acquire_wakes_when_a_slot_frees() -> None:
    table = SlotTable(1)
    stop = threading.Event()
    assert table.acquire_free(stop) == 0
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(table.acquire_free(stop)))
    waiter.start()
    table.move(0, SlotState.FILLING, SlotState.FREE)
    waiter.join(10)
    assert got == [0]


def test_try_acquire_never_waits_and_wait_for_room_returns_on_room() -> None:
    """What a trainer's session runs (``LoaderEngine.drive``): no slot is no wait."""
    table = SlotTable(2)
    table.set_limit(1)
    stop = threading.Event()
    assert table.try_acquire() == 0
    assert table.try_acquire() is None  # at the limit: at once
    t0 = time.monotonic()
    table.wait_for_room(stop, 0.05)  # none comes: back after the timeout
    assert time.monotonic() - t0 >= 0.05
    waiter = threading.Thread(target=table.wait_for_room, args=(stop, 30))
    waiter.start()
    table.move(0, SlotState.FILLING, SlotState.FREE)
    waiter.join(10)
    assert not waiter.is_alive()
    assert table.try_acquire() == 0
