"""One remote object read by byte range through the node's cache: ``pread``, and a
read-only binary file over it (``io.RawIOBase``) for readers that want a file (pyarrow's
Parquet reader: its footer, then each row group's column chunks).

A range is served from the blocks holding it, each a file of the cache (fetched when
missing: by the server, or by asking it from a worker). Open descriptors are kept per
process (a few dozen, the most recent): a block evicted meanwhile stays readable through
one, with the same bytes (same ETag).
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from typing import Any, Protocol

from pinfeed_server.remote.objects import Manifest, Unit

OPEN_FDS = 64


class Local(Protocol):
    def local(self, unit: Unit, dataset: str) -> Any: ...


class _Fds:
    """Per process: digest -> open fd, the most recent ``OPEN_FDS``."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, unit: Unit, remote: Local, dataset: str) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its own table (fds inherited)
                self._pid, self._fds = os.getpid(), OrderedDict()
            fd = self._fds.get(unit.digest)
            if fd is not None:
                self._fds.move_to_end(unit.digest)
                return fd
        for _ in range(3):
            path = remote.local(unit, dataset)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                break
            except FileNotFoundError:
                continue  # evicted between the answer and the open: ask again
        else:
            raise FileNotFoundError(f"{unit}: evicted before it could be opened")
        if os.fstat(fd).st_size != unit.length:
            os.close(fd)
            raise OSError(f"{unit}: the cached block has the wrong size")
        with self._lock:
            old = self._fds.get(unit.digest)
            if old is not None:
                os.close(fd)
                return old
            self._fds[unit.digest] = fd
            while len(self._fds) > OPEN_FDS:
                os.close(self._fds.popitem(last=False)[1])
        return fd


FDS = _Fds()


class RemoteObject:
    """Object ``k`` of ``manifest``, read by range (``pread``)."""

    def __init__(self, remote: Local, manifest: Manifest, k: int) -> None:
        self.remote, self.manifest, self.k = remote, manifest, k
        self.size = manifest.objects[k].size

    def pread(self, offset: int, n: int) -> bytes:
        stop = min(self.size, offset + n)
        if offset >= stop:
            return b""
        first, last = self.manifest.span(self.k, offset, stop)
        parts = []
        for uid in range(first, last + 1):
            unit = self.manifest.unit(uid)
            lo, hi = max(offset, unit.start), min(stop, unit.start + unit.length)
            fd = FDS.get(unit, self.remote, self.manifest.name)
            data = os.pread(fd, hi - lo, lo - unit.start)
            if len(data) != hi - lo:
                raise OSError(f"{unit}: short read from the cache")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def open(self) -> RemoteFile:
        return RemoteFile(self)

    def open_fd(self) -> int:
        """A descriptor of the cached file of this object, the caller's to close (a
        manifest of whole objects): for readers that map a file (``mmap``, or by its
        name ``/proc/self/fd/<fd>``: ``torch.load``, pyarrow), whose mapping outlives
        an eviction of the file."""
        first, last = self.manifest.span(self.k, 0, self.size)
        assert first == last, "a whole object is one unit"
        return os.dup(FDS.get(self.manifest.unit(first), self.remote, self.manifest.name))


class RemoteFile(io.RawIOBase):
    def __init__(self, obj: RemoteObject) -> None:
        super().__init__()
        self.obj = obj
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.obj.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.obj.pread(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        data = self.obj.pread(self._pos, self.obj.size - self._pos)
        self._pos += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        data = self.obj.pread(self._pos, size)
        self._pos += len(data)
        return data

    @property
    def size(self) -> int:
        return self.obj.size
