"""The mixing rule (``pinfeed.mixing``), computed: realised proportions over 1 M
positions, a pure function of (seed, epoch, position), each source read in its own
order pass after pass, the epoch lengths, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from pinfeed.mixing import Mixing

LENGTHS = (50_000, 20_000, 7_000, 3_000)
WEIGHTS = (0.6, 0.2, 0.15, 0.05)  # web, code, books, math


@pytest.mark.parametrize("rule", ["interleave", "quota"])
def test_realised_proportions_over_a_million_positions(rule: str) -> None:
    n = 1_000_000
    mixing = Mixing.of(LENGTHS, WEIGHTS, samples=n, rule=rule)  # type: ignore[arg-type]
    for epoch in (0, 1):
        share = mixing.draws(7, epoch).counts(4) / n
        error = np.abs(share - np.asarray(WEIGHTS))
        if rule == "quota":  # exact: within one sample per source
            assert np.all(error <= 1 / n)
        else:  # within 0.5 percentage points, and within 4 binomial sigmas
            sigma = np.sqrt(np.asarray(WEIGHTS) * (1 - np.asarray(WEIGHTS)) / n)
            assert np.all(error < 0.005) and np.all(error < 4 * sigma), (share, WEIGHTS)
            # relative to the weight: within 0.5% of it but for the smallest source,
            # whose binomial sigma alone is 0.44% of 0.05
            assert np.all((error / np.asarray(WEIGHTS))[:3] < 0.005)


@pytest.mark.parametrize("rule", ["interleave", "quota"])
def test_every_position_is_a_function_of_seed_epoch_and_position(rule: str) -> None:
    a = Mixing.of(LENGTHS, WEIGHTS, samples=30_000, rule=rule)  # type: ignore[arg-type]
    b = Mixing.of(list(LENGTHS), [w * 10 for w in WEIGHTS], samples=30_000, rule=rule)  # type: ignore[arg-type]
    assert a == b  # the weights are normalised: the same rule
    x, y = a.draws(3, 5), b.draws(3, 5)
    assert np.array_equal(x.sources, y.sources) and np.array_equal(x.samples, y.samples)
    other_epoch, other_seed = a.draws(3, 6), a.draws(4, 5)
    assert not np.array_equal(x.sources, other_epoch.sources)
    assert not np.array_equal(x.sources, other_seed.sources)


def test_each_source_is_read_in_its_own_order_each_sample_once_a_pass() -> None:
    lengths = (900, 40, 7)
    mixing = Mixing.of(lengths, (0.5, 0.3, 0.2), samples=2_000, shuffle=(True, True, False))
    draws = mixing.draws(11, 2)
    for s, n in enumerate(lengths):
        got = draws.samples[draws.sources == s]
        passes = [got[i : i + n] for i in range(0, len(got), n)]
        for q, part in enumerate(passes):
            # each pass a permutation (its prefix, for the last one), no sample twice
            assert len(set(part.tolist())) == len(part)
            expect = mixing.order(11, 2, s, q + 1)[q * n : q * n + len(part)]
            assert np.array_equal(part, expect)
        if s == 2:  # unshuffled: file order, cycled
            assert got.tolist() == [i % n for i in range(len(got))]
        elif len(passes) > 1:  # shuffled: a new order each pass
            assert not np.array_equal(passes[0][: len(passes[1])], passes[1])


def test_until_takes_a_source_whole_once_with_a_fixed_length() -> None:
    mixing = Mixing.of(LENGTHS, WEIGHTS, until=3, rule="quota")
    for epoch in range(3):
        draws = mixing.draws(0, epoch)
        assert len(draws.sources) == mixing.samples
        math_samples = draws.samples[draws.sources == 3]
        assert sorted(math_samples.tolist()) == list(range(LENGTHS[3]))  # each once
    counts = mixing.counts()
    assert counts is not None and counts[3] == LENGTHS[3]
    assert counts.tolist() == [36_000, 12_000, 9_000, 3_000]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": 10, "until": 0}, "give the epoch's length"),
        ({}, "give the epoch's length"),
        ({"until": 0}, "needs rule 'quota'"),
        ({"samples": 10, "rule": "blend"}, "one of"),
        ({"samples": 0}, "positive"),
    ],
)
def test_refusals(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mixing.of((10, 10), (1, 1), **kwargs)  # type: ignore[arg-type]


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        Mixing.of((10, 10), (1, 0), samples=5)
