"""Batch layout and collation straight into a ring slot.

``probe`` reads one sample and records default_collate's structure (the *treedef*)
and one *leaf* per tensor-like value: the loader's fixed layout. ``SlotWriter`` writes
batches into ring slots: array-backed datasets (and a shipped ``TensorDataset``)
through ``batch_fetch`` (one gather per leaf), all others by ``torch.stack(...,
out=leaf_view)``. There is no intermediate batch tensor: the collate is the batch's
one host copy.

default_collate's rules that we keep: tensors stack; numpy arrays and scalars become
tensors; Python ``int`` -> int64, ``float`` -> float64, ``bool`` -> bool; ``str``
comes back as a list of strings; tuples, lists and dicts keep their structure.

A batch that does not fit the fixed layout (its shapes or structure are not the first
sample's) is collated by torch's own ``default_collate``, so that ragged samples fail
with DataLoader's own error, and a batch it can make (equal shapes within the batch,
as a length-bucketing sampler gives) is written with a layout of its own
(``batchlayout.py``). A loader with a ``collate_fn`` writes every batch that way: the
function is called with the list of samples, as DataLoader calls it, in the worker.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, default_convert

from pinfeed.errors import BatchTooLarge, SampleError
from pinfeed.protocol import MAX_MESSAGE, Layout, Leaf, align, container
from pinfeed.unbatched import Unbatched
from pinfeed_server.datasets.base import Fetch, batch_fetch
from pinfeed_server.engine.batchlayout import OutputError, OutputPlan, output_leaves
from pinfeed_server.engine.ring import OwnBuffer, SlotSpace  # a ring of several segments
from pinfeed_server.errors import DomainError

__all__ = [
    "Layout",
    "LayoutError",
    "Leaf",
    "SlotWriter",
    "describe",
    "loader_layout",
    "per_batch_layout",
    "probe",
    "proposal",
    "with_rows",
]

TreeDef = list[Any]  # see pinfeed.protocol.Layout
Collate = Callable[[list[Any]], Any]


# A collate_fn loader's slots without max_batch_bytes: MARGIN x its first batch.
MARGIN = 4
MIN_SLOT_BYTES = 1 << 20


class LayoutError(DomainError, ValueError):
    """A sample's structure cannot be batched the way the first sample was."""


class _NotTheLayout(Exception):
    """This batch is not shaped as the fixed layout: default_collate makes it."""


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

    def walk(value: Any, zipped: bool = False) -> TreeDef:
        leaf = _leaf_of(value)
        if leaf is not None:
            specs.append(leaf)
            # default_collate's strings are the batch's as it transposed them: a sequence's
            # or namedtuple's by zip (a tuple), a dict's or the batch's own (a list)
            node: TreeDef = ["leaf", len(specs) - 1]
            return [*node, "tuple"] if zipped and leaf[0] == "str" else node
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, (str, int)):
                    raise LayoutError(f"dict keys must be str or int, got {type(k).__name__}")
            items = [[k, walk(v)] for k, v in value.items()]
            # default_collate keeps a mapping's class (a MutableMapping's by a copy)
            return container("dict", items, type(value), dict)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            # default_collate rebuilds namedtuples; the trainer rebuilds this class.
            body = [type(value).__name__, list(value._fields), [walk(v, True) for v in value]]
            return container("namedtuple", body, type(value))
        if isinstance(value, (tuple, list)):
            # default_collate returns a list for tuple samples too ("backwards compatibility").
            return ["list", [walk(v, True) for v in value]]
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


def describe(layout: Layout) -> Any:
    """The batch structure with shapes and dtypes, for humans and the HTTP API: one
    sample's (a fixed layout), or the first batch's (a per-batch layout)."""

    def walk(node: list[Any]) -> Any:
        tag, body = node[:2]
        if tag == "leaf":
            leaf = layout.leaves[body]
            if leaf.kind in ("str", "obj"):
                return {"kind": leaf.dtype or leaf.kind}
            shape = {"dtype": leaf.dtype, "shape": list(leaf.shape)}
            return shape if leaf.kind == "tensor" else {"kind": leaf.kind, **shape}
        if tag == "dict":
            return {str(k): walk(v) for k, v in body}
        if tag == "namedtuple":
            return {
                "namedtuple": body[0],
                "fields": dict(zip(body[1], map(walk, body[2]), strict=True)),
            }
        return [walk(c) for c in body]

    return walk(layout.treedef)


def per_batch_layout(out: Any, batch_size: int, slot_bytes: int | None, cap: int) -> Layout:
    """The layout of a ``collate_fn`` loader from its first batch's output ``out``.

    Slots hold ``slot_bytes`` (the loader's ``max_batch_bytes``) if given; else
    ``MARGIN`` times the first batch, at least ``MIN_SLOT_BYTES``, at most ``cap``
    (a share of the memory budget), and never less than the first batch."""
    treedef, leaves, first = output_leaves(out)
    if slot_bytes is None:
        slot_bytes = max(first, min(max(MARGIN * first, MIN_SLOT_BYTES), cap))
    return Layout(treedef, tuple(leaves), batch_size, align(max(slot_bytes, 64)), per_batch=True)


def with_rows(layout: Layout, rows: int) -> Layout:
    """``layout`` for slots of ``rows`` samples: a fixed layout's leaves each get room for
    that many rows (offsets moved on); a per-batch layout's slot size is kept."""
    if layout.per_batch:
        return replace(layout, batch_size=rows)
    leaves, offset = [], 0
    for leaf in layout.leaves:
        if leaf.kind == "str":
            leaves.append(replace(leaf, offset=offset))
            continue
        capacity = align(leaf.row_bytes * rows)
        leaves.append(replace(leaf, offset=offset, capacity=capacity))
        offset += capacity
    return replace(layout, leaves=tuple(leaves), batch_size=rows, slot_bytes=max(offset, 64))


def layout_bytes(layout: Layout) -> int:
    """The bytes a layout's leaves take in a slot (a per-batch layout's: its first batch's)."""
    return max((leaf.offset + leaf.capacity for leaf in layout.leaves), default=0)


def proposal(out: Any, samples: Sequence[Any], rows: int, fixed: bool) -> Layout:
    """The ring layout a loader's batch proposes, where the loader's ring is sized from
    its first batches (``pinfeed.DataLoader``'s): with ``fixed`` (default collate) the
    first sample's layout for ``rows`` samples, else, or where default_collate's output
    cannot be laid out that way, ``out``'s own (``per_batch_layout``, uncapped: the
    engine caps it by the node's memory)."""
    if fixed:
        try:
            return probe(samples[0], rows)
        except LayoutError:
            pass
    return per_batch_layout(out, rows, None, 1 << 62)


def loader_layout(
    first_batch: Sequence[Any],
    batch_size: int,
    collate_fn: Collate | None = None,
    max_batch_bytes: int | None = None,
    cap: int = 1 << 62,
    where: str = "sample 0",
) -> Layout:
    """A new loader's layout, from its first batch's samples (``where``: what they are,
    for messages): default collate probes the first sample (slots hold ``batch_size`` of
    it, or ``max_batch_bytes`` if more); a ``collate_fn`` is called on the first batch
    (``per_batch_layout``). LayoutError (a 422) when neither can be used."""
    if collate_fn is None:
        try:
            layout = probe(first_batch[0], batch_size)
        except LayoutError as exc:
            raise LayoutError(f"{where}: {exc}") from None
        if max_batch_bytes is not None and max_batch_bytes > layout.slot_bytes:
            layout = replace(layout, slot_bytes=align(max_batch_bytes))
        return layout
    try:
        out = collate_fn(list(first_batch))
    except Exception as exc:
        raise LayoutError(
            f"collate_fn raised on the first batch ({where}): {type(exc).__name__}: {exc}"
        ) from None
    try:
        return per_batch_layout(out, batch_size, max_batch_bytes, cap)
    except OutputError as exc:
        raise LayoutError(f"collate_fn's output cannot be carried: {exc}") from None


def columns(samples: list[Any], treedef: TreeDef, out: list[list[Any]]) -> None:
    """Append, in treedef order, each leaf's values across ``samples`` (a column per
    leaf); LayoutError where a sample's structure differs. Walked once per node of the
    structure, not once per sample and node."""
    tag, body = treedef[:2]
    if tag == "leaf":
        out.append(samples)
    elif tag == "dict":
        for sample in samples:
            if not isinstance(sample, Mapping) or len(sample) != len(body):
                raise LayoutError("sample structure differs from the first sample's (dict)")
        for key, child in body:
            try:
                column = [sample[key] for sample in samples]
            except KeyError:
                raise LayoutError(f"sample has no key {key!r}") from None
            columns(column, child, out)
    else:
        if tag == "namedtuple":
            body = body[2]
        for sample in samples:
            if not isinstance(sample, (tuple, list)) or len(sample) != len(body):
                raise LayoutError(f"sample structure differs from the first sample's ({tag})")
        for k, child in enumerate(body):
            columns([sample[k] for sample in samples], child, out)


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


def fetch_samples(
    dataset: Any, indices: Sequence[int], collate_fn: Collate | None = None
) -> list[Any]:
    """The samples of ``indices``, as DataLoader's fetcher reads them: through the
    dataset's ``__getitems__`` where it has one; without automatic batching (an
    ``Unbatched`` collate: DataLoader's ``batch_size=None``) the one item, read with the
    sampler's index as it yielded it: ``dataset[index]``, or ``dataset[indices]`` where
    it yields index lists."""
    if isinstance(collate_fn, Unbatched):
        key = collate_fn.key(indices)
        try:
            return [dataset[key]]
        except Exception as exc:
            at = key if isinstance(key, int) else None
            raise dataset_error(
                exc, f"sample {key} raised {type(exc).__name__}: {exc}", at
            ) from exc
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
                error_module=type(exc).__module__,
            ) from exc
    samples = []
    for i in indices:
        try:
            samples.append(dataset[i])
        except Exception as exc:
            raise dataset_error(exc, f"sample {i} raised {type(exc).__name__}: {exc}", i) from exc
    return samples


def dataset_error(exc: BaseException, message: str, index: int | None) -> SampleError:
    """A sample-error standing in for what the dataset's code raised: ``exc``'s type and
    the end of its traceback. Call it in the ``except`` clause (it reads the traceback)."""
    return SampleError(
        message,
        index=index,
        error_type=type(exc).__name__,
        error_module=type(exc).__module__,
        where=traceback.format_exc(limit=-3),
    )


def _write_leaf(leaf: Leaf, view: torch.Tensor, values: list[Any]) -> None:
    first = values[0]
    if type(first) is torch.Tensor:  # the common case, checked without _leaf_of's strings
        dtype, shape = view.dtype, view.shape[1:]
        if all(type(v) is torch.Tensor and v.dtype == dtype and v.shape == shape for v in values):
            torch.stack(values, out=view)
            return
    for value in values:
        spec = _leaf_of(value)
        if spec is None or spec[1] != leaf.dtype or spec[2] != leaf.shape:
            raise _NotTheLayout
    if isinstance(first, torch.Tensor):
        torch.stack(values, out=view)
    elif isinstance(first, (np.ndarray, np.generic)):
        np.stack(values, out=view.numpy())
    else:
        view.numpy()[:] = values


class SlotWriter:
    """Writes one loader's batches into its ring (or into any uint8 buffer of whole
    slots: a remote producer's own one-slot buffer). What is the same for every batch
    is worked out once: whether the dataset fetches whole batches, and each slot's leaf
    views (a slot holds a full batch or the epoch's last, shorter one).

    ``write`` returns the BATCH body: the strings JSON (b"" if none) of a batch in the
    fixed layout, or a layout of its own (``batchlayout.OutputPlan``).

    ``own``: DataLoader's rule that a batch is never refused for its size (a
    ``pinfeed.DataLoader``'s loader). A batch that does not fit its slot goes into a
    buffer of its own (``ring.OwnBuffer``), and so does every batch while the writer has
    no ring (``layout`` None: the ring is sized from the first batches, which also say
    what layout they propose for it); ``take`` hands both over after each batch.
    ``rows``: the loader's batch size where it is known, for the proposal."""

    def __init__(
        self,
        dataset: Any,
        layout: Layout | None,
        ring: torch.Tensor | SlotSpace | None,
        slot_bytes: int,
        collate_fn: Collate | None = None,
        *,
        own: bool = False,
        rows: int = 0,
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self.collate_fn = collate_fn
        self._ring = ring
        self._slot_bytes = slot_bytes
        self._own = own or layout is None
        self._rows = rows
        strings = layout is not None and any(x.kind == "str" for x in layout.leaves)
        # where batch_fetch may (into the fixed layout's views: never without a ring)
        self._gathers = layout is not None and not strings and collate_fn is None
        # batch_fetch of the dataset written last (held: its identity cannot be reused)
        self._fetch_for: Any = None
        self._fetch: Fetch | None = None
        self._listed: tuple[torch.Tensor, ...] | None = None  # listed_tensors of it
        self._views: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._slots: dict[int, torch.Tensor] = {}  # each slot's bytes, as _slot views them
        self._made: OwnBuffer | None = None
        self._proposal: Layout | None = None

    def _slot(self, slot: int) -> torch.Tensor:
        view = self._slots.get(slot)
        if view is None:
            assert self._ring is not None
            start = slot * self._slot_bytes
            view = self._slots[slot] = self._ring[start : start + self._slot_bytes]
        return view

    def take(self) -> tuple[OwnBuffer | None, Layout | None]:
        """The last batch's buffer of its own (None: it is in its slot) and the ring
        layout it proposes (None: the writer has a ring)."""
        made, self._made, proposal, self._proposal = self._made, None, self._proposal, None
        return made, proposal

    def write(self, slot: int, indices: Sequence[int]) -> bytes:
        """Fetch the samples of ``indices`` and write their batch into ``slot``."""
        # Of the dataset as it is now (a worker's copy, whose tensors its worker_init_fn
        # may have rebound), resolved once per dataset object, not per batch.
        if self.dataset is not self._fetch_for:
            self._fetch_for = self.dataset
            self._fetch = batch_fetch(self.dataset) if self._gathers else None
            self._listed = listed_tensors(self.dataset, self.collate_fn)
        fetch = self._fetch
        if fetch is not None:
            try:
                fetch(indices, [v for v in self._fixed(slot, len(indices)) if v is not None])
                return b""
            except Exception:
                pass  # the per-sample path says what is wrong, as DataLoader would
        tensors = self._listed
        if tensors is not None and self._ring is not None:
            body = _gather_listed(tensors, indices, self._slot(slot))
            if body is not None:
                self._made = self._proposal = None
                return body
        samples = fetch_samples(self.dataset, indices, self.collate_fn)
        return self.write_samples(slot, samples, indices)

    def write_samples(
        self, slot: int, samples: list[Any], indices: Sequence[int] | None = None
    ) -> bytes:
        """Collate ``samples`` (of ``indices``, if known: for error messages) into ``slot``."""
        self._made = self._proposal = None
        if self.collate_fn is not None:
            out = self.collate_fn(samples)
            if self.layout is None:
                self._proposal = proposal(out, samples, self._batch_rows(samples), False)
            return self._write_out(out, slot, "collate_fn")
        if not samples:
            raise SampleError("an empty batch", index=None, error_type="")
        if self.layout is None:
            out = default_collate(samples)  # its errors (ragged samples) are DataLoader's
            self._proposal = proposal(out, samples, self._batch_rows(samples), True)
            return self._write_out(out, slot, "default_collate")
        try:
            return _write_fixed(self.layout, self._fixed(slot, len(samples)), samples)
        except _NotTheLayout:
            # DataLoader's own collate: its errors (ragged samples) are DataLoader's.
            return self._write_out(default_collate(samples), slot, "default_collate")

    def _batch_rows(self, samples: list[Any]) -> int:
        return max(self._rows, len(samples), 1)

    def _write_out(self, out: Any, slot: int, what: str) -> bytes:
        """``out`` with a layout of its own: into ``slot``, or, where it does not fit (or
        there is no ring yet) and the writer may, into a buffer of its own."""
        plan = OutputPlan(out)
        if self._ring is not None and plan.nbytes <= self._slot_bytes:
            return plan.write(self._slot(slot), what)
        if not self._own:
            raise BatchTooLarge(
                f"{what}'s batch needs {plan.nbytes} bytes; this loader's slots hold "
                f"{self._slot_bytes}: create the loader with max_batch_bytes >= {plan.nbytes}",
                index=None,
                error_type="BatchTooLarge",
            )
        if plan.nbytes == 0:  # no arrays: everything travels in the message
            return plan.write(torch.empty(0, dtype=torch.uint8), what)
        self._made, body = OwnBuffer.make(plan.nbytes, lambda view: plan.write(view, what))
        return body

    def _fixed(self, slot: int, rows: int) -> list[torch.Tensor | None]:
        views = self._views.get((slot, rows))
        if views is None:
            assert self.layout is not None
            if rows > self.layout.batch_size:
                raise _NotTheLayout
            views = self._views[(slot, rows)] = leaf_views(self.layout, self._slot(slot), rows)
        return views

    def close(self) -> None:
        """Drop the cached views (they keep the ring's mapping alive)."""
        self._views.clear()
        self._slots.clear()
        self._ring = None


def listed_tensors(dataset: Any, collate_fn: Any) -> tuple[torch.Tensor, ...] | None:
    """The tensors a batch is gathered from in the slot itself where each fed index list
    is read whole and its batch kept as read: torch's own ``TensorDataset`` (its exact
    type) without automatic batching, a ``BatchSampler`` as ``sampler=`` and
    ``default_convert`` (DataLoader's tuned read, ``dataset[indices]``: each tensor's
    rows, as a list). None: the batch is made and then written."""
    if (
        type(dataset) is torch.utils.data.TensorDataset
        and isinstance(collate_fn, Unbatched)
        and collate_fn.by_list
        and collate_fn.collate_fn is default_convert
    ):
        return tuple(dataset.tensors)
    return None


def _gather_listed(
    tensors: tuple[torch.Tensor, ...], indices: Sequence[int], slot: torch.Tensor
) -> bytes | None:
    """``default_convert(TensorDataset(*tensors)[indices])`` (a list of each tensor's
    rows) gathered straight into ``slot``, one ``index_select`` a tensor, with the layout
    its own copy would have: the BATCH body; None where it does not fit the slot or the
    gather refuses the indices (the made batch then says what is wrong, as under
    DataLoader)."""
    try:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        shapes = [
            torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors
        ]
        plan = OutputPlan(shapes)
        if plan.nbytes > slot.numel():
            return None

        def gather(targets: list[torch.Tensor]) -> None:
            for t, target in zip(tensors, targets, strict=True):
                torch.index_select(t, 0, idx, out=target)

        return plan.write(slot, "dataset[indices]", gather)
    except (IndexError, RuntimeError, TypeError, ValueError):
        return None


def _write_fixed(layout: Layout, views: list[torch.Tensor | None], samples: list[Any]) -> bytes:
    """Write samples shaped as the fixed layout into its leaf views; the strings JSON."""
    cols: list[list[Any]] = []
    try:
        columns(samples, layout.treedef, cols)
    except LayoutError:
        raise _NotTheLayout from None
    strings: list[list[str]] = []
    for leaf, view, values in zip(layout.leaves, views, cols, strict=True):
        if view is None:
            if not all(isinstance(v, str) for v in values):
                raise _NotTheLayout
            strings.append(values)
        else:
            _write_leaf(leaf, view, values)
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
