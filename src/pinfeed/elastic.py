"""Elastic resume: the state of every rank in one, and the rest of an interrupted epoch
spread over another world size, each sample once.

A sharded loader (``world_size`` W, DistributedSampler's semantics) at epoch e gives
rank r the samples ``spread(order_e, W)[r::W]`` (``order_e``: DistributedSampler's
permutation of epoch e; ``spread``: its padding to a multiple of W, or, with
``drop_last``, its cut), in batches of ``batch_size``. Rank r's state says how many of
its batches it has consumed. Given every rank's state, the samples of epoch e that no
rank consumed (the *remainder*, in the order of ``order_e``) are known, and a new world
of W' ranks can share them: DistributedSampler's rule applied to the remainder, rank r'
taking ``spread(remainder, W')[r'::W']``. That is a *stage* of the epoch; a job can be
resized again in the middle of it, and the next stage spreads what the earlier ones
left. The following epochs are DistributedSampler(W')'s.

The state format (``Loader.state_dict()``; ``merge_states`` of every rank's; version 2)::

    {"version": 2,
     "loader": "train-0",                       the loader that saved it (rank 0's, in a
                                                state of every rank; not checked)
     "epoch": 3, "index": 17,                   this rank's next batch (version 1's keys;
                                                in a state of every rank, the earliest)
     "rank": 0, "world_size": 4,                its sharding (world_size null: none; rank
                                                null in a state of every rank)
     "batch_size": 32,
     "plan": {"length": 50000, "shuffle": true, "seed": 7, "drop_last": false},
                                                null: the loader's plan cannot be respread
                                                (a custom sampler, an IterableDataset)
     "elastic": {"epoch": 3, "start": 12,       the epoch is itself a resumed one: its
        "stages": [[8, 32, 0, [12, 12, 11, null, 12, 12, 12, 12]]]},
                                                batches are numbered from ``start``; the
                                                stages before the current one, each
                                                [world_size, batch_size, start, every
                                                rank's next batch when it ended (null: it
                                                had finished the stage)]. Not in one:
                                                {"epoch": null, "start": 0, "stages": []}
     "ranks": [[3, 17], [3, 17], [3, 16], [4, 0]]}
                                                every rank's (epoch, index): present in a
                                                gathered or merged state, absent in one
                                                rank's own

Every value is a number, a string, null, a list of such, or a dict of fixed keys, so
the structure is the same whatever the position (``torch.distributed.checkpoint``
flattens dicts and needs the keys it saved at load), it survives
``torch.load(weights_only=True)``, and JSON.

``Loader.state_dict()`` gathers ``ranks`` itself under an initialized
``torch.distributed`` (an all-gather: every rank calls it, as Lightning, Accelerate and
``torch.distributed.checkpoint`` do), and the gathered state is the same on every rank,
so a checkpoint that keeps rank 0's state alone still has every rank's position (and
``torch.distributed.checkpoint`` may keep any rank's copy); ``merge_states`` builds the
same from the per-rank states of a job without a process group.

What a loading rank does (``resume``): at the same world size and batch size it goes on
from its own position in ``ranks`` (in the same stage); else it starts the next stage
of the earliest unfinished epoch: its shard of the remainder, numbered from ``start``
(the furthest index any old rank had reached, rounded up to a multiple of the loader's
worker streams, so that batch ``start + j`` is made by DataLoader's worker ``j % N``,
as the j-th batch of a fresh iterator). With ``drop_last`` a stage keeps the first
``W' * batch_size * floor(len(remainder) / (W' * batch_size))`` samples of the
remainder (DistributedSampler's cut, then DataLoader's ``drop_last``: fewer than
``W' * batch_size`` samples are dropped); without, it pads the remainder to a multiple
of W' with its own first samples (DistributedSampler's padding: fewer than W' samples
twice) and a rank's last batch may be short. Every new rank gets the same number of
batches.

This module is pure (torch and the state's JSON): the server builds a loader's plan
with it, and a trainer-side sampler can use it the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pinfeed.errors import InvalidState

STATE_VERSION = 2


@dataclass(frozen=True)
class Plan:
    """What a loader's epochs are made of and must agree on across a resize."""

    length: int  # the dataset's samples (a mixture's: its positions an epoch)
    shuffle: bool
    seed: int
    drop_last: bool
    shard_size: int | None = None  # the shard-aware order's samples a shard (None: global)
    mixture: str | None = None  # a mixture's rule (``pinfeed.mixing.Mixing.digest``)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "length": self.length,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }
        # Each absent where not used: the states of version 2 as they were
        if self.shard_size is not None:
            out["shard_size"] = self.shard_size
        if self.mixture is not None:
            out["mixture"] = self.mixture
        return out

    @classmethod
    def from_json(cls, data: Any) -> Plan | None:
        if data is None:
            return None
        try:
            shard_size = data.get("shard_size")  # absent in states saved before it
            mixture = data.get("mixture")
            return cls(
                int(data["length"]),
                bool(data["shuffle"]),
                int(data["seed"]),
                bool(data["drop_last"]),
                None if shard_size is None else int(shard_size),
                None if mixture is None else str(mixture),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidState(f"a state's plan is malformed: {exc!r}") from None


@dataclass(frozen=True)
class Stage:
    """A finished stage of an elastic epoch: its world and batches, the index its
    batches were numbered from, and where each rank was when it ended."""

    world_size: int
    batch_size: int
    start: int
    reached: tuple[int | None, ...]  # per rank: its next batch; None: it had finished

    def to_json(self) -> list[Any]:
        """A list (not a dict): a leaf for ``torch.distributed.checkpoint``."""
        return [self.world_size, self.batch_size, self.start, list(self.reached)]

    @classmethod
    def from_json(cls, data: Any) -> Stage:
        try:
            world_size, batch_size, start, reached_json = data
            reached = tuple(None if r is None else int(r) for r in reached_json)
            stage = cls(int(world_size), int(batch_size), int(start), reached)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidState(f"a state's elastic stage is malformed: {exc!r}") from None
        if stage.world_size < 1 or stage.batch_size < 1 or len(reached) != stage.world_size:
            raise InvalidState(f"a state's elastic stage is malformed: {data!r}")
        return stage


@dataclass(frozen=True)
class Elastic:
    """An epoch resumed at another world size or batch size: the stages before the
    current one, and the index the current one's batches are numbered from."""

    epoch: int
    start: int
    stages: tuple[Stage, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "start": self.start,
            "stages": [s.to_json() for s in self.stages],
        }

    @classmethod
    def from_json(cls, data: Any) -> Elastic | None:
        """The record of a state, RESUMED or ATTACHED (None: not in an elastic epoch)."""
        if data is None or data.get("epoch") is None:
            return None
        try:
            stages = tuple(Stage.from_json(s) for s in data["stages"])
            return cls(int(data["epoch"]), int(data["start"]), stages)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidState(f"a state's elastic record is malformed: {exc!r}") from None


NO_ELASTIC: dict[str, Any] = {"epoch": None, "start": 0, "stages": []}
"""A state's ``elastic`` outside an elastic epoch (the same keys as in one)."""


# -- DistributedSampler's rule, on any order ------------------------------------------------
def per_rank(count: int, world: int, drop_last: bool) -> int:
    """DistributedSampler's ``num_samples`` for ``count`` samples over ``world`` ranks."""
    if drop_last and count % world:
        return max(0, math.ceil((count - world) / world))
    return math.ceil(count / world)


def spread(order: torch.Tensor, world: int, drop_last: bool) -> torch.Tensor:
    """``order`` cut (``drop_last``) or padded with its own first samples to
    ``per_rank * world``, as DistributedSampler makes its ``total_size`` list; rank r's
    samples are ``spread(...)[r::world]``."""
    n = len(order)
    total = per_rank(n, world, drop_last) * world
    if total <= n:
        return order[:total]
    pad = total - n
    return torch.cat([order, order.repeat(math.ceil(pad / n))[:pad]])


def epoch_order(plan: Plan, epoch: int, world: int) -> torch.Tensor:
    """The order of ``epoch`` started at ``world`` ranks, before padding: rank r's
    samples are ``spread(order, world)[r::world]``. DistributedSampler's permutation
    (the same whatever the world), or with ``shard_size`` the shard-aware order."""
    if plan.shard_size is not None:
        return _interleaved(shard_sequence(plan, epoch), world, plan.drop_last)
    if plan.shuffle:
        g = torch.Generator().manual_seed(plan.seed + epoch)
        return torch.randperm(plan.length, generator=g)
    return torch.arange(plan.length)


def shard_sequence(plan: Plan, epoch: int) -> torch.Tensor:
    """The shard-aware order's sequence of ``epoch``: shard ``j`` is the samples
    ``[j * shard_size, (j + 1) * shard_size)``; with ``shuffle``, the shards in a random
    order and each shard's samples in a random order within it, both drawn from
    ``Generator().manual_seed(seed + epoch)`` (as Mosaic Streaming's ``py1s``: shards,
    then samples within each); without, the samples in order."""
    assert plan.shard_size is not None
    n, k = plan.length, plan.shard_size
    if not plan.shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed(plan.seed + epoch)
    shards = math.ceil(n / k)
    place = torch.empty(shards, dtype=torch.int64)
    place[torch.randperm(shards, generator=g)] = torch.arange(shards)
    within = torch.rand(n, generator=g, dtype=torch.float64)
    # By (the shard's place in the epoch, the sample's draw): one stable sort of each key.
    by_draw = torch.argsort(within, stable=True)
    by_shard = torch.argsort(place[by_draw // k], stable=True)
    return by_draw[by_shard]


def _interleaved(sequence: torch.Tensor, world: int, drop_last: bool) -> torch.Tensor:
    """``sequence`` cut into ``world`` consecutive blocks, one a rank, and laid out so
    that ``spread(result, world)[r::world]`` is block r: row-major over a grid of a row
    per position and a column per rank. Without ``drop_last`` the blocks are
    DistributedSampler's ``num_samples`` long but the last ``pad`` ranks', one shorter:
    their last places are the padding ``spread`` fills with the order's first samples
    (one sample of another rank's first shard each); with it, the samples past
    ``num_samples * world`` go last, where ``spread`` cuts them."""
    n = len(sequence)
    rows = per_rank(n, world, drop_last)
    if drop_last and rows * world < n:
        kept = sequence[: rows * world].view(world, rows)
        return torch.cat([kept.t().reshape(-1), sequence[rows * world :]])
    pad = rows * world - n
    grid = torch.full((rows, world), -1, dtype=torch.int64)
    at = 0
    for rank in range(world):
        size = rows - (1 if rank >= world - pad else 0)
        grid[:size, rank] = sequence[at : at + size]
        at += size
    return grid.reshape(-1)[:n]  # the empty places are the last ``pad`` of the grid


def _batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def _ends(stage: Stage, samples: int, drop_last: bool) -> int:
    """The index after a stage's last batch, on every rank."""
    return stage.start + _batches(samples, stage.batch_size, drop_last)


def remainder(plan: Plan, elastic: Elastic) -> torch.Tensor:
    """The samples of the epoch still due when the current stage began, in the epoch's
    order: every stage's deliverable samples minus those its ranks had consumed."""
    started = elastic.stages[0].world_size if elastic.stages else 1
    left = epoch_order(plan, elastic.epoch, started)
    for stage in elastic.stages:
        left = _after_stage(left, stage, plan)
    return left


def _after_stage(left: torch.Tensor, stage: Stage, plan: Plan) -> torch.Tensor:
    world, size = stage.world_size, stage.batch_size
    full = spread(left, world, plan.drop_last)
    samples = len(full) // world
    batches = _batches(samples, size, plan.drop_last)
    due = torch.zeros(plan.length, dtype=torch.bool)
    seen = torch.zeros(plan.length, dtype=torch.bool)
    for rank, reached in enumerate(stage.reached):
        mine = full[rank::world]
        deliverable = mine[: batches * size] if plan.drop_last else mine
        due[deliverable] = True
        if reached is None:
            seen[deliverable] = True
            continue
        done = reached - stage.start
        if not 0 <= done <= batches:
            raise InvalidState(
                f"rank {rank} reached batch {reached} of a stage numbered {stage.start}.."
                f"{stage.start + batches - 1}: the states are not of one run"
            )
        seen[mine[: done * size]] = True
    return left[due[left] & ~seen[left]]


def stage_samples(
    plan: Plan, elastic: Elastic, world: int, rank: int, batch_size: int
) -> torch.Tensor:
    """Rank ``rank``'s samples in the current stage of ``elastic`` (``world`` ranks,
    batches of ``batch_size``), in order: ``spread(remainder, world)[rank::world]``, cut
    to whole batches with ``drop_last``."""
    mine = spread(remainder(plan, elastic), world, plan.drop_last)[rank::world]
    if plan.drop_last:
        mine = mine[: len(mine) // batch_size * batch_size]
    return mine


# -- states ----------------------------------------------------------------------------------
def _positions(state: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    ranks = state.get("ranks")
    if ranks is None:
        return None
    try:
        return [(int(e), int(i)) for e, i in ranks]
    except (TypeError, ValueError) as exc:
        raise InvalidState(f"a state's ranks are malformed: {exc!r}") from None


def _common(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What every rank's state must agree on."""
    keys = ("world_size", "batch_size", "plan", "elastic")
    first = {k: states[0].get(k) for k in keys}
    for state in states[1:]:
        for key in keys:
            if state.get(key) != first[key]:
                raise InvalidState(
                    f"the states disagree on {key!r} ({first[key]!r} and {state.get(key)!r}): "
                    "they are not the ranks of one run"
                )
    return first


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state from every rank's ``Loader.state_dict()`` of one run (in any order), that
    ``load_state_dict`` accepts on every rank of any world size. States that already
    carry every rank's position (gathered under ``torch.distributed``) merge to
    themselves. ``InvalidState`` says why states cannot be merged."""
    if not states:
        raise InvalidState("merge_states needs at least one state")
    for state in states:
        if state.get("version") != STATE_VERSION:
            raise InvalidState(
                f"merge_states takes version {STATE_VERSION} states (Loader.state_dict()); "
                f"got version {state.get('version')!r}"
            )
    common = _common(states)
    world = common["world_size"]
    if world is None:
        raise InvalidState(
            "the states are of a loader without world_size: there is one rank; load its "
            "state as it is (create the loaders with world_size to resize)"
        )
    gathered = [p for p in (_positions(s) for s in states) if p is not None]
    if gathered:
        if any(p != gathered[0] for p in gathered) or len(gathered[0]) != world:
            raise InvalidState("the gathered states disagree on the ranks' positions")
        positions = gathered[0]
    else:
        by_rank: dict[int, tuple[int, int]] = {}
        for state in states:
            rank = int(state["rank"])
            if rank in by_rank:
                raise InvalidState(f"two states of rank {rank}")
            by_rank[rank] = (int(state["epoch"]), int(state["index"]))
        missing = sorted(set(range(world)) - set(by_rank))
        if missing:
            raise InvalidState(
                f"the states of ranks {missing} are missing: every rank's of the "
                f"{world} is needed (no rank's samples may be lost or repeated)"
            )
        positions = [by_rank[r] for r in range(world)]
    rank0 = next((s for s in states if s.get("rank") == 0), states[0])
    return every_rank(dict(states[0]), str(rank0.get("loader")), positions)


def every_rank(
    state: dict[str, Any], loader: str, positions: Sequence[tuple[int, int]]
) -> dict[str, Any]:
    """``state`` as a state of every rank: their positions, and nothing one rank's (so
    that every rank's copy is the same)."""
    epoch, index = min(positions)
    return {
        **state,
        "loader": loader,
        "epoch": epoch,
        "index": index,
        "rank": None,
        "ranks": [list(p) for p in positions],
    }


def gather(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every rank's position (``ranks``), all-gathered over
    ``torch.distributed`` when a process group is up and the loader is sharded; a
    collective: every rank calls it at the same point. Unchanged otherwise, or when the
    group's ranks do not cover the loader's (then merge the per-rank states)."""
    dist = torch.distributed
    world = state.get("world_size")
    if world is None or not (dist.is_available() and dist.is_initialized()):
        return state
    mine = (int(state["rank"]), int(state["epoch"]), int(state["index"]), str(state["loader"]))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_rank: dict[int, tuple[int, int]] = {}
    names: dict[int, str] = {}
    for rank, epoch, index, name in everyone:
        names[rank] = name
        if by_rank.setdefault(rank, (epoch, index)) != (epoch, index):
            return state  # two processes on one loader rank, apart: nothing to trust
    if sorted(by_rank) != list(range(world)):
        return state
    return every_rank(state, names[0], [by_rank[r] for r in range(world)])


@dataclass(frozen=True)
class Target:
    """The loader a state is loaded into."""

    plan: Plan | None  # None: its plan cannot be respread (no elastic resume)
    rank: int
    world_size: int | None
    batch_size: int
    streams: int  # DataLoader's num_workers (its RNG streams; 0: the main process)


@dataclass(frozen=True)
class Resumed:
    """Where a loaded state puts a loader: its next batch, and the elastic epoch it is
    in (or None)."""

    epoch: int
    index: int
    elastic: Elastic | None


def resume(state: Mapping[str, Any], target: Target) -> Resumed:
    """Where ``target`` goes on from after loading ``state`` (see the module docstring);
    ``InvalidState`` if the state is of another plan, or cannot resume this rank."""
    try:
        return _resume(state, target)
    except InvalidState:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidState(f"a malformed state: {exc!r}") from None


def _resume(state: Mapping[str, Any], target: Target) -> Resumed:
    if state.get("version") != STATE_VERSION:
        raise InvalidState(f"not a version {STATE_VERSION} state: {state.get('version')!r}")
    plan = Plan.from_json(state.get("plan"))
    elastic = Elastic.from_json(state.get("elastic"))
    world, size = state.get("world_size"), int(state["batch_size"])
    if plan != target.plan:
        boundary = _mixture_boundary(plan, target.plan, state)
        if boundary is not None:
            return Resumed(boundary, 0, None)
    if plan != target.plan:
        if plan is not None and target.plan is not None and plan.mixture != target.plan.mixture:
            raise InvalidState(
                "the state was saved inside an epoch of another mixture (weights, sources or "
                "epoch): load it into a loader of the same mixture to finish that epoch; a "
                "state saved at an epoch's end loads into a new mixture, which makes the "
                "following epochs"
            )
        raise InvalidState(
            f"the state is of another plan ({plan} and this loader's {target.plan}): the "
            "dataset's length, shuffle, seed and drop_last must be the same"
        )
    positions = _positions(state)
    same = world == target.world_size and size == target.batch_size
    if same and positions is None:
        if world is not None and int(state["rank"]) != target.rank:
            raise InvalidState(
                f"the state is rank {state['rank']}'s, not rank {target.rank}'s: load each "
                "rank's own, or a state with every rank's (gathered under torch.distributed, "
                "or pinfeed.merge_states)"
            )
        return _within(int(state["epoch"]), int(state["index"]), elastic)
    if positions is None:
        raise InvalidState(
            f"the state is one rank's of world_size {world} and batch_size {size}; loading "
            f"it at world_size {target.world_size} and batch_size {target.batch_size} needs "
            "every rank's position (Loader.state_dict() under torch.distributed, or "
            "pinfeed.merge_states of every rank's state)"
        )
    if world is None or len(positions) != world:
        raise InvalidState("a state's ranks do not match its world_size")
    if same:
        return _within(*positions[target.rank], elastic)
    if plan is None or target.world_size is None:
        raise InvalidState(
            "only a loader with world_size and its own shuffle (DistributedSampler's "
            "semantics) over a map-style dataset resumes at another world_size or batch_size"
        )
    return _next_stage(plan, positions, world, size, elastic, target)


def _mixture_boundary(
    plan: Plan | None, target: Plan | None, state: Mapping[str, Any]
) -> int | None:
    """The epoch a loader of another mixture starts from a ``state`` that every rank
    saved between two epochs (at an epoch's start, or past its last batch); None if the
    plans differ otherwise, or a rank is inside an epoch."""
    if plan is None or target is None or plan.mixture is None or target.mixture is None:
        return None
    if {**plan.to_json(), "mixture": 0, "length": 0} != {
        **target.to_json(),
        "mixture": 0,
        "length": 0,
    }:
        return None
    if (state.get("elastic") or {}).get("epoch") is not None:
        return None
    world = state.get("world_size") or 1
    size = int(state["batch_size"])
    end = _batches(per_rank(plan.length, world, plan.drop_last), size, plan.drop_last)
    positions = _positions(state) or [(int(state["epoch"]), int(state["index"]))]
    nexts = {e if i == 0 else e + 1 for e, i in positions if i == 0 or i >= end}
    done = sum(1 for _, i in positions if i == 0 or i >= end)
    return nexts.pop() if done == len(positions) and len(nexts) == 1 else None


def _within(epoch: int, index: int, elastic: Elastic | None) -> Resumed:
    """A position as it stands, in its elastic epoch if it is inside one (where a batch
    before the epoch's first is its first: nothing of it was consumed yet)."""
    if elastic is None or elastic.epoch != epoch:
        return Resumed(epoch, index, None)
    return Resumed(epoch, max(index, elastic.start), elastic)


def _next_stage(
    plan: Plan,
    positions: list[tuple[int, int]],
    world: int,
    size: int,
    elastic: Elastic | None,
    target: Target,
) -> Resumed:
    epoch = min(e for e, _ in positions)
    ahead = [(e, i) for e, i in positions if e > epoch]
    if any(p != (epoch + 1, 0) for p in ahead):
        raise InvalidState(
            f"the ranks are more than one epoch apart ({sorted(set(positions))}): only one "
            "interrupted epoch can be respread"
        )
    if elastic is not None and elastic.epoch != epoch:
        if elastic.epoch > epoch:
            raise InvalidState("a state's elastic epoch is after its ranks' positions")
        elastic = None  # an earlier epoch's: done with
    if elastic is None and all(p == (epoch, 0) for p in positions):
        return Resumed(epoch, 0, None)  # nobody is inside an epoch: the new world starts it
    start = elastic.start if elastic is not None else 0
    reached = tuple(None if e > epoch else i for e, i in positions)
    if any(r is not None and r < start for r in reached):
        raise InvalidState("a rank's position is before its elastic epoch's first batch")
    stage = Stage(world, size, start, reached)
    stages = (*(elastic.stages if elastic is not None else ()), stage)
    # Number the new stage after the furthest batch any rank reached (a loop that counts
    # batches from the checkpoint's count, as Lightning's, then never ends early), and
    # from a multiple of the worker streams: batch start + j is worker j % N's.
    left = remainder(plan, Elastic(epoch, 0, stages[:-1]))
    samples = len(spread(left, world, plan.drop_last)) // world
    end = _ends(stage, samples, plan.drop_last)
    furthest = max(end if r is None else r for r in reached)
    streams = max(1, target.streams)
    start = math.ceil(furthest / streams) * streams
    new = Elastic(epoch, start, stages)
    if len(stage_samples(plan, new, target.world_size or 1, target.rank, target.batch_size)) == 0:
        return Resumed(epoch + 1, 0, None)  # nothing left for anyone (the same on every rank)
    return Resumed(epoch, start, new)
