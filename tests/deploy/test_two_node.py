"""deploy/two-node: one compose file per node, run here as two "nodes" of local processes.

Each node gets its own server, volumes and HTTP port; the trainers rendezvous through
torchrun on 127.0.0.1 (``network_mode: host`` in the files) and train with DDP over
gloo on the CPU (``PINFEED_TRAIN_DEVICE=cpu``). Each rank reads its own shard from its
own node's server, from one permutation given by the shared seed.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pinfeed import Client
from tests.conftest import REPO, free_port
from tests.deploy.compose_local import Project

NODES = [REPO / "deploy" / "two-node" / f"node{i}.compose.yml" for i in (0, 1)]
SEED = 7


def _normalized(path: Path) -> dict:
    text = re.sub(r"node-rank=\d", "node-rank=N", path.read_text())
    model = yaml.safe_load(text)
    model["name"] = re.sub(r"\d+$", "N", model["name"])
    return model


def test_node_files_differ_only_in_node_rank() -> None:
    assert _normalized(NODES[0]) == _normalized(NODES[1])
    for rank, path in enumerate(NODES):
        command = yaml.safe_load(path.read_text())["services"]["trainer"]["command"]
        assert "--nnodes=2" in command and f"--node-rank={rank}" in command
        assert any(c.startswith("--seed=${PINFEED_SEED") for c in command), "one shared seed"


@pytest.fixture()
def nodes(short_tmp: Path) -> Iterator[list[Project]]:
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PINFEED_TOKEN": secrets.token_hex(16),
        "PINFEED_TRAIN_DEVICE": "cpu",
        "PINFEED_SEED": str(SEED),
        "NPROC_PER_NODE": "1",
    }
    projects: list[Project] = []
    try:
        for i, path in enumerate(NODES):
            env = {**common, "PINFEED_HTTP_PORT": str(free_port())}
            projects.append(Project(path, short_tmp / f"node{i}", env))
        yield projects
    finally:
        for p in projects:
            p.terminate()
        for p in projects:
            p.close()


@pytest.mark.slow
@pytest.mark.heavy
def test_two_nodes_train_one_model(nodes: list[Project]) -> None:
    for node in nodes:
        node.start("pinfeed")
    for node in nodes:
        node.wait_healthy("pinfeed")
    procs = {node.file.name: node.start("trainer").proc for node in nodes}
    # Poll both: when one node's torchrun fails, the other's waits in torchrun's exit
    # barrier for minutes, so the failure must be reported from the node that failed.
    deadline = time.monotonic() + 100
    running = list(nodes)
    while running and time.monotonic() < deadline:
        for node in list(running):
            proc = procs[node.file.name]
            assert proc is not None
            if (rc := proc.poll()) is not None:
                out = node.output("trainer")[-4000:]
                assert rc == 0, f"{node.file.name} trainer exited with {rc}:\n{out}"
                running.remove(node)
        time.sleep(0.2)
    if running:
        logs = "\n".join(
            f"--- {n.file.name} trainer{' (aborted: tracebacks below)' * (n in running)} ---\n"
            f"{n.dump_stacks('trainer')[-12000:]}"
            for n in nodes
        )
        names = [n.file.name for n in running]
        pytest.fail(f"trainers of {names} still running after 100 s\n{logs}")

    out0 = nodes[0].output("trainer")
    assert "rank 0/2" in out0 and "rank 1/2" in nodes[1].output("trainer")
    assert len(re.findall(r"^epoch \d/3 loss", out0, re.M)) == 3, out0[-3000:]
    assert (nodes[0].tmp / "volumes" / "trainer-state" / "toy-model.pt").is_file()

    # Each node's server holds its own rank's loader: same seed, world size 2.
    for rank, node in enumerate(nodes):
        port = node.ports[("pinfeed", 8321)]
        with Client(f"http://127.0.0.1:{port}") as admin:
            loaders = {lo["name"]: lo for lo in admin.loaders()}
        assert list(loaders) == [f"toy-rank{rank}"]
        lo = loaders[f"toy-rank{rank}"]
        assert (lo["rank"], lo["world_size"], lo["seed"]) == (rank, 2, SEED)
