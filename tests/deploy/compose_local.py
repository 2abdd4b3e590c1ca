"""Run a compose file's services as local processes: no Docker engine needed.

Each service gets exactly what the compose file and the image's Dockerfile give it:
argv (ENTRYPOINT/CMD, or the service's ``entrypoint``/``command``), environment
(the image's ``ENV``, then the service's ``environment``, after compose's ``${VAR}``
interpolation), working directory and volume layout. What cannot be the same on one
host is rewritten, and only that:

- container paths become paths under a per-service root directory ``<tmp>/<service>``
  in which every mount target is a symlink: named volumes to ``<tmp>/volumes/<name>``
  (shared by the services that mount them, as in compose), files the image COPYs from
  the build context to the context's files, and the image's virtual environment
  (``COPY --from=... /opt/venv``) to the running interpreter's;
- a service's port is its published host port (a free one when none is fixed): the
  service is told that port (``PINFEED_PORT``) and binds loopback (``PINFEED_HOST``)
  instead of the container's 0.0.0.0, and ``<service>:<port>`` in the others' values
  becomes ``127.0.0.1:<that port>``; ``network_mode: host`` needs nothing more;
- ``ulimits.memlock`` is applied with ``prlimit`` where this process may.

Keys this harness does not understand fail the run, so a new key in the compose file
cannot slip past the smoke test unnoticed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.launcher import free_port

# The base image's own environment (python:3.11-slim): what `$PATH` means in ENV.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# Host quirks that must reach every process here (OpenBLAS on some CPUs); never set
# by the compose file, so passing them through changes nothing a container would see.
HOST_PASSTHROUGH = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# The harness's own diagnostics: Python prints every thread's traceback on a fatal
# signal, so a hung service can be asked where it is (``Project.dump_stacks``). It
# changes nothing else a process does.
HARNESS_ENV = {"PYTHONFAULTHANDLER": "1"}

# Service keys and what the harness does with them. "applied": reproduced locally;
# "checked": validated elsewhere (schema) and meaningless for a local process.
SERVICE_KEYS = {
    "build": "applied",
    "image": "applied",
    "entrypoint": "applied",
    "command": "applied",
    "environment": "applied",
    "working_dir": "applied",
    "volumes": "applied",
    "ports": "applied",
    "depends_on": "applied",
    "healthcheck": "applied",
    "ulimits": "applied",
    "profiles": "applied",
    "stop_grace_period": "applied",
    "restart": "checked",
    "init": "checked",
    "cap_drop": "checked",
    "security_opt": "checked",
    "deploy": "checked",
    "shm_size": "checked",
    "network_mode": "applied",
}

_INTERP = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)"
    r"(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation over every string in ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["named"]
        op, arg = m["op"], m["arg"] or ""
        present = name in env
        usable = present and (env[name] != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return env[name] if usable else arg
        if op in (":?", "?"):
            if not usable:
                raise ValueError(f"compose variable {name} is required: {arg}")
            return env[name]
        if op in (":+", "+"):
            return arg if usable else ""
        return env.get(name, "")

    return _INTERP.sub(sub, value)


def parse_duration(text: str | int | float) -> float:
    if isinstance(text, int | float):
        return float(text)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    total = 0.0
    for number, unit in re.findall(r"([0-9.]+)(us|ms|s|m|h)", text):
        total += float(number) * units[unit]
    return total


@dataclass
class Image:
    """The final stage of a Dockerfile, as far as running a process needs it."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    workdir: str = "/"
    healthcheck: dict[str, Any] | None = None
    copies: list[tuple[str, str]] = field(default_factory=list)  # (context src, dest)
    venv_dest: str | None = None  # COPY --from=<stage> <venv> <dest>
    volumes: list[str] = field(default_factory=list)
    exposed: list[int] = field(default_factory=list)
    user: str | None = None


def _instructions(text: str) -> list[tuple[str, str]]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and current):
            continue  # comments and blank lines inside a continuation are dropped, as Docker does
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _expand(text: str, values: dict[str, str]) -> str:
    return re.sub(
        r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)",
        lambda m: values.get(m[1] or m[2], ""),
        text,
    )


def parse_dockerfile(
    path: Path, target: str | None = None, args: dict[str, str] | None = None
) -> Image:
    """The image config of ``target`` (default: the last stage)."""
    stages: list[tuple[str | None, list[tuple[str, str]]]] = []
    global_args: dict[str, str] = {}
    for word, rest in _instructions(path.read_text()):
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append((name, []))
        elif not stages:
            if word == "ARG":
                k, _, v = rest.partition("=")
                global_args[k] = v
        else:
            stages[-1][1].append((word, rest))
    chosen = next((s for s in stages if s[0] == target), None) if target else stages[-1]
    if chosen is None:
        raise ValueError(f"{path} has no stage {target!r}")
    image = Image(env=dict(BASE_ENV))
    argv: dict[str, str] = {}
    for word, rest in chosen[1]:
        values = {**argv, **image.env}
        if word == "ARG":
            k, _, v = rest.partition("=")
            argv[k] = (args or {}).get(k, v or global_args.get(k, ""))
        elif word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                image.env[k] = _expand(v, {**argv, **image.env})
        elif word in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)  # exec form only: shell form would hide signals
            setattr(image, word.lower(), value)
        elif word == "WORKDIR":
            image.workdir = os.path.normpath(os.path.join(image.workdir, _expand(rest, values)))
        elif word == "COPY":
            parts = shlex.split(rest)
            flags = [p for p in parts if p.startswith("--")]
            src, dest = [p for p in parts if not p.startswith("--")][-2:]
            dest = os.path.normpath(os.path.join(image.workdir, dest))
            if any(f.startswith("--from=") for f in flags):
                # The one thing the image takes from its build stage: the virtual
                # environment, which is the running interpreter's here.
                if image.venv_dest is not None:
                    raise ValueError(f"{path}: more than one COPY --from in the final stage")
                image.venv_dest = dest
            else:
                image.copies.append((src.rstrip("/"), dest))
        elif word == "VOLUME":
            image.volumes = list(json.loads(rest)) if rest.startswith("[") else rest.split()
        elif word == "EXPOSE":
            image.exposed += [int(p.split("/")[0]) for p in rest.split()]
        elif word == "USER":
            image.user = _expand(rest, values)
        elif word == "HEALTHCHECK":
            opts = dict(re.findall(r"--([a-z-]+)=(\S+)", rest))
            _, _, test = rest.partition("CMD ")
            image.healthcheck = {
                "test": ["CMD", *json.loads(test)],
                "interval": opts.get("interval", "30s"),
                "timeout": opts.get("timeout", "30s"),
                "start_period": opts.get("start-period", "0s"),
                "retries": int(opts.get("retries", "3")),
            }
    return image


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    root: Path
    healthcheck: dict[str, Any] | None
    depends_on: dict[str, dict[str, Any]]
    memlock: int | None
    stop_grace: float
    mounts: dict[str, Path]  # container path -> host path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    signalled: bool = False  # a second SIGTERM would make uvicorn skip its graceful shutdown

    def host_path(self, container_path: str) -> Path:
        """Where a container path of this service lies on this host."""
        return self.root / container_path.lstrip("/")


class Project:
    """A compose file's services for some profiles, laid out under ``tmp``."""

    def __init__(
        self, compose_file: Path, tmp: Path, env: dict[str, str], profiles: tuple[str, ...] = ()
    ) -> None:
        self.file = compose_file
        self.dir = compose_file.parent
        self.tmp = tmp
        self.model = interpolate(yaml.safe_load(compose_file.read_text()), env)
        self.profiles = profiles
        self.ports: dict[tuple[str, int], int] = {}
        specs = self.model["services"]
        self.active = [
            n
            for n, s in specs.items()
            if not s.get("profiles") or set(s["profiles"]) & set(profiles)
        ]
        for name in self.active:
            unknown = set(specs[name]) - set(SERVICE_KEYS)
            if unknown:
                raise ValueError(f"service {name}: the local harness does not know {unknown}")
            for port, published in self._ports(name).items():
                self.ports[(name, port)] = published or free_port()
        self.services = {n: self._service(n) for n in self.active}

    # -- model -------------------------------------------------------------------------
    def _build_of(self, name: str) -> dict[str, Any]:
        spec = self.model["services"][name]
        if "build" in spec:
            build = spec["build"]
            return {"context": build} if isinstance(build, str) else dict(build)
        for other in self.model["services"].values():  # an image built by another service
            if other.get("image") == spec.get("image") and "build" in other:
                b = other["build"]
                return {"context": b} if isinstance(b, str) else dict(b)
        raise ValueError(f"service {name}: image {spec.get('image')!r} is built by no service")

    def image(self, name: str) -> tuple[Image, Path]:
        build = self._build_of(name)
        context = (self.dir / build.get("context", ".")).resolve()
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        args = {k: str(v) for k, v in (build.get("args") or {}).items()}
        return parse_dockerfile(dockerfile, build.get("target"), args), context

    def _ports(self, name: str) -> dict[int, int | None]:
        """Container port -> published host port (None: not published, or no fixed port)."""
        spec = self.model["services"][name]
        ports: dict[int, int | None] = {}
        for entry in spec.get("ports", []):
            parts = str(entry).split("/")[0].split(":")
            ports[int(parts[-1])] = int(parts[-2]) if len(parts) >= 2 and parts[-2] else None
        if "entrypoint" not in spec:  # EXPOSE documents the image's own entrypoint only
            image, _ = self.image(name)
            for port in image.exposed:
                ports.setdefault(port, None)
        return ports

    def _rewrite(self, text: str, roots: list[str], root: Path) -> str:
        for (svc, port), host_port in self.ports.items():
            text = re.sub(rf"\b{re.escape(svc)}:{port}\b", f"127.0.0.1:{host_port}", text)
        for prefix in sorted((r for r in roots if r != "/"), key=len, reverse=True):
            text = re.sub(rf"(?<![\w.-]){re.escape(prefix)}(?=/|:|$|\s)", str(root) + prefix, text)
        return text

    def _service(self, name: str) -> Service:
        spec = self.model["services"][name]
        if spec.get("network_mode", "host") != "host":
            raise ValueError(f"service {name}: network_mode {spec['network_mode']!r} unsupported")
        image, context = self.image(name)
        root = self.tmp / name
        mounts: dict[str, Path] = {}
        for vol in spec.get("volumes", []):
            source, target = (
                vol.split(":")[:2] if isinstance(vol, str) else (vol["source"], vol["target"])
            )
            if source.startswith((".", "/")):
                mounts[target] = (self.dir / source).resolve()
            else:
                assert source in (self.model.get("volumes") or {}), f"undeclared volume {source}"
                mounts[target] = self.tmp / "volumes" / source
        for target in image.volumes:  # anonymous volumes of the image
            mounts.setdefault(target, self.tmp / "anon" / name / target.strip("/"))
        for src, dest in image.copies:
            mounts.setdefault(dest, context / src)
        if image.venv_dest:
            mounts[image.venv_dest] = Path(sys.prefix)
        for target, host in mounts.items():
            link = root / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not host.exists():
                host.mkdir(parents=True)
            link.symlink_to(host, target_is_directory=host.is_dir())
        workdir = spec.get("working_dir", image.workdir)
        (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        roots = [*mounts, workdir]

        env = dict(image.env)
        raw_env = spec.get("environment", {})
        if isinstance(raw_env, list):
            raw_env = dict(item.split("=", 1) for item in raw_env)
        env.update({k: "" if v is None else str(v) for k, v in raw_env.items()})
        for (svc, _), host_port in self.ports.items():
            if svc == name:  # the process that listens: loopback and the host port
                env["PINFEED_HOST"], env["PINFEED_PORT"] = "127.0.0.1", str(host_port)
        env = {k: self._rewrite(v, roots, root) for k, v in env.items()}
        env["HOME"] = str(root / "home")
        (root / "home").mkdir(exist_ok=True)
        env.update({k: os.environ[k] for k in HOST_PASSTHROUGH if k in os.environ})
        env.update(HARNESS_ENV)

        def as_list(value: Any) -> list[str]:
            return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]

        if "entrypoint" in spec:
            argv = as_list(spec["entrypoint"]) + as_list(spec.get("command", []))
        else:
            argv = image.entrypoint + (as_list(spec["command"]) if "command" in spec else image.cmd)
        argv = [self._rewrite(a, roots, root) for a in argv]

        health = spec.get("healthcheck", image.healthcheck)
        if health is not None and health.get("disable"):
            health = None
        if health is not None:
            test = health["test"]
            assert test[0] in ("CMD", "CMD-SHELL"), test
            cmd = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
            health = {**health, "argv": [self._rewrite(a, roots, root) for a in cmd]}

        deps = spec.get("depends_on", {})
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        memlock = (spec.get("ulimits") or {}).get("memlock")
        if isinstance(memlock, dict):
            memlock = memlock.get("hard")
        return Service(
            name=name,
            argv=argv,
            env=env,
            cwd=root / workdir.lstrip("/"),
            root=root,
            healthcheck=health,
            depends_on=deps,
            memlock=None if memlock is None else int(memlock),
            stop_grace=parse_duration(spec.get("stop_grace_period", "10s")),
            mounts=mounts,
        )

    # -- processes ---------------------------------------------------------------------
    def start(self, name: str) -> Service:
        svc = self.services[name]
        for dep, how in svc.depends_on.items():
            assert dep in self.services, f"{name} depends on {dep}, which is not active"
            condition = how.get("condition", "service_started")
            if condition == "service_healthy":
                self.wait_healthy(dep)
            elif condition == "service_completed_successfully":
                assert self.services[dep].proc is not None
                assert self.services[dep].proc.wait(60) == 0
            else:
                assert self.services[dep].proc is not None
        svc.log = self.tmp / f"{name}.log"
        svc.signalled = False
        with svc.log.open("ab") as out:
            svc.proc = subprocess.Popen(
                svc.argv, env=svc.env, cwd=svc.cwd, stdout=out, stderr=subprocess.STDOUT
            )
        if svc.memlock is not None:
            limit = resource.RLIM_INFINITY if svc.memlock < 0 else svc.memlock
            # The server mlocks only once a loader exists, long after this call. Where this
            # process may not raise the limit, rings are simply not page-locked.
            with contextlib.suppress(PermissionError, ValueError, ProcessLookupError):
                resource.prlimit(svc.proc.pid, resource.RLIMIT_MEMLOCK, (limit, limit))
        return svc

    def output(self, name: str) -> str:
        log = self.services[name].log
        return log.read_text(errors="replace") if log and log.exists() else ""

    def wait_healthy(self, name: str) -> None:
        """Run the service's healthcheck until it passes, as the engine would."""
        svc = self.services[name]
        health = svc.healthcheck
        assert health is not None, f"{name} has no healthcheck, yet a service waits for it"
        assert svc.proc is not None, f"{name} was not started"
        budget = parse_duration(health.get("start_period", "0s")) + health.get("retries", 3) * (
            parse_duration(health.get("interval", "30s"))
        )
        deadline = time.monotonic() + min(budget, 90.0)
        timeout = parse_duration(health.get("timeout", "30s")) or 30.0
        while True:
            if svc.proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {svc.proc.returncode}:\n{self.output(name)[-3000:]}"
                )
            try:
                check = subprocess.run(
                    health["argv"], env=svc.env, cwd=svc.cwd, capture_output=True, timeout=timeout
                )
                healthy, why = check.returncode == 0, check.stderr.decode()[-2000:]
            except subprocess.TimeoutExpired as exc:
                # A check past its timeout is a failed check, as the engine counts it (a
                # loaded machine can take that long just to start the check's python).
                healthy, why = False, f"the check took over {timeout} s: {exc.stderr!r}"[-2000:]
            if healthy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy: {why}\n{self.output(name)[-3000:]}")
            time.sleep(0.25)  # the healthcheck's own interval, shortened

    def run(self, name: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Start a one-shot service and wait for it to end."""
        svc = self.start(name)
        assert svc.proc is not None
        try:
            rc = svc.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            svc.proc.kill()
            svc.proc.wait()
            raise
        out = self.output(name)
        assert svc.log is not None
        svc.log.unlink()  # the next run starts a fresh log
        return subprocess.CompletedProcess(svc.argv, rc, out, "")

    def stop(self, name: str) -> int | None:
        """SIGTERM, then SIGKILL after the service's stop_grace_period."""
        svc = self.services[name]
        if svc.proc is None:
            return None
        if svc.proc.poll() is None:
            if not svc.signalled:
                svc.proc.terminate()
                svc.signalled = True
            try:
                svc.proc.wait(svc.stop_grace)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        return svc.proc.returncode

    def dump_stacks(self, name: str) -> str:
        """Abort a hung service's process tree, deepest first, and return its log.

        With ``PYTHONFAULTHANDLER`` every Python process in the tree writes all its
        threads' tracebacks to the service's log as it dies: where each one was stuck."""
        svc = self.services[name]
        if svc.proc is None or svc.proc.poll() is not None:
            return self.output(name)
        root = psutil.Process(svc.proc.pid)
        for proc in [*reversed(root.children(recursive=True)), root]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGABRT)
                proc.wait(5)
        svc.signalled = True
        return self.output(name)

    def terminate(self) -> None:
        """SIGTERM to every running service at once (``close`` then waits for each)."""
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is None and not svc.signalled:
                svc.proc.terminate()
                svc.signalled = True

    def close(self) -> None:
        self.terminate()
        for name in reversed(list(self.services)):
            self.stop(name)
