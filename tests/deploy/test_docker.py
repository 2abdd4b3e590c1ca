"""The real deployment: build the image, ``docker compose up`` the stack, train, tear down.

Runs where a Docker engine is reachable (``.ci/run`` starts one), skipped elsewhere with
the reason. Prints build time, time to healthy and the trainer's epochs (``-s`` or the
CI log shows them).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.deploy import engine

pytestmark = [
    pytest.mark.skipif(engine.engine_missing() is not None, reason=str(engine.engine_missing())),
    pytest.mark.slow,
    pytest.mark.heavy,  # images and containers: make test-heavy
    # The first test also makes the base image and builds the image (minutes, once).
    pytest.mark.timeout(1800),
]

EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) loss ([0-9.]+) acc ([0-9.]+)", re.M)
MiB = 1 << 20

# A second trainer container, with Docker's default 64 MB /dev/shm, reads a 256 MiB ring
# (4 slots of 64 MiB: 16 samples of 4 MiB) and checks every byte against the synthetic
# kind's definition (sample i: uint8 drawn from a generator seeded with seed * 2**32 + i).
BIG = {"kind": "synthetic", "length": 32, "seed": 7, "shape": [4096, 1024]}
BIG_TRAINER = r"""
import json, os, sys
import torch
from pinfeed import Loader

st = os.statvfs("/dev/shm")
out = {"shm_bytes": st.f_blocks * st.f_frsize, "batches": 0, "uid": os.getuid()}
with Loader(sys.argv[1], timeout=120) as loader:
    out["ring_bytes"] = loader.meta.ring_bytes
    for epoch in range(2):
        for i, (x,) in enumerate(loader):
            for row in range(x.shape[0]):
                g = torch.Generator().manual_seed(7 * 2**32 + i * 16 + row)
                want = torch.randint(0, 256, (4096, 1024), generator=g, dtype=torch.uint8)
                assert torch.equal(x[row], want), (epoch, i, row)
            out["batches"] += 1
print(json.dumps(out))
"""


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    files: tuple[Path, ...] = (REPO / "docker-compose.yml",)
    log: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return engine.compose(self.project, *args, env=self.env, files=self.files, timeout=timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['PINFEED_HTTP_PORT']}"

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        rows = []
        for kind in ("container", "volume", "network"):
            listed = subprocess.run(
                [
                    "docker",
                    kind,
                    "ls",
                    "-q",
                    *(["-a"] if kind == "container" else []),
                    "--filter",
                    label,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            rows += [f"{kind} {r}" for r in listed.stdout.split()]
        return rows


@pytest.fixture(scope="module")
def build_seconds() -> float:
    return engine.build_image()


@pytest.fixture()
def stack(build_seconds: float) -> Iterator[Stack]:
    env = {"PINFEED_TOKEN": secrets.token_hex(16), "PINFEED_HTTP_PORT": str(free_port())}
    s = Stack(f"pinfeed-test-{secrets.token_hex(4)}", env)
    try:
        yield s
    finally:
        s("--profile", "cpu", "down", "-v", "--remove-orphans", "--timeout", "20")


def test_compose_stack_trains_and_tears_down(stack: Stack, build_seconds: float) -> None:
    t0 = time.monotonic()
    up = stack("--profile", "cpu", "up", "-d", "--no-build", "--wait", "pinfeed", timeout=240)
    healthy_s = time.monotonic() - t0
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert httpx.get(f"{stack.url}/healthz", timeout=10).status_code == 200
    # The token from the environment guards the published control plane.
    denied = httpx.post(f"{stack.url}/v1/datasets", json={}, timeout=10)
    assert denied.status_code == 401, denied.text

    # The server runs as the image's non-root user.
    uid = stack("exec", "-T", "pinfeed", "python", "-c", "import os; print(os.getuid())")
    assert uid.returncode == 0 and uid.stdout.strip() == "10001", uid.stdout + uid.stderr

    # The example trainer runs its 3 epochs against the server over the socket volume.
    t1 = time.monotonic()
    trained = stack("--profile", "cpu", "run", "--rm", "-T", "--no-deps", "trainer-cpu")
    train_s = time.monotonic() - t1
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    epochs = [(int(m[1]), float(m[3])) for m in EPOCH_LINE.finditer(trained.stdout)]
    assert [e for e, _ in epochs] == [1, 2, 3], trained.stdout[-4000:]
    assert epochs[-1][1] < epochs[0][1], f"the toy model did not learn: {epochs}"

    # A second trainer container, default 64 MB /dev/shm, reads a ring four times larger.
    headers = {"authorization": f"Bearer {stack.env['PINFEED_TOKEN']}"}
    fields = [{"shape": BIG["shape"], "dtype": "uint8", "low": 0, "high": 256}]
    params = {"length": BIG["length"], "seed": BIG["seed"], "fields": fields}
    made = httpx.post(
        f"{stack.url}/v1/datasets",
        json={"name": "big", "kind": "synthetic", "params": params},
        headers=headers,
        timeout=30,
    )
    assert made.status_code == 201, made.text
    made = httpx.post(
        f"{stack.url}/v1/loaders",
        json={"name": "big", "dataset": "big", "batch_size": 16, "num_workers": 2},
        headers=headers,
        timeout=60,
    )
    assert made.status_code == 201, made.text
    big = stack(
        "--profile",
        "cpu",
        "run",
        "--rm",
        "-T",
        "--no-deps",
        "--entrypoint",
        "python",
        "trainer-cpu",
        "-c",
        BIG_TRAINER,
        "big",
    )
    assert big.returncode == 0, big.stdout[-3000:] + big.stderr[-3000:]
    seen = json.loads(big.stdout.strip().splitlines()[-1])
    assert seen["shm_bytes"] == 64 * MiB, seen
    assert seen["ring_bytes"] >= 4 * 64 * MiB, seen
    assert seen["batches"] == 4 and seen["uid"] == 10001, seen

    down = stack("--profile", "cpu", "down", "-v", "--timeout", "20")
    assert down.returncode == 0, down.stderr[-3000:]
    assert stack.leftovers() == []
    print(
        f"\n[deploy] image {engine.image_bytes() / 1e6:.0f} MB, build {build_seconds:.0f} s, "
        f"healthy in {healthy_s:.1f} s, trainer {train_s:.1f} s, epochs {epochs}, "
        f"64 MB /dev/shm read a {seen['ring_bytes'] // MiB} MiB ring"
    )


def test_unlimited_memlock_fails_here_and_the_compose_file_no_longer_asks_for_it(
    stack: Stack, tmp_path: Path
) -> None:
    """The old ``ulimits: memlock: -1`` stops every container on an engine without
    CAP_SYS_RESOURCE; the compose file leaves memlock at the host's limit, and
    ``deploy/compose.memlock.yml`` is the opt-in for hosts that allow it."""
    old = tmp_path / "old-memlock.yml"
    old.write_text(yaml.safe_dump({"services": {"pinfeed": {"ulimits": {"memlock": -1}}}}))
    stack.files = (REPO / "docker-compose.yml", old)
    up = stack("--profile", "cpu", "up", "-d", "--no-build", "pinfeed", timeout=120)
    if up.returncode == 0:
        pytest.skip("this engine may raise RLIMIT_MEMLOCK (it has CAP_SYS_RESOURCE)")
    assert "error setting rlimit type 8" in up.stderr, up.stderr[-3000:]
    stack("--profile", "cpu", "down", "-v", "--timeout", "10")

    stack.files = (REPO / "docker-compose.yml",)
    up = stack("--profile", "cpu", "up", "-d", "--no-build", "--wait", "pinfeed", timeout=240)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    status = httpx.get(f"{stack.url}/readyz", timeout=10)
    assert status.status_code == 200, status.text


def test_kubernetes_container_spec_matches_the_image(build_seconds: float) -> None:
    """The DaemonSet's container spec against the built image: the entrypoint it relies
    on, the uid it runs as, and the paths its probes ask for."""
    docs = list(yaml.safe_load_all((REPO / "deploy/k8s/pinfeed.yaml").read_text()))
    ds = next(d for d in docs if d and d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["image"] == engine.IMAGE)
    inspect = subprocess.run(
        ["docker", "image", "inspect", engine.IMAGE],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    config = json.loads(inspect.stdout)[0]["Config"]
    assert "command" not in server, "the manifest relies on the image's entrypoint"
    assert config["Entrypoint"] == ["pinfeed", "serve"]
    assert config["User"].split(":")[0] == str(pod["securityContext"]["runAsUser"])

    # The manifest's environment: literal values as given, a secret's as a fresh token.
    env = [
        f"{e['name']}={e['value'] if 'value' in e else secrets.token_hex(16)}"
        for e in server.get("env", [])
    ]
    port = free_port()
    name = f"pinfeed-k8s-{secrets.token_hex(4)}"
    run = subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "-p",
            f"127.0.0.1:{port}:8321",
            *(a for e in env for a in ("-e", e)),
            engine.IMAGE,
            *server.get("args", []),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    try:
        probes = [server[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")]
        deadline = time.monotonic() + 90
        for path in probes:
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{path} never answered 200"
                time.sleep(0.5)  # the container is starting: nothing to wait on but time
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60, check=False)


# deploy/two-node on one machine: the trainer image is the CPU one and asks for no GPU.
TWO_NODE_CPU = """\
services:
  trainer:
    image: pinfeed:cpu
    build: !reset null
    deploy: !reset null
"""


def test_two_node_files_train_one_model(build_seconds: float, tmp_path: Path) -> None:
    """Both nodes' compose files, as they are, on one engine: two servers, two torchrun
    trainers on the host network rendezvousing on loopback, DDP over gloo."""
    override = tmp_path / "cpu.yml"
    override.write_text(TWO_NODE_CPU)
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PINFEED_TOKEN": secrets.token_hex(16),
        "PINFEED_TRAIN_DEVICE": "cpu",
        "PINFEED_SEED": "7",
        "NPROC_PER_NODE": "1",
    }
    nodes = [
        Stack(
            f"pinfeed-test-node{i}-{secrets.token_hex(3)}",
            {**common, "PINFEED_HTTP_PORT": str(free_port())},
            (REPO / "deploy" / "two-node" / f"node{i}.compose.yml", override),
        )
        for i in (0, 1)
    ]
    procs: list[subprocess.Popen[str]] = []
    try:
        for node in nodes:
            up = node("up", "-d", "--no-build", "--wait", "pinfeed", timeout=240)
            assert up.returncode == 0, f"{up.args}\n{up.stderr[-3000:]}"
        for node in nodes:
            argv = engine.compose_argv(node.project, node.files)
            procs.append(
                subprocess.Popen(
                    [*argv, "run", "--rm", "-T", "--no-deps", "trainer"],
                    env={**os.environ, **node.env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=300)[0] for p in procs]
        for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
            assert p.returncode == 0, f"node {i} trainer exited with {p.returncode}:\n{out[-4000:]}"
        assert "rank 0/2" in outs[0] and "rank 1/2" in outs[1], outs[0][-2000:]
        assert len(re.findall(r"^epoch \d/3 loss", outs[0], re.M)) == 3, outs[0][-3000:]
        for rank, node in enumerate(nodes):
            loaders = httpx.get(f"{node.url}/v1/loaders", timeout=10).json()
            names = [lo["name"] for lo in loaders]
            assert names == [f"toy-rank{rank}"], loaders
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        for node in nodes:
            node("down", "-v", "--remove-orphans", "--timeout", "20")
    assert [row for node in nodes for row in node.leftovers()] == []
