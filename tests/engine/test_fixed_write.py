"""The fixed layout's write (``collate._write_fixed``): samples shaped as the first one
go straight into the slot's leaf views, as default_collate would batch them; any that
differ (a leaf's dtype or shape, a leaf's type, the structure) leave it to
default_collate (``_NotTheLayout``), whose batch or error is DataLoader's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from pinfeed_server.engine.collate import _NotTheLayout, _write_fixed, leaf_views, probe


class Sub(torch.Tensor):
    """A tensor subclass: not the plain tensors the quick check takes."""


def _first() -> tuple[torch.Tensor, np.ndarray, int, dict[str, Any]]:
    return (torch.ones(2, 3), np.zeros(4, np.float32), 7, {"y": torch.tensor(1), "s": "a"})


def _write(samples: list[Any]) -> tuple[list[Any], bytes]:
    layout = probe(samples[0], len(samples))
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    views = leaf_views(layout, slot, len(samples))
    return views, _write_fixed(layout, views, samples)


def test_samples_shaped_as_the_first_are_default_collates_batch() -> None:
    samples = [_first() for _ in range(3)]
    samples[1] = (torch.full((2, 3), 5.0).as_subclass(Sub), *samples[1][1:])
    views, strings = _write(samples)
    want = default_collate(samples)
    x, a, n, d = want
    assert torch.equal(views[0], x) and torch.equal(views[1], a) and torch.equal(views[2], n)
    assert torch.equal(views[3], d["y"])
    assert strings == b'[["a", "a", "a"]]'


@pytest.mark.parametrize(
    "odd",
    [
        (torch.ones(2, 3, dtype=torch.float64), np.zeros(4, np.float32), 7, {"y": 1, "s": "a"}),
        (torch.ones(3, 2), np.zeros(4, np.float32), 7, {"y": torch.tensor(1), "s": "a"}),
        (torch.ones(2, 3), np.zeros(4, np.float64), 7, {"y": torch.tensor(1), "s": "a"}),
        (torch.ones(2, 3), np.zeros(4, np.float32), 7.5, {"y": torch.tensor(1), "s": "a"}),
        (torch.ones(2, 3), np.zeros(4, np.float32), 7, {"y": torch.tensor(1), "s": 3}),
        (torch.ones(2, 3), np.zeros(4, np.float32), 7, {"y": torch.tensor(1), "t": "a"}),
        (torch.ones(2, 3), np.zeros(4, np.float32), 7),
        [torch.ones(2, 3), np.zeros(4, np.float32), 7, {"y": torch.tensor(1)}],
    ],
    ids=["dtype", "shape", "numpy-dtype", "number", "string", "key", "length", "dict-length"],
)
def test_a_sample_that_differs_is_left_to_default_collate(odd: Any) -> None:
    samples = [_first(), odd, _first()]
    with pytest.raises(_NotTheLayout):
        _write(samples)
