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
_MAP_FAILED = ctypes.c_void_p(-1).value


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


def tensor_from_buffer(
    data: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """A CPU tensor shipped as its bytes (``pinfeed._shipping``): a view of them, no copy."""
    kind = getattr(torch, dtype.removeprefix("torch."))
    return torch.from_numpy(data).view(kind).reshape(shape)
