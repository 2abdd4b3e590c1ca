"""``ServerDataset(kind, **params)``: a dataset the node's pinfeed server builds from
one of its kinds, named in a training script without registering anything.

    from pinfeed import DataLoader, ServerDataset
    train = ServerDataset("images", path="s3://corpus/train/", size=224)
    loader = DataLoader(train, batch_size=256, shuffle=True, num_workers=8)

It is what ``POST /v1/datasets`` with that kind and those params would register, built
where the batches are made: in the server, its zygote and its workers, with the
server's settings (its data root, ``PINFEED_REMOTE_ALLOW``, the AWS chain in its
environment). The trainer holds the kind and the params only: it has no client, no
credential, and cannot read a sample itself (``__getitem__`` here says so); what it
needs of the dataset for DataLoader's samplers, its length and whether it is an
``IterableDataset``, it asks the server once, when it is made (DESCRIBE, over the
data-plane socket; a server is started for it if none runs, as ``pinfeed.DataLoader``
starts one). ``pinfeed.DataLoader`` ships it as it ships any dataset (a few bytes), and
never falls back to torch's own DataLoader over it: torch's could not read it here.

In a server's processes (``install``) the same object reads the dataset the kind built
there: ``dataset`` is that dataset (so the server sees it is remote, fetches ahead and
gates batches on its objects), ``__getitem__`` and ``__iter__`` its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from pinfeed import protocol as p
from pinfeed._autostart import ensure_server
from pinfeed._transport import SocketTransport
from pinfeed.errors import DataPlaneError, error_from_info

# kind, params -> the dataset, in a server's processes (``install``); None in a trainer
_BUILD: Callable[[str, dict[str, Any]], Any] | None = None


def install(build: Callable[[str, dict[str, Any]], Any] | None) -> None:
    """Make ``ServerDataset``s read what ``build(kind, params)`` builds, in this process
    and the processes forked from it (a server while it serves, a zygote); None: no
    more (a server closed)."""
    global _BUILD
    _BUILD = build


def describe(kind: str, params: dict[str, Any], path: Path) -> p.Described:
    """What the server at ``path`` builds from ``kind`` and ``params`` (its ERROR raised:
    an ``InvalidRequest`` naming what is wrong with them)."""
    ensure_server(path)
    transport = SocketTransport(path, 300.0, f"ServerDataset({kind!r})")
    try:
        n, _ = transport.attach(p.Describe(kind, params).encode())
        buf = transport.buf
        if buf[0] == p.DESCRIBED:
            return p.Described.decode(memoryview(buf)[:n])
        if buf[0] == p.ERROR:
            raise error_from_info(p.ErrorInfo.decode(memoryview(buf)[:n]))
        raise DataPlaneError(f"unexpected message kind {buf[0]} in reply to DESCRIBE")
    finally:
        transport.close()


class ServerDataset(Dataset[Any]):
    """A dataset of kind ``kind`` over ``params``, built and read by the server (see the
    module). ``socket``: the server's data-plane socket (default ``PINFEED_SOCKET``)."""

    kind: str
    params: dict[str, Any]
    length: int | None

    def __new__(
        cls, kind: str, *, socket: str | os.PathLike[str] | None = None, **params: Any
    ) -> ServerDataset:
        path = Path(socket) if socket is not None else p.default_socket_path()
        found = describe(kind, params, path)
        self = super().__new__(ServerIterable if found.iterable else ServerDataset)
        self.kind, self.params, self.length = kind, params, found.length
        return self

    def __init__(
        self, kind: str, *, socket: str | os.PathLike[str] | None = None, **params: Any
    ) -> None:
        self._built: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.kind, self.params, self.length))

    @property
    def dataset(self) -> Any:
        """The dataset the kind built in this process (a server's only)."""
        if self._built is None:
            if _BUILD is None:
                raise RuntimeError(
                    f"{self!r} is read by the pinfeed server (it holds the store's "
                    "credentials, the trainer none): give it to pinfeed.DataLoader, which "
                    "has the server make its batches"
                )
            self._built = _BUILD(self.kind, self.params)
        return self._built

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(f"{self!r} has no length")
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"ServerDataset({self.kind!r}, {shown})"


class ServerIterable(ServerDataset, IterableDataset[Any]):
    """A ``ServerDataset`` of an iterable kind (``webdataset``)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


def _restore(
    cls: type[ServerDataset], kind: str, params: dict[str, Any], length: int | None
) -> ServerDataset:
    self = object.__new__(cls)
    self.kind, self.params, self.length, self._built = kind, params, length, None
    return self


def _of(dataset: Any) -> ServerDataset | None:
    """``dataset``, or the dataset a ``Transformed`` wraps, if it is a ServerDataset."""
    if isinstance(dataset, ServerDataset):
        return dataset
    inner = getattr(dataset, "dataset", None)
    return inner if isinstance(inner, ServerDataset) else None


def served(dataset: Any) -> bool:
    """Whether ``dataset`` (or the dataset a ``Transformed`` wraps) is a ServerDataset."""
    return _of(dataset) is not None


def build(dataset: Any) -> None:
    """Build ``dataset``'s ServerDataset now (a zygote, before it forks its workers)."""
    found = _of(dataset)
    if found is not None:
        found.dataset  # noqa: B018 -- the property builds it
