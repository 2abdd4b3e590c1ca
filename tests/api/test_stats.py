"""LoaderStats: O(1) per batch and per read, and reads that never take the writers' lock;
StatsSnapshot: the one typed reading that the stats body, /metrics and the CLI render."""

from __future__ import annotations

import random
import threading

import pytest

from pinfeed_server.engine.stats import (
    WAIT_BUCKETS_S,
    LoaderStats,
    RateWindow,
    StatsSnapshot,
    bucket_quantile,
    bucket_quantiles,
)
from pinfeed_server.metric import metric_fields
from pinfeed_server.schemas import LoaderStatsPublic


def test_a_read_does_not_wait_for_a_writer_holding_its_lock() -> None:
    stats = LoaderStats()
    stats.produced(4, 100)
    stats.consumed(4)
    stats.consumer_wait(0.003)
    done = threading.Event()
    with stats._write:  # a writer stuck mid-update: the scrape must still answer
        t = threading.Thread(target=lambda: (stats.snapshot("l", 0.0, 1), done.set()))
        t.start()
        assert done.wait(10), "snapshot() waited for the per-batch lock"
    t.join()


def test_counters_and_the_histogram_add_up() -> None:
    stats = LoaderStats()
    for rows in (4, 4, 2):
        stats.produced(rows, 100)
        stats.consumed(rows)
    for w in (0.00001, 0.002, 0.03, 99.0):
        stats.consumer_wait(w)
    snap = stats.snapshot("l", 0.0, 1)
    assert (snap.batches_produced, snap.batches_consumed) == (3, 3)
    assert snap.samples_consumed == 10 and snap.bytes_consumed == stats.bytes_consumed == 300
    counts, total = snap.wait_histogram
    assert len(counts) == len(WAIT_BUCKETS_S) + 1 and sum(counts) == 4
    assert counts[0] == 1 and counts[-1] == 1  # under 25 us; over the last bound
    assert total == snap.consumer_wait_s == pytest.approx(0.00001 + 0.002 + 0.03 + 99.0)
    assert snap.samples_per_s > 0 and 0 < snap.consumer_wait_share <= 1


def test_rate_window_covers_the_last_seconds_in_fixed_memory() -> None:
    w = RateWindow(10)
    for t in range(1000):  # 1000 s of one batch of 5 samples a second
        w.add(1000.0 + t + 0.5, samples=5, nbytes=50, wait_s=0.1)
    assert len(w._buckets) == 11
    samples, nbytes, wait, covered = w.sums(1000.0 + 999 + 0.75)
    assert (samples, nbytes) == (55, 550) and wait == pytest.approx(1.1)
    assert covered == pytest.approx(10.75)
    assert w.sums(1000.0 + 999 + 20)[0] == 0  # 20 s later nothing is recent


def test_quantiles_from_buckets_match_the_exact_ones_within_a_bucket() -> None:
    rng = random.Random(0)
    waits = sorted(rng.lognormvariate(-7, 1.5) for _ in range(5000))
    stats = LoaderStats()
    for w in waits:
        stats.consumer_wait(w)
    counts, _ = stats.wait_histogram()
    for q in (0.5, 0.99):
        exact = waits[int(q * len(waits))]
        got = bucket_quantile(q, WAIT_BUCKETS_S, counts)
        assert got is not None
        i = next(i for i, b in enumerate(WAIT_BUCKETS_S) if exact <= b)
        lower = WAIT_BUCKETS_S[i - 1] if i else 0.0
        assert lower <= got <= WAIT_BUCKETS_S[i], (q, exact, got)
    assert bucket_quantile(0.5, WAIT_BUCKETS_S, [0] * len(counts)) is None


def _quantile(q: float, counts: list[int]) -> float | None:
    """One quantile by the loop bucket_quantile had before it took several in one pass."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(WAIT_BUCKETS_S):
                return WAIT_BUCKETS_S[-1]
            lower = WAIT_BUCKETS_S[i - 1] if i else 0.0
            return lower + (WAIT_BUCKETS_S[i] - lower) * (rank - seen) / n
        seen += n
    return WAIT_BUCKETS_S[-1]


def test_quantiles_in_one_pass_are_the_quantiles_one_by_one() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        counts = [rng.choice([0, 0, 1, 5, 100]) for _ in range(len(WAIT_BUCKETS_S) + 1)]
        qs = sorted(rng.choice([0.0001, 0.1, 0.5, 0.9, 0.99, 1.0]) for _ in range(3))
        expected = [_quantile(q, counts) for q in qs]
        assert bucket_quantiles(qs, WAIT_BUCKETS_S, counts) == expected, (counts, qs)


def test_a_snapshot_sets_every_field_as_model_construct_would() -> None:
    stats = LoaderStats()
    stats.produced(4, 100)
    stats.consumed(4)
    stats.consumer_wait(0.003)
    snap = stats.snapshot("l", 1.5, 2, autotune={"enabled": True})
    assert set(vars(snap)) == set(StatsSnapshot.model_fields)  # none missing, none extra
    assert snap == StatsSnapshot.model_construct(**vars(snap))
    assert snap.model_fields_set == set(StatsSnapshot.model_fields)
    with pytest.raises(ValueError, match="frozen"):
        snap.errors = 1  # type: ignore[misc]
    # Snapshots share one fields-set (see _built): a copy must not write into it.
    copy = snap.model_copy(update={"errors": 7})
    assert copy.errors == 7 and snap.errors == 0
    assert snap.model_fields_set == set(StatsSnapshot.model_fields)
    assert (snap.workers, snap.worker_busy_s, snap.autotune) == (2, 1.5, {"enabled": True})


def test_the_body_is_the_snapshot_less_its_running_totals() -> None:
    """The stats body keeps the fields it had; the totals Prometheus takes rates of (and
    the histogram) go to /metrics only, and a body parses back into a snapshot (as
    ``pinfeed status`` does), with those at their defaults."""
    only_metrics = {"bytes_consumed", "wait_histogram", "consumer_wait_s", "worker_busy_s"}
    only_metrics |= {"workers"}
    schema = LoaderStatsPublic.model_json_schema(mode="serialization")
    assert set(schema["properties"]) == set(StatsSnapshot.model_fields) - only_metrics
    assert set(LoaderStatsPublic.model_fields) == set(StatsSnapshot.model_fields)
    stats = LoaderStats()
    stats.consumed(4)
    stats.consumer_wait(0.003)
    snap = stats.snapshot("l", 0.5, 1)
    body = LoaderStatsPublic.model_validate(snap, from_attributes=True).model_dump(mode="json")
    assert set(body) == set(schema["properties"])
    back = StatsSnapshot.model_validate(body)
    assert back.model_dump() == snap.model_dump()
    assert back.bytes_consumed == 0 and back.wait_histogram.sum_s == 0.0


def test_a_loader_that_could_not_start_has_zero_stats() -> None:
    zeros = StatsSnapshot.zeros("gone", 3)
    assert (zeros.name, zeros.workers, zeros.autotune) == ("gone", 3, None)
    assert zeros.consumer_wait_p50_s is None and zeros.consumer_wait_p99_s is None
    assert sum(zeros.wait_histogram.counts) == 0 and zeros.wait_histogram.sum_s == 0.0
    for field, _ in metric_fields(StatsSnapshot):
        if field not in ("workers", "wait_histogram"):
            assert getattr(zeros, field) == 0, field
