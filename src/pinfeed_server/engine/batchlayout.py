"""Batches with a layout of their own: a ``collate_fn``'s output (any nesting, shapes
that change from batch to batch, lists of differently shaped tensors), or a batch that
torch's ``default_collate`` made because its shapes are not the loader's.

``write_output`` walks the output once: tensors and numpy arrays are copied into the
slot (the batch's one copy into shared memory, as DataLoader's worker makes one into
its shared memory), one after the other at aligned offsets; numbers, strings and
``None`` travel as JSON. What it returns is the BATCH body with ``FLAG_LAYOUT``
(``pinfeed.protocol.encode_batch_layout``): the structure (treedef and leaf kinds, the
same bytes for batches of the same structure, so the client parses it once), the
offsets and shapes, and the objects.

The client rebuilds what DataLoader yields: tuples stay tuples, lists lists,
namedtuples namedtuples; a mapping becomes a ``dict``; a numpy array a numpy view.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from pinfeed.errors import BatchTooLarge
from pinfeed.protocol import (
    BATCH_HEAD,
    MAX_MESSAGE,
    Leaf,
    align,
    container,
    encode_batch_layout,
)

__all__ = ["OutputError", "OutputPlan", "output_leaves", "write_output"]

# JSON carries these exactly (type and value); anything else must be an array or a container.
_SCALARS = (str, int, float, bool, type(None))
MAX_BODY = MAX_MESSAGE - BATCH_HEAD.size
_TORCH_DTYPES: dict[np.dtype[Any], torch.dtype] = {}


class OutputError(TypeError):
    """A collate output that pinfeed cannot carry; the message names where it is."""


def _torch_dtype(dtype: np.dtype[Any], where: str) -> torch.dtype:
    out = _TORCH_DTYPES.get(dtype)
    if out is None:
        try:
            out = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except TypeError:
            raise OutputError(
                f"{where}: a numpy {dtype} array cannot live in shared memory as a tensor; "
                "return numeric arrays, tensors, numbers or strings"
            ) from None
        _TORCH_DTYPES[dtype] = out
    return out


class _Walk:
    """One pass over an output: its treedef, leaf specs, arrays and objects."""

    def __init__(self) -> None:
        self.specs: list[list[Any]] = []  # [kind, dtype, ndim] per leaf
        self.arrays: list[tuple[Any, torch.dtype, tuple[int, ...], int]] = []
        self.objects: list[Any] = []

    def leaf(self, kind: str, dtype: str, ndim: int) -> list[Any]:
        self.specs.append([kind, dtype, ndim])
        return ["leaf", len(self.specs) - 1]

    def array(self, kind: str, value: Any, dtype: torch.dtype) -> list[Any]:
        shape = tuple(value.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        self.arrays.append((value, dtype, shape, nbytes))
        return self.leaf(kind, str(dtype).removeprefix("torch."), len(shape))

    def walk(self, value: Any, where: str) -> list[Any]:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.is_nested:
                raise OutputError(f"{where}: a {value.layout} tensor; return dense tensors")
            return self.array("t", value, value.dtype)
        if isinstance(value, np.ndarray):
            return self.array("n", value, _torch_dtype(value.dtype, where))
        if isinstance(value, np.generic):
            return self.array("s", np.asarray(value), _torch_dtype(value.dtype, where))
        if type(value) in _SCALARS:
            self.objects.append(value)
            return self.leaf("o", "", 0)
        if type(value) is list and all(type(v) in _SCALARS for v in value):
            self.objects.append(value)  # a list of strings or numbers: one JSON value
            return self.leaf("o", "", 0)
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                if type(k) not in (str, int):
                    raise OutputError(f"{where}: dict keys must be str or int, got {k!r}")
                items.append([k, self.walk(v, f"{where}[{k!r}]")])
            return container("dict", items, type(value), dict)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            children = [
                self.walk(v, f"{where}.{f}") for f, v in zip(value._fields, value, strict=True)
            ]
            body = [type(value).__name__, list(value._fields), children]
            return container("namedtuple", body, type(value))
        if isinstance(value, (tuple, list)):
            tag = "tuple" if isinstance(value, tuple) else "list"
            return [tag, [self.walk(v, f"{where}[{i}]") for i, v in enumerate(value)]]
        raise OutputError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a batch may "
            "hold tensors, numpy arrays, numbers, strings and None, in tuples, lists, dicts "
            "and namedtuples"
        )


def _dest(slot: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: Any) -> Any:
    return slot[offset : offset + nbytes].view(dtype).view(shape)


class OutputPlan:
    """Where one output's arrays go in a buffer (aligned offsets, one after another) and
    how many bytes they take: ``write`` copies them into any buffer that large (a ring
    slot, or a batch's memory of its own) and returns the BATCH body."""

    def __init__(self, out: Any) -> None:
        self._w = w = _Walk()
        self._treedef = w.walk(out, "the batch")
        self._dims: list[int] = []
        self._offsets: list[int] = []
        offset = 0
        for _, _, shape, nbytes in w.arrays:
            self._offsets.append(offset)
            self._dims.append(offset)
            self._dims.extend(shape)
            offset = align(offset + nbytes)
        self.nbytes = offset

    def write(
        self,
        dest: torch.Tensor,
        what: str = "collate_fn",
        fill: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> bytes:
        """Copy the arrays into ``dest`` (uint8, at least ``nbytes``); the BATCH body.
        ``fill``: instead of copying, it writes the arrays into their views in ``dest``
        itself (an output planned from its shapes alone, gathered in place). BatchTooLarge
        if the layout (strings, numbers, structure) exceeds a message."""
        w = self._w
        targets = [
            _dest(dest, at, nbytes, dtype, shape)
            for (_, dtype, shape, nbytes), at in zip(w.arrays, self._offsets, strict=True)
        ]
        if fill is not None:
            fill(targets)
        else:
            for (value, _, _, _), target in zip(w.arrays, targets, strict=True):
                if not isinstance(value, torch.Tensor):
                    np.copyto(target.numpy(), value, casting="no")
                elif value.requires_grad:
                    with torch.no_grad():
                        target.copy_(value)
                else:
                    target.copy_(value)
        structure = _structure(self._treedef, w.specs)
        objects = json.dumps(w.objects, separators=(",", ":")).encode() if w.objects else b""
        body = encode_batch_layout(structure, self._dims, objects)
        if len(body) > MAX_BODY:
            raise BatchTooLarge(
                f"{what}'s batch has a layout of {len(body)} bytes (strings, numbers and "
                f"structure); a batch message holds at most {MAX_BODY}: return long strings "
                "and many numbers as tensors (e.g. token ids)",
                index=None,
                error_type="BatchTooLarge",
            )
        return body


_last_structure: tuple[list[Any], list[list[Any]], bytes] = ([], [], b"")


def _structure(treedef: list[Any], specs: list[list[Any]]) -> bytes:
    """The structure bytes of an output (JSON ``[treedef, specs]``); those of the last
    output again where its structure is the same (batches of one loader mostly are: two
    list comparisons in place of an encoding). Threads may race on the last one: each
    then encodes its own."""
    global _last_structure
    last_treedef, last_specs, encoded = _last_structure
    if treedef == last_treedef and specs == last_specs:
        return encoded
    encoded = json.dumps([treedef, specs], separators=(",", ":")).encode()
    _last_structure = (treedef, specs, encoded)
    return encoded


def write_output(out: Any, slot: torch.Tensor, what: str = "collate_fn") -> bytes:
    """Copy ``out``'s arrays into ``slot`` (uint8, the whole slot); the BATCH body.
    BatchTooLarge (naming ``max_batch_bytes`` and the size needed) if it does not fit."""
    plan = OutputPlan(out)
    if plan.nbytes > slot.numel():
        raise BatchTooLarge(
            f"{what}'s batch needs {plan.nbytes} bytes; this loader's slots hold "
            f"{slot.numel()}: create the loader with max_batch_bytes >= {plan.nbytes}",
            index=None,
            error_type="BatchTooLarge",
        )
    return plan.write(slot, what)


def output_leaves(out: Any) -> tuple[list[Any], list[Leaf], int]:
    """(treedef, leaves, bytes in a slot) of one output: what ``GET`` shows of a
    per-batch loader's first batch, and what its slots are sized from."""
    w = _Walk()
    treedef = w.walk(out, "the batch")
    leaves: list[Leaf] = []
    arrays = iter(w.arrays)
    objects = iter(w.objects)
    offset = 0
    kinds = {"t": "tensor", "n": "ndarray", "s": "scalar"}
    for kind, dtype, _ in w.specs:
        if kind == "o":
            leaves.append(Leaf("obj", type(next(objects)).__name__, (), 0, 0))
            continue
        _, torch_dtype, shape, nbytes = next(arrays)
        leaves.append(Leaf(kinds[kind], dtype, shape, offset, nbytes, torch_dtype.itemsize))
        offset = align(offset + nbytes)
    return treedef, leaves, offset
