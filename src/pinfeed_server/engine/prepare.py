"""What a loader needs before it starts, checked against its dataset: its plugins
resolved, the dataset its producers read (its ``transform`` over the shared dataset:
``Transformed``), its batch plan (sampler), and its slot layout, sized from a first
batch.

Everything here raises ``ConfigError`` with a message that says what to change; the
service answers it with a 422. The executor's refusals come first, then DataLoader's own
checks in its words (``iterable.iterable_conflict``, the sampler's), then pinfeed's (a
ring that fits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pinfeed.transformed import Transformed
from pinfeed_server.cache import CachedDataset
from pinfeed_server.datasets import Kind
from pinfeed_server.engine.collate import Layout, LayoutError, fetch_samples, loader_layout
from pinfeed_server.engine.config import LoaderCode, LoaderConfig, make_sampler, streams_of
from pinfeed_server.engine.custom_sampler import SamplerError
from pinfeed_server.engine.iterable import first_samples, is_iterable, iterable_conflict
from pinfeed_server.engine.producers import Executor
from pinfeed_server.engine.sampler import BatchPlan
from pinfeed_server.errors import DomainError
from pinfeed_server.global_rng import GLOBAL_RNG
from pinfeed_server.plugins import PluginError


class ConfigError(DomainError, ValueError):
    """A loader config that its dataset cannot serve; the message says why."""


@dataclass(frozen=True)
class Prepared:
    plan: BatchPlan
    layout: Layout | None  # None: sized from the first batches (a trainer-fed plan)
    code: LoaderCode
    executor: Executor
    dataset: Any  # what the loader's producers read: the dataset, or its Transformed


def prepare(
    cfg: LoaderConfig,
    dataset: Any,
    kind: Kind[Any],
    executors: Mapping[str, Executor],
    allowed: tuple[str, ...],
    cap: int,
    code: LoaderCode | None = None,
    plan: BatchPlan | None = None,
    iterable: bool | None = None,
) -> Prepared:
    """``cfg``'s executor, plan and layout over ``dataset`` (of ``kind``); ``cap`` bounds
    a ``collate_fn`` loader's slot when it sets no ``max_batch_bytes``
    (``collate.loader_layout``). ``code`` and ``plan``, where the trainer brings them
    (``pinfeed.DataLoader``: its objects, its sampler): then no sample is read here
    (DataLoader reads none before the loop asks), the layout is None (the ring is sized
    from the first batches, ``loader.Sizing``) and ``dataset`` may be None (its objects
    run only in its workers; ``iterable`` says what it is)."""
    if iterable is None:
        iterable = is_iterable(dataset)
    executor = executors.get(cfg.executor)
    if executor is None:
        raise ConfigError(
            f"loader {cfg.name!r}: no executor {cfg.executor!r}; one of {sorted(executors)}"
        )
    refusal = executor.refusal(cfg, kind, iterable)
    if refusal is not None:
        raise ConfigError(refusal)
    if code is None:
        try:
            code = LoaderCode.resolve(cfg, allowed)
        except PluginError as exc:
            raise ConfigError(str(exc)) from None
    transform = code.transform
    if transform is not None:
        if iterable:
            raise ConfigError(
                f"loader {cfg.name!r}: transform applies to a map-style dataset "
                "(Transformed(d, t)[i] = t(d[i])); an IterableDataset transforms its samples "
                "in its own __iter__"
            )
        dataset = Transformed(dataset, transform)
    fed = plan is not None
    if plan is None:
        conflict = iterable_conflict(cfg) if iterable else None
        if conflict is not None:
            raise ConfigError(conflict)
        try:
            plan = make_sampler(cfg, dataset, allowed, streams=streams_of(cfg))
        except SamplerError as exc:
            raise ConfigError(str(exc)) from None
        if len(plan) == 0 and not iterable:
            raise ConfigError(
                f"dataset {cfg.dataset!r} has {len(dataset)} samples: batch_size "
                f"{cfg.batch_size} with drop_last yields no batch"
            )
    if fed:
        # a trainer's Transformed over the node's cache: checked on its first sample
        if isinstance(dataset, Transformed) and isinstance(dataset.dataset, CachedDataset):
            with GLOBAL_RNG:  # not while an inline loader has its RNGs swapped in
                _check_transform(cfg, dataset.dataset, dataset.transform, 0)
        return Prepared(plan, None, code, executor, dataset)
    collate = code.collate_fn
    # default collate sizes slots from one sample; a collate_fn from its first batch
    n = 1 if collate is None else plan.max_rows
    first: Any = "the first sample of its iterator"
    indices: list[int] = []
    if not iterable:
        batch0 = next(plan.batches(0))
        assert batch0 is not None  # a map-style dataset's plan yields index lists
        indices, first = batch0, batch0[0]
    try:
        with GLOBAL_RNG:  # not while an inline loader has its RNGs swapped in
            if iterable:
                batch, where = first_samples(dataset, cfg, n), "the first batch of its iterator"
            else:
                batch, where = fetch_samples(dataset, indices[:n], collate), f"sample {first}"
                # a transform over the node's cache: its own, or a trainer's Transformed
                if isinstance(dataset, Transformed) and isinstance(dataset.dataset, CachedDataset):
                    _check_transform(cfg, dataset.dataset, dataset.transform, indices[0])
            layout = loader_layout(batch, plan.max_rows, collate, cfg.max_batch_bytes, cap, where)
    except (LayoutError, ConfigError) as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:
        raise ConfigError(
            f"reading sample {first} to size the ring raised {type(exc).__name__}: {exc}"
        ) from None
    return Prepared(plan, layout, code, executor, dataset)


def _check_transform(
    cfg: LoaderConfig, shared: CachedDataset, transform: Callable[..., Any], index: int
) -> None:
    """A transform over a cached dataset gets read-only views of the node's cache in
    the workers (a write there faults): refuse one that writes into its input."""
    problem = shared.check_transform(transform, index)
    if problem is not None:
        raise ConfigError(f"loader {cfg.name!r}: {problem}")
