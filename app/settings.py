"""Service settings: one pydantic-settings class, environment prefix ``PINFEED_``."""

from __future__ import annotations

import ipaddress
import logging
import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from client._protocol import DEFAULT_SOCKET_NAME, default_run_dir

log = logging.getLogger("pinfeed")


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pinfeed"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Settings(BaseSettings):
    """Every knob of ``pinfeed serve``; each has an env var ``PINFEED_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="PINFEED_", extra="ignore")

    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8321, ge=0, le=65535, description="HTTP port (0: any free port)")
    run_dir: Path = Field(default_factory=default_run_dir, description="runtime directory")
    socket: Path | None = Field(None, description="data-plane socket (default run_dir/pinfeed.sock)")
    state_dir: Path = Field(
        default_factory=_default_state_dir, description="registry and state directory"
    )
    data_root: Path = Field(
        default_factory=Path.cwd, description="dataset files are resolved inside this directory"
    )
    max_shm_bytes: int = Field(
        default_factory=lambda: _physical_memory() // 2,
        gt=0,
        description="memory budget for all rings together (default: half the RAM)",
    )
    token: str | None = Field(None, description="bearer token required on mutating requests")
    allowed_plugins: list[str] = Field(
        default_factory=list,
        description="module prefixes that 'python' datasets may import (empty: none)",
    )
    attach_timeout_s: float = Field(60.0, gt=0, description="how long an attach waits for a loader")
    demo: bool = Field(False, description="register the demo dataset and loader at start")
    log_level: str = Field("info", description="log level")

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        return v

    @property
    def socket_path(self) -> Path:
        return self.socket or self.run_dir / DEFAULT_SOCKET_NAME

    @property
    def registry_path(self) -> Path:
        return self.state_dir / "registry.sqlite3"

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_safe(self) -> None:
        """Refuse unsafe combinations at start-up; warn loudly on risky ones."""
        if self.data_root.exists() and not self.data_root.is_dir():
            raise ValueError(f"PINFEED_DATA_ROOT {self.data_root} is not a directory")
        if Path(self.data_root).resolve() == Path("/"):
            raise ValueError("PINFEED_DATA_ROOT=/ would expose the whole filesystem; name a folder")
        if not self.is_loopback() and self.token is None:
            log.warning(
                "pinfeed is listening on %s without PINFEED_TOKEN: anyone who reaches this "
                "address can create and delete loaders. Set PINFEED_TOKEN.",
                self.host,
            )


@lru_cache
def get_settings() -> Settings:
    return Settings()
