"""Autotune's rules (``engine/autotune.py``) on measured intervals: more workers while
the trainers wait and the workers are busy, back when a worker gains nothing, deeper
prefetch when the workers idle while the trainers wait, settled when input keeps up."""

from __future__ import annotations

from pinfeed_server.engine.autotune import AutotuneSpec, Sample, Tuner


class Feed:
    """Cumulative counters for a tuner, one interval of 1 s at a time."""

    def __init__(self, tuner: Tuner) -> None:
        self.tuner = tuner
        self.now = Sample(0.0, 0, 0, 0.0, 0.0, 1)

    def interval(self, rate: float, wait: float, busy: float, limit: int = 64) -> object:
        s = self.now
        workers = max(1, self.tuner.num_workers)
        self.now = Sample(
            s.t + 1,
            s.batches + 4,
            s.samples + int(rate),
            s.wait_s + wait,
            s.busy_s + busy * workers,
            1,
        )
        decision = self.tuner.tick(self.now, limit)
        if decision is not None:
            self.tuner.applied(*decision)
        return decision


def _tuner(workers: int = 1, **spec: int) -> tuple[Tuner, Feed]:
    tuner = Tuner(AutotuneSpec(max_workers=spec.pop("max_workers", 4), **spec), workers, 2)
    feed = Feed(tuner)
    feed.tuner.tick(feed.now, 64)  # the first sample: nothing to measure yet
    return tuner, feed


def test_adds_workers_while_they_pay_then_goes_back_and_settles() -> None:
    tuner, feed = _tuner()
    assert feed.interval(100, 0.8, 1.0) is None  # the warm-up interval
    assert feed.interval(100, 0.8, 1.0) == (
        2,
        2,
        "trainers wait 80%, workers busy 100%: one more worker",
    )
    feed.interval(0, 0, 0)  # ignored: right after a change
    assert feed.interval(190, 0.5, 1.0)[:2] == (3, 2)  # type: ignore[index]
    feed.interval(0, 0, 0)
    back = feed.interval(195, 0.5, 1.0)  # a third worker gains under 5%: back to 2
    assert back is not None and back[:2] == (2, 2) and "back to 2" in back[2]
    assert tuner.ceiling == 2
    feed.interval(0, 0, 0)
    assert feed.interval(190, 0.5, 1.0) is None  # at the ceiling: settled
    assert tuner.settled_at is not None
    assert [d.num_workers for d in tuner.decisions] == [2, 3, 2, 2]


def test_never_past_max_workers_or_the_node_limit() -> None:
    tuner, feed = _tuner(max_workers=2)
    feed.interval(100, 0.9, 1.0)
    assert feed.interval(100, 0.9, 1.0)[:2] == (2, 2)  # type: ignore[index]
    feed.interval(0, 0, 0)
    assert feed.interval(300, 0.9, 1.0) is None and tuner.num_workers == 2
    _, low = _tuner(max_workers=8)
    low.interval(100, 0.9, 1.0)
    assert low.interval(100, 0.9, 1.0, limit=1) is None  # the node has one core for it


def test_idle_workers_and_waiting_trainers_deepen_prefetch() -> None:
    _, feed = _tuner(workers=2, max_prefetch_factor=8)
    feed.interval(100, 0.4, 0.5)
    decision = feed.interval(100, 0.4, 0.5)
    assert decision is not None and decision[:2] == (2, 4) and "prefetch_factor 4" in decision[2]


def test_input_that_keeps_up_settles_and_idle_workers_are_let_go() -> None:
    tuner, feed = _tuner(workers=3)
    feed.interval(100, 0.0, 0.1)
    assert feed.interval(100, 0.0, 0.1)[:2] == (2, 2)  # type: ignore[index]
    feed.interval(0, 0, 0)
    # One fewer made the trainers wait: back up, and never below 3 again.
    assert feed.interval(80, 0.3, 1.0)[:2] == (3, 2)  # type: ignore[index]
    assert tuner.floor == 3
    feed.interval(0, 0, 0)
    assert feed.interval(100, 0.0, 0.1) is None
    assert tuner.settled_at is not None and tuner.report()["settled"]


def test_a_refused_decision_is_a_ceiling() -> None:
    tuner, feed = _tuner()
    feed.interval(100, 0.9, 1.0)
    assert feed.interval(100, 0.9, 1.0)[:2] == (2, 2)  # type: ignore[index]
    tuner.refused(3)
    assert tuner.ceiling == 2
