"""``shipped``: a trainer's own Dataset, ``collate_fn`` and ``worker_init_fn``, sent by
``pinfeed.DataLoader`` over the data-plane socket (never over HTTP) as a payload memfd
(``pinfeed.payload``). Not a kind one registers: the server builds it from the payload
a trainer of its own uid sent, and it lives as long as that trainer's loader.

Loading runs the trainer's code in the server, with the server's uid (unpickling may
import modules and call constructors): the data plane accepts a payload only from a
peer with the server's own uid (``PINFEED_ACCEPT_OBJECTS`` turns it off). The dataset's
zygote maps the same memfd and loads it once more, so the workers forked from it share
the payload's pages (its numpy arrays and tensors) with the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pinfeed import payload
from pinfeed_server.datasets.base import DatasetContext, DatasetError, Kind, Params


class ShippedParams(Params):
    draws_rng: bool = True  # the script's code may draw: False where it cannot (params)


@dataclass
class Shipped:
    """The objects of one ``pinfeed.DataLoader``, as loaded from its payloads."""

    dataset: Any
    collate_fn: Any
    worker_init_fn: Any
    mapping: Any  # the pages of the payload its pickle came in


def load(fds: list[int], shared: list[int] | None = None) -> Shipped:
    """The objects in payloads ``fds`` (a ``payload.Chain``'s: the last one's pickle),
    their shared tensors mapping the memory of ``shared`` (fds, the caller's); a
    ``DatasetError`` that names what to do if they cannot be loaded here (a module of
    the trainer's the server cannot import)."""
    try:
        objects, mapping = payload.Store().load(fds, shared)
    except ModuleNotFoundError as exc:
        raise DatasetError(
            f"the pinfeed server cannot import module {exc.name!r}, which the trainer's "
            "objects are pickled against: install it in the server's Python environment "
            "(a server pinfeed.DataLoader starts uses the trainer's), or define the class "
            "in the training script"
        ) from None
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    except Exception as exc:
        raise DatasetError(
            f"the trainer's objects cannot be loaded in the pinfeed server: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(objects, dict) or "dataset" not in objects:
        raise DatasetError("the payload holds no dataset")
    return Shipped(
        objects["dataset"],
        objects.get("collate_fn"),
        objects.get("worker_init_fn"),
        mapping,
    )


def params(draws: bool) -> dict[str, Any]:
    """The loader's dataset params: ``draws_rng: false`` where the trainer found that its
    objects draw nothing from the global RNGs (``rng.draws_nothing``, and no
    ``worker_init_fn``, which might change the dataset per worker: ``Create.draws``):
    then no RNG stream is kept per worker and any worker may make any batch, as for a
    registered dataset that draws none."""
    return {} if draws else {"draws_rng": False}


def _build(params: ShippedParams, ctx: DatasetContext) -> Any:
    raise DatasetError("a shipped dataset comes from its trainer (pinfeed.DataLoader)")


# Its objects are the script's: they may draw random numbers (augmentations).
KIND = Kind("shipped", ShippedParams, _build, __doc__, ship_build=True, draws_rng=True)
