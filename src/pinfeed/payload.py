"""The objects a trainer ships to its node's server (``pinfeed.DataLoader``), as one
memfd: a pickle (protocol 5) and its out-of-band buffers, so that numpy arrays and
tensors held by a dataset travel once, are never copied into the pickle stream, and
are shared by the server, the dataset's zygote and every worker forked from it (they
map the same pages).

Layout (little-endian)::

    MAGIC (8 bytes) | header length (u32) | header JSON | ... blocks at 64-byte offsets
    header: {"pickle": [offset, length], "buffers": [[offset, length], ...]}

``read`` maps the memfd copy-on-write (``MAP_PRIVATE``): buffers are writable (numpy
arrays come back writeable, as the trainer had them) and a write stays in the writer's
process. The pickle is read with the standard ``pickle`` module; objects pickled by
value by cloudpickle need cloudpickle importable where they load (it is a dependency
of both sides). Writing is the trainer's (``pinfeed._shipping``); this module is the
format both sides share.
"""

from __future__ import annotations

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

MAGIC = b"pinfeed\x01"
_LEN = struct.Struct("<I")
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write(data: bytes, buffers: list[memoryview], name: str = "pinfeed-payload") -> int:
    """A sealed-size memfd holding ``data`` (a protocol-5 pickle) and its ``buffers``;
    the caller owns the fd."""
    layout: list[list[int]] = []
    at = 0
    header_guess = 64 + 32 * (len(buffers) + 1)  # room for the header, refined below
    while True:
        start = _align(len(MAGIC) + _LEN.size + header_guess)
        at = start + _align(len(data))
        layout = []
        for b in buffers:
            layout.append([at, b.nbytes])
            at = _align(at + b.nbytes)
        header = json.dumps({"pickle": [start, len(data)], "buffers": layout}).encode()
        if len(header) <= header_guess:
            break
        header_guess = len(header)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(at, start + len(data), 1))
        # pwrite, not a mapping: the kernel copies, with no page fault per page on
        # either side (a dataset's tensors can be GBs).
        head = MAGIC + _LEN.pack(len(header)) + header
        for offset, block in [(0, memoryview(head)), (start, memoryview(data))] + [
            (offset, b.cast("B")) for (offset, _), b in zip(layout, buffers, strict=True)
        ]:
            _pwrite_all(fd, block, offset)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, block: memoryview, offset: int) -> None:
    while block.nbytes:
        n = os.pwrite(fd, block, offset)
        block, offset = block[n:], offset + n


def read(fd: int) -> tuple[Any, Any]:
    """The objects in memfd ``fd``, and the mapping their buffers live in (it goes, with
    the pages, once they and it are gone; it holds no fd: the caller's is theirs). A
    ValueError names what is wrong with a payload that is not one; what unpickling
    raises (a module the server cannot import) is raised as it is."""
    size = os.fstat(fd).st_size
    if size < len(MAGIC) + _LEN.size:
        raise ValueError("not a pinfeed payload (too short)")
    mapping = _map_private(fd, size)
    view = memoryview(mapping).cast("B")
    if view[: len(MAGIC)] != MAGIC:
        raise ValueError("not a pinfeed payload (bad magic): trainer and server versions differ?")
    (n,) = _LEN.unpack_from(view, len(MAGIC))
    at = len(MAGIC) + _LEN.size
    header = json.loads(bytes(view[at : at + n]))
    start, length = header["pickle"]
    buffers = [view[o : o + size_] for o, size_ in header["buffers"]]
    obj = pickle.loads(view[start : start + length], buffers=buffers)
    return obj, mapping


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


def tensor_from_buffer(
    data: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """A CPU tensor shipped as its bytes (``pinfeed._shipping``): a view of them, no copy."""
    kind = getattr(torch, dtype.removeprefix("torch."))
    return torch.from_numpy(data).view(kind).reshape(shape)
