"""The objects a trainer ships to its node's server (``pinfeed.DataLoader``), as memfds:
a pickle (protocol 5) and buffers, so that numpy arrays and tensors held by a dataset
travel once, are never copied into the pickle stream, and are shared by the server, the
dataset's zygote and every worker forked from it (they map the same pages).

A loader's objects follow the trainer (DataLoader hands its workers the objects as they
are at each ``iter()``): the trainer ships them again when they changed, in a new
payload that carries the new pickle and only the buffers not shipped before. A large
buffer (``STORED_MIN`` bytes or more: a dataset's tensors and arrays) is *stored*: it
has an id, unique for the loader, and a pickle refers to it by id (``stored_tensor``,
``stored_array``), whichever earlier payload of the loader brought it. A receiver loads
the payloads of the loader's ``Chain`` together (``Store``): their pages are the same
memfds', mapped again, never copied.

Layout (little-endian)::

    MAGIC (8 bytes) | header length (u32) | header JSON | ... blocks at 64-byte offsets
    header: {"pickle": [offset, length], "buffers": [[offset, length, id], ...],
             "refs": [the stored ids the pickle refers to]}

A buffer whose id is null is one of the pickle's own out-of-band buffers (in order: an
object other than a tensor or array that pickles its bytes out of band). A loader's
objects need the payload that brought their pickle and those that brought a buffer it
refers to: a ``Chain`` keeps those, and ``Store.load`` takes them all.

``read`` maps the memfd copy-on-write (``MAP_PRIVATE``): buffers are writable (numpy
arrays come back writeable, as the trainer had them) and a write stays in the writer's
process. The pickle is read with the standard ``pickle`` module; objects pickled by
value by cloudpickle need cloudpickle importable where they load (it is a dependency
of both sides). Writing is the trainer's (``pinfeed._shipping``); this module is the
format both sides share.
"""

from __future__ import annotations

import contextvars
import ctypes
import json
import mmap
import os
import pickle
import stat
import struct
import weakref
from typing import Any

import numpy as np
import torch

MAGIC = b"pinfeed\x02"
_LEN = struct.Struct("<I")
ALIGN = 64
STORED_MIN = 64 << 10  # a tensor or array this large is stored (shipped once, by id)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write(
    data: bytes,
    stored: list[tuple[int, memoryview]],
    buffers: list[memoryview],
    refs: set[int],
    name: str = "pinfeed-payload",
) -> int:
    """A sealed-size memfd holding ``data`` (a protocol-5 pickle), the ``stored`` buffers
    it brings (id, bytes), its own out-of-band ``buffers``, and the ids of the stored
    buffers its pickle refers to (``refs``); the caller owns the fd."""
    blocks: list[tuple[int | None, memoryview]] = [*stored, *((None, b) for b in buffers)]
    layout: list[tuple[int, int, int | None]] = []
    at = 0
    header_guess = 64 + 48 * (len(blocks) + 1)  # room for the header, refined below
    while True:
        start = _align(len(MAGIC) + _LEN.size + header_guess)
        at = start + _align(len(data))
        layout = []
        for i, b in blocks:
            layout.append((at, b.nbytes, i))
            at = _align(at + b.nbytes)
        header = json.dumps(
            {"pickle": [start, len(data)], "buffers": layout, "refs": sorted(refs)}
        ).encode()
        if len(header) <= header_guess:
            break
        header_guess = len(header)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(at, start + len(data), 1))
        # pwrite, not a mapping: the kernel copies, with no page fault per page on
        # either side (a dataset's tensors can be GBs).
        head = MAGIC + _LEN.pack(len(header)) + header
        parts = [(0, memoryview(head)), (start, memoryview(data))]
        parts += [(entry[0], b.cast("B")) for entry, (_, b) in zip(layout, blocks, strict=True)]
        for offset, block in parts:
            _pwrite_all(fd, block, offset)
    except BaseException:
        os.close(fd)
        raise
    return fd


def consolidate(fds: list[int]) -> int:
    """One payload of the objects of a chain's payloads ``fds``: the last one's pickle
    and own buffers, and the stored buffers it refers to, from whichever brought each."""
    last = _header(fds[-1])
    refs = set(last["refs"])
    found: dict[int, bytes] = {}
    for fd in fds:
        for offset, nbytes, ident in _header(fd)["buffers"]:
            if ident is not None and ident in refs:
                found[int(ident)] = os.pread(fd, nbytes, offset)
    start, length = last["pickle"]
    data = os.pread(fds[-1], length, start)
    own = [
        memoryview(os.pread(fds[-1], nbytes, offset))
        for offset, nbytes, ident in last["buffers"]
        if ident is None
    ]
    return write(data, [(i, memoryview(found[i])) for i in sorted(refs)], own, refs)


class Chain:
    """The payloads a loader's objects need, oldest first: the newest (its pickle is the
    objects') and every earlier one that brought a stored buffer it refers to; and the
    shared memory the newest's objects map (``shared``: a tensor the trainer shares,
    ``share_memory_()``, as DataLoader's workers share it). The chain owns their fds;
    those no longer needed are closed as the next payload is added."""

    def __init__(self) -> None:
        self._links: list[tuple[int, set[int]]] = []  # (fd, the stored ids it brought)
        self.shared: list[int] = []

    def add(self, fd: int, shared: list[int] | None = None) -> None:
        """The newest payload, and the shared memory fds its objects map (the chain owns
        them all from now on)."""
        shared = shared or []
        try:
            header = _header(fd)
        except BaseException:
            for f in (fd, *shared):
                os.close(f)
            raise
        refs = set(header["refs"])
        kept = []
        for old, ids in self._links:
            if ids & refs:
                kept.append((old, ids))
            else:
                os.close(old)
        brought = {int(i) for _, _, i in header["buffers"] if i is not None}
        self._links = [*kept, (fd, brought)]
        for old in self.shared:
            os.close(old)
        self.shared = shared

    @property
    def fds(self) -> list[int]:
        return [fd for fd, _ in self._links]

    def close(self) -> None:
        for fd in (*self.fds, *self.shared):
            os.close(fd)
        self._links, self.shared = [], []


def _header(fd: int) -> dict[str, Any]:
    head = os.pread(fd, len(MAGIC) + _LEN.size, 0)
    if head[: len(MAGIC)] != MAGIC:
        raise ValueError("not a pinfeed payload (bad magic)")
    (n,) = _LEN.unpack_from(head, len(MAGIC))
    header: dict[str, Any] = json.loads(os.pread(fd, n, len(MAGIC) + _LEN.size))
    return header


def _pwrite_all(fd: int, block: memoryview, offset: int) -> None:
    while block.nbytes:
        n = os.pwrite(fd, block, offset)
        block, offset = block[n:], offset + n


_LOADING: contextvars.ContextVar[Store] = contextvars.ContextVar("pinfeed_payload_store")


class Store:
    """A receiver's stored buffers while it loads one loader's objects from the payloads
    of its chain: each payload's are registered by id, then the last one's pickle is
    read, which refers to them by id (``stored_tensor``, ``stored_array``). A buffer's
    pages stay mapped while an object made from it holds a view of them."""

    def __init__(self) -> None:
        self._views: dict[int, memoryview] = {}
        self._shared: list[int] = []

    def load(self, fds: list[int], shared: list[int] | None = None) -> tuple[Any, Any]:
        """The objects of the payloads ``fds`` (a ``Chain``'s, or one that stands alone):
        the stored buffers they bring, then the last one's pickle, whose shared tensors
        map the memory of ``shared`` (fds; a chain's ``shared``); and the mapping that
        pickle's pages live in (it holds no fd: the caller's are theirs). A ValueError
        names what is wrong with a payload that is not one; what unpickling raises (a
        module the server cannot import) is raised as it is."""
        if not fds:
            raise ValueError("no payload to load")
        self._shared = list(shared or [])
        for fd in fds:
            mapping, header = _map(fd)
            view = memoryview(mapping).cast("B")
            own = []
            for offset, nbytes, ident in header["buffers"]:
                if ident is None:
                    own.append(view[offset : offset + nbytes])
                else:
                    self._views[int(ident)] = view[offset : offset + nbytes]
        start, length = header["pickle"]
        token = _LOADING.set(self)
        try:
            obj = pickle.loads(view[start : start + length], buffers=own)
        finally:
            _LOADING.reset(token)
            self._views, self._shared = {}, []
        return obj, mapping

    def shared(self, index: int, size: int) -> torch.UntypedStorage:
        """Shared memory ``index`` of the pickle being loaded, as a storage that maps it."""
        try:
            fd = self._shared[index]
        except IndexError:
            raise ValueError(f"shared memory {index} did not come with the payload") from None
        # torch takes the fd it is given: a duplicate, this one is the caller's
        return torch.UntypedStorage._new_shared_fd_cpu(os.dup(fd), size)  # type: ignore[attr-defined,no-any-return]

    def view(self, ident: int) -> memoryview:
        try:
            return self._views[ident]
        except KeyError:
            raise ValueError(f"payload buffer {ident} was never shipped to this process") from None


def _map(fd: int) -> tuple[Any, dict[str, Any]]:
    """Payload ``fd`` mapped copy-on-write, and its header."""
    size = os.fstat(fd).st_size
    if size < len(MAGIC) + _LEN.size:
        raise ValueError("not a pinfeed payload (too short)")
    mapping = _map_private(fd, size)
    view = memoryview(mapping).cast("B")
    if view[: len(MAGIC)] != MAGIC:
        raise ValueError("not a pinfeed payload (bad magic): trainer and server versions differ?")
    (n,) = _LEN.unpack_from(view, len(MAGIC))
    at = len(MAGIC) + _LEN.size
    header: dict[str, Any] = json.loads(bytes(view[at : at + n]))
    return mapping, header


def read(fd: int) -> tuple[Any, Any]:
    """The objects of a payload that stands alone (a store of its own)."""
    return Store().load([fd])


def _loading() -> Store:
    store = _LOADING.get(None)
    if store is None:
        raise ValueError("a stored buffer outside a payload's load (pinfeed.payload.Store)")
    return store


def stored_tensor(ident: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of a stored buffer (``STORED_MIN`` bytes or more): a view of the
    payload's pages, no copy."""
    data = np.frombuffer(_loading().view(ident), dtype=np.uint8)
    kind = getattr(torch, dtype.removeprefix("torch."))
    return torch.from_numpy(data).view(kind).reshape(shape)


def stored_array(
    ident: int, dtype: str, shape: tuple[int, ...], order: str
) -> np.ndarray[Any, Any]:
    """A numpy array of a stored buffer: a view of the payload's pages, writeable (as the
    trainer's was; a write stays in this process)."""
    data = np.frombuffer(_loading().view(ident), dtype=np.dtype(dtype))
    return data.reshape(shape, order=order)  # type: ignore[call-overload,no-any-return]


def shared_tensor(
    index: int,
    size: int,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    _storage: int,
) -> torch.Tensor:
    """A tensor whose storage the trainer shares (``share_memory_()``): the same memory
    mapped here, so that a change on either side is seen on the other, as DataLoader's
    workers see it (``_storage``: which storage it was, so that another one pickles
    differently)."""
    storage = _loading().shared(index, size)
    kind = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty(0, dtype=kind).set_(storage, offset, shape, stride)


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A small CPU tensor, its bytes in the pickle (part of what is compared)."""
    kind = getattr(torch, dtype.removeprefix("torch."))
    flat = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(kind).reshape(shape)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_READ = 22  # Linux 5.14
_POPULATE_CHUNK = 64 << 20


def _map_private(fd: int, size: int) -> Any:
    """``size`` bytes of ``fd`` mapped copy-on-write, as a ctypes array that unmaps them
    when it goes. Not ``mmap.mmap``: that keeps a duplicate of the fd open for as long
    as the mapping lives, and a payload's memfd must close with its loader."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of the payload failed: {os.strerror(err)}")
    array = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(array, _libc.munmap, addr, size)
    return array


def populate(mapping: Any) -> None:
    """Map every page of a payload's ``mapping`` (``read``'s) into this process's page
    tables now, read-only (``MADV_POPULATE_READ``: no copy-on-write), a chunk at a time:
    what its first reads would otherwise fault in, page group by page group, in the
    middle of an epoch (600 MB: ~50 ms here, against 55-85 ms of faults). ctypes lets
    go of the GIL, so a thread can run it beside the loader. A kernel without it
    (before 5.14): nothing is done."""
    addr, size = ctypes.addressof(mapping), ctypes.sizeof(mapping)
    for at in range(0, size, _POPULATE_CHUNK):
        n = min(_POPULATE_CHUNK, size - at)
        if _libc.madvise(addr + at, n, _MADV_POPULATE_READ) != 0:
            return


def memmap_file(obj: np.memmap[Any, Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """``obj`` as the call that maps its file again (a process on this node maps the
    same page cache: nothing is copied), where it is a file's mapping as ``np.memmap``
    or ``np.load(mmap_mode=...)`` made it; None for a view of one (it is pickled as
    data). A writable mapping comes back copy-on-write: the receiver never writes the
    file, as a copy of the array would not."""
    if not (isinstance(obj.base, mmap.mmap) and obj.filename):
        return None
    order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
    mode = "r" if not obj.flags.writeable else "c"
    return np.memmap, (obj.filename, obj.dtype, mode, obj.offset, obj.shape, order)


FILE_MIN_BYTES = 1 << 20  # smaller storages are copied: reading /proc costs more
_PAGEMAP_CHUNK = 1 << 20


def file_backing(address: int, nbytes: int) -> tuple[str, int, tuple[int, int]] | None:
    """Where ``[address, address + nbytes)`` of this process's memory is a regular
    file's pages: (path, offset in it, its (size, mtime_ns)), so that another process on
    the node maps the same page cache instead of getting a copy. None where it is not
    (anonymous or shared memory, a deleted file, more than one mapping), and where any
    of its pages was written here: a private mapping's written page is this process's
    own (``/proc/self/pagemap``: present and not a file page, or swapped), and the file
    does not hold what it reads."""
    if nbytes < FILE_MIN_BYTES:
        return None
    found = None
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                path = parts[5].rstrip("\n") if len(parts) == 6 else ""
                if address + nbytes <= hi and path.startswith("/") and "(deleted)" not in path:
                    found = path, int(parts[2], 16) + address - lo
                break
    if found is None or not _file_pages(address, nbytes):
        return None
    try:
        st = os.stat(found[0])
    except OSError:  # gone since: its bytes are shipped
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return found[0], found[1], (st.st_size, st.st_mtime_ns)


def _file_pages(address: int, nbytes: int) -> bool:
    """Whether every page of the range is still its file's (none written, none swapped)."""
    first, end = address // mmap.PAGESIZE, (address + nbytes - 1) // mmap.PAGESIZE + 1
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            for at in range(first, end, _PAGEMAP_CHUNK):  # 8 MB of entries at a time
                count = min(_PAGEMAP_CHUNK, end - at)
                f.seek(at * 8)
                flags = np.frombuffer(f.read(count * 8), dtype=np.uint64)
                if len(flags) != count:
                    return False
                present, swapped = (flags >> 63) & 1, (flags >> 62) & 1
                if np.any(swapped | (present & (1 - ((flags >> 61) & 1)))):
                    return False
    except OSError:
        return False
    return True


def tensor_from_file(
    path: str,
    offset: int,
    nbytes: int,
    stamp: tuple[int, int],
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
) -> torch.Tensor:
    """A CPU tensor shipped as the file its storage maps (``file_backing``): the same
    pages mapped again, copy-on-write (a write stays in this process, as a write into a
    copy would). ValueError where the file is not the one the trainer mapped."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{path}, which a tensor of the trainer's maps: {exc}") from None
    if (st.st_size, st.st_mtime_ns) != tuple(stamp):
        raise ValueError(
            f"{path}, which a tensor of the trainer's maps, is not the file the trainer "
            "mapped (another size or modification time here): the server must see the "
            "trainer's files, or load the tensor into memory (t.clone()) before shipping"
        )
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))
    kind = getattr(torch, dtype.removeprefix("torch."))
    flat = torch.from_numpy(data).view(kind)
    return flat.as_strided(shape, stride, storage_offset)
