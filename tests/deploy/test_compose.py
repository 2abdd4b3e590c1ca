"""docker-compose.yml: its promises, and a smoke run of its services as local processes.

The smoke run starts exactly the argv, environment and volume layout that the compose
file (and the image's Dockerfile) give each service, rewritten only where one host
cannot be a container (see ``compose_local``), waits for the server's healthcheck
and drives the trainer example to its end.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, Server, free_port
from tests.deploy.compose_local import Project, parse_dockerfile
from tests.helpers import unique

COMPOSE = REPO / "docker-compose.yml"
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) loss ([0-9.]+) acc ([0-9.]+)", re.M)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def trainers(model: dict) -> dict[str, dict]:
    return {n: s for n, s in model["services"].items() if n != "pinfeed"}


def test_services_share_the_socket_volume_and_wait_for_health() -> None:
    model = compose()
    server = model["services"]["pinfeed"]
    assert "pinfeed-run:/run/pinfeed" in server["volumes"]
    assert set(trainers(model)) == {"trainer", "trainer-cpu"}
    for name, svc in trainers(model).items():
        assert "pinfeed-run:/run/pinfeed" in svc["volumes"], name
        assert svc["environment"]["PINFEED_SOCKET"] == "/run/pinfeed/pinfeed.sock", name
        assert svc["depends_on"]["pinfeed"]["condition"] == "service_healthy", name
    assert {"pinfeed-run", "pinfeed-state"} <= set(model["volumes"])


def test_no_ipc_host_and_no_shm_size() -> None:
    """Rings are memfds passed over the socket: /dev/shm's size never matters."""
    for name, svc in compose()["services"].items():
        assert "ipc" not in svc, name
        assert "shm_size" not in svc, name


def test_memlock_restart_token_and_budget() -> None:
    """memlock is never a hard requirement (an engine without CAP_SYS_RESOURCE refuses
    to start a container that asks for it; tests/deploy/test_docker.py shows it):
    deploy/compose.memlock.yml is the opt-in, for every service of the file."""
    model = compose()
    opt_in = yaml.safe_load((REPO / "deploy/compose.memlock.yml").read_text())["services"]
    for name, svc in model["services"].items():
        assert "memlock" not in svc.get("ulimits", {}), name
        assert opt_in[name]["ulimits"]["memlock"] == -1, name
        assert svc["restart"] in ("unless-stopped", "on-failure:5"), name
        assert "PINFEED_TOKEN" in svc["environment"], name
    assert "PINFEED_MAX_SHM_BYTES" in model["services"]["pinfeed"]["environment"]


def test_gpu_reservation_and_cpu_profile() -> None:
    services = compose()["services"]
    devices = services["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert services["trainer"]["profiles"] == ["gpu"]
    assert services["trainer-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["trainer-cpu"]
    assert "profiles" not in services["pinfeed"]


def test_dockerfile_runtime_stage() -> None:
    image = parse_dockerfile(REPO / "Dockerfile")
    assert image.entrypoint == ["pinfeed", "serve"]
    assert image.env["PINFEED_HOST"] == "0.0.0.0"
    assert set(image.volumes) == {"/var/lib/pinfeed", "/run/pinfeed"}
    assert image.healthcheck is not None and "/healthz" in image.healthcheck["test"][-1]
    assert image.user is not None and image.user.split(":")[0].isdigit()
    assert not any(k in image.env for k in ("PINFEED_TOKEN",)), "no secret baked in"


@pytest.fixture()
def project(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Project]:
    env = {"PINFEED_TOKEN": secrets.token_hex(16), "PINFEED_HTTP_PORT": str(free_port())}
    proj = Project(COMPOSE, short_tmp, env, profiles=(request.param,))
    try:
        yield proj
    finally:
        proj.close()


def _epochs(output: str) -> list[float]:
    return [float(m[3]) for m in EPOCH_LINE.finditer(output)]


@pytest.mark.parametrize(
    ("project", "trainer"),
    [("cpu", "trainer-cpu"), pytest.param("gpu", "trainer", marks=pytest.mark.gpu)],
    indirect=["project"],
)
@pytest.mark.slow
@pytest.mark.heavy
def test_compose_smoke(project: Project, trainer: str) -> None:
    assert sorted(project.services) == sorted(["pinfeed", trainer])
    server = project.start("pinfeed")
    assert len(str(server.host_path("/run/pinfeed/pinfeed.sock"))) < 100  # sun_path limit
    project.wait_healthy("pinfeed")

    # The control plane is the published port, and the token from the environment guards it.
    port = project.ports[("pinfeed", 8321)]
    denied = httpx.post(f"http://127.0.0.1:{port}/v1/datasets", json={}, timeout=10)
    assert denied.status_code == 401, denied.text

    first = project.run(trainer, timeout=90)
    assert first.returncode == 0, first.stdout[-4000:]
    assert "created dataset 'toy'" in first.stdout and "created loader 'toy'" in first.stdout
    losses = _epochs(first.stdout)
    assert len(losses) == 3, first.stdout[-4000:]
    assert losses[-1] < losses[0], f"the toy model did not learn: {losses}"

    # Where the volumes say: the socket and registry in the server's volumes, the weights
    # in the trainer's.
    volumes = project.tmp / "volumes"
    assert (volumes / "pinfeed-run" / "pinfeed.sock").is_socket()
    assert (volumes / "pinfeed-state" / "registry.sqlite3").is_file()
    assert (volumes / "trainer-state" / "toy-model.pt").is_file()

    # SIGTERM: a graceful shutdown within stop_grace_period, exit status 0.
    rc = project.stop("pinfeed")
    assert rc == 0, project.output("pinfeed")[-3000:]
    assert "Application shutdown complete" in project.output("pinfeed")


@pytest.mark.slow
def test_trainer_example_on_the_demo_dataset(server: Server) -> None:
    """examples/train.py trains on the shape `pinfeed serve --demo` registers too, and
    attaches to a dataset and loader that already exist (a trainer restart)."""
    from pinfeed_server.service import DEMO_DATASET, DEMO_LOADER

    name = unique("demo-shape")
    with server.client() as admin:
        admin.create_dataset(name, DEMO_DATASET.kind, DEMO_DATASET.params)
        config = DEMO_LOADER.model_dump(exclude={"name", "dataset"})
        admin.create_loader(name, dataset=name, **config)
    env = {**os.environ, "PINFEED_URL": server.url, "PINFEED_SOCKET": str(server.socket)}
    result = subprocess.run(
        [
            sys.executable,
            "examples/train.py",
            "--loader",
            name,
            "--dataset",
            name,
            "--epochs",
            "1",
            "--device",
            "cpu",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "created" not in result.stdout
    assert len(_epochs(result.stdout)) == 1
    with server.client() as admin:
        admin.delete_loader(name)
        admin.delete_dataset(name)
