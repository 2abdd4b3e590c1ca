"""deploy/ray/compose.yml: a Ray head and workers next to pinfeed. Valid against the
Compose Specification (the schema vendored in check-jsonschema, as `make deploy-check`
checks the others), and its promises: one image with the ray extra, the datasets at
the same path everywhere, the head and the server's Ray node without CPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

FILE = REPO / "deploy" / "ray" / "compose.yml"


def _services() -> dict:
    return yaml.safe_load(FILE.read_text())["services"]


def test_compose_schema() -> None:
    checker = Path(sys.executable).with_name("check-jsonschema")
    done = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(FILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deploy/ray/compose.yml" in (REPO / "Makefile").read_text()


def test_one_image_with_the_ray_extra_and_the_data_everywhere() -> None:
    services = _services()
    assert set(services) == {"ray-head", "ray-worker", "pinfeed"}
    for name, svc in services.items():
        assert svc["image"] == "pinfeed:ray", name
        assert svc["build"]["args"]["PINFEED_EXTRAS"] == "server,ray", name
        assert any(v.endswith(":/data:ro") for v in svc["volumes"]), name
        assert svc["environment"]["RAY_USAGE_STATS_ENABLED"] == "0", name


def test_head_and_server_node_make_no_batches() -> None:
    services = _services()
    assert "--num-cpus=0" in services["ray-head"]["command"]
    assert "--include-dashboard=false" in services["ray-head"]["command"]
    server = services["pinfeed"]
    assert "--num-cpus=0" in server["command"][0] and "pinfeed serve" in server["command"][0]
    assert server["environment"]["PINFEED_RAY_ADDRESS"] == "ray-head:6379"
    assert server["environment"]["PINFEED_DATA_ROOT"] == "/data"
    worker = services["ray-worker"]
    assert "--address=ray-head:6379" in worker["command"]
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_dockerfile_installs_the_extras_asked_for() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "ARG PINFEED_EXTRAS=server" in text
    assert "os.environ['PINFEED_EXTRAS'].split(',')" in text
