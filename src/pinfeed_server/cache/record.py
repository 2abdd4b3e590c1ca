"""One cached sample as bytes: a record, and the sample read back from it.

A record is a small header, the sample's structure as JSON (``meta``) and its tensor
and array payloads, each 64-byte aligned::

    magic "PFR1" | meta length u32 | sample index u64 | record length u64 | meta | pad
    | leaf 0 bytes | pad | leaf 1 bytes | ...

``meta`` is ``[tree, leaves]``: the tree names containers and scalars by tag (``l``
list, ``u`` tuple, ``d`` dict, ``nt`` namedtuple by ``module:qualname``, ``i`` int,
``f`` float, ``b`` bool, ``s`` str, ``y`` bytes, ``n`` None) and tensor leaves by
number (``t`` a torch tensor, ``a`` a numpy array, ``g`` a numpy scalar); each leaf is
``[dtype, shape, offset in the record, nbytes]``. Reading a record parses its meta
(memoized: samples of one shape share it) and builds each tensor or array over the
mapped bytes (``torch.frombuffer`` / ``np.frombuffer``): no unpickling, no object graph
but the sample's own containers, and no copy unless asked (``copy=True``).

What the cache does not keep (an object of another type, a CUDA or sparse tensor, a
numpy array of objects, a namedtuple whose class cannot be imported by name) makes
``plan`` return None: such a sample is served uncached.
"""

from __future__ import annotations

import functools
import importlib
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAGIC = b"PFR1"
HEAD = struct.Struct("<4sIQQ")
ALIGN = 64


class CorruptRecord(ValueError):
    """A record whose header does not match the entry that points at it."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Plan:
    """A sample ready to be written: its meta, its leaves' bytes (flat uint8 numpy
    arrays over the sample's own memory) and the record's length."""

    meta: bytes
    payloads: tuple[np.ndarray[Any, Any], ...]
    offsets: tuple[int, ...]
    size: int


def _class_name(cls: type) -> str | None:
    """``module:qualname`` of a class that import finds again by that name, else None."""
    spec = f"{cls.__module__}:{cls.__qualname__}"
    try:
        return spec if _resolve(spec) is cls else None
    except Exception:
        return None


@functools.lru_cache(maxsize=256)
def _resolve(spec: str) -> Any:
    module, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Unstorable(Exception):
    pass


def plan(sample: Any) -> Plan | None:
    """How ``sample`` is written as a record; None if the cache cannot keep it."""
    leaves: list[list[Any]] = []
    payloads: list[np.ndarray[Any, Any]] = []

    def leaf(tag: str, dtype: str, shape: tuple[int, ...], raw: np.ndarray[Any, Any]) -> list[Any]:
        leaves.append([tag, dtype, list(shape), 0, int(raw.nbytes)])
        payloads.append(raw)
        return [tag, len(leaves) - 1]

    def walk(v: Any) -> list[Any]:
        # bool before int: bool is an int
        if isinstance(v, bool):
            return ["b", v]
        if isinstance(v, int):
            return ["i", v]
        if isinstance(v, float):
            return ["f", v]
        if isinstance(v, str):
            return ["s", v]
        if v is None:
            return ["n"]
        if isinstance(v, bytes):
            return ["y", v.hex()]
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu" or v.layout != torch.strided or v.is_quantized:
                raise _Unstorable
            t = v.detach().resolve_conj().resolve_neg().contiguous()
            flat = t.reshape(-1).view(torch.uint8).numpy()
            return leaf("t", str(v.dtype).removeprefix("torch."), tuple(v.shape), flat)
        if isinstance(v, np.ndarray | np.generic):
            a = np.asarray(v)
            if a.dtype.hasobject:
                raise _Unstorable
            descr = json.dumps(np.lib.format.dtype_to_descr(a.dtype))
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            return leaf("g" if isinstance(v, np.generic) else "a", descr, a.shape, raw)
        if isinstance(v, Mapping):
            # a dict exactly: a subclass would come back as a dict
            if type(v) is not dict or not all(isinstance(k, str | int) for k in v):
                raise _Unstorable
            return ["d", [[walk(k), walk(x)] for k, x in v.items()]]
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            name = _class_name(type(v))
            if name is None:
                raise _Unstorable
            return ["nt", name, [walk(x) for x in v]]
        if type(v) is tuple:
            return ["u", [walk(x) for x in v]]
        if type(v) is list:
            return ["l", [walk(x) for x in v]]
        raise _Unstorable

    try:
        tree = walk(sample)
    except _Unstorable:
        return None
    # Offsets are known once the meta's length is: a fixed point, since they are in it.
    for _ in range(4):
        meta = json.dumps([tree, leaves], separators=(",", ":")).encode()
        at = _align(HEAD.size + len(meta))
        offsets = []
        for entry in leaves:
            offsets.append(at)
            at = _align(at + entry[4])
        if [entry[3] for entry in leaves] == offsets:
            return Plan(meta, tuple(payloads), tuple(offsets), at)
        for entry, off in zip(leaves, offsets, strict=True):
            entry[3] = off
    return None  # the meta's length kept moving the offsets: never seen, but bounded


def parts(p: Plan, index: int) -> list[Any]:
    """The record of ``p`` (the plan of sample ``index``) as the buffers that make its
    ``p.size`` bytes, in order (the padding between them zeros): written with one
    ``pwritev`` (``Region.write``), never copied into one buffer first."""
    head = HEAD.pack(MAGIC, len(p.meta), index, p.size) + p.meta
    out: list[Any] = [head]
    at = len(head)
    for raw, off in zip(p.payloads, p.offsets, strict=True):
        if off > at:
            out.append(bytes(off - at))
        if raw.nbytes:
            out.append(raw)
        at = off + raw.nbytes
    if p.size > at:
        out.append(bytes(p.size - at))
    return out


@functools.lru_cache(maxsize=256)
def _numpy_dtype(descr: str) -> np.dtype[Any]:
    return np.lib.format.descr_to_dtype(json.loads(descr))


Builder = Callable[[Any, int, bool], Any]  # (buffer, record start, copy) -> the sample


@functools.lru_cache(maxsize=4096)
def _builder(meta: bytes) -> Builder:
    """The function that builds a sample from its record, compiled once per meta
    (samples of one shape and one label share it)."""
    tree, raw = json.loads(meta)
    leaves = [(t, d, tuple(s), o, n) for t, d, s, o, n in raw]

    def leaf(i: int) -> Builder:
        tag, dtype, shape, off, nbytes = leaves[i]
        if tag == "t":
            dt = getattr(torch, dtype)
            count = nbytes // dt.itemsize
            if count == 0:
                return lambda buf, at, copy: torch.empty(shape, dtype=dt)

            def tensor(buf: Any, at: int, copy: bool) -> Any:
                t = torch.frombuffer(buf, dtype=dt, count=count, offset=at + off).view(shape)
                return t.clone() if copy else t

            return tensor
        nd = _numpy_dtype(dtype)
        count = nbytes // nd.itemsize

        def array(buf: Any, at: int, copy: bool) -> Any:
            a = np.frombuffer(buf, dtype=nd, count=count, offset=at + off).reshape(shape)
            if copy:
                a = a.copy()
            return a[()] if tag == "g" else a

        return array

    def compile_(node: list[Any]) -> Builder:
        tag = node[0]
        if tag in ("t", "a", "g"):
            return leaf(node[1])
        if tag in ("i", "f", "b", "s", "n", "y"):
            value = None if tag == "n" else bytes.fromhex(node[1]) if tag == "y" else node[1]
            return lambda buf, at, copy: value
        if tag in ("l", "u"):
            parts = [compile_(c) for c in node[1]]
            kind: Any = list if tag == "l" else tuple
            return lambda buf, at, copy: kind([p(buf, at, copy) for p in parts])
        if tag == "d":
            items = [(compile_(k), compile_(v)) for k, v in node[1]]
            return lambda buf, at, copy: {k(buf, at, copy): v(buf, at, copy) for k, v in items}
        if tag == "nt":
            cls, fields = _resolve(node[1]), [compile_(c) for c in node[2]]
            return lambda buf, at, copy: cls(*[f(buf, at, copy) for f in fields])
        raise CorruptRecord(f"unknown tag {tag!r}")

    return compile_(tree)


def read(buf: Any, at: int, *, index: int, size: int, copy: bool) -> Any:
    """Sample ``index``, from its record of ``size`` bytes at byte ``at`` of ``buf``:
    tensors and arrays are views of ``buf`` (read-only where ``buf`` is), or copies with
    ``copy``. CorruptRecord where the record is not that sample's."""
    try:
        magic, meta_len, found, length = HEAD.unpack_from(buf, at)
        if magic != MAGIC or found != index or length != size or meta_len > size:
            raise CorruptRecord(f"the record at byte {at} is not sample {index}'s")
        start = at + HEAD.size
        return _builder(buf[start : start + meta_len])(buf, at, copy)
    except CorruptRecord:
        raise
    except Exception as exc:  # a record a checksum let through: not a sample
        raise CorruptRecord(f"sample {index}'s record: {type(exc).__name__}: {exc}") from None


def payload_bytes(p: Plan) -> list[bytes]:
    """The meta and each leaf's bytes: what two reads of a deterministic sample share."""
    return [p.meta, *(raw.tobytes() for raw in p.payloads)]
