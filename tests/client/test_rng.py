"""``pinfeed.rng``: the global RNG states as bytes, read and written without numpy's
item-by-item ``get_state``/``set_state`` or random's ``getstate``/``setstate`` where their
layouts allow, and the same bytes either way."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pinfeed import rng


def _draws() -> tuple[float, float, torch.Tensor, np.ndarray, np.ndarray]:
    return (
        random.random(),
        random.gauss(0, 1),
        torch.rand(3),
        np.random.normal(size=3),
        np.random.randint(0, 1 << 30, size=4),
    )


def _same(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and a[1] == b[1]
        and torch.equal(a[2], b[2])
        and all(np.array_equal(x, y) for x, y in zip(a[3:], b[3:], strict=True))
    )


@pytest.fixture
def seeded() -> None:
    saved = rng.capture()
    random.seed(3)
    random.gauss(0, 1)  # random's cached second Gaussian is part of its state
    torch.manual_seed(4)
    np.random.seed(5)
    np.random.normal()  # and numpy's (has_gauss, gauss)
    yield
    rng.restore(saved)


@pytest.mark.usefixtures("seeded")
def test_a_dumped_state_loaded_again_draws_the_same() -> None:
    blob = rng.dump_state()
    first = _draws()
    random.seed(1)
    torch.manual_seed(1)
    np.random.seed(1)
    assert rng.dump_state() != blob
    rng.load_state(blob)
    assert rng.dump_state() == blob
    assert _same(_draws(), first)


@pytest.mark.usefixtures("seeded")
def test_the_cached_gaussian_alone_changes_the_bytes() -> None:
    """numpy's second Gaussian is cached without moving the Mersenne Twister: a state
    that differs in it alone must not read as the same (the trainer's "drew nothing")."""
    assert np.random.get_state()[3] == 1
    before = rng.dump_state()
    key_before = np.random.get_state()[1].copy()
    np.random.normal()  # takes the cached one
    assert np.array_equal(np.random.get_state()[1], key_before)
    assert rng.dump_state() != before


@pytest.mark.usefixtures("seeded")
def test_the_fast_way_and_numpys_own_agree() -> None:
    fast = rng._NumpyGlobal()
    if fast.offset is None:
        pytest.skip("this numpy's layout was not found: only numpy's own way runs")
    slow = rng._NumpyGlobal()
    slow.offset = None
    assert fast.read() == slow.read()
    state = fast.read()
    expected = np.random.normal(size=5)
    np.random.seed(9)
    slow.write(state)
    assert fast.read() == state
    assert np.array_equal(np.random.normal(size=5), expected)
    np.random.seed(9)
    fast.write(state)
    assert slow.read() == state
    assert np.array_equal(np.random.normal(size=5), expected)


@pytest.mark.usefixtures("seeded")
@pytest.mark.parametrize("gauss", [False, True], ids=["no-gauss", "cached-gauss"])
def test_the_fast_way_and_randoms_own_agree(gauss: bool) -> None:
    fast = rng._RandomGlobal()
    if fast.offset is None:
        pytest.skip("this Python's layout of random was not found: only its own way runs")
    slow = rng._RandomGlobal()
    slow.offset = None
    random.random()
    if not gauss:
        random.gauss(0, 1)  # takes the cached second Gaussian: none is left
    assert (random._inst.gauss_next is not None) is gauss
    state = slow.read()
    version, words, gauss_next = random.getstate()
    assert state == rng._RANDOM.pack(version, *words, gauss, gauss_next or 0.0)
    assert fast.read() == state
    expected = [random.random(), random.gauss(0, 1), random.getrandbits(70)]
    for writer, reader in ((fast, slow), (slow, fast)):
        random.seed(9)
        writer.write(state)
        assert reader.read() == state
        assert [random.random(), random.gauss(0, 1), random.getrandbits(70)] == expected


def test_a_random_state_setstate_refuses_is_refused_the_fast_way_too() -> None:
    state = bytearray(rng._RANDOM_GLOBAL.read())
    before = rng._RANDOM_GLOBAL.read()
    state[4 + 624 * 4 : 8 + 624 * 4] = (625).to_bytes(4, "little")  # index out of range
    with pytest.raises(ValueError):
        rng._RANDOM_GLOBAL.write(bytes(state))
    version = bytearray(before)
    version[:4] = (1).to_bytes(4, "little")  # a version setstate does not know
    with pytest.raises(ValueError):
        rng._RANDOM_GLOBAL.write(bytes(version))
    assert rng._RANDOM_GLOBAL.read() == before  # nothing written


def test_a_state_of_another_size_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        rng.load_state(rng.dump_state()[:-1])
