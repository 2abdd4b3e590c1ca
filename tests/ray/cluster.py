"""A real multi-node Ray cluster on this machine, each node in its own network namespace.

    with NetCluster(tmp) as c:      # head, two workers, a server node; a bridge namespace
        c.start_server(root)        # pinfeed serve in the server namespace, Ray node there too

Layout (``X`` chosen per run, so two runs never share a subnet):

    <p>-br    a Linux bridge; one veth per namespace below attaches to it
    <p>-head  10.77.X.1   ray head (GCS), no CPUs
    <p>-w1    10.77.X.2   ray worker node, WORKER_CPUS CPUs
    <p>-w2    10.77.X.3   ray worker node, WORKER_CPUS CPUs
    <p>-srv   10.77.X.5   a ray node with no CPUs (the server's driver uses it) and pinfeed
    host      10.77.X.254 one veth in the machine's namespace: the tests' HTTP client

Ray never runs in the machine's own namespace (it would probe external addresses and
bind every interface); in a namespace whose only links are ours it binds there.
Everything started here is killed by pid (every process found in our namespaces) and
the namespaces deleted in ``close``, which fixtures call on failure too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from tests.launcher import REPO, SERVE, Server

RAY = str(Path(sys.executable).with_name("ray"))
WORKER_CPUS = 2
OBJECT_STORE_BYTES = 80 * 1024 * 1024
GCS_PORT = 6379
# Small and quiet: no dashboard, no usage stats, lost nodes noticed within seconds.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "10",
    "RAY_DISABLE_IMPORT_WARNING": "1",
    "RAY_enable_worker_prestart": "0",
    # Ray nices its workers to 15: on a machine shared with other load they would starve.
    "RAY_worker_niceness": "0",
}


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=60)


def netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


@dataclass
class Node:
    name: str  # head, w1, w2, srv
    ns: str
    ip: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None  # the latest start's output


@dataclass
class NetCluster:
    root: Path
    prefix: str = field(default_factory=lambda: f"pfr{os.getpid() % 100000}")
    subnet: int = field(default_factory=lambda: 1 + os.getpid() % 250)
    nodes: dict[str, Node] = field(default_factory=dict)
    server: Server | None = None
    up: set[str] = field(default_factory=set)  # nodes started and not stopped
    starts: int = 0

    def __post_init__(self) -> None:
        self.prefix = f"{self.prefix}{self.subnet % 10}"
        self.bridge_ns = f"{self.prefix}-br"
        self.ray_tmp = Path(tempfile.gettempdir()) / self.prefix  # Ray's session dirs
        for name, last in (("head", 1), ("w1", 2), ("w2", 3), ("srv", 5)):
            self.nodes[name] = Node(name, f"{self.prefix}-{name}", self.ip(last))

    def ip(self, last: int) -> str:
        return f"10.77.{self.subnet}.{last}"

    @property
    def address(self) -> str:
        return f"{self.nodes['head'].ip}:{GCS_PORT}"

    # -- network -----------------------------------------------------------------------
    def _net_up(self) -> None:
        br = self.bridge_ns
        run("ip", "netns", "add", br)
        run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", br, "link", "set", "br0", "up")
        run("ip", "-n", br, "link", "set", "lo", "up")
        for node in self.nodes.values():
            run("ip", "netns", "add", node.ns)
            veth = f"v-{node.name}"
            run(
                "ip",
                "-n",
                br,
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "eth0",
                "netns",
                node.ns,
            )
            run("ip", "-n", br, "link", "set", veth, "master", "br0", "up")
            run("ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            run("ip", "-n", node.ns, "link", "set", "eth0", "up")
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
        # The tests' own link, for HTTP to the server (never a Ray process here).
        host = f"{self.prefix}h"
        run("ip", "link", "add", host, "type", "veth", "peer", "v-host", "netns", br)
        run("ip", "-n", br, "link", "set", "v-host", "master", "br0", "up")
        run("ip", "addr", "add", f"{self.ip(254)}/24", "dev", host)
        run("ip", "link", "set", host, "up")

    # -- ray nodes ---------------------------------------------------------------------
    def start_node(self, *names: str, timeout: float = 120.0, tries: int = 3) -> None:
        """Start nodes together and wait until the GCS counts each; on a loaded machine
        a node (Ray gives the GCS 30 s to list it) can time out in its start-up: then
        those that did not come up start again."""
        todo = list(names)
        for attempt in range(tries):
            for name in todo:
                self._launch(name)
            failed: list[str] = []
            deadline = time.monotonic() + timeout
            want = len(self.up - set(todo)) + len(todo)
            for name in todo:
                try:
                    self._wait_node(self.nodes[name], deadline, want)
                except (RuntimeError, TimeoutError):
                    if attempt == tries - 1:
                        raise
                    failed.append(name)
            for name in failed:
                self.stop_node(name)
            todo = failed
            if not todo:
                return

    def _launch(self, name: str) -> None:
        node = self.nodes[name]
        # A fresh, short session root per start (Unix socket paths stay under 107 bytes).
        self.starts += 1
        tmp = self.ray_tmp / f"{name}{self.starts}"
        tmp.mkdir(parents=True, exist_ok=True)
        argv = [
            RAY,
            "start",
            "--block",
            f"--node-ip-address={node.ip}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
            f"--temp-dir={tmp}",
        ]
        if name == "head":
            argv += ["--head", f"--port={GCS_PORT}", "--num-cpus=0", "--include-dashboard=false"]
        else:
            cpus = WORKER_CPUS if name.startswith("w") else 0
            argv += [f"--address={self.address}", f"--num-cpus={cpus}"]
        node.log = self.root / f"{name}{self.starts}.log"  # this start's output alone
        with node.log.open("ab") as out:
            node.proc = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, *argv],
                # Ray workers import pinfeed_server (installed) and tests.fixtures.
                env=os.environ | RAY_ENV | {"PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )

    def _wait_node(self, node: Node, deadline: float, want: int) -> None:
        """Until the node says it started and the GCS counts at least ``want`` active
        nodes (those up before, and the ones started with it)."""
        while time.monotonic() < deadline:
            assert node.proc is not None
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray node {node.name} exited:\n{self.log(node.name)}")
            if node.name in self.up:
                return
            if "Ray runtime started" in self.log(node.name, 100_000) and self.active() >= want:
                self.up.add(node.name)
                return
            time.sleep(0.5)  # nothing to wait on: the GCS is polled
        raise TimeoutError(f"ray node {node.name} not up in time:\n{self.log(node.name)}")

    def active(self) -> int:
        """How many nodes the GCS lists as active (``ray status``: no dashboard needed)."""
        try:
            probe = run(
                "ip",
                "netns",
                "exec",
                self.nodes["head"].ns,
                RAY,
                "status",
                f"--address={self.address}",
                check=False,
            )
        except subprocess.TimeoutExpired:  # an overloaded GCS: not yet
            return 0
        if probe.returncode != 0 or "Active:" not in probe.stdout:
            return 0
        section = probe.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
        return len(re.findall(r"^\s*\d+ node_[0-9a-f]+", section, re.M))

    def stop_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill every process of a node (its namespace's, by pid)."""
        self.up.discard(name)
        self.kill_namespace(self.nodes[name].ns, sig)
        node = self.nodes[name]
        if node.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(10)

    def processes(self, ns: str) -> list[psutil.Process]:
        """Every process whose network namespace is ``ns``."""
        want = netns_inode(ns)
        found = []
        for p in psutil.process_iter():
            try:
                if os.stat(f"/proc/{p.pid}/ns/net").st_ino == want:
                    found.append(p)
            except (FileNotFoundError, PermissionError, ProcessLookupError):
                continue
        return found

    def _server_tree(self) -> set[int]:
        if self.server is None or self.server.proc is None or self.server.proc.poll() is not None:
            return set()
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(self.server.pid)
            return {top.pid, *(c.pid for c in top.children(recursive=True))}
        return set()

    def kill_namespace(
        self, ns: str, sig: int = signal.SIGKILL, *, spare_server: bool = True
    ) -> None:
        """Kill the namespace's processes; the pinfeed server (in the srv namespace)
        and its children are spared unless ``spare_server`` is False."""
        for _ in range(3):  # a dying raylet may still start a worker: look again
            spared = self._server_tree() if spare_server else set()
            procs = [p for p in self.processes(ns) if p.pid not in spared]
            if not procs:
                return
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            psutil.wait_procs(procs, timeout=10)

    def actor_pids(self) -> list[int]:
        """The pids of the loader's Ray actors (the process titles Ray gives them)."""
        pids = []
        for name in ("w1", "w2"):
            for p in self.processes(self.nodes[name].ns):
                with contextlib.suppress(psutil.Error):
                    if "BatchActor" in " ".join(p.cmdline()):
                        pids.append(p.pid)
        return pids

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.nodes[name].log
        try:
            return "" if path is None else path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    # -- the pinfeed server ------------------------------------------------------------
    def start_server(self, root: Path, env: dict[str, str] | None = None) -> Server:
        srv = self.nodes["srv"]
        self.server = NetServer(
            root,
            env={
                "PINFEED_HOST": srv.ip,
                "PINFEED_RAY_ADDRESS": self.address,
                "PINFEED_TOKEN": "ray-tests-token-0123456789",
                **RAY_ENV,
                **(env or {}),
            },
            command=("ip", "netns", "exec", srv.ns, *SERVE),
        )
        self.server.host = srv.ip
        self.server.start(timeout=120)
        return self.server

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> NetCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._net_up()
            self.start_node("head")
            self.start_node("w1", "w2", "srv")  # together: the head is up
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.server is not None and self.server.proc is not None:
            self.server.stop(timeout=10)
        for node in self.nodes.values():
            if os.path.exists(f"/run/netns/{node.ns}"):
                self.kill_namespace(node.ns, spare_server=False)
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
        with contextlib.suppress(subprocess.SubprocessError):
            run("ip", "link", "del", f"{self.prefix}h", check=False)
        for ns in [*(n.ns for n in self.nodes.values()), self.bridge_ns]:
            run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self) -> NetCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NetServer(Server):
    """A ``pinfeed serve`` in the server namespace, reached over the host's veth."""

    host: str = "127.0.0.1"
    token: str = "ray-tests-token-0123456789"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self):  # type: ignore[no-untyped-def]
        from pinfeed import Client

        return Client(self.url, token=self.token)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
