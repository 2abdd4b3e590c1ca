"""One Ray cluster (head, two worker nodes, a server node) in network namespaces for
the module's tests, torn down (processes killed by pid, namespaces deleted) at its end,
also on failure. Needs root (``ip netns``) and Ray (``pinfeed[ray]``).

Heavy (a Ray cluster on this machine): skipped in a plain ``make test``/``pytest``,
run by ``make test-ray`` (``PINFEED_TEST_RAY=1``), which CI (``.ci/run``) calls."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.launcher import REPO
from tests.ray.cluster import NetCluster, NetServer


def _why_not() -> str | None:
    if os.environ.get("PINFEED_TEST_RAY") != "1":
        return (
            "a Ray cluster in network namespaces (heavy): run with `make test-ray` "
            "(PINFEED_TEST_RAY=1)"
        )
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 (ip netns) and util-linux (unshare)"
    if importlib.util.find_spec("ray") is None:
        return "needs pinfeed[ray]"
    # A network namespace of our own (a container without CAP_SYS_ADMIN has none); Ray
    # never runs in the machine's own.
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.decode().strip()}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(REPO / "tests" / "ray")
    if not any(str(item.path).startswith(here) for item in items):
        return
    why = _why_not()
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.ray)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    root = tmp_path_factory.mktemp("raync", numbered=True)
    c = NetCluster(root)
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def ray_server(cluster: NetCluster, tmp_path_factory: pytest.TempPathFactory) -> NetServer:
    srv = cluster.start_server(tmp_path_factory.mktemp("rayserver"))
    assert isinstance(srv, NetServer)
    return srv
