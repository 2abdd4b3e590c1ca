"""Zero copy: yielded tensors are views into the ring, and the collate is the batch's
only host copy (workers write straight into the slot, no intermediate batch).

Two witnesses of a copy: torch results outside the ring (a ``TorchFunctionMode`` sees
every torch call), and numpy allocations (numpy reports its data buffers to
``tracemalloc``, which torch's allocator does not use), for kinds that hold numpy arrays.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from pinfeed import Client, Loader
from pinfeed_server.datasets import DatasetContext, build_dataset
from pinfeed_server.engine.collate import SlotWriter, probe
from pinfeed_server.engine.ring import Ring
from tests.conftest import Server
from tests.helpers import unique


class OpLog(TorchFunctionMode):
    """Records every torch result: (function, lies in the ring, bytes)."""

    def __init__(self, ring: Ring) -> None:
        super().__init__()
        self.ring = ring
        self.calls: list[tuple[str, bool, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.numel():
            ptr, lo = result.data_ptr(), self.ring.base.data_ptr()
            inside = lo <= ptr < lo + self.ring.size
            name = getattr(func, "__name__", str(func))
            self.calls.append((name, inside, result.numel() * result.element_size()))
        return result


def _collate(ds: Any, indices: list[int]) -> tuple[list[tuple[str, bool, int]], int]:
    """Run the collate under OpLog; return the calls and the batch's smallest leaf size."""
    layout = probe(ds[indices[0]], len(indices))
    leaf_bytes = min(x.row_bytes * len(indices) for x in layout.leaves if x.kind == "tensor")
    with Ring("t", 1, layout.slot_bytes, lock=False) as ring:
        writer = SlotWriter(ds, layout, ring.base, ring.slot_bytes)
        with OpLog(ring) as log:
            writer.write(0, indices)
        writer.close()
    return log.calls, leaf_bytes


def _python_heap_peak(fn: Callable[[], object]) -> int:
    """The most bytes ``fn`` had allocated at once through Python's and numpy's tracked
    allocators (numpy's array buffers included; torch's tensors not)."""
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def _batch_copies(calls: list[tuple[str, bool, int]], leaf_bytes: int) -> list[str]:
    """Ops that wrote a batch-sized result outside the ring (an extra host copy)."""
    return [name for name, inside, nbytes in calls if not inside and nbytes >= leaf_bytes]


def _ring_writes(calls: list[tuple[str, bool, int]]) -> list[str]:
    # Slicing the slot into leaf views (__getitem__/view) lands in the ring but copies nothing.
    return [name for name, inside, _ in calls if inside and name not in ("__getitem__", "view")]


def test_array_kind_writes_once_into_the_slot(tmp_path: Any) -> None:
    x = torch.arange(40 * 12, dtype=torch.float32).reshape(40, 3, 4)
    # Labels of 2 float64 per row, so every leaf is larger than the int64 index list.
    torch.save((x, torch.arange(80, dtype=torch.float64).reshape(40, 2)), tmp_path / "t.pt")
    ds = build_dataset("tensors", {"path": "t.pt"}, DatasetContext(tmp_path))
    calls, leaf_bytes = _collate(ds, [5, 1, 30, 7])
    assert _batch_copies(calls, leaf_bytes) == []
    assert _ring_writes(calls) == ["index_select", "index_select"]  # one gather per field


def test_generic_path_stacks_into_the_slot() -> None:
    from tests.fixtures.datasets import Flaky

    ds = Flaky(length=8, fail_at=99)
    calls, leaf_bytes = _collate(ds, [0, 1, 2, 3])
    assert _batch_copies(calls, leaf_bytes) == []
    # The tensor field: one stack(out=slot view); the int field is written through numpy.
    assert _ring_writes(calls) == ["stack"]


def test_npy_kind_gathers_into_the_slot(tmp_path: Any) -> None:
    # Rows of 48 KiB, so a batch (144 KiB) stands out of the few KiB a write allocates.
    np.save(tmp_path / "a.npy", np.arange(20 * 12288, dtype=np.float32).reshape(20, 3, 64, 64))
    ds = build_dataset("npy", {"paths": ["a.npy"]}, DatasetContext(tmp_path))
    indices = [3, 4, 19]
    calls, leaf_bytes = _collate(ds, indices)
    assert _batch_copies(calls, leaf_bytes) == []
    assert _ring_writes(calls) == ["index_select"]  # one gather, straight into the slot
    # A numpy copy of the rows (``a[indices]``, ``np.take`` without ``out``) is invisible
    # to torch; numpy's allocations are not.
    layout = probe(ds[indices[0]], len(indices))
    with Ring("t", 1, layout.slot_bytes, lock=False) as ring:
        writer = SlotWriter(ds, layout, ring.base, ring.slot_bytes)
        writer.write(0, indices)  # warm: first-use allocations are not the batch's
        peak = _python_heap_peak(lambda: writer.write(0, indices))
        writer.close()
    assert peak < leaf_bytes, f"{peak} bytes allocated by numpy or Python for a {leaf_bytes} batch"
    assert leaf_bytes == 3 * 3 * 64 * 64 * 4


def test_yielded_tensors_live_in_the_ring(admin: Client, server: Server) -> None:
    ds_name = unique("zc")
    admin.create_dataset(
        ds_name,
        "synthetic",
        {
            "length": 64,
            "fields": [
                {"shape": [3, 8, 8], "dtype": "uint8", "low": 0, "high": 255},
                {"shape": [], "dtype": "int64", "low": 0, "high": 10},
            ],
        },
    )
    name = unique("zc")
    admin.create_loader(name, dataset=ds_name, batch_size=16, num_workers=2)
    with Loader(name, socket=server.socket) as loader:
        for images, labels in loader:
            assert loader.ring_contains(images) and loader.ring_contains(labels)
            assert images.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr()
    with Loader(name, socket=server.socket, copy=True) as loader:
        images, labels = next(iter(loader))
        assert not loader.ring_contains(images)
    admin.delete_loader(name)
    admin.delete_dataset(ds_name)
