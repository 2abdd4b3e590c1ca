"""The batch plan of a trainer-fed loader: a batch fed ahead of the trainer's RNG states,
then its states (``FedPlan.feed(..., ahead=True)``, ``trainer_rng``, ``wait_rng``)."""

from __future__ import annotations

import threading
import time

import pytest

from pinfeed_server.engine.fed_plan import FedPlan


def _plan() -> FedPlan:
    plan = FedPlan(40, 4, iterable=False, reported=10, samples=40, fed_turns=True)
    plan.begin(0, 123)
    plan.feed(0, 0, [3, 1, 2, 0], b"s0")
    return plan


def test_a_batch_fed_ahead_then_its_states() -> None:
    plan = _plan()
    assert plan.trainer_rng(0, 0) == (b"s0", False)
    plan.feed(0, 1, [5, 4, 7, 6], ahead=True)
    assert plan.trainer_rng(0, 1) == (None, True)  # ahead: its states still to come
    plan.feed(0, 1, [5, 4, 7, 6], b"s1")
    assert plan.trainer_rng(0, 1) == (b"s1", False)
    assert plan.fed(0) == ([[3, 1, 2, 0], [5, 4, 7, 6]], False)  # one batch, not two


def test_the_states_must_come_with_the_same_indices() -> None:
    plan = _plan()
    plan.feed(0, 1, [5, 4, 7, 6], ahead=True)
    with pytest.raises(ValueError, match="fed ahead"):
        plan.feed(0, 1, [5, 4, 7, 9], b"s1")
    with pytest.raises(ValueError, match="fed ahead"):
        plan.feed(0, 1, [5, 4, 7, 6])  # no states
    with pytest.raises(ValueError, match="fed ahead"):
        plan.feed(0, 1, [5, 4, 7, 6], ahead=True)


def _waiting() -> tuple[FedPlan, threading.Thread, list[bytes | None]]:
    """A plan with batch 1 fed ahead, and a thread waiting for its states (in ``got``)."""
    plan = _plan()
    plan.feed(0, 1, [5, 4, 7, 6], ahead=True)
    got: list[bytes | None] = []
    waiter = threading.Thread(target=lambda: got.append(plan.wait_rng(0, 1)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    return plan, waiter, got


def test_waiting_for_the_states_of_a_batch_fed_ahead() -> None:
    plan, waiter, got = _waiting()
    plan.feed(0, 1, [5, 4, 7, 6], b"s1")
    waiter.join(5)
    assert got == [b"s1"]


@pytest.mark.parametrize("how", ["ended", "interrupted", "reset"])
def test_states_that_never_come(how: str) -> None:
    """The trainer left the epoch (its sampler's end), a seek or stop, a new trainer."""
    plan, waiter, got = _waiting()
    {"ended": lambda: plan.end(0), "interrupted": plan.interrupt, "reset": plan.reset}[how]()
    waiter.join(5)
    assert got == [None]
