"""The process's global RNG states (``torch``, ``random``, numpy) as bytes: what a
worker sends after each batch (an RNG snapshot), and what travels with a batch made for
a ``pinfeed.DataLoader`` without workers (FEED and RNG messages), since DataLoader makes
those in the trainer, on the trainer's RNGs. Both sides read and write it here, and
decide here which shipped objects draw nothing from them (``draws_nothing``).

numpy's global ``RandomState`` is read and written as bytes (``_NumpyGlobal``): its
Mersenne Twister's words and position where ``bit_generator.ctypes.state_address``
points, and its cached Gaussian (``has_gauss``, ``gauss``) at an offset in the object
found at import by setting known values through ``set_state`` and reading them back.
numpy's own ``get_state``/``set_state`` copy the 624 words one Python-level item at a
time (about 130 us each, the most of a batch's cost without workers); these are a
``memcpy``. Where the offset cannot be found (another numpy's layout) both fall back to
``get_state``/``set_state``. The bytes are the same logical state either way (624
little-endian words, position, has_gauss, gauss), so two processes may differ in which
way they use. random's global ``Random`` is read and written the same way
(``_RandomGlobal``: its 624 words and index, where they lie in the object), against
``getstate``/``setstate``'s tuple of 625 Python ints and ``struct`` over them (about
30 us each way)."""

from __future__ import annotations

import _random
import ctypes
import random
import struct
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from pinfeed.unbatched import Unbatched

# torch's, random's (``_RandomGlobal``), numpy's (``_NumpyGlobal``)
RngState = tuple[torch.Tensor, bytes, bytes]

_MT = struct.Struct("<624Ii")  # the Mersenne Twister's words and position
# memmove with the GIL held (ctypes.memmove releases it): no other thread draws from an
# RNG while its state is half written. ctypes.string_at holds it too.
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)
_GAUSS = struct.Struct("<id")  # has_gauss, gauss
# A known state to set, and where in an object's memory it then lies (offsets)
Probe = tuple[Callable[[], object], Callable[[bytes], list[int]]]


def _one_offset(obj: object, size: int, probes: list[Probe]) -> int | None:
    """The one offset in ``obj``'s first ``size`` bytes at which each probe's known
    state lies once set, the same for all; None where it is not one and the same, or a
    probe raised (another layout or runtime: the slow way). The caller restores the
    object's state."""
    found = None
    try:
        for put, where in probes:
            put()
            at = where(ctypes.string_at(id(obj), size))
            if len(at) != 1 or found not in (None, at[0]):
                return None
            found = at[0]
    except Exception:
        return None
    return found


class _NumpyGlobal:
    """numpy's global ``RandomState`` (``np.random.mtrand._rand``) as bytes."""

    SIZE = _MT.size + _GAUSS.size

    def __init__(self) -> None:
        self.rs = np.random.mtrand._rand
        self.offset = self._find_offset()  # of has_gauss in the object; None: the slow way

    def _find_offset(self) -> int | None:
        rs = self.rs
        saved: Any = rs.get_state()
        size = type(rs).__basicsize__

        def probe(has: int, gauss: float) -> Probe:
            def where(mem: bytes) -> list[int]:
                return [
                    i - 8
                    for i in range(8, len(mem) - 7, 8)
                    if mem[i : i + 8] == struct.pack("<d", gauss)
                    and mem[i - 8 : i - 4] == struct.pack("<i", has)
                ]

            return lambda: rs.set_state((*saved[:3], has, gauss)), where

        try:
            probes = [probe(1, 0.1234567891234), probe(0, -9876.54321), probe(1, 3.25e-200)]
            return _one_offset(rs, size, probes)
        finally:
            rs.set_state(saved)

    def _state_address(self) -> int:
        return int(self.rs._bit_generator.ctypes.state_address)

    def read(self) -> bytes:
        if self.offset is None:
            _, key, pos, has, gauss = cast(Any, self.rs.get_state())
            return _MT.pack(*key.tolist(), pos) + _GAUSS.pack(has, gauss)
        return (
            ctypes.string_at(self._state_address(), _MT.size)
            + ctypes.string_at(id(self.rs) + self.offset, 4)
            + ctypes.string_at(id(self.rs) + self.offset + 8, 8)
        )

    def write(self, state: bytes) -> None:
        if len(state) != self.SIZE:
            raise ValueError(f"numpy's RNG state is {self.SIZE} bytes, not {len(state)}")
        if self.offset is None:
            *key, pos = _MT.unpack_from(state)
            has, gauss = _GAUSS.unpack_from(state, _MT.size)
            self.rs.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has, gauss))
            return
        _memmove(self._state_address(), state, _MT.size)
        _memmove(id(self.rs) + self.offset, state[_MT.size : _MT.size + 4], 4)
        _memmove(id(self.rs) + self.offset + 8, state[_MT.size + 4 :], 8)


_NUMPY = _NumpyGlobal()

_RANDOM = struct.Struct("<i625I?d")  # random's version, words and index, gauss_next (if any)
_WORDS = struct.Struct("<624I")


class _RandomGlobal:
    """random's global ``Random`` as bytes (``_RANDOM``: what ``getstate`` gives, packed).
    CPython's ``_random.Random`` holds its Mersenne Twister as an ``int index`` followed
    by ``uint32_t state[624]``; their offset in the object is found at import by setting
    known states through ``setstate`` and finding them in its memory. Where it cannot be
    found (another layout or runtime) both fall back to ``getstate``/``setstate``."""

    VERSION = 3  # random.Random.VERSION: the only state layout setstate takes

    def __init__(self) -> None:
        self.inst = cast(Any, random)._inst
        self.offset = self._find_offset()  # of state[0] in the object; None: the slow way

    def _find_offset(self) -> int | None:
        inst = self.inst
        saved = inst.getstate()

        def probe(seed: int) -> Probe:
            words = [(seed * 2654435761 + i * 40503 + 17) & 0xFFFFFFFF for i in range(624)]
            index = seed * 13

            def where(mem: bytes) -> list[int]:
                at = mem.find(_WORDS.pack(*words))
                if at < 4 or mem.find(_WORDS.pack(*words), at + 1) != -1:
                    return []
                return [at] if struct.unpack_from("<i", mem, at - 4)[0] == index else []

            return lambda: inst.setstate((self.VERSION, (*words, index), None)), where

        if saved[0] != self.VERSION:
            return None
        try:
            return _one_offset(inst, _random.Random.__basicsize__, [probe(s) for s in (1, 7, 23)])
        finally:
            inst.setstate(saved)

    def read(self) -> bytes:
        inst = self.inst
        gauss = inst.gauss_next
        has = gauss is not None
        if self.offset is None:
            version, words, gauss = inst.getstate()
            return _RANDOM.pack(version, *words, has, gauss if has else 0.0)
        # index and words in one read: no other thread draws between the two
        raw = ctypes.string_at(id(inst) + self.offset - 4, 4 + _WORDS.size)
        return b"".join((_VERSION, raw[4:], raw[:4], _GAUSS_NEXT.pack(has, gauss if has else 0.0)))

    def write(self, state: bytes) -> None:
        if len(state) != _RANDOM.size:
            raise ValueError(f"random's RNG state is {_RANDOM.size} bytes, not {len(state)}")
        index = struct.unpack_from("<I", state, 4 + _WORDS.size)[0]
        version = struct.unpack_from("<i", state)[0]
        if self.offset is None or version != self.VERSION or index > 624:
            version, *words, has, gauss = _RANDOM.unpack(state)
            self.inst.setstate((version, tuple(words), gauss if has else None))  # or raises
            return
        raw = state[4 + _WORDS.size : 8 + _WORDS.size] + state[4 : 4 + _WORDS.size]
        _memmove(id(self.inst) + self.offset - 4, raw, len(raw))  # index and words at once
        has, gauss = _GAUSS_NEXT.unpack_from(state, 8 + _WORDS.size)
        self.inst.gauss_next = gauss if has else None


_VERSION = struct.pack("<i", _RandomGlobal.VERSION)
_GAUSS_NEXT = struct.Struct("<?d")
_RANDOM_GLOBAL = _RandomGlobal()


def capture() -> RngState:
    return torch.get_rng_state(), _RANDOM_GLOBAL.read(), _NUMPY.read()


def restore(state: RngState) -> None:
    torch.set_rng_state(state[0])
    _RANDOM_GLOBAL.write(state[1])
    _NUMPY.write(state[2])


def dump_state() -> bytes:
    """The global RNG states, as bytes: torch's, then random's (``_RANDOM``), then
    numpy's (``_NumpyGlobal``). Equal bytes are equal states and the other way round."""
    torch_state, r, np_state = capture()
    t = torch_state.numpy().tobytes()
    return b"".join((struct.pack("<I", len(t)), t, r, np_state))


def load_state(blob: bytes) -> None:
    """Make the global RNG states those ``dump_state`` gave."""
    (n,) = struct.unpack_from("<I", blob)
    if len(blob) != 4 + n + _RANDOM.size + _NumpyGlobal.SIZE:
        raise ValueError(f"an RNG state of {len(blob)} bytes does not fit its torch part of {n}")
    t = torch.frombuffer(bytearray(blob[4 : 4 + n]), dtype=torch.uint8)
    split = 4 + n + _RANDOM.size
    restore((t, blob[4 + n : split], blob[split:]))


def draws_nothing(dataset: Any, collate_fn: Any, worker_init_fn: Any = None) -> bool:
    """Whether a batch of ``dataset`` collated by ``collate_fn`` (None: the default) is
    made without drawing from the global RNGs, whichever process makes it and on
    whatever RNG state: torch's own ``TensorDataset`` (its exact type: a subclass may
    draw) with ``default_collate``, or without automatic batching (``Unbatched``) with
    ``default_convert`` (a ``TensorDataset`` indexed with a sample's index or a batch's
    index list), and no ``worker_init_fn`` (which might change the dataset per worker,
    so that each batch must come from its own worker)."""
    if isinstance(collate_fn, Unbatched):
        collate_fn = collate_fn.collate_fn
    return (
        type(dataset) is torch.utils.data.TensorDataset
        and collate_fn in _PLAIN_COLLATES
        and worker_init_fn is None
    )


_PLAIN_COLLATES = (
    None,
    torch.utils.data.default_collate,
    torch.utils.data._utils.collate.default_convert,
)
