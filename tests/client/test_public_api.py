"""The client's public surface: a sorted ``__all__`` of what trainers and scripts use,
every exception in it reachable from the problem ``type`` the server sends."""

from __future__ import annotations

import client
from client._errors import PROBLEM_PREFIX, PinfeedError, error_from_slug


def test_all_is_sorted_and_complete() -> None:
    assert client.__all__ == sorted(client.__all__)
    for name in client.__all__:
        assert hasattr(client, name), name
    assert {"Client", "Loader", "PinfeedError", "SampleError"} <= set(client.__all__)


def test_every_exported_error_maps_back_from_its_type() -> None:
    for name in client.__all__:
        cls = getattr(client, name)
        if isinstance(cls, type) and issubclass(cls, PinfeedError) and cls is not PinfeedError:
            err = error_from_slug(PROBLEM_PREFIX + cls.slug, "detail")
            assert isinstance(err, cls), name
