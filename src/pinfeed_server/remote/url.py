"""``s3://bucket/key`` URLs, and the allow-list they must fall under."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pinfeed_server.remote.errors import NotAllowed

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def is_remote(path: str) -> bool:
    return path.startswith(SCHEME)


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # an object's key, or a prefix ("" for the whole bucket)

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not is_remote(url):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, key = url[len(SCHEME) :].partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name")
        if ".." in key.split("/"):
            raise ValueError(f"{url!r}: a key may not have a '..' component")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def child(self, name: str) -> S3Url:
        """The key ``name`` below this prefix."""
        base = self.key.rstrip("/")
        return S3Url(self.bucket, f"{base}/{name}" if base else name)

    def within(self, other: S3Url) -> bool:
        """Whether this URL is ``other`` or below it (a prefix ends at a '/')."""
        if self.bucket != other.bucket:
            return False
        prefix = other.key.rstrip("/")
        return not prefix or self.key == prefix or self.key.startswith(prefix + "/")


def check_allowed(url: S3Url, allowed: tuple[str, ...]) -> None:
    """Refuse ``url`` unless it lies under an entry of PINFEED_REMOTE_ALLOW."""
    if any(url.within(S3Url.parse(a)) for a in allowed):
        return
    shown = ", ".join(allowed) if allowed else "empty: no bucket may be read"
    raise NotAllowed(
        f"{url} is not under PINFEED_REMOTE_ALLOW ({shown}); the server's operator adds "
        f"its bucket or prefix there, e.g. PINFEED_REMOTE_ALLOW='[\"s3://{url.bucket}/\"]'"
    )
