"""Service settings: one pydantic-settings class, environment prefix ``PINFEED_``.

Values that cannot work are refused when the settings are built (pydantic validation);
combinations that are unsafe are refused by ``check_safe()`` before anything starts.
"""

from __future__ import annotations

import grp
import ipaddress
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pinfeed._autostart import SCRIPT, StartedBy
from pinfeed.protocol import DEFAULT_SOCKET_NAME, default_run_dir
from pinfeed_server.engine.config import MAX_WORKERS  # a loader's bound
from pinfeed_server.engine.producers.ray import check_ray_address
from pinfeed_server.remote import RemoteConfig
from pinfeed_server.remote.url import S3Url

log = logging.getLogger("pinfeed")


def group_id(group: str) -> int:
    """A group's gid, from its name or number; ValueError if there is no such group."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None


# sockaddr_un.sun_path is 108 bytes on Linux, NUL included.
MAX_SOCKET_PATH = 107
MIN_TOKEN_CHARS = 16
MODULE_PREFIX = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pinfeed"


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_max_workers() -> int:
    """Four worker processes per CPU the server may use (8 at least): room for every
    trainer's DataLoader-sized pool, far from the hundreds a runaway client could ask."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(8, 4 * cpus)


class Settings(BaseSettings):
    """Every knob of ``pinfeed serve``; each has an env var ``PINFEED_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="PINFEED_", extra="ignore")

    host: str = Field(
        "127.0.0.1", description="HTTP bind address; non-loopback without a token warns"
    )
    port: int = Field(8321, ge=0, le=65535, description="HTTP port (0: any free port)")
    run_dir: Path = Field(
        default_factory=default_run_dir,
        description="runtime directory for the data-plane socket "
        "(default $XDG_RUNTIME_DIR/pinfeed, else /tmp/pinfeed-<uid>)",
    )
    socket: Path | None = Field(
        None, description="data-plane Unix socket (default <run_dir>/pinfeed.sock)"
    )
    state_dir: Path = Field(
        default_factory=_default_state_dir,
        description="registry directory (default $XDG_STATE_HOME/pinfeed, "
        "else ~/.local/state/pinfeed)",
    )
    data_root: Path = Field(
        default_factory=Path.cwd,
        description="dataset file paths resolve inside this directory (default: the cwd)",
    )
    max_shm_bytes: int = Field(
        default_factory=lambda: physical_memory() // 2,
        gt=0,
        description="memory budget for all rings and sample caches together (default: half "
        "the RAM); a loader or cache over it gets 507; more than the RAM is refused",
    )
    cache_max_bytes: int | None = Field(
        None,
        ge=0,
        description="the part of PINFEED_MAX_SHM_BYTES that datasets' sample caches may "
        "reserve together (default: half of it)",
    )
    cache_dir: Path | None = Field(
        None,
        description="where persisted sample caches live, one memory-mapped file per dataset "
        "(local disk; default <state_dir>/cache)",
    )
    max_workers: int = Field(
        default_factory=default_max_workers,
        ge=0,
        le=4096,
        description="worker processes of all loaders together (default: 4 per CPU, at "
        f"least 8); a loader over it gets 409 worker-limit; one loader may have at most "
        f"min(this, {MAX_WORKERS})",
    )
    arbiter: bool = Field(
        True,
        description="the node arbiter divides the workers among autotuned loaders by their "
        "trainers' stall and priority (GET /v1/node); false: each autotuned loader tunes "
        "itself alone",
    )
    arbiter_interval_s: float = Field(
        2.0, ge=0.05, le=600, description="seconds per arbiter round (one change at most)"
    )
    http_max_rps: float = Field(
        50.0,
        ge=0,
        description="requests a second the HTTP control plane serves each client (its "
        "address and x-pinfeed-client header; probes apart); more wait their turn, so a "
        "client polling flat out neither takes the trainers' CPU nor delays another "
        "client (0: no pace)",
    )
    metrics_max_age_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="GET /metrics serves a body rendered at most this long ago (0: render "
        "every scrape)",
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30, description="largest request body accepted (413 above)"
    )
    token: str | None = Field(
        None,
        repr=False,  # a secret: never in logs or tracebacks
        description=f"bearer token required on mutating requests; at least {MIN_TOKEN_CHARS} "
        "printable characters",
    )
    allowed_plugins: list[str] = Field(
        default_factory=list,
        description="module prefixes that 'python' datasets may import, as a JSON list "
        "(default: none)",
    )
    socket_group: str | None = Field(
        None,
        description="a group (name or gid) whose processes may attach besides the server's "
        "own uid: the socket becomes 0660 and its directory 0750 in that group",
    )
    attach_timeout_s: float = Field(
        60.0, gt=0, description="how long a trainer's attach waits for its loader to start"
    )
    torch_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="torch intra-op threads in the server (in-server production with "
        "num_workers=0); workers always use one, as DataLoader's do",
    )
    ray_address: str | None = Field(
        None,
        description="the Ray cluster's GCS address (head:6379) for loaders with "
        "executor 'ray'; refused at start-up if it cannot be reached (needs pinfeed[ray])",
    )
    accept_objects: bool = Field(
        True,
        description="accept a trainer's own objects (pinfeed.DataLoader ships its Dataset, "
        "collate_fn, worker_init_fn to the server over the Unix socket): loading them runs "
        "the trainer's code in the server, so only a peer of the server's own uid may send "
        "them; false refuses every one (named loaders over HTTP only)",
    )
    idle_exit_s: float | None = Field(
        None,
        gt=0,
        description="exit this long after the last trainer's connection closed (the loaders "
        "it holds go with it; the server pinfeed.DataLoader starts when none runs sets it); "
        "unset: run until stopped",
    )
    started_by: StartedBy = Field(
        "serve",
        description="who started this server: 'serve' (`pinfeed serve`), or 'script' "
        "(pinfeed.DataLoader's autostart sets it): a script's server keeps a registry of "
        "its own, in memory, and never restores the one under PINFEED_STATE_DIR",
    )
    remote_allow: list[str] = Field(
        default_factory=list,
        description="s3:// buckets or prefixes that datasets may read, as a JSON list, e.g. "
        '["s3://corpus/train/"] (default: none). The store, region and credentials come from '
        "the standard AWS chain in the server's environment (AWS_ENDPOINT_URL, AWS_REGION, "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...), never from a request",
    )
    remote_cache_dir: Path | None = Field(
        None,
        description="the node's object cache of remote datasets, kept across restarts "
        "(local disk; default <cache_dir>/objects)",
    )
    remote_cache_max_bytes: int = Field(
        64 << 30, gt=0, description="bytes the object cache may hold on disk (default 64 GiB)"
    )
    remote_block_bytes: int = Field(
        8 << 20,
        ge=1 << 16,
        le=1 << 30,
        description="a range-read object (token file, .npy) is fetched and cached in blocks "
        "of this size",
    )
    remote_concurrency: int = Field(
        32, ge=1, le=1024, description="GETs to the store at once, for the whole node"
    )
    remote_ahead_bytes: int = Field(
        512 << 20,
        ge=0,
        description="bytes each loader fetches ahead of the batch it is making (at most a "
        "quarter of PINFEED_REMOTE_CACHE_MAX_BYTES)",
    )
    remote_eviction: Literal["next-use", "lru"] = Field(
        "next-use",
        description="next-use: evict what the loaders need furthest in the future (their "
        "known order); lru: the least recently used",
    )
    remote_retries: int = Field(10, ge=1, le=100, description="tries of a failing request")
    remote_retry_s: float = Field(
        60.0, gt=0, description="seconds a request keeps being retried (backoff with jitter)"
    )
    remote_verify: bool = Field(
        True, description="check a whole object's MD5 against its ETag where it is one"
    )
    demo: bool = Field(False, description="register the demo dataset and loader at start")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="log level"
    )

    @field_validator("socket_group")
    @classmethod
    def _group_exists(cls, v: str | None) -> str | None:
        if v is not None:
            group_id(v)  # refuse an unknown group at start-up
        return v

    @property
    def socket_gid(self) -> int | None:
        return None if self.socket_group is None else group_id(self.socket_group)

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("allowed_plugins")
    @classmethod
    def _module_prefixes(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not re.match(MODULE_PREFIX, p)]
        if bad:
            raise ValueError(f"not module names: {bad}; give dotted prefixes like 'mylab.data'")
        return v

    @property
    def socket_path(self) -> Path:
        return self.socket or self.run_dir / DEFAULT_SOCKET_NAME

    @property
    def registry_path(self) -> Path | None:
        """The registry's file; None: in memory. A script's server keeps what is made on
        it to itself, and it goes with it: the file holds the named loaders of this
        user's ``pinfeed serve``, whose workers and rings are not a script's to start."""
        if self.started_by == SCRIPT:
            return None
        return self.state_dir / "registry.sqlite3"

    @property
    def cache_path(self) -> Path:
        return self.cache_dir or self.state_dir / "cache"

    @property
    def remote(self) -> RemoteConfig:
        return RemoteConfig(
            allow=tuple(self.remote_allow),
            cache_dir=self.remote_cache_dir or self.cache_path / "objects",
            max_bytes=self.remote_cache_max_bytes,
            block_bytes=self.remote_block_bytes,
            concurrency=self.remote_concurrency,
            ahead_bytes=self.remote_ahead_bytes,
            eviction=self.remote_eviction,
            retries=self.remote_retries,
            retry_s=self.remote_retry_s,
            verify=self.remote_verify,
        )

    @field_validator("remote_allow")
    @classmethod
    def _s3_urls(cls, v: list[str]) -> list[str]:
        for url in v:
            S3Url.parse(url)  # a ValueError names the entry
        return v

    @property
    def cache_budget(self) -> int:
        """PINFEED_CACHE_MAX_BYTES, or its default: half of PINFEED_MAX_SHM_BYTES."""
        limit = self.max_shm_bytes // 2 if self.cache_max_bytes is None else self.cache_max_bytes
        return min(limit, self.max_shm_bytes)

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_safe(self) -> None:
        """Refuse unsafe settings at start-up (ValueError); warn loudly on risky ones."""
        root = self.data_root.resolve()
        if self.data_root.exists() and not self.data_root.is_dir():
            raise ValueError(f"PINFEED_DATA_ROOT {self.data_root} is not a directory")
        if root == Path("/"):
            raise ValueError("PINFEED_DATA_ROOT=/ would expose the whole filesystem; name a folder")
        if self.max_shm_bytes > physical_memory():
            raise ValueError(
                f"PINFEED_MAX_SHM_BYTES={self.max_shm_bytes} is more than this node's "
                f"{physical_memory()} bytes of RAM; page-locked rings that large would "
                "starve the node"
            )
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"the data-plane socket path {self.socket_path} is longer than "
                f"{MAX_SOCKET_PATH} bytes, the Unix socket limit; set a shorter PINFEED_SOCKET"
            )
        if self.ray_address is not None:
            check_ray_address(self.ray_address)
        if self.token is not None:
            if len(self.token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"PINFEED_TOKEN is shorter than {MIN_TOKEN_CHARS} characters; use a random "
                    "one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`"
                )
            if not self.token.isascii() or not self.token.isprintable() or " " in self.token:
                raise ValueError("PINFEED_TOKEN must be printable ASCII without spaces")
        if not self.is_loopback() and self.token is None:
            log.warning(
                "pinfeed is listening on %s without PINFEED_TOKEN: anyone who reaches this "
                "address can create and delete loaders. Set PINFEED_TOKEN.",
                self.host,
            )


@lru_cache
def get_settings() -> Settings:
    return Settings()
