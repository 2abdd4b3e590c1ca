"""Docker's 64 MB /dev/shm does not limit pinfeed: rings are memfds, not /dev/shm files.

The server and the trainer each run in a private mount namespace with a 64 MB tmpfs
over /dev/shm, as in two containers without ``ipc: host`` or ``shm_size``, while the
server serves a loader whose ring is 256 MiB (4 slots of 64 MiB) over a memory-mapped
npy file. The trainer pulls two epochs and checks every byte; both /dev/shm stay 64 MB
and empty.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pinfeed import Client
from tests.launcher import REPO, Server

MiB = 1 << 20
SHM_SIZE = 64 * MiB
# 32 samples of 4 MiB (1 Mi int32) in a memory-mapped npy file: 16 a batch make 64 MiB
# slots, and 2 workers x prefetch 2 make 4 slots: a 256 MiB ring.
SAMPLES, SAMPLE_SHAPE = 32, (1024, 1024)
LOADER = {"batch_size": 16, "num_workers": 2, "prefetch_factor": 2}

# Mount the small /dev/shm, then become the given command (same pid, so the test can
# look at the process's mounts through /proc/<pid>).
SMALL_SHM = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--",
    "sh",
    "-c",
    f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"',
    "sh",
]

TRAINER = r"""
import json, os, sys
import numpy as np
import torch
from pinfeed import Loader

xs = torch.from_numpy(np.load(sys.argv[1], mmap_mode="r")[:])
ys = torch.from_numpy(np.load(sys.argv[2]))
st = os.statvfs("/dev/shm")
out = {"shm_bytes": st.f_blocks * st.f_frsize, "batches": 0}
# The small /dev/shm is real: a file twice its size does not fit.
fd = os.open("/dev/shm/pinfeed-probe", os.O_CREAT | os.O_RDWR, 0o600)
try:
    os.posix_fallocate(fd, 0, 2 * out["shm_bytes"])
    out["shm_enforced"] = False
except OSError:
    out["shm_enforced"] = True
finally:
    os.close(fd)
    os.unlink("/dev/shm/pinfeed-probe")
with Loader(sys.argv[3], timeout=60) as loader:
    out["ring_bytes"] = int(loader.meta.ring_bytes)
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            assert loader.ring_contains(x), "not a view into the ring"
            assert torch.equal(x, xs[i * 16 : (i + 1) * 16]), (epoch, i)
            assert torch.equal(y, ys[i * 16 : (i + 1) * 16]), (epoch, i)
            out["batches"] += 1
    st = os.statvfs("/dev/shm")
    out["shm_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
print(json.dumps(out))
"""


def _small_shm_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs over /dev/shm (unshare -m)"
    if shutil.which("unshare") is None:
        return "needs util-linux unshare"
    probe = subprocess.run([*SMALL_SHM, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a private /dev/shm here: {probe.stderr.strip()}"
    return None


def _shm_of(pid: int) -> tuple[int, int]:
    """(size, used) of /dev/shm as process ``pid`` sees it, through its own mounts."""
    st = os.statvfs(f"/proc/{pid}/root/dev/shm")
    return st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture()
def small_shm_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    reason = _small_shm_skip_reason()
    if reason:
        pytest.skip(reason)
    pinfeed = Path(sys.executable).with_name("pinfeed")
    srv = Server(
        tmp_path,
        env={"PINFEED_MAX_SHM_BYTES": str(1024 * MiB)},
        data=tmp_path,  # the socket's grandparent
        command=(*SMALL_SHM, str(pinfeed), "serve"),
    )
    try:
        srv.start()
        assert srv.proc is not None
        yield srv.proc, srv.url, srv.socket
    finally:
        if srv.proc is not None:
            srv.stop()


def test_ring_far_larger_than_a_64mb_dev_shm(
    small_shm_server: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, url, sock = small_shm_server
    assert _shm_of(proc.pid) == (SHM_SIZE, 0)
    assert _shm_of(os.getpid())[0] != SHM_SIZE, "the small /dev/shm leaked out of its namespace"

    data = sock.parent.parent  # the server's PINFEED_DATA_ROOT
    xs = np.lib.format.open_memmap(
        data / "x.npy", mode="w+", dtype=np.int32, shape=(SAMPLES, *SAMPLE_SHAPE)
    )
    xs[:] = np.arange(xs.size, dtype=np.int32).reshape(xs.shape)
    xs.flush()
    del xs
    np.save(data / "y.npy", np.arange(SAMPLES, dtype=np.int64) * 7)
    with Client(url) as admin:
        admin.create_dataset("big", "npy", {"paths": ["x.npy", "y.npy"]})
        loader = admin.create_loader("big", dataset="big", **LOADER)
    ring_bytes = loader.get("ring_bytes")

    # As the launcher does: the caller's PYTHONPATH (a tree's src/) goes along, or the
    # trainer would import whichever pinfeed is installed.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PINFEED_SOCKET": str(sock), "PYTHONPATH": path}
    trainer = subprocess.run(
        [
            *SMALL_SHM,
            sys.executable,
            "-c",
            TRAINER,
            str(data / "x.npy"),
            str(data / "y.npy"),
            "big",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert trainer.returncode == 0, trainer.stderr[-4000:]
    got = json.loads(trainer.stdout.strip().splitlines()[-1])

    assert got["shm_bytes"] == SHM_SIZE  # the trainer, too, had only 64 MB of /dev/shm
    assert got["shm_enforced"], "a file larger than the small /dev/shm fitted in it"
    assert got["ring_bytes"] >= 4 * SHM_SIZE, got
    if ring_bytes is not None:
        assert ring_bytes == got["ring_bytes"]
    assert got["batches"] == 2 * SAMPLES // LOADER["batch_size"]
    assert got["shm_used"] == 0, "batches went through /dev/shm"
    size, used = _shm_of(proc.pid)
    assert (size, used) == (SHM_SIZE, 0), "the server put something in /dev/shm"
    assert proc.poll() is None
