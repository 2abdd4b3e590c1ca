"""Datasets in object storage (``s3://``, S3-compatible endpoints), read through one
on-disk object cache per node: each object (or block of one) fetched once for every
loader, job and epoch.

    url.py      s3:// URLs and the allow-list (PINFEED_REMOTE_ALLOW)
    errors.py   what can go wrong, in words that say what to do; credentials redacted
    client.py   the S3 client (obstore), the AWS chain, retries and their counts
    retry.py    backoff with jitter, and which failures are retried
    objects.py  a dataset's objects as listed at registration, cut into units
    cache.py    the on-disk cache: complete units only, single flight, bounded, persisted
    schedule.py a loader's future reads, for the next-use eviction rule
    reader.py   one loader's gate (a batch waits for its units) and look-ahead
    reads.py    what the engine asks of a remote dataset (its units per sample)
    file.py     an object read by range through the cache (pread, a file for pyarrow)
    link.py     how a worker process gets a unit: the file, or ask the server
    stats.py    the counts and the snapshot every view reads
    node.py     Remote: the node's one of each of the above

docs/how-to/object-storage.md has the design and the guarantees.
"""

from __future__ import annotations

from pinfeed_server.remote.errors import RemoteError
from pinfeed_server.remote.file import RemoteObject
from pinfeed_server.remote.link import RemoteLink
from pinfeed_server.remote.node import Remote, RemoteConfig
from pinfeed_server.remote.objects import Manifest, ObjectInfo, Unit
from pinfeed_server.remote.reader import Reader
from pinfeed_server.remote.reads import RemoteReads, remote_reads
from pinfeed_server.remote.stats import RemoteStats
from pinfeed_server.remote.url import is_remote

__all__ = [
    "Manifest",
    "ObjectInfo",
    "Reader",
    "Remote",
    "RemoteConfig",
    "RemoteError",
    "RemoteLink",
    "RemoteObject",
    "RemoteReads",
    "RemoteStats",
    "Unit",
    "is_remote",
    "remote_reads",
]
