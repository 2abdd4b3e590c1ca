"""A loader's configuration, declared once, and what follows from it.

``LoaderFields`` is DataLoader's arguments (plus pinfeed's own: sharding, groups,
``on_error``) with DataLoader's defaults, their bounds and their documentation. The
HTTP request model (``schemas.LoaderCreate``) is these fields; the engine's
``LoaderConfig`` is the same with the seed resolved; the response model
(``schemas.LoaderPublic``) is ``LoaderConfig`` plus the live status. A new loader
field is one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pinfeed.protocol import NEXTS_IN_FLIGHT
from pinfeed_server.engine.autotune import AutotuneSpec
from pinfeed_server.engine.custom_sampler import (
    BatchSamplerSpec,
    SamplerError,
    SamplerSpec,
    custom_plan,
)
from pinfeed_server.engine.iterable import IterablePlan, is_iterable
from pinfeed_server.engine.mixture import MixtureSpec, Positions
from pinfeed_server.engine.sampler import BatchPlan, EpochSampler
from pinfeed_server.plugins import SPEC, resolve

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
Name = Field(
    pattern=NAME_PATTERN,
    description="letters, digits, '.', '_' and '-'; 1-63 chars",
    examples=["demo"],
)
MAX_WORKERS = 256  # per loader
MAX_PREFETCH = 1024
DEFAULT_PREFETCH = 2  # DataLoader's, for prefetch_factor=None with workers
Prefetch = Annotated[int, Field(ge=1, le=MAX_PREFETCH)]


class LoaderFields(BaseModel):
    """DataLoader's arguments, with DataLoader's defaults."""

    model_config = ConfigDict(extra="forbid")

    name: str = Name
    dataset: str = Field(
        pattern=NAME_PATTERN,
        description="letters, digits, '.', '_' and '-'; 1-63 chars (a mixture: its first "
        "source, if left out)",
        examples=["demo"],
    )
    mixture: MixtureSpec | None = Field(
        None,
        description="several datasets by weight: {sources: [{dataset, weight, shuffle}], "
        "samples | until, rule} (a list of sources alone is the sources); the datasets "
        "the loader reads instead of dataset (how-to/mixtures-packing.md)",
    )
    batch_size: int = Field(1, ge=1, le=1 << 20)
    shuffle: bool = False
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="shuffle seed; the server picks one if null"
    )
    drop_last: bool = False
    num_workers: int = Field(
        0, ge=0, le=MAX_WORKERS, description="0: batches are built in the server"
    )
    pin_memory: bool = False
    prefetch_factor: Prefetch = Field(
        DEFAULT_PREFETCH,
        description="batches made ahead: num_workers * prefetch_factor (1 with no workers); "
        "null: DataLoader's default, 2",
    )
    rank: int = Field(0, ge=0, description="this loader's rank (DistributedSampler semantics)")
    world_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="shard like DistributedSampler(num_replicas=world_size, rank=rank); "
        "null: no sharding (RandomSampler/SequentialSampler semantics)",
    )
    shard_size: int | None = Field(
        None,
        ge=1,
        le=1 << 40,
        description="the shard-aware order: runs of shard_size consecutive samples are "
        "shards (e.g. the samples of one block of a token file in the node's object "
        "cache); an epoch reads the shards in a random order, each shard's samples in a "
        "random order within it (Mosaic Streaming's py1s), each rank a consecutive share "
        "of that sequence, so a rank reads about 1/world_size of the shards. null: "
        "DataLoader's order (RandomSampler, or DistributedSampler's with world_size)",
    )
    group_size: int = Field(
        1, ge=1, le=1024, description="trainer processes that attach to this loader as a group"
    )
    group_mode: Literal["broadcast", "split"] = Field(
        "broadcast",
        description="broadcast: every member gets every batch from one shared slot; "
        "split: member i gets batches i, i+group_size, ... of each epoch",
    )
    group_timeout_s: float = Field(
        300.0, gt=0, le=86400, description="how long a group waits for a member that left"
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="a sample that raises: raise in the trainer, or skip its batch"
    )
    sampler: SamplerSpec | None = Field(
        None,
        description="DataLoader's sampler: {factory, kwargs}, factory(dataset, **kwargs) "
        "returns a Sampler of indices; excludes shuffle",
    )
    batch_sampler: BatchSamplerSpec | None = Field(
        None,
        description="DataLoader's batch_sampler: {factory, kwargs, max_batch_size}, "
        "factory(dataset, **kwargs) returns a Sampler of index lists; excludes "
        "batch_size, shuffle, sampler and drop_last",
    )

    persistent_workers: bool = Field(
        False,
        description="DataLoader's: the base seed is drawn once and each worker's RNG "
        "carries on across epochs (needs num_workers > 0)",
    )
    worker_init_fn: str | None = Field(
        None,
        pattern=SPEC,
        description="'package.module:callable' called in each worker with its id after "
        "seeding, as DataLoader calls it (modules under PINFEED_ALLOWED_PLUGINS)",
    )

    transform: str | None = Field(
        None,
        pattern=SPEC,
        description="'package.module:callable' called on each sample in the worker, after "
        "the dataset (and its cache) and before collate_fn, on DataLoader's worker RNG "
        "streams: the batches are DataLoader(Transformed(dataset, callable))'s. The random "
        "augmentation goes here, the deterministic stages in the dataset (modules under "
        "PINFEED_ALLOWED_PLUGINS; map-style datasets)",
    )
    collate_fn: str | None = Field(
        None,
        pattern=SPEC,
        description="'package.module:callable' called with the list of samples, as "
        "DataLoader calls it, in the worker (modules under PINFEED_ALLOWED_PLUGINS); its "
        "output (any nesting, shapes that change per batch) is written into the slot as "
        "it comes. null: default_collate",
    )
    max_batch_bytes: int | None = Field(
        None,
        ge=64,
        le=1 << 40,
        description="slot capacity in bytes, for batches whose size the first one does not "
        "tell; null: a collate_fn loader's slots hold 4x its first batch (at least 1 MiB), "
        "a default-collated loader's batch_size x the first sample",
    )
    autotune: AutotuneSpec | None = Field(
        None,
        description="set num_workers and prefetch_factor from the trainers' wait share and "
        "the workers' busy share ({max_workers, max_prefetch_factor, interval_s}); a PATCH "
        "of explicit values turns it off. With the node arbiter (PINFEED_ARBITER) the node "
        "divides its workers among autotuned loaders (GET /v1/node)",
    )
    priority: int = Field(
        1,
        ge=1,
        le=100,
        description="the node arbiter's weight of this loader's trainers' stall: when the "
        "loaders want more workers than the node has, a stalled priority-4 trainer counts "
        "as four stalled priority-1 trainers",
    )
    min_workers: int = Field(
        0,
        ge=0,
        le=MAX_WORKERS,
        description="the workers the node arbiter never takes from this loader (at most "
        "num_workers, and autotune's max_workers)",
    )

    executor: str = Field(
        "local",
        pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="what makes the batches (engine/producers: one module per executor): "
        "local (worker processes on this node, or the server itself at num_workers=0), "
        "ray (num_workers Ray actors on the cluster at PINFEED_RAY_ADDRESS; the data must "
        "be readable there), thread (num_workers threads in the server, for datasets whose "
        "decode releases the GIL and that draw no global RNG)",
    )
    ray_num_cpus: float = Field(
        1.0, gt=0, le=256, description="CPUs each Ray actor reserves (executor 'ray')"
    )

    @model_validator(mode="before")
    @classmethod
    def _mixture_names_its_dataset(cls, data: Any) -> Any:
        # a mixture loader's dataset (the registry's row, the loaders a dataset has) is
        # its first source where the request names none
        if isinstance(data, dict) and data.get("dataset") is None and data.get("mixture"):
            mixture = MixtureSpec.model_validate(data["mixture"])
            return {**data, "dataset": mixture.sources[0].dataset}
        return data

    @model_validator(mode="after")
    def _mixture_plan(self) -> LoaderFields:
        if self.mixture is not None:
            if self.sampler is not None or self.batch_sampler is not None:
                raise ValueError("a mixture is its own sampler: no sampler or batch_sampler")
            if self.dataset not in self.mixture.names:
                raise ValueError(
                    f"dataset {self.dataset!r} is not one of the mixture's {self.mixture.names}"
                )
        return self

    @field_validator("prefetch_factor", mode="before", json_schema_input_type=Prefetch | None)
    @classmethod
    def _prefetch_default(cls, value: Any) -> Any:
        # DataLoader(prefetch_factor=None): its default where there are workers; a loader
        # without workers makes one batch ahead whatever it says (prefetch_depth).
        return DEFAULT_PREFETCH if value is None else value

    @model_validator(mode="after")
    def _persistent_needs_workers(self) -> LoaderFields:
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")  # DataLoader's
        return self

    @model_validator(mode="after")
    def _min_workers_fit(self) -> LoaderFields:
        check_min_workers(self)
        return self

    @model_validator(mode="after")
    def _rank_in_world(self) -> LoaderFields:
        if self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.world_size is None and self.rank != 0:
            raise ValueError("rank needs world_size")
        return self

    @model_validator(mode="after")
    def _sampler_exclusions(self) -> LoaderFields:
        # DataLoader's own rules and wording (DataLoader.__init__).
        if self.sampler is not None and self.shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if self.batch_sampler is not None:
            given = [
                f"{name}={value}"
                for name, value, default in (
                    ("batch_size", self.batch_size, 1),
                    ("shuffle", self.shuffle, False),
                    ("sampler", self.sampler, None),
                    ("drop_last", self.drop_last, False),
                )
                if value != default
            ]
            if given:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                    f"sampler, and drop_last (got {', '.join(given)})"
                )
        custom = "batch_sampler" if self.batch_sampler is not None else "sampler"
        if self.shard_size is not None and getattr(self, custom) is not None:
            raise ValueError(f"shard_size orders the samples itself, which a {custom} replaces")
        if self.world_size is not None and getattr(self, custom) is not None:
            raise ValueError(
                f"world_size shards as DistributedSampler does, which a {custom} replaces: "
                f"a {custom} shards itself (as with DataLoader: e.g. its factory returns a "
                "DistributedSampler given num_replicas and rank in its kwargs)"
            )
        return self


class LoaderConfig(LoaderFields):
    """A loader's configuration as the engine runs it: the seed is chosen.

    Its ``num_workers`` is the live number of processes (a PATCH, autotune and the node
    arbiter change it); the loader's RNG streams are fixed when it is created
    (``streams_of``): DataLoader's worker ids, which every later process count serves."""

    model_config = ConfigDict(frozen=True)

    seed: int = Field(ge=0, lt=2**63, description="shuffle seed")

    @model_validator(mode="after")
    def _persistent_needs_workers(self) -> LoaderConfig:
        # A live PATCH may take a persistent loader to 0 (its workers' streams stay).
        return self


def check_min_workers(fields: LoaderFields) -> None:
    """``ValueError`` unless min_workers <= autotune's max_workers (checked first: no
    live change can meet it) and <= num_workers (a loader starts with its guarantee,
    and a live change keeps it)."""
    if fields.autotune is not None and fields.min_workers > fields.autotune.max_workers:
        raise ValueError(
            f"min_workers {fields.min_workers} must be <= autotune.max_workers "
            f"{fields.autotune.max_workers}"
        )
    if fields.min_workers > fields.num_workers:
        raise ValueError(
            f"min_workers {fields.min_workers} must be <= num_workers {fields.num_workers}"
        )


def streams_of(config: LoaderConfig) -> int:
    """The RNG streams of a loader created with ``config``: DataLoader's ``num_workers``
    (with autotune, its ``max_workers``: any count it picks then only adds speed). They
    never change while the loader lives (``producers/seeding.py``)."""
    return config.autotune.max_workers if config.autotune else config.num_workers


def persistent(config: LoaderConfig, streams: int) -> bool:
    """DataLoader's persistent workers: one base seed, RNG streams carried across epochs."""
    return config.persistent_workers and streams > 0


class Named(Protocol):
    """What names a loader's code: its config, or the spec its workers start with."""

    @property
    def collate_fn(self) -> str | None: ...

    @property
    def worker_init_fn(self) -> str | None: ...

    @property
    def transform(self) -> str | None: ...


@dataclass(frozen=True)
class LoaderCode:
    """A loader's own code, called as DataLoader calls it. A loader made over HTTP names
    it (``"module:callable"``, imported under PINFEED_ALLOWED_PLUGINS: ``resolve``); a
    trainer's ``pinfeed.DataLoader`` ships the script's objects themselves."""

    collate_fn: Callable[..., Any] | None = None
    worker_init_fn: Callable[..., Any] | None = None
    transform: Callable[..., Any] | None = None  # per sample, over the dataset

    @classmethod
    def resolve(cls, config: Named, allowed: tuple[str, ...]) -> LoaderCode:
        """The callables ``config`` names; ``PluginError`` names one that cannot be used."""
        collate, init, transform = config.collate_fn, config.worker_init_fn, config.transform
        return cls(
            None if collate is None else resolve(collate, allowed, what="collate_fn"),
            None if init is None else resolve(init, allowed, what="worker_init_fn"),
            None if transform is None else resolve(transform, allowed, what="transform"),
        )


# What may change while a loader runs, each with what a PATCH of it does (the PATCH
# field's description; None: none). The one declaration: the PATCH body
# (schemas.LoaderPatch), ``LiveChange`` and the registry's record of a live change all
# follow it. A new live field is one line here, plus its apply step in
# ``LoaderEngine.reconfigure`` where reading ``config`` anew at its use does not do.
LIVE: dict[str, str | None] = {
    "num_workers": None,
    "prefetch_factor": None,
    "autotune": "turn autotune on (null: off); explicit values alone turn it off",
    "priority": "the node arbiter's weight (autotune stays)",
    "min_workers": "the workers the node arbiter never takes (autotune stays)",
}


def nullable(field: str) -> bool:
    """Whether null is a value of the field (``autotune``: off), not "unchanged"."""
    return type(None) in get_args(LoaderFields.model_fields[field].annotation)


@dataclass(frozen=True, init=False)
class LiveChange:
    """A live change: the ``LIVE`` fields it sets (``autotune=None``: off), the others as
    they are. ``LoaderEngine.reconfigure`` is the one place that applies it, for a PATCH,
    autotune and the node arbiter alike."""

    values: dict[str, Any]

    def __init__(self, **values: Any) -> None:
        fixed = sorted(set(values) - set(LIVE))
        if fixed:
            raise TypeError(f"{fixed} cannot change while a loader runs (config.LIVE)")
        object.__setattr__(self, "values", values)

    def applied_to(self, config: LoaderConfig) -> LoaderConfig:
        """``config`` changed; ``ValueError`` when the result breaks a rule of the fields
        (min_workers above num_workers or above autotune's max_workers)."""
        new = config.model_copy(update=self.values)
        check_min_workers(new)
        return new


def prefetch_depth(config: LoaderConfig) -> int:
    """Batches being made or ready ahead of the trainers, as DataLoader keeps
    ``num_workers * prefetch_factor`` in flight (one with ``num_workers=0``)."""
    return max(1, config.num_workers * config.prefetch_factor)


def ring_slots(config: LoaderConfig, keeps: bool = False) -> int:
    """The prefetch depth, plus the slots each trainer holds: a ``pinfeed.Loader``'s, the
    batch it is using and one for each of the ``NEXTS_IN_FLIGHT`` NEXTs it keeps in
    flight (``pinfeed._epochs``: each is answered as soon as a batch is ready, and the
    batch stays leased in the socket); with ``keeps``, a ``pinfeed.DataLoader``'s, which
    keeps one NEXT in flight and hands a slot back only once it no longer holds the batch
    in it (its loop still holds the last one while it asks for the next): three too.
    With a slot less, a trainer's NEXTs held the prefetch depth's slots, and at
    ``num_workers=0`` the server began each batch only once the one before was taken."""
    held = 3 if keeps else 1 + NEXTS_IN_FLIGHT
    return prefetch_depth(config) + held * config.group_size


def make_sampler(
    config: LoaderConfig, dataset: Any, allowed: tuple[str, ...] = (), *, streams: int
) -> BatchPlan:
    """The loader's batch plan (``streams``: ``streams_of`` the loader as created);
    ``SamplerError`` when its sampler cannot be used."""
    if is_iterable(dataset):
        if config.shard_size is not None:
            raise SamplerError(
                "shard_size orders a map-style dataset's samples; an IterableDataset reads "
                "its own shards in its own order (the webdataset kind splits them by rank "
                "and worker): leave shard_size out"
            )
        return IterablePlan(dataset, config.batch_size, config.drop_last)
    for field in ("batch_sampler", "sampler"):
        spec = getattr(config, field)
        if spec is not None:
            return custom_plan(
                field,
                spec,
                dataset,
                allowed,
                batch_size=config.batch_size,
                drop_last=config.drop_last,
            )
    if config.mixture is not None:
        sources = getattr(dataset, "dataset", dataset)  # under its Transformed
        try:
            rule = config.mixture.rule_for(sources.lengths, config.shuffle)
        except ValueError as exc:
            raise SamplerError(f"mixture: {exc}") from None
        return EpochSampler(
            rule.samples,
            config.batch_size,
            shuffle=False,  # the positions are drawn at random; each source shuffles its own
            seed=config.seed,
            drop_last=config.drop_last,
            rank=config.rank,
            world_size=config.world_size,
            persistent=persistent(config, streams),
            positions=Positions(rule, config.seed),
        )
    return EpochSampler(
        len(dataset),
        config.batch_size,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=config.drop_last,
        rank=config.rank,
        world_size=config.world_size,
        persistent=persistent(config, streams),
        shard_size=config.shard_size,
    )
