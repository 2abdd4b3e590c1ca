"""The data-plane wire format, shared by ``pinfeed.Loader`` and
``pinfeed_server.engine.dataplane``. Its complete table is ``docs/reference/protocol.md``.

One ``SOCK_SEQPACKET`` Unix socket per consumer; the first byte of a message is its
kind. Control messages carry one JSON object, typed here (``Attach``, ``Attached`` and
its ``AttachedConfig``, ``ErrorInfo``); per-batch messages are fixed ``struct`` layouts,
so the hot path neither pickles nor parses JSON::

    client -> server                         server -> client
    ATTACH  A  JSON Attach                   ATTACHED a  JSON Attached + ring memfd
    NEXT    N  RELEASE_HEAD, slots, wait_us  BATCH    B  BATCH_HEAD, dims, strings JSON;
                                                         or (FLAG_LAYOUT) its own layout
    RELEASE R  as NEXT (no reply)            END      E  END_BODY (epoch over)
    SKIP    S  as NEXT; reply END            POSITION P  POSITION_BODY (after SEEK)
    SEEK    K  POSITION_BODY                 ERROR    X  JSON ErrorInfo
    CUDA    C  (no body, no reply)           SEGMENT  G  SEGMENT_BODY (+ memfd: ring grew)
                                             RING     W  JSON RingInfo + segment 0's memfd
                                                         (a ring sized after ATTACHED)
    CREATE  O  JSON Create + payload memfd   RNG      Y  RNG_HEAD + the trainer's RNG
    EPOCH   H  EPOCH_BODY (seeds)                        states, ahead of its BATCH
    OBJECTS J  OBJECTS_BODY + payload memfd
               (the objects changed)
    FEED    F  FEED_HEAD, int64 indices, RNG
               (FEED_NEXT: then a NEXT; FEED_AHEAD: no RNG yet, its FEED follows)
    FEEDS   M  FEEDS_HEAD, uint32 batch sizes, int64 indices (many FEEDs in one)
    RESUME  U  JSON {"state": state_dict}    RESUMED  u  JSON Resumed (after RESUME)
    REPLAY  V  JSON Replay (a connection's   REPLAYED v  JSON Replayed + a one-slot ring
               first message)                            memfd, then its BATCH or ERROR
    DESCRIBE Q JSON Describe (a connection's DESCRIBED q JSON Described (or ERROR)
               first message)

CREATE, EPOCH, OBJECTS, FEED, FEEDS and RNG are ``pinfeed.DataLoader``'s: the trainer
ships its objects (``pinfeed.payload``) and gets a loader of its own (the reply is
ATTACHED), then, per epoch, sends its objects again where they changed (OBJECTS: the
objects as DataLoader would hand them to that epoch's workers), the base seed its
iterator drew and the index batches its sampler made,
ahead of the batches it asks for, as DataLoader's iterator hands them to its workers
(FEED, one a batch), or, where when the sampler is iterated cannot be seen (torch's own
samplers), many at once (FEEDS).

RESUME is ``load_state_dict`` (a version 2 state, ``pinfeed.elastic``: it may make one
epoch the rest of a run at another world size); REPLAY, on a connection of its own,
asks for one batch made again (``Loader.replay``), into a ring of one slot that the
server makes for it and the client maps, copies and lets go. DESCRIBE, on a connection
of its own, asks what a dataset the server would build from a kind and its params is
(``pinfeed.ServerDataset``: its length, and whether it is iterable), registering nothing.

An ERROR's slug names a class of ``pinfeed.errors``, which this module does not import:
it imports neither pinfeed nor torch (a stdlib-only trainer loads it by path)."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

PROTOCOL_VERSION = 14
# The NEXTs a trainer keeps in flight inside an epoch whose length it knows
# (``pinfeed._epochs``): the server answers them in order, each as its item is ready.
# Their batches take no slot of their own (``engine/config.py``'s ``ring_slots``).
NEXTS_IN_FLIGHT = 2
# HTTP, not the socket: the header a client names itself with; the control plane paces
# each (address, this header) apart (pinfeed_server/api/throttle.py).
HTTP_CLIENT_HEADER = "x-pinfeed-client"

ATTACH, NEXT, RELEASE, SKIP, SEEK, CUDA = map(ord, "ANRSKC")  # client -> server
CREATE, EPOCH, FEED, FEEDS, OBJECTS = map(ord, "OHFMJ")  # client -> server: pinfeed.DataLoader's
RESUME, REPLAY, DESCRIBE = map(
    ord, "UVQ"
)  # client -> server: load_state_dict, replay, ServerDataset
ATTACHED, BATCH, END, POSITION, ERROR, SEGMENT, RNG, RING = map(ord, "aBEPXGYW")  # server -> client
RESUMED, REPLAYED, DESCRIBED = map(ord, "uvq")  # server -> client
KIND_NAMES = {
    ATTACH: "ATTACH", NEXT: "NEXT", RELEASE: "RELEASE", SKIP: "SKIP", SEEK: "SEEK",
    CUDA: "CUDA", CREATE: "CREATE", EPOCH: "EPOCH", FEED: "FEED", FEEDS: "FEEDS",
    OBJECTS: "OBJECTS",
    ATTACHED: "ATTACHED",
    BATCH: "BATCH", END: "END", POSITION: "POSITION", ERROR: "ERROR", SEGMENT: "SEGMENT",
    RNG: "RNG", RING: "RING", RESUME: "RESUME", RESUMED: "RESUMED", REPLAY: "REPLAY",
    REPLAYED: "REPLAYED", DESCRIBE: "DESCRIBE", DESCRIBED: "DESCRIBED",
}  # fmt: skip

# kind | flags << 8, slot, seq, epoch, index in epoch, length of the trailing body
BATCH_HEAD = struct.Struct("<H2xIQIII")
# A BATCH flag: its body is its own layout (BATCH_LAYOUT_HEAD ..), not dims + strings.
FLAG_LAYOUT = 1
# A BATCH flag: its arrays are not in its slot but in a memfd of its own, which travels
# with it (SCM_RIGHTS), at the offsets its own layout gives (FLAG_LAYOUT is set too): a
# pinfeed.DataLoader's batch made before its loader's ring was sized from the first
# batches, or larger than the ring's slots. Its slot is leased and released as any.
FLAG_OWN = 2
# mark (0: never the first byte of a strings JSON), structure JSON bytes, objects JSON bytes
BATCH_LAYOUT_HEAD = struct.Struct("<B3xII")
END_BODY = struct.Struct("<B3xIQ")  # kind, epoch, seq
POSITION_BODY = struct.Struct("<B3xII")  # kind, epoch, index
SEGMENT_BODY = struct.Struct("<B3xIII")  # kind, segment id, first slot, slots (0: closed)
RELEASE_HEAD = struct.Struct("<BxH")  # kind, count
# kind, 1: a shared seed (a datapipe's), epoch, base seed, shared seed (0 where none)
EPOCH_BODY = struct.Struct("<B?2xIqq")
# kind, the epoch from which the objects in the payload memfd that travels with it apply
# (the memfd first, then the shared memory fds its objects map)
OBJECTS_BODY = struct.Struct("<B3xI")
# kind, flags, epoch, index, indices (FEED_END: the sampler ran out), RNG state bytes
FEED_HEAD = struct.Struct("<BB2xIIII")
FEED_END = 0xFFFFFFFF
FEED_NEXT = 1  # flag: a NEXT follows the RNG states in the same message
# flag: a batch fed ahead of the trainer's RNG states, to be made on the states the batch
# before left; a FEED of the same batch with the states follows (``encode_feed_ahead``)
FEED_AHEAD = 2
# flag: the first indices of a batch too large for one message (MAX_FEED_INDICES), alone:
# more parts may follow, then the FEED of that batch with the rest (``feed_parts``)
FEED_PART = 4
MAX_FEED_INDICES = 16384
# A fed batch of an unbatched loader (Unbatched) that begins with ITEM_LIST is one item
# the sampler yielded as an index list: read as dataset[indices] (DataLoader's bulk read).
ITEM_LIST = -(2**63)
# kind, flags, epoch, index of the first batch, batches; then each batch's size (<I) and
# all their indices (<q), in order
FEEDS_HEAD = struct.Struct("<BB2xIII")
FEEDS_END = 1  # flag: the sampler ran out after these batches
RNG_HEAD = struct.Struct("<B3xI")  # kind, bytes of the pickled (torch, random, numpy) states
SLOT = struct.Struct("<I")
WAIT = struct.Struct("<I")
_ONE_RELEASE = struct.Struct("<BxHII")  # kind, count=1, slot, wait_us

# Largest message either side sends. A BATCH's strings or own layout are its variable part.
MAX_MESSAGE = 256 * 1024
# Slot offsets and leaf offsets are aligned so every dtype view is aligned too.
ALIGN = 64

DEFAULT_SOCKET_NAME = "pinfeed.sock"


def default_run_dir() -> Path:
    """Where the server puts its socket unless told otherwise."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    ok = runtime and os.path.isdir(runtime)
    return Path(f"{runtime}/pinfeed") if ok else Path(f"/tmp/pinfeed-{os.getuid()}")


def default_socket_path() -> Path:
    """``PINFEED_SOCKET`` if set, else the server's default path."""
    env = os.environ.get("PINFEED_SOCKET")
    return Path(env) if env else default_run_dir() / DEFAULT_SOCKET_NAME


def container(tag: str, body: list[Any], cls: type, builtin: type | None = None) -> list[Any]:
    """A treedef node of a container of class ``cls``: ``[tag, body]`` where ``cls`` is
    the ``builtin`` one, else ``[tag, body, "module:qualname"]``."""
    return [tag, body] if cls is builtin else [tag, body, f"{cls.__module__}:{cls.__qualname__}"]


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


Buffer = bytes | bytearray | memoryview


def _encode_json(kind: int, payload: Mapping[str, Any]) -> bytes:
    return bytes([kind]) + json.dumps(payload, separators=(",", ":"), default=str).encode()


def _decode_json(kind: int, data: Buffer) -> dict[str, Any]:
    """The JSON object of a control message; ValueError if it is anything else."""
    if len(data) < 1 or data[0] != kind:
        raise ValueError(f"expected a {KIND_NAMES[kind]} message")
    try:  # UnicodeDecodeError and JSONDecodeError are ValueErrors already
        value = json.loads(bytes(data[1:]))
    except RecursionError:
        raise ValueError(f"{KIND_NAMES[kind]} JSON nests too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{KIND_NAMES[kind]} must carry a JSON object")
    return value


# -- the layout JSON (in ATTACHED, and the server's worker spec) -------------------------
@dataclass(frozen=True)
class Leaf:
    """One tensor (or string) of a batch: where its rows live inside a slot."""

    kind: str  # "tensor" or "str"
    dtype: str  # torch dtype name without "torch.", "" for strings
    shape: tuple[int, ...]  # sample shape
    offset: int  # byte offset of this leaf's rows inside a slot
    capacity: int  # bytes reserved for batch_size rows
    itemsize: int = 0  # bytes per element, 0 for strings

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Leaf:
        return cls(**(dict(data) | {"shape": tuple(data["shape"])}))


@dataclass(frozen=True)
class Layout:
    """A batch's structure: a treedef (``["leaf", j]``, ``["list" | "tuple", [..]]``,
    ``["dict", [[key, ..]]]``, ``["namedtuple", [name, fields, [..]]]``) over leaves,
    each at a fixed offset in a slot. A container node of a class other than the
    builtin one (a namedtuple, an ``OrderedDict``, HF's ``BatchEncoding``) carries its
    ``module:qualname`` third (``container``): the trainer rebuilds that class where it
    finds it."""

    treedef: list[Any]
    leaves: tuple[Leaf, ...]
    batch_size: int
    slot_bytes: int
    per_batch: bool = False  # every BATCH has FLAG_LAYOUT; treedef, leaves: the first batch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # leaves become dicts, shapes JSON lists

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        leaves = tuple(Leaf.from_json(x) for x in data["leaves"])
        per_batch = bool(data.get("per_batch", False))
        return cls(data["treedef"], leaves, data["batch_size"], data["slot_bytes"], per_batch)


def dims_struct(layout: Layout) -> struct.Struct:
    """The BATCH dims: for each tensor leaf, rows then its sample shape, as int64."""
    n = sum(len(x.shape) + 1 for x in layout.leaves if x.kind == "tensor")
    return struct.Struct(f"<{n}q")


def pack_dims(layout: Layout, rows: int) -> bytes:
    """A batch's dims; the server packs them once per distinct batch length."""
    dims: list[int] = []
    for leaf in layout.leaves:
        if leaf.kind == "tensor":
            dims.append(rows)
            dims.extend(leaf.shape)
    return dims_struct(layout).pack(*dims)


def encode_batch_layout(structure: bytes, dims: list[int], objects: bytes) -> bytes:
    """A BATCH body with FLAG_LAYOUT. ``structure``: JSON ``[treedef, [[kind, dtype, ndim],
    ..]]``, kind ``t`` (tensor), ``n`` (numpy array), ``s`` (numpy scalar) or ``o`` (the
    next value of ``objects``, a JSON list); ``dims``: per array leaf, its byte offset in
    the slot then its shape."""
    head = BATCH_LAYOUT_HEAD.pack(0, len(structure), len(objects))
    return b"".join((head, structure, struct.pack(f"<{len(dims)}q", *dims), objects))


def decode_batch_layout(body: Buffer) -> tuple[list[Any], tuple[int, ...], list[Any]]:
    """(structure, dims, objects) of a FLAG_LAYOUT body; the client caches the parse of
    the structure bytes instead (``pinfeed._views``)."""
    _, nstruct, nobj = BATCH_LAYOUT_HEAD.unpack_from(body)
    at = BATCH_LAYOUT_HEAD.size + nstruct
    structure = json.loads(bytes(body[BATCH_LAYOUT_HEAD.size : at]))
    dims = layout_dims(structure[1]).unpack_from(body, at)
    at += 8 * len(dims)
    return structure, dims, json.loads(bytes(body[at : at + nobj])) if nobj else []


def layout_dims(leaves: list[list[Any]]) -> struct.Struct:
    """The int64 dims of a FLAG_LAYOUT body with these structure leaves."""
    return struct.Struct(f"<{sum(n + 1 for kind, _, n in leaves if kind != 'o')}q")


# -- control messages ------------------------------------------------------------------
@dataclass(frozen=True)
class Attach:
    """The client's first message: which loader, which group member (None: any free)."""

    loader: str
    member: int | None = None
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return _encode_json(ATTACH, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Attach:
        """ValueError if malformed; any peer may send anything, so types are checked."""
        obj = _decode_json(ATTACH, data)
        loader, member, version = obj.get("loader"), obj.get("member"), obj.get("version")
        if not isinstance(loader, str):
            raise ValueError("ATTACH needs a loader name (a string)")
        if member is not None and type(member) is not int:  # bool is an int, not a member
            raise ValueError("ATTACH member must be an int or null")
        if type(version) is not int:
            raise ValueError("ATTACH needs the protocol version (an int)")
        return cls(loader, member, version)


@dataclass(frozen=True)
class Create:
    """``pinfeed.DataLoader``'s first message: a loader of its own over the objects in the
    payload memfd that travels with it (``pinfeed.payload``). DataLoader's arguments that
    the server acts on; the sampler stays in the trainer (FEED). ``name``: a named loader
    that stays warm for the next trainer asking for it with an equal config and payload
    (``digest``); None: the loader goes with this connection."""

    name: str | None
    digest: str  # sha256 of the payload and these fields: "an equal config"
    # The batch size, where the trainer knows it (batch_size; a batch_sampler's
    # batch_size); None: a batch_sampler of its own sizes, seen as they are fed. The
    # ring's slots are sized from the first batches made, not from this.
    max_rows: int | None
    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    persistent_workers: bool
    iterable: bool
    length: int | None  # len(dataset), None for an iterable without one
    batches_per_epoch: int | None  # len(DataLoader), where it has one
    samples: int | None  # len(sampler), where it has one
    drop_last: bool = False  # an IterableDataset's batches (its workers batch it)
    executor: str = "local"
    # The node's cache of the dataset's deterministic part (pinfeed.DataLoader's cache=):
    # shared by every loader naming ``cache_name``, or (None) the loader's own.
    cache: bool = False
    cache_name: str | None = None
    cache_max_bytes: int | None = None
    # Whether the objects may draw from the global RNGs (``pinfeed.rng.draws_nothing``
    # says when they cannot): then each batch is made on its worker's RNG stream.
    draws: bool = True
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return _encode_json(CREATE, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Create:
        """ValueError if malformed; any peer may send anything, so types are checked."""
        obj = _decode_json(CREATE, data)
        if type(obj.get("version")) is not int:
            raise ValueError("CREATE needs the protocol version (an int)")
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(obj) - set(kinds)
        if unknown:
            raise ValueError(f"CREATE has unknown fields {sorted(unknown)}")
        try:
            out = cls(**obj)
        except TypeError as exc:
            raise ValueError(f"CREATE: {exc}") from None
        for name in ("max_rows", "num_workers", "prefetch_factor"):
            value = getattr(out, name)
            if name == "max_rows" and value is None:
                continue
            if type(value) is not int or value < (1 if name != "num_workers" else 0):
                raise ValueError(f"CREATE {name} must be a positive int, not {value!r}")
        if type(out.draws) is not bool:
            raise ValueError("CREATE draws must be a bool")
        if type(out.cache) is not bool or not isinstance(out.cache_name, str | None):
            raise ValueError("CREATE cache must be a bool, cache_name a string or null")
        size = out.cache_max_bytes
        if size is not None and (type(size) is not int or size < 0):
            raise ValueError(f"CREATE cache_max_bytes must be an int >= 0, not {size!r}")
        return out


def encode_epoch(epoch: int, base_seed: int, shared_seed: int | None = None) -> bytes:
    """``shared_seed``: a datapipe's (DataLoader's ``_shared_seed``), which its
    persistent workers apply to their graph each epoch."""
    shared = shared_seed is not None
    return EPOCH_BODY.pack(EPOCH, shared, epoch, base_seed, shared_seed if shared else 0)


def decode_epoch(data: Buffer) -> tuple[int, int, int | None]:
    if len(data) != EPOCH_BODY.size:
        raise ValueError("an EPOCH is kind, shared flag, epoch, base seed, shared seed")
    _, shared, epoch, seed, shared_seed = EPOCH_BODY.unpack_from(data)
    return epoch, seed, shared_seed if shared else None


def encode_objects(epoch: int) -> bytes:
    """An OBJECTS (its payload memfd travels with it): the objects from ``epoch`` on."""
    return OBJECTS_BODY.pack(OBJECTS, epoch)


def decode_objects(data: Buffer) -> int:
    """The epoch an OBJECTS applies from."""
    if len(data) != OBJECTS_BODY.size:
        raise ValueError("an OBJECTS is kind, epoch (and its payload's memfd)")
    return int(OBJECTS_BODY.unpack_from(data)[1])


def encode_feed(epoch: int, index: int, indices: list[int] | None, rng: bytes = b"") -> bytes:
    """Batch ``index`` of ``epoch`` (None: the sampler ran out), and the trainer's RNG
    states to make it on (a loader without workers: DataLoader makes its batches in the
    trainer, on the trainer's RNGs). ``struct.error`` if an index is no integer."""
    if indices is None:
        return FEED_HEAD.pack(FEED, 0, epoch, index, FEED_END, 0)
    head = FEED_HEAD.pack(FEED, 0, epoch, index, len(indices), len(rng))
    return head + struct.pack(f"<{len(indices)}q", *indices) + rng


def feed_parts(epoch: int, index: int, indices: list[int]) -> tuple[list[bytes], list[int]]:
    """A batch of more than MAX_FEED_INDICES indices: the FEED_PART messages of its first
    ones, and the rest, which its FEED carries (``struct.error`` if an index is no
    integer). A batch that fits: none, and all of them."""
    parts = []
    while len(indices) > MAX_FEED_INDICES:
        part, indices = indices[:MAX_FEED_INDICES], indices[MAX_FEED_INDICES:]
        head = FEED_HEAD.pack(FEED, FEED_PART, epoch, index, len(part), 0)
        parts.append(head + struct.pack(f"<{len(part)}q", *part))
    return parts, indices


def decode_feed_part(data: Buffer) -> tuple[int, int, list[int]] | None:
    """(epoch, index, indices) of a FEED_PART; None for any other FEED."""
    if len(data) < FEED_HEAD.size or not data[1] & FEED_PART:
        return None
    _, flags, epoch, index, count, nrng = FEED_HEAD.unpack_from(data)
    if flags != FEED_PART or nrng or count == FEED_END or len(data) != FEED_HEAD.size + 8 * count:
        raise ValueError("a FEED_PART carries indices alone")
    return epoch, index, list(struct.unpack_from(f"<{count}q", data, FEED_HEAD.size))


def encode_feed_ahead(epoch: int, index: int, indices: list[int]) -> bytes:
    """Batch ``index`` of ``epoch`` ahead of the trainer's RNG states (a loader without
    workers, whose trainer drew nothing between its batches so far): the server may make
    it now on the states the batch before left, and keeps it for the FEED of the same
    batch with the trainer's states (``encode_feed``), which says whether they were those.
    ``struct.error`` if an index is no integer."""
    head = FEED_HEAD.pack(FEED, FEED_AHEAD, epoch, index, len(indices), 0)
    return head + struct.pack(f"<{len(indices)}q", *indices)


def feed_then_next(feed: bytes, next_message: bytes) -> bytes:
    """A FEED (``encode_feed``'s) and the NEXT after it as one message: the per-batch
    message of a ``pinfeed.DataLoader`` (without workers: the batch it waits for)."""
    return bytes((FEED, feed[1] | FEED_NEXT)) + feed[2:] + next_message


def encode_feeds(epoch: int, index: int, batches: list[list[int]], ended: bool) -> bytes:
    """Batches ``index``, ``index + 1``, .. of ``epoch`` in one message (``ended``: and
    then the sampler ran out): what ``pinfeed.DataLoader`` sends where the moments its
    sampler is iterated cannot be seen. ``struct.error`` if an index is no integer."""
    head = FEEDS_HEAD.pack(FEEDS, FEEDS_END if ended else 0, epoch, index, len(batches))
    sizes = struct.pack(f"<{len(batches)}I", *map(len, batches))
    return b"".join([head, sizes, *(struct.pack(f"<{len(b)}q", *b) for b in batches)])


def decode_feeds(data: Buffer) -> tuple[int, int, list[list[int]], bool]:
    """(epoch, index of the first batch, the batches, whether the sampler ran out after
    them); ValueError if malformed."""
    data = memoryview(data)
    if len(data) < FEEDS_HEAD.size:
        raise ValueError("short FEEDS")
    _, flags, epoch, index, count = FEEDS_HEAD.unpack_from(data)
    if flags & ~FEEDS_END:
        raise ValueError(f"a FEEDS with unknown flags {flags:#x}")
    at = FEEDS_HEAD.size + 4 * count
    sizes = struct.unpack_from(f"<{count}I", data, FEEDS_HEAD.size) if len(data) >= at else ()
    if len(sizes) != count or len(data) != at + 8 * sum(sizes) or 0 in sizes:
        raise ValueError("a FEEDS's length does not match its batch sizes")
    batches = []
    for n in sizes:
        batches.append(list(struct.unpack_from(f"<{n}q", data, at)))
        at += 8 * n
    return epoch, index, batches, bool(flags & FEEDS_END)


def decode_feed(
    data: Buffer,
) -> tuple[int, int, list[int] | None, bytes, bool, memoryview | None]:
    """(epoch, index, indices or None at the end, RNG states or b"", whether it came
    ahead of its states (FEED_AHEAD), the NEXT that came with it or None); ValueError if
    malformed."""
    data = memoryview(data)
    if len(data) < FEED_HEAD.size:
        raise ValueError("short FEED")
    _, flags, epoch, index, count, nrng = FEED_HEAD.unpack_from(data)
    if flags & ~(FEED_NEXT | FEED_AHEAD):
        raise ValueError(f"a FEED with unknown flags {flags:#x}")
    end = FEED_HEAD.size if count == FEED_END else FEED_HEAD.size + 8 * count + nrng
    then = data[end:] if flags & FEED_NEXT else None
    if (
        len(data) < end
        or (then is None and len(data) != end)
        or (then is not None and (not then or then[0] != NEXT))
    ):
        raise ValueError("a FEED's length does not match its counts")
    ahead = bool(flags & FEED_AHEAD)
    if ahead and (count == FEED_END or nrng):
        raise ValueError("a FEED ahead of its RNG states carries indices and no states")
    if count == FEED_END:
        return epoch, index, None, b"", False, then
    indices = list(struct.unpack_from(f"<{count}q", data, FEED_HEAD.size))
    rng = bytes(data[end - nrng : end])
    return epoch, index, indices, rng, ahead, then


@dataclass(frozen=True)
class AttachedConfig:
    """The loader's configuration as a trainer sees it (``Attached.config``): the
    fields ``pinfeed.Loader`` reports as DataLoader's attributes and acts on, with the
    meaning of the loader's HTTP fields (its name is ``Attached.loader``). The rest
    (autotune, executor, ...) is in ``GET /v1/loaders/{name}``. A decoder ignores keys
    it does not know."""

    dataset: str
    batch_size: int  # under a batch_sampler, the field's value (DataLoader's is None)
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int  # the loader's worker processes when the trainer attached
    prefetch_factor: int
    pin_memory: bool
    persistent_workers: bool
    rank: int
    world_size: int | None  # None: no sharding (DistributedSampler's otherwise)
    group_size: int  # trainer processes attached as one consumer group
    group_mode: str  # "broadcast" or "split"
    collate_fn: str | None  # 'module:callable' run in the server; None: default_collate
    sampler: str | None  # a sampler's factory 'module:callable'; None: DataLoader's own
    batch_sampler: str | None  # a batch sampler's factory; None: none
    shard_size: int | None = None  # the shard-aware order's samples a shard; None: global

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AttachedConfig:
        try:
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except TypeError as exc:  # a field missing
            raise ValueError(f"ATTACHED config: {exc}") from None


@dataclass(frozen=True)
class Attached:
    """The server's reply to ATTACH; ring segment 0's memfd travels with it (SCM_RIGHTS).
    ``epoch``/``position``: the member's next batch. A decoder ignores unknown keys.

    A ``pinfeed.DataLoader``'s loader is attached before its ring exists (it is sized
    from the first batches made, in its workers): then ``ring_bytes`` and ``slot_bytes``
    are 0, ``layout`` None, no memfd travels, and a RING brings them ahead of the first
    batch in the ring."""

    loader: str
    member: int
    ring_bytes: int
    nslots: int
    slot_bytes: int
    layout: Layout | None
    batches_per_epoch: int | None  # None: an iterable without __len__
    epoch: int
    position: int
    config: AttachedConfig
    dataset_length: int | None
    sampler_length: int | None  # None: an IterableDataset's (no sampler)
    sample: Any
    version: int = PROTOCOL_VERSION
    # The elastic epoch the loader is in or heads for (``pinfeed.elastic.Elastic``'s
    # JSON with its ``end``: the index after its last batch), or None.
    elastic: dict[str, Any] | None = None
    # A mixture loader's rule (``pinfeed.mixing.Mixing.digest``: a state's ``plan``
    # names it), or None. Its plan is over unshuffled positions (``dataset_length``).
    mixture: str | None = None

    def encode(self) -> bytes:
        return _encode_json(ATTACHED, asdict(self))  # layout and config as JSON objects

    @classmethod
    def decode(cls, data: Buffer) -> Attached:
        """ValueError if a field is missing; fields it does not know are left out."""
        obj = _decode_json(ATTACHED, data)
        known = {f.name: obj[f.name] for f in fields(cls) if f.name in obj}
        try:
            layout = obj["layout"]
            known |= {
                "layout": None if layout is None else Layout.from_json(layout),
                "config": AttachedConfig.from_json(obj["config"]),
            }
            return cls(**known)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"ATTACHED lacks a field: {exc}") from None


@dataclass(frozen=True)
class RingInfo:
    """A RING: the ring of a loader attached before it had one (``Attached``), now sized
    from its first batches: segment 0 (its memfd travels with this), its slots and their
    fixed layout. It comes ahead of the first item that may use the ring."""

    nslots: int
    slot_bytes: int
    layout: Layout

    def encode(self) -> bytes:
        return _encode_json(RING, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> RingInfo:
        obj = _decode_json(RING, data)
        try:
            return cls(int(obj["nslots"]), int(obj["slot_bytes"]), Layout.from_json(obj["layout"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"RING lacks a field: {exc}") from None


@dataclass(frozen=True)
class ErrorInfo:
    """An ERROR: ``slug`` (a class of ``pinfeed.errors``, whose ``info()`` builds this), a
    human ``detail``, whether the server closes the connection after it (``fatal``, sent
    so that a client needs no table of slugs), the batch it stands in for (if any) and
    slug-specific ``extra``."""

    slug: str
    detail: str
    fatal: bool
    epoch: int | None = None
    batch_index: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _KEYS: ClassVar[frozenset[str]] = frozenset(("type", "detail", "fatal", "epoch", "batch_index"))

    def at(self, epoch: int, batch_index: int) -> ErrorInfo:
        """The same error, standing in for batch ``batch_index`` of ``epoch``."""
        return replace(self, epoch=epoch, batch_index=batch_index)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.slug, "detail": self.detail, "fatal": self.fatal}
        if self.batch_index is not None:
            out |= {"epoch": self.epoch, "batch_index": self.batch_index}
        return out | self.extra

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ErrorInfo:
        slug = str(obj.get("type", "protocol-error"))
        fatal = obj.get("fatal")
        if not isinstance(fatal, bool):  # absent: assume the connection is over
            fatal = True
        index = obj.get("batch_index")
        return cls(
            slug,
            str(obj.get("detail", "error")),
            fatal,
            int(obj["epoch"]) if index is not None else None,
            int(index) if index is not None else None,
            {k: v for k, v in obj.items() if k not in cls._KEYS},
        )

    def encode(self) -> bytes:
        return _encode_json(ERROR, self.to_json())

    @classmethod
    def decode(cls, data: Buffer) -> ErrorInfo:
        return cls.from_json(_decode_json(ERROR, data))


def encode_resume(state: Mapping[str, Any]) -> bytes:
    """A RESUME: a ``state_dict`` for the server to load."""
    return _encode_json(RESUME, {"state": state})


def decode_resume(data: Buffer) -> dict[str, Any]:
    """The state of a RESUME; ValueError if it carries none."""
    state = _decode_json(RESUME, data).get("state")
    if not isinstance(state, dict):
        raise ValueError("a RESUME carries a state object")
    return state


@dataclass(frozen=True)
class Resumed:
    """The reply to RESUME: the next batch, and the elastic epoch the loader is in
    (``Attached.elastic``'s form) or None."""

    epoch: int
    index: int
    elastic: dict[str, Any] | None

    def encode(self) -> bytes:
        return _encode_json(RESUMED, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Resumed:
        obj = _decode_json(RESUMED, data)
        try:
            return cls(int(obj["epoch"]), int(obj["index"]), obj.get("elastic"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"RESUMED lacks a field: {exc}") from None


@dataclass(frozen=True)
class Replay:
    """A connection's first message asking for batch ``index`` of ``epoch`` of
    ``loader`` to be made again."""

    loader: str
    epoch: int
    index: int
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return _encode_json(REPLAY, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Replay:
        obj = _decode_json(REPLAY, data)
        try:
            return cls(
                str(obj["loader"]), int(obj["epoch"]), int(obj["index"]), int(obj["version"])
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"REPLAY lacks a field: {exc}") from None


@dataclass(frozen=True)
class Replayed:
    """The reply to REPLAY, with the memfd of a one-slot ring (``ring_bytes``) that
    holds the batch; the batch's BATCH (slot 0, in ``layout``) or ERROR follows.
    ``indices``: its samples; ``worker``: DataLoader's worker that made it (None: the
    main process); ``rank``: the loader's."""

    loader: str
    epoch: int
    index: int
    indices: list[int]
    worker: int | None
    rank: int
    ring_bytes: int
    layout: Layout

    def encode(self) -> bytes:
        return _encode_json(REPLAYED, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Replayed:
        obj = _decode_json(REPLAYED, data)
        try:
            return cls(
                str(obj["loader"]),
                int(obj["epoch"]),
                int(obj["index"]),
                [int(i) for i in obj["indices"]],
                None if obj["worker"] is None else int(obj["worker"]),
                int(obj["rank"]),
                int(obj["ring_bytes"]),
                Layout.from_json(obj["layout"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"REPLAYED lacks a field: {exc}") from None


@dataclass(frozen=True)
class Describe:
    """A connection's first message asking what dataset ``kind`` builds from ``params``
    in the server (nothing registered)."""

    kind: str
    params: dict[str, Any]
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return _encode_json(DESCRIBE, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Describe:
        obj = _decode_json(DESCRIBE, data)
        try:
            params = obj["params"]
            if not isinstance(params, dict):
                raise TypeError("params is not an object")
            return cls(str(obj["kind"]), params, int(obj["version"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"DESCRIBE lacks a field: {exc}") from None


@dataclass(frozen=True)
class Described:
    """The reply to DESCRIBE: the dataset's ``length`` (None: it has none, an iterable's
    may not) and whether it is an ``IterableDataset``."""

    length: int | None
    iterable: bool

    def encode(self) -> bytes:
        return _encode_json(DESCRIBED, asdict(self))

    @classmethod
    def decode(cls, data: Buffer) -> Described:
        obj = _decode_json(DESCRIBED, data)
        try:
            length = obj["length"]
            return cls(None if length is None else int(length), bool(obj["iterable"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"DESCRIBED lacks a field: {exc}") from None


# -- per-batch messages ----------------------------------------------------------------
def encode_release(kind: int, slots: list[int], wait_us: int = 0) -> bytes:
    """A NEXT, RELEASE or SKIP handing back ``slots``."""
    wait_us = min(wait_us, 0xFFFFFFFF)
    if len(slots) == 1:  # the per-batch case: one pack, no joins
        return _ONE_RELEASE.pack(kind, 1, slots[0], wait_us)
    packed = b"".join(SLOT.pack(s) for s in slots)
    return RELEASE_HEAD.pack(kind, len(slots)) + packed + WAIT.pack(wait_us)


def decode_release(data: Buffer) -> tuple[list[int], int | None]:
    """(slots, wait_us or None) of a NEXT, RELEASE or SKIP message; ValueError if malformed."""
    if len(data) < RELEASE_HEAD.size:
        raise ValueError("short release message")
    _, count = RELEASE_HEAD.unpack_from(data)
    end = RELEASE_HEAD.size + count * SLOT.size
    if len(data) not in (end, end + WAIT.size):
        raise ValueError("release message length does not match its count")
    slots = [SLOT.unpack_from(data, RELEASE_HEAD.size + i * SLOT.size)[0] for i in range(count)]
    wait = WAIT.unpack_from(data, end)[0] if len(data) > end else None
    return slots, wait


def encode_position(kind: int, epoch: int, index: int) -> bytes:
    """A SEEK (client) or POSITION (server)."""
    return POSITION_BODY.pack(kind, epoch, index)


def decode_position(data: Buffer) -> tuple[int, int]:
    """(epoch, index) of a SEEK or POSITION; ValueError if its length is wrong."""
    if len(data) != POSITION_BODY.size:
        raise ValueError("a SEEK or POSITION is kind, epoch, index")
    _, epoch, index = POSITION_BODY.unpack_from(data)
    return epoch, index


def encode_end(epoch: int, seq: int) -> bytes:
    return END_BODY.pack(END, epoch, seq)


def decode_end(data: Buffer) -> tuple[int, int]:
    """(epoch, seq) of an END."""
    _, epoch, seq = END_BODY.unpack_from(data)
    return epoch, seq


def batch_parts(
    slot: int, seq: int, epoch: int, index: int, dims: bytes, body: bytes, flags: int = 0
) -> list[bytes]:
    """A BATCH as the parts of one scatter ``sendmsg`` (the server sends it this way);
    with FLAG_LAYOUT, ``dims`` is empty and ``body`` is ``encode_batch_layout``'s."""
    return [BATCH_HEAD.pack(BATCH | flags << 8, slot, seq, epoch, index, len(body)), dims, body]


def decode_batch(
    data: Buffer, dims: struct.Struct
) -> tuple[int, int, int, int, tuple[int, ...], bytes]:
    """(slot, seq, epoch, index, dims, strings JSON) of a BATCH without FLAG_LAYOUT."""
    _, slot, seq, epoch, index, nstr = BATCH_HEAD.unpack_from(data)
    start = BATCH_HEAD.size + dims.size
    strings = bytes(data[start : start + nstr])
    return slot, seq, epoch, index, dims.unpack_from(data, BATCH_HEAD.size), strings


# -- the socket ------------------------------------------------------------------------
def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


_ANCILLARY = socket.CMSG_SPACE(4 * struct.calcsize("i"))


def recv_message(sock: socket.socket, buf: bytearray) -> tuple[int, list[int]]:
    """Receive one message into ``buf``; return (length, fds). Length 0 means EOF."""
    fds: list[int] = []
    nbytes, ancdata, flags, _ = sock.recvmsg_into([buf], _ANCILLARY)
    for level, ctype, data in ancdata:
        if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    if flags & socket.MSG_TRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"message longer than {len(buf)} bytes")
    return nbytes, fds
