"""From a BATCH message to the trainer's batch: tensor views over a ring slot
(``BatchViews``), then as views, owned copies or a CUDA copy (``Delivery``), and which
slots can go back to the server.

A BATCH in the loader's fixed layout carries dims (rows, shapes); one with
``FLAG_LAYOUT`` carries its own layout (a ``collate_fn``'s output): its structure is
parsed once per distinct structure and cached, so the per-batch cost is a dict lookup,
one ``struct`` unpack and one view per leaf, as for a fixed layout. One with
``FLAG_OWN`` too lives in a memfd of its own that came with it (a ``pinfeed.DataLoader``'s
batch made before its ring was sized, or larger than its slots): its views are of that
mapping, which goes when they do.
"""

from __future__ import annotations

import collections
import json
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pinfeed import protocol as p
from pinfeed._ring import RingSegments, SlotMemory

Builder = Callable[[list[Any]], Any]


def builder(node: list[Any]) -> Builder:
    """Turn a treedef into a function from flat leaves to the nested batch."""
    tag, body = node
    if tag == "leaf":
        j = int(body)
        return lambda leaves: leaves[j]
    if tag == "dict":
        keys = [k for k, _ in body]
        subs = [builder(c) for _, c in body]
        return lambda leaves: {k: f(leaves) for k, f in zip(keys, subs, strict=True)}
    if tag == "namedtuple":
        typename, fields, children = body
        cls = collections.namedtuple(typename, fields)  # type: ignore[misc]
        nsubs = [builder(c) for c in children]
        return lambda leaves: cls(*(f(leaves) for f in nsubs))
    subs = [builder(c) for c in body]
    if tag == "list":
        return lambda leaves: [f(leaves) for f in subs]
    return lambda leaves: tuple(f(leaves) for f in subs)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


# A per-batch layout's parsed structure: (builder, leaves as (kind, dtype, ndim), dims).
Structure = tuple[Builder, list[tuple[str, torch.dtype | None, int]], Any]
MAX_STRUCTURES = 256


def _parse_structure(raw: bytes) -> Structure:
    treedef, leaves = json.loads(raw)
    specs = [(k, getattr(torch, d) if k != "o" else None, int(n)) for k, d, n in leaves]
    return builder(treedef), specs, p.layout_dims(leaves)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to its tensors; numpy views into the slot are
    copied (DataLoader's pin_memory leaves arrays alone, but the slot goes back)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, list):
        return [_map_tensors(v, fn) for v in batch]
    if isinstance(batch, tuple):
        items = (_map_tensors(v, fn) for v in batch)
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return batch


class BatchViews:
    """The batch a BATCH message announces, as tensor views into the ring. A loader
    attached before its ring was sized has none until ``set_ring`` (a RING message);
    ``fds()`` hands over the fds the last message carried (a FLAG_OWN batch's memfd)."""

    def __init__(
        self,
        ring: RingSegments | None,
        layout: p.Layout | None,
        slot_bytes: int,
        fds: Callable[[], list[int]] = list,
    ):
        self._fds = fds
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        # Per slot and dims: the batch's leaf views, built once (``SlotMemory.cached``).
        # Each batch hands out detach()ed aliases of them: new tensor objects (a trainer
        # may reshape its own in place), for a quarter of the cost of as_strided, and far
        # less when the trainer's step has left the caches cold.
        self._structures: dict[bytes, Structure] = {}
        self._ring: RingSegments | None = None
        self.held: SlotMemory | None = None  # the last batch's slot (``batch``)
        if ring is not None and layout is not None:
            self.set_ring(ring, layout, slot_bytes)

    def set_ring(self, ring: RingSegments, layout: p.Layout, slot_bytes: int) -> None:
        """The ring and its fixed layout (ATTACHED's, or a RING's)."""
        self._ring = ring
        self._slot_bytes = slot_bytes
        self._leaves = [
            (
                leaf.offset,
                getattr(torch, leaf.dtype) if leaf.kind == "tensor" else None,
                len(leaf.shape) + 1,
            )
            for leaf in layout.leaves
        ]
        self._dims = p.dims_struct(layout)
        self._build = builder(layout.treedef)
        ring.clear_cached()

    def batch(self, buf: bytearray, slot: int, nstr: int) -> Any:
        """The nested batch of the BATCH message in ``buf`` (its head already read).
        ``held`` is then its slot's memory (None: nothing of the batch is in its slot)."""
        if buf[1] & p.FLAG_LAYOUT:
            return self._own_layout(buf, slot)
        dims = self._dims.unpack_from(buf, p.BATCH_HEAD.size)
        assert self._ring is not None, "a batch in a slot before the ring (RING)"
        memory = self.held = self._ring.slot(slot)
        if not nstr:
            views = memory.cached.get(dims)
            if views is None:
                views = self._make_leaves(memory, dims, None)
                memory.cache(dims, views)
            return self._build([v.detach() for v in views])
        start = p.BATCH_HEAD.size + self._dims.size
        strings = iter(json.loads(bytes(buf[start : start + nstr])))
        return self._build(self._make_leaves(memory, dims, strings))

    def _make_leaves(self, memory: SlotMemory, dims: tuple[int, ...], strings: Any) -> list[Any]:
        out: list[Any] = []
        d = 0
        for offset, dtype, ndim in self._leaves:
            if dtype is None:
                out.append(next(strings))
                continue
            shape = dims[d : d + ndim]
            d += ndim
            stride = self._strides.get(shape)
            if stride is None:
                stride = self._strides[shape] = _strides(shape)
            typed = memory.typed(dtype)
            out.append(torch.as_strided(typed, shape, stride, offset // dtype.itemsize))
        return out

    def _own_layout(self, buf: bytearray, slot: int) -> Any:
        """A FLAG_LAYOUT batch: its structure (cached), then per array leaf its offset
        and shape, then its objects (numbers, strings) as JSON."""
        at = p.BATCH_HEAD.size
        _, nstruct, nobj = p.BATCH_LAYOUT_HEAD.unpack_from(buf, at)
        at += p.BATCH_LAYOUT_HEAD.size
        raw = bytes(buf[at : at + nstruct])
        structure = self._structures.get(raw)
        if structure is None:
            if len(self._structures) >= MAX_STRUCTURES:
                self._structures.clear()
            structure = self._structures[raw] = _parse_structure(raw)
        build, specs, dims_struct = structure
        at += nstruct
        dims = dims_struct.unpack_from(buf, at)
        at += dims_struct.size
        objects = iter(json.loads(bytes(buf[at : at + nobj])) if nobj else ())
        memory: Callable[[torch.dtype], torch.Tensor]
        base = 0  # its arrays' offsets are from its slot's first byte, or its memfd's
        self.held = None  # nothing of it in its slot (in a memfd of its own, or no arrays)
        if buf[1] & p.FLAG_OWN:  # in the memfd that came with it
            memory = _own_memory(self._fds())
        elif any(dtype is not None for _, dtype, _ in specs):
            assert self._ring is not None, "a batch in a slot before the ring (RING)"
            slot_memory = self.held = self._ring.slot(slot)
            memory = slot_memory.typed
        out: list[Any] = []
        d = 0
        for kind, dtype, ndim in specs:
            if dtype is None:
                out.append(next(objects))
                continue
            offset, shape = dims[d], dims[d + 1 : d + 1 + ndim]
            d += ndim + 1
            t = torch.as_strided(
                memory(dtype), shape, _strides(shape), (base + offset) // dtype.itemsize
            )
            out.append(t if kind == "t" else t.numpy() if kind == "n" else t.numpy()[()])
        return build(out)

    def clear(self) -> None:
        if self._ring is not None:
            self._ring.clear_cached()
        self._structures.clear()


def _own_memory(fds: list[int]) -> Callable[[torch.dtype], torch.Tensor]:
    """A FLAG_OWN batch's memfd (``fds``: what its message carried), mapped: its whole
    bytes viewed as a dtype. The fd is closed; the mapping lives as long as a view."""
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a BATCH with FLAG_OWN carries one memfd, not {len(fds)}")
    try:
        size = os.fstat(fds[0]).st_size
        mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fds[0])
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping
    return lambda dtype: whole.view(dtype)


class Delivery:
    """Hands a slot's batch to the trainer and says when the slot can go back.

    Views: the slot is released with the next message (the view lives until then); with
    ``keep`` (``pinfeed.DataLoader``: DataLoader's batches are the trainer's for as long
    as it holds them), with the first message once no tensor of the trainer's holds the
    batch's views (``held``: the slot's storage is held by the slot's own views alone).
    ``copy``: owned CPU tensors, the slot released at once. ``device`` (CUDA): a
    ``non_blocking`` copy on a side stream; the slot is released once its event is done.
    """

    def __init__(
        self, device: torch.device | None, copy: bool, nslots: int, keep: bool = False
    ) -> None:
        self.device = device
        self.copy = copy
        self.keep = keep
        self.release: list[int] = []  # slots to hand back with the next message
        self.pending: list[tuple[int, torch.cuda.Event]] = []  # (slot, copy done)
        # (slot, its memory): batches the trainer got as views, with ``keep``, until it
        # lets go of them
        self.held: list[tuple[int, SlotMemory]] = []
        self._hold = max(1, nslots - 1)
        if device is not None and device.type == "cuda":
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        else:
            self.stream = None

    def deliver(self, slot: int, batch: Any, held: SlotMemory | None) -> Any:
        """The batch as the trainer gets it; ``held``: ``BatchViews.held`` (None: nothing
        of it is in its slot)."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                out = _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
            current.wait_event(event)
            for t in _tensors(out):
                # The trainer uses these on its own stream: keep the allocator from
                # recycling them until that stream is done with them.
                t.record_stream(current)
            self.pending.append((slot, event))
            return out
        if self.copy:
            self.release.append(slot)
            return _map_tensors(batch, torch.Tensor.clone)
        if self.keep and held is not None:
            self.held.append((slot, held))
        else:
            self.release.append(slot)
        return batch

    def collect_held(self) -> None:
        """Release the slots of kept batches the trainer no longer holds."""
        still = []
        for slot, memory in self.held:
            if memory.alive():
                still.append((slot, memory))
            else:
                self.release.append(slot)
        self.held = still

    def collect_copies(self) -> None:
        """Release slots whose device copy has finished; block on the oldest only when
        we would otherwise hold so many slots that the server could not prefetch."""
        while self.pending:
            done = self.pending[0][1].query()  # type: ignore[no-untyped-call]
            if not done and len(self.pending) < self._hold:
                break
            slot, event = self.pending.pop(0)
            event.synchronize()
            self.release.append(slot)

    def finish_copies(self) -> None:
        """Wait for every device copy; their slots join ``release`` (and so do kept
        batches' that the trainer no longer holds)."""
        if self.held:
            self.collect_held()
        for slot, event in self.pending:
            event.synchronize()
            self.release.append(slot)
        self.pending.clear()
