"""A sample written as a record and read back is the sample: every type default_collate
batches, the containers' own types, and tensors that are views of the region."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch

from pinfeed_server.cache import record
from pinfeed_server.cache.region import Layout, Region
from tests.fixtures.datasets import Mixed
from tests.helpers import assert_same

Local = collections.namedtuple("Local", ["a"])  # importable by name: kept


def _roundtrip(sample: Any, copy: bool = True) -> tuple[Any, Region]:
    p = record.plan(sample)
    assert p is not None
    region = Region.memfd("t", Layout.within(1, 1 << 22))
    region.write(region.layout.data_at, record.parts(p, 7))
    got = record.read(region.rw, region.layout.data_at, index=7, size=p.size, copy=copy)
    return got, region


@pytest.mark.parametrize("i", [0, 1, 5])
def test_every_default_collate_type_comes_back(i: int) -> None:
    sample = Mixed()[i]
    got, region = _roundtrip(sample)
    assert_same(got, sample)
    region.close()


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(0, 3),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.arange(6.0).reshape(2, 3).to(torch.complex64),
        torch.arange(12).reshape(3, 4).t(),  # not contiguous
        np.zeros((2, 2), dtype=[("x", "<i4"), ("y", "<f8")]),
        np.float16(1.5),
        (b"raw", None, Local(torch.ones(2))),
        {0: "int key", "k": [1.0, float("inf")]},
    ],
    ids=repr,
)
def test_edge_values_come_back(value: Any) -> None:
    got, region = _roundtrip(value)
    if isinstance(value, torch.Tensor):
        assert got.dtype == value.dtype and torch.equal(got, value)
    elif isinstance(value, np.ndarray | np.generic):
        assert type(got) is type(value) and got.dtype == value.dtype
        assert np.array_equal(got, value)
    else:
        assert_same(got, value)
    region.close()


def test_tensors_are_views_of_the_region_unless_copied() -> None:
    image = torch.randint(0, 255, (3, 32, 40), dtype=torch.uint8)
    (view, label), region = _roundtrip((image, 4), copy=False)
    base = np.frombuffer(region.rw, dtype=np.uint8).ctypes.data
    assert base <= view.data_ptr() < base + region.layout.total
    assert torch.equal(view, image) and label == 4
    (copied, _), _ = _roundtrip((image, 4), copy=True)
    assert not base <= copied.data_ptr() < base + region.layout.total
    del view


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {"x": np.array([object()])},
        collections.OrderedDict(a=1),  # would come back a dict
        collections.namedtuple("Inner", ["a"])(1),  # its class has no importable name
        torch.ones(2).to_sparse(),
    ],
    ids=["object", "object-array", "dict-subclass", "local-namedtuple", "sparse"],
)
def test_what_it_does_not_keep_is_refused(value: Any) -> None:
    assert record.plan(value) is None


def test_a_record_read_for_another_index_is_corrupt() -> None:
    p = record.plan(torch.ones(3))
    assert p is not None
    region = Region.memfd("t", Layout.within(1, 1 << 20))
    region.write(region.layout.data_at, record.parts(p, 2))
    with pytest.raises(record.CorruptRecord):
        record.read(region.rw, region.layout.data_at, index=3, size=p.size, copy=True)
    with pytest.raises(record.CorruptRecord):
        record.read(region.rw, region.layout.data_at + 64, index=2, size=p.size, copy=True)
    region.close()
