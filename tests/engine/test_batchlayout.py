"""A batch with its own layout, in one process: what ``write_output`` writes into a slot
comes back from the client's ``BatchViews`` as the same batch (types, dtypes, shapes,
values), as zero-copy views; what cannot be carried, or does not fit, says so."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pinfeed import protocol as p
from pinfeed._ring import RingMapping, RingSegments
from pinfeed._views import BatchViews
from pinfeed.errors import BatchTooLarge
from pinfeed_server.engine.batchlayout import OutputError, write_output
from pinfeed_server.engine.collate import describe, per_batch_layout
from tests.helpers import assert_same

SLOT = 1 << 16
Point = collections.namedtuple("Point", ["x", "y"])


@pytest.fixture()
def ring() -> Iterator[RingMapping]:
    fd = os.memfd_create("test-batchlayout")
    os.ftruncate(fd, 2 * SLOT)
    mapping = RingMapping(fd, 2 * SLOT)
    yield mapping
    mapping.close()


def _round_trip(ring: RingMapping, out: Any, slot: int = 1) -> Any:
    body = write_output(out, ring.base[slot * SLOT : (slot + 1) * SLOT])
    buf = bytearray(p.MAX_MESSAGE)
    message = b"".join(p.batch_parts(slot, 0, 0, 0, b"", body, p.FLAG_LAYOUT))
    buf[: len(message)] = message
    layout = p.Layout(["list", []], (), 1, SLOT, per_batch=True)
    views = BatchViews(RingSegments(ring, 2, SLOT), layout, 2, SLOT)
    first = views.batch(buf, slot, len(body))
    second = views.batch(buf, slot, len(body))  # the cached structure
    assert_same(second, first)
    views.clear()
    return first


def test_every_kind_of_output_comes_back_as_it_went(ring: RingMapping) -> None:
    out = {
        "ids": torch.arange(12, dtype=torch.int64).view(3, 4),
        "t": (torch.tensor(True), torch.zeros(0, 4), torch.ones(2, dtype=torch.bfloat16)),
        "z": [torch.tensor([1 + 2j], dtype=torch.complex128), torch.rand(3).half()],
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": np.float32(2.5),
        "objects": [1, 2.5, "three", None, True],
        "one": 7,
        "name": "x",
        3: Point(torch.ones(1), ["a", "b"]),
        "strided": torch.arange(10).view(2, 5).t(),
    }
    got = _round_trip(ring, out)
    assert_same(got, out)
    assert ring.contains(got["ids"]) and ring.contains(got[3].x)
    assert np.shares_memory(got["np"], ring.base.numpy())
    assert type(got["scalar"]) is np.float32


def test_the_structure_is_the_same_bytes_when_only_shapes_change(ring: RingMapping) -> None:
    a = write_output({"x": torch.zeros(2, 3)}, ring.base[:SLOT])
    b = write_output({"x": torch.zeros(5, 7)}, ring.base[:SLOT])
    sa, _, _ = p.decode_batch_layout(a)
    sb, dims, _ = p.decode_batch_layout(b)
    assert sa == sb and dims == (0, 5, 7)


def test_what_cannot_be_carried_is_named(ring: RingMapping) -> None:
    with pytest.raises(OutputError, match=r"the batch\['meta'\]\[1\] is a builtins.object"):
        write_output({"meta": [1, object()]}, ring.base[:SLOT])
    with pytest.raises(OutputError, match="dict keys"):
        write_output({(1, 2): torch.ones(1)}, ring.base[:SLOT])
    with pytest.raises(OutputError, match="numpy"):
        write_output(np.array(["a", "b"]), ring.base[:SLOT])


def test_a_batch_over_the_slot_names_max_batch_bytes(ring: RingMapping) -> None:
    with pytest.raises(BatchTooLarge, match=r"needs 65600 bytes.*max_batch_bytes >= 65600"):
        write_output([torch.zeros(SLOT // 4), torch.zeros(1)], ring.base[:SLOT])
    with pytest.raises(BatchTooLarge, match="a batch message holds at most"):
        write_output(["x" * 1000] * 300, ring.base[:SLOT])


def test_a_per_batch_layout_is_sized_from_the_first_batch() -> None:
    out = {"ids": torch.zeros(4, 100, dtype=torch.int64), "n": 4}
    layout = per_batch_layout(out, 4, None, cap=1 << 40)
    assert layout.per_batch and layout.slot_bytes == 1 << 20  # 4 x 3200 < 1 MiB
    assert describe(layout) == {"ids": {"dtype": "int64", "shape": [4, 100]}, "n": {"kind": "int"}}
    assert per_batch_layout(out, 4, 5000, cap=1).slot_bytes == p.align(5000)
    assert per_batch_layout(out, 4, None, cap=100).slot_bytes == 3200  # never below the first
    big = {"ids": torch.zeros(4, 100_000, dtype=torch.int64)}
    assert per_batch_layout(big, 4, None, cap=1 << 40).slot_bytes == 4 * 3_200_000
