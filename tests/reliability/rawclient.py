"""A trainer that speaks the data-plane protocol with the standard library only, so
a test can start (and SIGKILL) many of them without each importing torch.

    python tests/reliability/rawclient.py SOCKET LOADER MODE

attach  attach, map the ring, print "ready", block
hold    ...then take two batches (holding the second's slot), print "ready", block
wait    ...then print "ready" and block inside a third NEXT (the server producing it)
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import signal
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "pinfeed_protocol", Path(__file__).resolve().parents[2] / "src" / "pinfeed" / "protocol.py"
)
assert _spec is not None and _spec.loader is not None
p = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = p  # dataclasses look their module up there
_spec.loader.exec_module(p)


def main(path: str, loader: str, mode: str) -> None:
    sock = p.new_socket()
    sock.connect(path)
    sock.send(p.Attach(loader).encode())
    buf = bytearray(p.MAX_MESSAGE)
    n, fds = p.recv_message(sock, buf)
    if buf[0] != p.ATTACHED or len(fds) != 1:
        sys.exit(f"attach failed: {bytes(buf[:n])!r}")
    meta = p.Attached.decode(memoryview(buf)[:n])
    ring = mmap.mmap(fds[0], meta.ring_bytes)
    os.close(fds[0])
    held: list[int] = []
    if mode in ("hold", "wait"):
        for _ in range(2):
            sock.send(p.encode_release(p.NEXT, held))
            sock.recv_into(buf)
            assert buf[0] == p.BATCH, bytes(buf[:64])
            held = [p.decode_batch(buf, p.dims_struct(meta.layout))[0]]
    print("ready", flush=True)
    if mode == "wait":
        sock.send(p.encode_release(p.NEXT, held))
        sock.recv_into(buf)  # killed while the server is producing this batch
    signal.pause()
    ring.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
