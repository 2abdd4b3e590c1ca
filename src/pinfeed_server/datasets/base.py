"""What every dataset kind shares: the build context, path checks, the error type."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch
import torch.utils.data
from pydantic import BaseModel, ConfigDict, ValidationError

from pinfeed_server.datasets.remote import RemoteDataset
from pinfeed_server.errors import DomainError
from pinfeed_server.remote import Manifest, Remote, RemoteError, RemoteLink


class DatasetError(DomainError, ValueError):
    """A dataset cannot be built from its kind and params (shown to users as 422)."""


@dataclass(frozen=True)
class DatasetContext:
    """What a dataset kind may use when it is built, in the server or in a worker."""

    data_root: Path
    allowed_plugins: tuple[str, ...] = field(default_factory=tuple)
    # s3:// paths: the node's object store and cache (None: PINFEED_REMOTE_ALLOW unset);
    # in a worker's zygote, its link to the server's
    remote: Remote | RemoteLink | None = None
    # a remote dataset built again in a zygote: the listing the server made (its
    # objects and their ETags), which ``manifest`` answers instead of listing
    pinned: Manifest | None = None

    def manifest(self, urls: str | list[str], *, blocks: bool, single: bool = False) -> Manifest:
        """The objects at ``urls`` (a prefix, or with ``single`` object URLs) as a
        manifest; what the store or the allow-list refuses is a ``DatasetError``."""
        shown = urls if isinstance(urls, str) else ", ".join(urls)
        if self.pinned is not None:
            if self.pinned.name != shown:  # a kind that lists twice: a bug, said here
                raise DatasetError(f"{shown}: not the listing pinned ({self.pinned.name})")
            return self.pinned
        if self.remote is None:
            raise DatasetError(
                f"{shown}: this server reads no object store; its operator sets "
                "PINFEED_REMOTE_ALLOW (the buckets it may read) and the AWS chain "
                "(AWS_ENDPOINT_URL, AWS_REGION, credentials)"
            )
        try:  # a zygote's link asks the server, which lends it the listing it made
            return self.remote.manifest(urls, blocks=blocks, single=single)
        except (RemoteError, ValueError) as exc:
            raise DatasetError(str(exc)) from None

    def _inside(self, relative: str) -> tuple[Path, Path]:
        """(root, path): ``relative`` resolved inside the data root, symlinks followed."""
        root = self.data_root.resolve()
        path = (root / relative).resolve()
        if not path.is_relative_to(root):
            raise DatasetError(
                f"path {relative!r} resolves outside the data root {str(root)!r}; "
                "give a path relative to PINFEED_DATA_ROOT"
            )
        return root, path

    def resolve(self, relative: str) -> Path:
        """Resolve ``relative`` inside the data root, following symlinks; refuse escapes."""
        root, path = self._inside(relative)
        if not path.is_file():
            raise DatasetError(f"file {relative!r} not found under the data root {str(root)!r}")
        return path

    def resolve_dir(self, relative: str) -> Path:
        """Like ``resolve``, for a directory (the data root itself is ``"."``)."""
        root, path = self._inside(relative)
        if not path.is_dir():
            raise DatasetError(
                f"directory {relative!r} not found under the data root {str(root)!r}"
            )
        return path


@runtime_checkable
class MapDataset(Protocol):
    """The map-style Dataset protocol that DataLoader uses."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class BatchFetcher(Protocol):
    """Array-backed kinds: write a whole index list straight into the slot's leaf views.

    ``out[j]`` is the view of leaf ``j`` (flattened sample order), shaped
    ``[len(indices), *sample_shape]``. The result must equal ``default_collate`` of
    ``[self[i] for i in indices]``; that is what the parity tests check.
    """

    def fetch_into(self, indices: Sequence[int], out: Sequence[torch.Tensor]) -> None: ...


Fetch = Callable[[Sequence[int], Sequence[torch.Tensor]], None]


def gather_rows(
    tensors: Sequence[torch.Tensor], indices: Sequence[int], out: Sequence[torch.Tensor]
) -> None:
    """Rows ``indices`` of each tensor into its ``out`` view: one ``index_select`` each,
    the same values as ``default_collate``'s stack of the rows (tensors, npy, and a
    shipped ``TensorDataset``)."""
    idx = torch.as_tensor(indices, dtype=torch.int64)
    for t, o in zip(tensors, out, strict=True):
        torch.index_select(t, 0, idx, out=o)


def batch_fetch(dataset: Any) -> Fetch | None:
    """How a whole index list of ``dataset`` is gathered straight into the slot's leaf
    views, where it can be: a kind's own ``fetch_into``, or torch's ``TensorDataset``
    (its exact type: a subclass may override ``__getitem__``), a trainer's object that
    ``pinfeed.DataLoader`` shipped, whose ``default_collate`` is a stack of each tensor's
    rows: ``index_select`` per tensor writes the same values. None: one sample at a time."""
    if isinstance(dataset, BatchFetcher):
        return dataset.fetch_into
    if type(dataset) is torch.utils.data.TensorDataset:
        return functools.partial(gather_rows, tuple(dataset.tensors))
    return None


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


P = TypeVar("P", bound=Params)


def parse_params(model: type[P], params: dict[str, Any]) -> P:
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']}" for e in exc.errors()
        )
        raise DatasetError(f"invalid params: {problems}") from None


@dataclass(frozen=True)
class Kind(Generic[P]):
    """A dataset kind: its name, its params model (validation and the OpenAPI schema
    of ``POST /v1/datasets``) and how to build the dataset from validated params.

    ``ship_build``: how the dataset's zygote (the process its workers are forked from,
    ``engine/producers/zygote.py``) gets it. True: the server's build, pickled once (a
    build that scans or parses, kept compact, e.g. in ``shared.SharedArrays``, which
    pickle as file descriptors). False: the zygote builds its own, once (a build that
    only opens memory maps).

    ``draws_rng``: whether its ``__getitem__`` may draw from the global ``torch``,
    ``random`` or numpy RNGs (a user's dataset may: random augmentations). Such a
    dataset's batches are made on DataLoader's per-worker RNG streams, each batch from
    its own stream's state, replayed where a stream moves (``producers/seeding.py``);
    a kind that draws nothing pays none of that, and any process may make any batch."""

    name: str
    params: type[P]
    build: Callable[[P, DatasetContext], Any]
    doc: str | None = None  # the kind module's docstring; its first line is the summary
    ship_build: bool = False
    draws_rng: bool = False

    @property
    def summary(self) -> str:
        return (self.doc or self.name).strip().splitlines()[0]

    def __call__(self, params: dict[str, Any], ctx: DatasetContext) -> Any:
        try:
            built = self.build(parse_params(self.params, params), ctx)
        except RemoteError as exc:  # a read of an object the build needed (a header)
            raise DatasetError(str(exc)) from None
        if isinstance(built, RemoteDataset):  # it pickles as this build, its listing pinned
            built.source = (self, params, dataclasses.replace(ctx, pinned=None))
        return built
