"""The process's global RNG states (``torch``, ``random``, numpy) as bytes: what a
worker sends after each batch (an RNG snapshot), and what travels with a batch made for
a ``pinfeed.DataLoader`` without workers (FEED and RNG messages), since DataLoader makes
those in the trainer, on the trainer's RNGs. Both sides read and write it here, and
decide here which shipped objects draw nothing from them (``draws_nothing``)."""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import torch

from pinfeed.unbatched import Unbatched

RngState = tuple[torch.Tensor, Any, Any]


def capture() -> RngState:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def restore(state: RngState) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


def dump_state() -> bytes:
    """The global RNG states, as bytes."""
    torch_state, random_state, np_state = capture()
    return pickle.dumps((torch_state.numpy().tobytes(), random_state, np_state))


def load_state(blob: bytes) -> None:
    """Make the global RNG states those ``dump_state`` gave."""
    torch_state, random_state, np_state = pickle.loads(blob)
    restore((torch.frombuffer(bytearray(torch_state), dtype=torch.uint8), random_state, np_state))


def draws_nothing(dataset: Any, collate_fn: Any, worker_init_fn: Any = None) -> bool:
    """Whether a batch of ``dataset`` collated by ``collate_fn`` (None: the default) is
    made without drawing from the global RNGs, whichever process makes it and on
    whatever RNG state: torch's own ``TensorDataset`` (its exact type: a subclass may
    draw) with ``default_collate``, or without automatic batching (``Unbatched``) with
    ``default_convert`` (a ``TensorDataset`` indexed with a sample's index or a batch's
    index list), and no ``worker_init_fn`` (which might change the dataset per worker,
    so that each batch must come from its own worker)."""
    if isinstance(collate_fn, Unbatched):
        collate_fn = collate_fn.collate_fn
    return (
        type(dataset) is torch.utils.data.TensorDataset
        and collate_fn in _PLAIN_COLLATES
        and worker_init_fn is None
    )


_PLAIN_COLLATES = (
    None,
    torch.utils.data.default_collate,
    torch.utils.data._utils.collate.default_convert,
)
