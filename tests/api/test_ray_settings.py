"""``executor: "ray"`` without a cluster: PINFEED_RAY_ADDRESS refused at start-up when
nothing answers there, and a ray loader refused (422) by a server without one. The
executor itself runs in tests/ray (a real cluster in network namespaces)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pinfeed import Client, InvalidRequest
from pinfeed_server.cli import app as cli
from pinfeed_server.engine.producers.ray import check_ray_address
from pinfeed_server.settings import Settings
from tests.conftest import free_port
from tests.helpers import unique


def test_unreachable_ray_address_is_refused(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = Settings(state_dir=tmp_path, data_root=tmp_path, ray_address=address)
    with pytest.raises(ValueError, match=r"cannot be reached|not installed"):
        settings.check_safe()


@pytest.mark.parametrize("address", ["head", "head:port", ":6379", "ray://"])
def test_malformed_ray_address_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match=r"not host:port|not installed"):
        check_ray_address(address)


def test_serve_refuses_an_unreachable_cluster(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["serve", "--state-dir", str(tmp_path), "--data-root", str(tmp_path)],
        env={"PINFEED_RAY_ADDRESS": f"127.0.0.1:{free_port()}", "COLUMNS": "300"},
    )
    assert result.exit_code == 2, result.output
    assert "refusing to start" in result.output and "PINFEED_RAY_ADDRESS" in result.output


def test_ray_loader_needs_a_cluster(admin: Client) -> None:
    name = unique("ray-none")
    admin.create_dataset(
        name, "synthetic", {"length": 8, "fields": [{"shape": [2], "dtype": "float32"}]}
    )
    with pytest.raises(InvalidRequest, match="PINFEED_RAY_ADDRESS"):
        admin.create_loader(unique("ray"), dataset=name, num_workers=2, executor="ray")
    with pytest.raises(InvalidRequest, match="num_workers"):
        admin.create_loader(unique("ray"), dataset=name, executor="ray")
    local = admin.create_loader(unique("local"), dataset=name)
    assert (local["executor"], local["ray_num_cpus"]) == ("local", 1.0)
    admin.delete_loader(local["name"])


def test_ray_loader_refuses_an_iterable_dataset(admin: Client) -> None:
    """Ray actors take no IterableDataset (a replaced actor cannot take over its
    worker's iterator): a 422 saying so, before the cluster is even needed."""
    name = unique("ray-iter")
    admin.create_dataset(
        name, "python", {"factory": "tests.fixtures.iterables:Shards", "kwargs": {}}
    )
    with pytest.raises(InvalidRequest, match="IterableDataset"):
        admin.create_loader(unique("ray"), dataset=name, num_workers=2, executor="ray")
    admin.delete_dataset(name)
