"""One W9 trainer process: ``python -m bench.w9_trainer '<json spec>'``.

A fresh process per run, driven over stdin/stdout as ``bench.trainer`` is:

    trainer -> {"event": "ready"}                  imports done, nothing started
    parent  -> "go"                                (all trainers of a run start together)
    trainer -> {"event": "result", "epochs": [...]} every epoch timed
    parent  -> EOF                                 CPU and memory read: exit

Nothing that decodes starts before "go": pinfeed's loader is created after it (a loader
prefetches from its creation), DataLoader's workers start at its first ``iter``. Each
epoch is timed from the end of the one before (the first from "go", so both systems'
start-up is in it): ``{"samples", "seconds", "end"}`` with ``end`` on the monotonic
clock, which every process of the node shares (the 4-job section adds them up).

Systems: ``pinfeed`` (a loader with ``"transform"`` over a cached ``images`` dataset
the parent registered), ``dataloader`` (``DataLoader(Transformed(ImageFolder,
transform))`` with ``persistent_workers``, the same seed: ``bench.references``'
ImageFolder, uncropped, the same pixels as the ``images`` kind's) and
``pinfeed-dataloader`` (that very call with ``pinfeed.DataLoader`` and ``cache=``: the
one-line switch, its dataset part cached by the node) and ``dataloader-cached`` (the
``dataloader`` call on a tuned user's own cache of the decode and resize,
``bench.references.SharedDecoded``: epoch 1 fills it in whichever process reads a
sample, later epochs run only the transform).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from bench.child import Reporting, emit


def _epochs(
    epochs: Callable[[], Iterable[Any]], count: int, after: Callable[[int], Any]
) -> list[dict[str, Any]]:
    """Each epoch's samples, seconds and end; the first also its first batch's time."""
    out: list[dict[str, Any]] = []
    t = time.monotonic()
    for e in range(count):
        rows, first = 0, None
        for batch in epochs():
            rows += int(batch[0].shape[0])
            if first is None:
                first = time.monotonic()
        end = time.monotonic()
        out.append(
            {"samples": rows, "seconds": end - t, "end": end, "first": first, "after": after(e)}
        )
        t = end
    return out


def _pinfeed(spec: dict[str, Any]) -> Callable[[], list[dict[str, Any]]]:
    from pinfeed import Client, Loader

    admin = Client(spec["url"], timeout=300)
    nw = spec["num_workers"]

    def run() -> list[dict[str, Any]]:
        admin.create_loader(
            spec["loader"],
            dataset=spec["dataset"],
            batch_size=spec["batch_size"],
            shuffle=True,
            seed=spec["seed"],
            num_workers=nw,
            persistent_workers=nw > 0,
            prefetch_factor=2,
            pin_memory=torch.cuda.is_available(),
            transform=spec["transform"],
        )
        with Loader(spec["loader"], socket=spec["socket"]) as loader:

            def stats(_: int) -> Any:
                return admin.dataset(spec["dataset"])["cache"] if spec.get("stats") else None

            return _epochs(lambda: loader, spec["epochs"], stats)

    return run


def loader(spec: dict[str, Any]) -> Any:
    """DataLoader, or with ``one_line`` the same call with ``pinfeed.DataLoader`` and
    ``cache=``, on ``Transformed(the script's ImageFolder, the transform)``; for
    ``dataloader-cached`` the ImageFolder decoded once, into shared memory."""
    import pinfeed
    from bench.references import imagefolder, imagefolder_cached
    from pinfeed_server.plugins import resolve

    read = imagefolder_cached if spec["system"] == "dataloader-cached" else imagefolder
    base = read(Path(spec["data_root"]), spec["params"])
    transform = resolve(spec["transform"], ("bench",))
    nw = spec["num_workers"]
    one_line = spec["system"] == "pinfeed-dataloader"
    cls: Any = pinfeed.DataLoader if one_line else torch.utils.data.DataLoader
    extra = {"cache": spec["cache"], "socket": spec["socket"]} if one_line else {}
    dl = cls(
        pinfeed.Transformed(base, transform),
        batch_size=spec["batch_size"],
        shuffle=True,
        num_workers=nw,
        persistent_workers=nw > 0,
        prefetch_factor=2 if nw > 0 else None,
        pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(spec["seed"]),
        **extra,
    )
    return dl


def _dataloader(spec: dict[str, Any]) -> Callable[[], list[dict[str, Any]]]:
    dl = loader(spec)
    return lambda: _epochs(lambda: dl, spec["epochs"], lambda _: None)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    with Reporting() as r:
        torch.set_num_threads(1)  # as DataLoader's workers and pinfeed's server
        run = _pinfeed(spec) if spec["system"] == "pinfeed" else _dataloader(spec)
        emit("ready")
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("expected 'go'")
        start = time.monotonic()
        epochs = run()
        emit("result", start=start, epochs=epochs)
        sys.stdin.read()  # the parent closes stdin once it has read CPU and memory
    return r.status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
