"""Once per node: four training jobs started together, each its own loader in its own
process over one dataset in the store, fetch its bytes from the store once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.data import _jpeg_folder
from tests.launcher import REPO, Server
from tests.remote.conftest import remote_env
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

JOBS = 4
IMAGES = 64
EPOCHS = 2


@pytest.mark.heavy  # four trainer processes and their workers at once
def test_four_jobs_fetch_the_dataset_once(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    """W3's JPEG folder (64 images of 400x300) in the store; four trainer processes,
    released together, each make a loader of their own (their own seed: four orders;
    0, 1, 2, 1 workers) and read 2 epochs. The proxy counts what the store sent:
    at most 1.05x the images' bytes, the listing included."""
    folder = tmp_path / "w3"
    _jpeg_folder(folder, {"n": IMAGES, "classes": 4, "source": [400, 300], "seed": 3})
    s3.upload("pinfeed", prefix, folder)
    size = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    env = remote_env(s3, proxy.endpoint, PINFEED_REMOTE_CACHE_DIR=str(tmp_path / "objects"))
    with Server(tmp_path / "srv", env=env) as srv:
        with srv.client() as admin:
            admin.create_dataset("w3", "images", {"path": f"s3://pinfeed/{prefix}", "size": 64})
        go = tmp_path / "go"
        jobs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.remote.job",
                    srv.url,
                    str(srv.socket),
                    "w3",
                    f"--seed={seed}",
                    f"--workers={(0, 1, 2, 1)[seed]}",
                    f"--epochs={EPOCHS}",
                    f"--go={go}",
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
            )
            for seed in range(JOBS)
        ]
        try:
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("go.ready-*"))) < JOBS:
                assert time.monotonic() < deadline, "the jobs did not get ready"
                time.sleep(0.02)
            go.touch()
            outs = [job.communicate(timeout=120)[0] for job in jobs]
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        assert [job.returncode for job in jobs] == [0] * JOBS
        assert [int(out) for out in outs] == [EPOCHS * IMAGES // 16] * JOBS
        seen = proxy.counts
        assert seen.bytes <= 1.05 * size, (seen, size)
        node = httpx.get(srv.url + "/v1/node").json()["remote"]
        assert node["store"]["misses"] + node["store"]["prefetched"] >= IMAGES
        assert node["store"]["hits"] >= (JOBS * EPOCHS - 1) * IMAGES * 0.9
