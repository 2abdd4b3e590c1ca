"""The server's own domain errors: one base, ``DomainError``, and the problem each is.

What both sides share is ``pinfeed.errors``: the slugs, the statuses, the classes a
trainer catches. A refusal that arises deep in the server (a dataset file that will
not open, a sampler that yields nothing, a dataset that a cache cannot keep, a name
the registry holds already) is raised there as a class of its own that says where it
came from (``DatasetError``, ``SamplerError``, ``NotCacheable``, ``DuplicateName``...):
a ``DomainError``, whose ``problem`` names the ``pinfeed.errors`` class it leaves the
server as (422 invalid-request unless it says otherwise), with its message as the
detail. Nothing between translates it: the one HTTP handler (``api/problems.py``) and
the data plane send it as that problem (``as_problem``), so no domain error can leave
as a 500. A server exception class that is not a ``DomainError`` is a signal caught
inside its own package (``tests/test_error_tree.py`` holds the server to both).
"""

from __future__ import annotations

from typing import ClassVar

from pinfeed.errors import InvalidRequest, ProblemError


class DomainError(Exception):
    """A request the server refuses, raised where the reason arises; the message says
    why and what to do."""

    problem: ClassVar[type[ProblemError]] = InvalidRequest

    def as_problem(self) -> ProblemError:
        return self.problem(str(self))


def problem_of(exc: BaseException) -> ProblemError | None:
    """The problem ``exc`` leaves the server as: a pinfeed problem as it is, a domain
    error as its ``problem`` with its message; None for anything else (a bug)."""
    if isinstance(exc, ProblemError):
        return exc
    if isinstance(exc, DomainError):
        return exc.as_problem()
    return None
