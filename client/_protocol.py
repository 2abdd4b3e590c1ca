"""The data-plane wire format, shared by the client and ``pinfeed_server.engine.dataplane``.

One ``SOCK_SEQPACKET`` Unix socket per consumer: message boundaries are kept by the
kernel, so every message is one ``send``/``recv`` with no framing. The first byte is
the message kind. Control messages (attach, errors) carry JSON; the per-batch
messages are fixed ``struct`` layouts so the hot path neither pickles nor allocates
beyond the tensor views.

client -> server
    ATTACH  b"A" + JSON {"loader": name, "version": 1}
    NEXT    b"N" + u16 count + count x u32 slots released + [u32 wait_us]  (one per batch)
    RELEASE b"R" + u16 count + count x u32 slots released + [u32 wait_us]  (no reply)
            wait_us: how long the trainer last waited for a batch; the server's
            "is training input-bound?" figure comes from it
    SKIP    b"S" + u16 count + count x u32 slots released: drop the rest of the
                            current epoch; reply END
    SEEK    b"K" + POSITION_BODY (epoch, index): make that the next batch; reply POSITION
    CUDA    b"C"            the client registered the ring with CUDA (for status)
server -> client
    ATTACHED b"a" + JSON layout, the ring's memfd in SCM_RIGHTS
    BATCH    b"B" + BATCH_HEAD + leaf dims (int64) + optional JSON strings
    END      b"E" + END_BODY (epoch, seq)
    POSITION b"P" + POSITION_BODY (epoch, index): the next batch after a SEEK
    ERROR    b"X" + JSON {"type", "detail", ...}
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1

ATTACH = ord("A")
NEXT = ord("N")
RELEASE = ord("R")
SKIP = ord("S")
SEEK = ord("K")
CUDA = ord("C")
POSITION = ord("P")
ATTACHED = ord("a")
BATCH = ord("B")
END = ord("E")
ERROR = ord("X")

# kind, slot, seq, epoch, index in epoch, length of the trailing strings JSON
BATCH_HEAD = struct.Struct("<B3xIQIII")
END_BODY = struct.Struct("<B3xIQ")
POSITION_BODY = struct.Struct("<B3xII")
RELEASE_HEAD = struct.Struct("<BxH")
SLOT = struct.Struct("<I")

# Largest message either side sends. Batches of strings are the only variable part.
MAX_MESSAGE = 256 * 1024
# Slot offsets and leaf offsets are aligned so every dtype view is aligned too.
ALIGN = 64

DEFAULT_SOCKET_NAME = "pinfeed.sock"


def default_run_dir() -> Path:
    """Where the server puts its socket unless told otherwise."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "pinfeed"
    return Path(f"/tmp/pinfeed-{os.getuid()}")


def default_socket_path() -> Path:
    """``PINFEED_SOCKET`` if set, else the server's default path."""
    env = os.environ.get("PINFEED_SOCKET")
    if env:
        return Path(env)
    return default_run_dir() / DEFAULT_SOCKET_NAME


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def encode_json(kind: int, payload: dict[str, Any]) -> bytes:
    return bytes([kind]) + json.dumps(payload, separators=(",", ":")).encode()


def decode_json(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    value = json.loads(bytes(data[1:]))
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


_ONE_RELEASE = struct.Struct("<BxHII")  # kind, count=1, slot, wait_us
_WAIT = struct.Struct("<I")


def encode_release(kind: int, slots: list[int], wait_us: int = 0) -> bytes:
    wait_us = min(wait_us, 0xFFFFFFFF)
    if len(slots) == 1:  # the per-batch case: one pack, no joins
        return _ONE_RELEASE.pack(kind, 1, slots[0], wait_us)
    return (
        RELEASE_HEAD.pack(kind, len(slots))
        + b"".join(SLOT.pack(s) for s in slots)
        + _WAIT.pack(wait_us)
    )


def decode_release(data: bytes | bytearray | memoryview) -> tuple[list[int], int | None]:
    """(slots, wait_us or None) of a NEXT, RELEASE or SKIP message; ValueError if malformed."""
    if len(data) < RELEASE_HEAD.size:
        raise ValueError("short release message")
    _, count = RELEASE_HEAD.unpack_from(data)
    end = RELEASE_HEAD.size + count * SLOT.size
    if len(data) not in (end, end + _WAIT.size):
        raise ValueError("release message length does not match its count")
    slots = [SLOT.unpack_from(data, RELEASE_HEAD.size + i * SLOT.size)[0] for i in range(count)]
    wait = _WAIT.unpack_from(data, end)[0] if len(data) > end else None
    return slots, wait


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


_ANCILLARY = socket.CMSG_SPACE(4 * struct.calcsize("i"))


def recv_message(sock: socket.socket, buf: bytearray) -> tuple[int, list[int]]:
    """Receive one message into ``buf``; return (length, fds). Length 0 means EOF."""
    fds: list[int] = []
    nbytes, ancdata, flags, _ = sock.recvmsg_into([buf], _ANCILLARY)
    for level, ctype, data in ancdata:
        if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    if flags & socket.MSG_TRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"message longer than {len(buf)} bytes")
    return nbytes, fds
