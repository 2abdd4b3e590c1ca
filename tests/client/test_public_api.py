"""The client's public surface: a sorted ``__all__`` of what trainers and scripts use,
every exception in it reachable from the problem ``type`` the server sends."""

from __future__ import annotations

import pinfeed
from pinfeed.errors import PROBLEM_PREFIX, PinfeedError, error_from_slug


def test_all_is_sorted_and_complete() -> None:
    assert pinfeed.__all__ == sorted(pinfeed.__all__)
    for name in pinfeed.__all__:
        assert hasattr(pinfeed, name), name
    assert {"Client", "Loader", "PinfeedError", "SampleError"} <= set(pinfeed.__all__)


def test_every_exported_error_maps_back_from_its_type() -> None:
    for name in pinfeed.__all__:
        cls = getattr(pinfeed, name)
        if isinstance(cls, type) and issubclass(cls, PinfeedError) and cls is not PinfeedError:
            err = error_from_slug(PROBLEM_PREFIX + cls.slug, "detail")
            assert isinstance(err, cls), name
