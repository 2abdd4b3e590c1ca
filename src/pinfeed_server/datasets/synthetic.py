"""``synthetic``: seeded random tensors, deterministic in (seed, index).

For demos, tests and benchmarks. Sample ``i`` is a tuple with one tensor per field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pydantic import Field, model_validator

from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
    )
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise DatasetError(f"unknown dtype {name!r}; one of {sorted(_DTYPES)}") from None


class FieldSpec(Params):
    shape: list[int] = Field(default_factory=list, description="sample shape ([] = scalar)")
    dtype: str = "float32"
    low: float = 0
    high: float = 1

    @model_validator(mode="after")
    def _check(self) -> FieldSpec:
        if any(d < 0 for d in self.shape):
            raise ValueError("shape entries must be >= 0")
        if self.high <= self.low:
            raise ValueError("high must be greater than low")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
        return self


MAX_SAMPLE_BYTES = 256 << 20


class SyntheticParams(Params):
    length: int = Field(gt=0, le=2**40)
    seed: int = Field(0, ge=0, lt=2**31)
    fields: list[FieldSpec] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _sample_fits(self) -> SyntheticParams:
        # The server builds a sample to size the ring: a huge one must not take it down.
        total = sum(math.prod(f.shape) * torch_dtype(f.dtype).itemsize for f in self.fields)
        if total > MAX_SAMPLE_BYTES:
            raise ValueError(
                f"one sample would take {total} bytes; synthetic samples are capped at "
                f"{MAX_SAMPLE_BYTES} bytes"
            )
        return self


class SyntheticDataset:
    """Sample ``i`` is drawn from a generator seeded with (seed, i): any process, any order."""

    def __init__(self, params: SyntheticParams) -> None:
        self.params = params
        self._fields = [(f, torch_dtype(f.dtype), tuple(f.shape)) for f in params.fields]

    def __len__(self) -> int:
        return self.params.length

    def _fill(self, index: int, outs: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.params.length:
            raise IndexError(f"index {index} out of range for length {self.params.length}")
        gen = torch.Generator().manual_seed(self.params.seed * 2**32 + index)
        result = []
        for j, (spec, dtype, shape) in enumerate(self._fields):
            out = outs[j] if outs is not None else None
            if dtype.is_floating_point:
                t = torch.rand(shape, generator=gen, dtype=dtype, out=out)
                t.mul_(spec.high - spec.low).add_(spec.low)
            else:
                t = torch.randint(
                    int(spec.low), int(spec.high), shape, generator=gen, dtype=dtype, out=out
                )
            result.append(t)
        return tuple(result)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self._fill(index, None)

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        # Same generator calls as __getitem__, writing into the slot rows directly.
        for row, index in enumerate(indices):
            self._fill(index, [o[row] for o in out])


def build(p: SyntheticParams, ctx: DatasetContext) -> SyntheticDataset:
    return SyntheticDataset(p)


KIND = Kind("synthetic", SyntheticParams, build, __doc__)
