"""LoaderStats: O(1) per batch and per read, and reads that never take the writers' lock."""

from __future__ import annotations

import random
import threading

import pytest

from pinfeed_server.engine.stats import WAIT_BUCKETS_S, LoaderStats, RateWindow, bucket_quantile


def test_a_read_does_not_wait_for_a_writer_holding_its_lock() -> None:
    stats = LoaderStats()
    stats.produced(4, 100)
    stats.consumed(4)
    stats.consumer_wait(0.003)
    done = threading.Event()
    with stats._write:  # a writer stuck mid-update: the scrape must still answer
        t = threading.Thread(target=lambda: (stats.snapshot(0.0, 1), done.set()))
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
    snap = stats.snapshot(0.0, 1)
    assert (snap["batches_produced"], snap["batches_consumed"]) == (3, 3)
    assert snap["samples_consumed"] == 10 and stats.bytes_consumed == 300
    counts, total = snap["wait_histogram"]
    assert len(counts) == len(WAIT_BUCKETS_S) + 1 and sum(counts) == 4
    assert counts[0] == 1 and counts[-1] == 1  # under 25 us; over the last bound
    assert total == pytest.approx(0.00001 + 0.002 + 0.03 + 99.0)
    assert snap["samples_per_s"] > 0 and 0 < snap["consumer_wait_share"] <= 1


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
