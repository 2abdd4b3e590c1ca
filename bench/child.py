"""The trainer process's side of the bench's JSON lines (``bench.procs`` is the parent's).

Standard library only: a trainer's memory and start-up are measured.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import TracebackType
from typing import Any


def emit(event: str, **data: Any) -> None:
    """One message to the parent: ``{"event": event, **data}`` on a line of stdout."""
    sys.stdout.write(json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


class Reporting:
    """``with Reporting() as r:`` a trainer's work, then ``return r.status``: 0, or 1 where
    it raised (anything but ``SystemExit``, which goes on), the error sent to the parent
    as an ``error`` event: its type and message, and its traceback as ``where``."""

    status = 0

    def __enter__(self) -> Reporting:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if typ is None or exc is None or isinstance(exc, SystemExit):
            return False
        where = "".join(traceback.format_exception(typ, exc, tb))
        emit("error", error=f"{typ.__name__}: {exc}", where=where)
        self.status = 1
        return True
