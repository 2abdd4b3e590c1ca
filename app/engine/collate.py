"""Batch layout and collation straight into a ring slot.

``probe`` reads one sample and records default_collate's structure (the *treedef*)
and one *leaf* per tensor-like value. ``SlotWriter`` writes batches into ring slots:
array-backed datasets through ``fetch_into`` (one gather per leaf), all others by
``torch.stack(..., out=leaf_view)``. There is no intermediate batch tensor: the
collate is the batch's one host copy.

default_collate's rules that we keep: tensors stack; numpy arrays and scalars become
tensors; Python ``int`` -> int64, ``float`` -> float64, ``bool`` -> bool; ``str``
comes back as a list of strings; tuples, lists and dicts keep their structure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pinfeed._protocol import MAX_MESSAGE, Layout, Leaf, align
from pinfeed_server.datasets.base import BatchFetcher
from pinfeed_server.engine.errors import BatchTooLarge, SampleError
from pinfeed_server.engine.ring import SlotSpace  # a ring of several segments

__all__ = ["Layout", "LayoutError", "Leaf", "SlotWriter", "probe"]

TreeDef = list[Any]  # see pinfeed._protocol.Layout


class LayoutError(ValueError):
    """A sample's structure cannot be batched the way the first sample was."""


def _leaf_of(value: Any) -> tuple[str, str, tuple[int, ...]] | None:
    if isinstance(value, torch.Tensor):
        return "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape)
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind in "OUSV":
            return None
        dtype = torch.from_numpy(np.empty(0, dtype=value.dtype)).dtype
        return "tensor", str(dtype).removeprefix("torch."), tuple(np.shape(value))
    if isinstance(value, bool):
        return "tensor", "bool", ()
    if isinstance(value, int):
        return "tensor", "int64", ()
    if isinstance(value, float):
        return "tensor", "float64", ()
    if isinstance(value, str):
        return "str", "", ()
    return None


def probe(sample: Any, batch_size: int) -> Layout:
    """The layout of a batch of ``batch_size`` samples shaped like ``sample``."""
    specs: list[tuple[str, str, tuple[int, ...]]] = []

    def walk(value: Any) -> TreeDef:
        leaf = _leaf_of(value)
        if leaf is not None:
            specs.append(leaf)
            return ["leaf", len(specs) - 1]
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, (str, int)):
                    raise LayoutError(f"dict keys must be str or int, got {type(k).__name__}")
            return ["dict", [[k, walk(v)] for k, v in value.items()]]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            # default_collate rebuilds namedtuples; the client rebuilds one of this name.
            children = [walk(v) for v in value]
            return ["namedtuple", [type(value).__name__, list(value._fields), children]]
        if isinstance(value, (tuple, list)):
            # default_collate returns a list for tuple samples too ("backwards compatibility").
            return ["list", [walk(v) for v in value]]
        raise LayoutError(
            f"default_collate cannot batch {type(value).__name__}; samples must be tensors, "
            "numpy arrays, numbers or strings in tuples, lists or dicts"
        )

    treedef = walk(sample)
    leaves = []
    offset = 0
    for kind, dtype, shape in specs:
        if kind == "str":
            leaves.append(Leaf(kind, dtype, shape, offset, 0))
            continue
        itemsize = getattr(torch, dtype).itemsize
        capacity = align(int(np.prod(shape, dtype=np.int64)) * itemsize * batch_size)
        leaves.append(Leaf(kind, dtype, shape, offset, capacity, itemsize))
        offset += capacity
    return Layout(treedef, tuple(leaves), batch_size, max(offset, 64))


def flatten(sample: Any, treedef: TreeDef, out: list[Any]) -> None:
    """Append ``sample``'s leaves in treedef order; LayoutError if its structure differs."""
    tag, body = treedef
    if tag == "leaf":
        out.append(sample)
    elif tag == "dict":
        if not isinstance(sample, Mapping) or len(sample) != len(body):
            raise LayoutError("sample structure differs from the first sample's (dict)")
        for key, child in body:
            if key not in sample:
                raise LayoutError(f"sample has no key {key!r}")
            flatten(sample[key], child, out)
    else:
        if tag == "namedtuple":
            body = body[2]
        if not isinstance(sample, (tuple, list)) or len(sample) != len(body):
            raise LayoutError(f"sample structure differs from the first sample's ({tag})")
        for value, child in zip(sample, body, strict=True):
            flatten(value, child, out)


def leaf_views(layout: Layout, slot: torch.Tensor, rows: int) -> list[torch.Tensor | None]:
    """Views of the first ``rows`` rows of every tensor leaf inside ``slot`` (uint8)."""
    views: list[torch.Tensor | None] = []
    for leaf in layout.leaves:
        if leaf.kind == "str":
            views.append(None)
            continue
        nbytes = leaf.row_bytes * rows
        raw = slot[leaf.offset : leaf.offset + nbytes]
        views.append(raw.view(getattr(torch, leaf.dtype)).view(rows, *leaf.shape))
    return views


def _fetch_samples(dataset: Any, indices: Sequence[int]) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        try:
            return list(getitems(list(indices)))
        except Exception as exc:
            raise SampleError(
                f"__getitems__ for indices {list(indices)[:8]}... raised "
                f"{type(exc).__name__}: {exc}",
                index=None,
                error_type=type(exc).__name__,
            ) from exc
    samples = []
    for i in indices:
        try:
            samples.append(dataset[i])
        except Exception as exc:
            raise SampleError(
                f"sample {i} raised {type(exc).__name__}: {exc}",
                index=i,
                error_type=type(exc).__name__,
            ) from exc
    return samples


def _write_leaf(leaf: Leaf, view: torch.Tensor, values: list[Any], indices: Sequence[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        spec = _leaf_of(value)
        if spec is None or spec[1] != leaf.dtype or spec[2] != leaf.shape:
            got = "unbatchable value" if spec is None else f"{spec[1]} {list(spec[2])}"
            error = BatchTooLarge if spec and _nbytes(spec) > _nbytes(leaf) else SampleError
            raise error(
                f"sample {index}: a field is {got}, but the loader's layout (from the first "
                f"sample) is {leaf.dtype} {list(leaf.shape)}; samples must have equal shapes "
                "and dtypes, as default_collate requires",
                index=index,
                error_type="LayoutError",
            )
    first = values[0]
    if isinstance(first, torch.Tensor):
        torch.stack(values, out=view)
    elif isinstance(first, (np.ndarray, np.generic)):
        np.stack(values, out=view.numpy())
    else:
        view.numpy()[:] = values


def _nbytes(spec: Leaf | tuple[str, str, tuple[int, ...]]) -> int:
    if isinstance(spec, Leaf):
        return spec.row_bytes
    itemsize: int = getattr(torch, spec[1]).itemsize
    return int(np.prod(spec[2], dtype=np.int64)) * itemsize


class SlotWriter:
    """Writes one loader's batches into its ring. What is the same for every batch is
    worked out once: whether the dataset fetches whole batches, and each slot's leaf
    views (a slot holds a full batch or the epoch's last, shorter one)."""

    def __init__(
        self, dataset: Any, layout: Layout, ring: torch.Tensor | SlotSpace, slot_bytes: int
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self._ring = ring
        self._slot_bytes = slot_bytes
        self._batched = isinstance(dataset, BatchFetcher) and not layout.has_strings
        self._views: dict[tuple[int, int], list[torch.Tensor | None]] = {}

    def write(self, slot: int, indices: Sequence[int]) -> bytes:
        rows = len(indices)
        views = self._views.get((slot, rows))
        if views is None:
            if rows > self.layout.batch_size:
                raise BatchTooLarge(
                    f"{rows} samples exceed batch_size {self.layout.batch_size}",
                    index=None,
                    error_type="",
                )
            start = slot * self._slot_bytes
            views = leaf_views(self.layout, self._ring[start : start + self._slot_bytes], rows)
            self._views[(slot, rows)] = views
        return write_batch(self.dataset, self.layout, views, indices, self._batched)

    def close(self) -> None:
        """Drop the cached views (they keep the ring's mapping alive)."""
        self._views.clear()
        del self._ring


def write_batch(
    dataset: Any,
    layout: Layout,
    views: list[torch.Tensor | None],
    indices: Sequence[int],
    batched: bool,
) -> bytes:
    """Write a batch into its leaf views; return the strings JSON (or b"")."""
    if batched:
        try:
            dataset.fetch_into(indices, [v for v in views if v is not None])
            return b""
        except Exception:
            pass
    samples = _fetch_samples(dataset, indices)
    flats: list[list[Any]] = []
    for sample, index in zip(samples, indices, strict=True):
        flat: list[Any] = []
        try:
            flatten(sample, layout.treedef, flat)
        except LayoutError as exc:
            raise SampleError(
                f"sample {index}: {exc}", index=index, error_type="LayoutError"
            ) from None
        flats.append(flat)
    strings: list[list[str]] = []
    for j, (leaf, view) in enumerate(zip(layout.leaves, views, strict=True)):
        values = [flat[j] for flat in flats]
        if view is None:
            if not all(isinstance(v, str) for v in values):
                raise SampleError(
                    "a string field holds a non-string value", index=None, error_type="LayoutError"
                )
            strings.append(values)
        else:
            _write_leaf(leaf, view, values, indices)
    if not strings:
        return b""
    encoded = json.dumps(strings).encode()
    if len(encoded) > MAX_MESSAGE - 4096:
        raise BatchTooLarge(
            f"the batch's strings take {len(encoded)} bytes; a batch message holds at most "
            f"{MAX_MESSAGE - 4096}: return tensors (e.g. token ids) instead of long strings",
            index=None,
            error_type="LayoutError",
        )
    return encoded
